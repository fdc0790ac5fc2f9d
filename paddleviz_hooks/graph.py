"""The plain data model of a captured backward graph.

Nothing here imports paddle: a :class:`BackwardGraph` is nodes, edges and
numbers, so it can be saved, loaded, compared and drawn on a machine without
paddle (the CLI and the background worker rely on that).

Edges point the way gradients flow: from the node that produced a gradient to
the node that receives it, so the root (the loss) is the only source and the
leaves (parameters, inputs) are sinks.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

__all__ = ["GradMeta", "Node", "Edge", "BackwardGraph", "op_display_name"]

FORMAT_VERSION = 1
NODE_KINDS = ("root", "op", "param", "input", "layer")


def op_display_name(grad_node_name: str) -> str:
    """Turn Paddle's grad node class name into a readable op name.

    Args:
        grad_node_name: the C++ class name, e.g. ``"MatmulGradNode"``.

    Returns:
        The op name without Paddle's suffixes, e.g. ``"Matmul"``;
        ``"Conv2dGradNodeFinal"`` gives ``"Conv2d"``, a PyLayer node
        ``"GradNodePyLayer_MyOp_..."`` gives ``"PyLayer:MyOp"``.

    Example:
        >>> op_display_name("CrossEntropyWithSoftmaxGradNode")
        'CrossEntropyWithSoftmax'
    """
    name = grad_node_name
    if name.startswith("GradNodePyLayer_"):
        inner = name[len("GradNodePyLayer_"):]
        return "PyLayer:" + inner.split("_")[0] if inner else "PyLayer"
    if name == "GradNodeAccumulation":
        return "Accumulation"
    for suffix in ("GradNodeFinal", "GradNode", "GradNodeCompat"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


@dataclass
class GradMeta:
    """What is known of one gradient tensor flowing along an edge.

    ``norm``, ``min`` and ``max`` are None when gradient statistics were off
    or the gradient was not a floating point tensor; ``nan``/``inf`` count
    non-finite elements (only counted when the norm is not finite).
    """

    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    norm: float | None = None
    min: float | None = None
    max: float | None = None
    nan: int = 0
    inf: int = 0

    @property
    def nonfinite(self) -> int:
        """Number of NaN and Inf elements."""
        return self.nan + self.inf

    @property
    def absmax(self) -> float | None:
        """Largest absolute element, when min/max are known."""
        if self.min is None or self.max is None:
            return None
        return max(abs(self.min), abs(self.max))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape) if self.shape is not None else None
        for k in ("norm", "min", "max"):
            d[k] = _float_out(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GradMeta":
        return cls(
            shape=tuple(d["shape"]) if d.get("shape") is not None else None,
            dtype=d.get("dtype"),
            norm=_float_in(d.get("norm")),
            min=_float_in(d.get("min")),
            max=_float_in(d.get("max")),
            nan=int(d.get("nan", 0)),
            inf=int(d.get("inf", 0)),
        )


@dataclass
class Node:
    """One node of the backward graph.

    Attributes:
        id: index in ``BackwardGraph.nodes`` (breadth-first order from the root).
        kind: ``"root"`` (the tensor backward started from), ``"op"`` (a grad
            node), ``"param"`` (a named parameter leaf) or ``"input"`` (any
            other leaf: an input with ``stop_gradient=False``, or a parameter
            whose name is unknown).
        name: Paddle's grad node class name (``"MatmulGradNode"``), or
            ``"loss"``-like labels for the root.
        op: readable op name (``"Matmul"``).
        layer: dotted sublayer path that created the node
            (``"encoder.layers.3.linear1"``), ``""`` for the top layer, None
            when unknown (ops outside the model, e.g. the loss).
        call: call index of that layer when it ran more than once (0 first).
        param: parameter name for ``kind == "param"``.
        shape / dtype: of the parameter or root tensor, when known.
        hooked: whether gradients were recorded at this node.
        note: why a node was not hooked, when it was not.
        key: stable identity across steps (see ``BackwardGraph.assign_keys``).
        count: for ``kind == "layer"`` (a collapsed box, see
            ``paddleviz_hooks.render.collapse``): how many identical sibling
            layers it stands for (``"x N"``); 1 otherwise.
        params: for a box, the parameter leaves folded into it.
        norm: for a box, the L2 norm of those parameters' gradients (None
            when unknown).
        nonfinite: for a box, NaN/Inf elements in gradients that stayed
            inside it.
    """

    id: int
    kind: str
    name: str
    op: str = ""
    layer: str | None = None
    call: int = 0
    param: str | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    hooked: bool = False
    note: str | None = None
    key: str = ""
    count: int = 1
    params: int = 0
    norm: float | None = None
    nonfinite: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape) if self.shape is not None else None
        # Box-only fields are written only when set, so graphs without boxes
        # stay readable by versions that do not know them.
        for k, default in _NODE_BOX_DEFAULTS.items():
            if d[k] == default:
                del d[k]
        if "norm" in d:
            d["norm"] = _float_out(d["norm"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Node":
        d = dict(d)
        if d.get("shape") is not None:
            d["shape"] = tuple(d["shape"])
        if d.get("norm") is not None:
            d["norm"] = _float_in(d["norm"])
        return cls(**d)


_NODE_BOX_DEFAULTS = {"count": 1, "params": 0, "norm": None, "nonfinite": 0}


@dataclass
class Edge:
    """A gradient flowing from node ``src`` to node ``dst``.

    ``slot`` is the position of ``dst`` among ``src``'s next functions;
    ``grad`` is None when the gradient could not be observed (the producing
    node cannot be hooked safely, see ``paddleviz_hooks.hazards``).
    """

    src: int
    dst: int
    slot: int = 0
    grad: GradMeta | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "dst": self.dst,
            "slot": self.slot,
            "grad": self.grad.to_dict() if self.grad is not None else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Edge":
        g = d.get("grad")
        return cls(d["src"], d["dst"], d.get("slot", 0), GradMeta.from_dict(g) if g else None)


@dataclass
class BackwardGraph:
    """A captured backward graph: nodes, edges and capture metadata.

    Attributes:
        nodes: node list; ``nodes[i].id == i``.
        edges: gradient-flow edges.
        layers: dotted layer path -> layer class name, for every layer seen.
        meta: free-form capture facts: ``step``, ``entry`` (``"backward"`` or
            ``"grad"``), ``grad_stats``, ``capture_ms``, ``trigger``...

    Example:
        >>> with paddleviz_hooks.capture_backward(model) as cap:
        ...     loss = loss_fn(model(x), y); loss.backward()
        >>> g = cap.graph
        >>> print(g.summary()); g.render("step.svg", format="svg")
    """

    nodes: list[Node] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    layers: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ queries
    def node_by_key(self) -> dict[str, Node]:
        """Map stable key -> node."""
        return {n.key: n for n in self.nodes}

    def out_edges(self) -> dict[int, list[Edge]]:
        """Map node id -> edges leaving it (gradients it produced)."""
        out: dict[int, list[Edge]] = defaultdict(list)
        for e in self.edges:
            out[e.src].append(e)
        return out

    def in_edges(self) -> dict[int, list[Edge]]:
        """Map node id -> edges entering it (gradients it received)."""
        inn: dict[int, list[Edge]] = defaultdict(list)
        for e in self.edges:
            inn[e.dst].append(e)
        return inn

    def count_ops(self) -> dict[str, int]:
        """Number of op nodes of each readable op name."""
        counts: dict[str, int] = defaultdict(int)
        for n in self.nodes:
            if n.kind == "op":
                counts[n.op] += 1
        return dict(counts)

    def params(self) -> dict[str, GradMeta | None]:
        """Parameters reached by the gradient, name -> gradient metadata."""
        inn = self.in_edges()
        found: dict[str, GradMeta | None] = {}
        for n in self.nodes:
            if n.kind == "param" and n.param is not None:
                metas = [e.grad for e in inn.get(n.id, []) if e.grad is not None]
                found[n.param] = _merge_metas(metas)
        return found

    def topo_order(self) -> list[int]:
        """Node ids in gradient-flow order (every node after all producers)."""
        indeg = [0] * len(self.nodes)
        out = self.out_edges()
        for e in self.edges:
            indeg[e.dst] += 1
        ready = [n.id for n in self.nodes if indeg[n.id] == 0]
        order: list[int] = []
        while ready:
            ready.sort(reverse=True)
            nid = ready.pop()
            order.append(nid)
            for e in out.get(nid, []):
                indeg[e.dst] -= 1
                if indeg[e.dst] == 0:
                    ready.append(e.dst)
        return order

    def nonfinite_sites(self) -> list[Node]:
        """Nodes that produced a non-finite gradient: the origin first, then
        the others in gradient-flow order.

        The origin is the node that most likely created the NaN/Inf: it
        received only finite gradients and passed a non-finite one on to
        another op. A node whose non-finite gradients all go to leaves (the
        weight gradient of a ``Matmul`` fed NaN activations) only reflects
        activations that went bad further up the forward pass, although it
        comes earlier in gradient-flow order; it is the origin only when there
        is no better candidate.
        """
        bad_edges = [e for e in self.edges if e.grad is not None and e.grad.nonfinite]
        if not bad_edges:
            return []
        bad = {e.src for e in bad_edges}
        received_bad = {e.dst for e in bad_edges}
        order = [i for i in self.topo_order() if i in bad]
        fresh = [i for i in order if i not in received_bad]
        to_op = [
            i for i in fresh
            if any(e.src == i and self.nodes[e.dst].kind not in ("param", "input") for e in bad_edges)
        ]
        origin = (to_op or fresh or order)[0]
        return [self.nodes[origin]] + [self.nodes[i] for i in order if i != origin]

    def nonfinite_count(self) -> int:
        """Non-finite gradient elements summed over all observed edges."""
        return sum(e.grad.nonfinite for e in self.edges if e.grad is not None)

    def global_grad_norm(self) -> float | None:
        """L2 norm over all parameter gradients (None without statistics)."""
        norms = [m.norm for m in self.params().values() if m is not None and m.norm is not None]
        if not norms:
            return None
        return math.sqrt(sum(v * v for v in norms))

    def layer_grad_norms(self, depth: int = 1) -> dict[str, float]:
        """L2 norm of the parameter gradients grouped by layer path prefix.

        Args:
            depth: how many leading path components name the group
                (1: top-level layers such as ``"encoder"``).

        Returns:
            group -> norm; parameters of the top layer itself go to ``"(self)"``.
        """
        sq: dict[str, float] = defaultdict(float)
        for name, m in self.params().items():
            if m is None or m.norm is None:
                continue
            parts = name.split(".")[:-1]
            group = ".".join(parts[:depth]) if parts else "(self)"
            sq[group] += m.norm * m.norm
        return {k: math.sqrt(v) for k, v in sorted(sq.items())}

    # ------------------------------------------------------------- identities
    def assign_keys(self) -> None:
        """Give every node a key that is stable across steps and processes.

        Keys are built from what does not change between two runs of the same
        code path: the layer path and call index, the op name and the node's
        position among nodes with the same layer call and op, the parameter
        name for parameter leaves. Memory addresses never enter a key.

        Positions count in depth-first pre-order from the roots, following
        each node's inputs in slot order. Breadth-first order would depend on
        the distance to the loss, so ops inserted on one branch (a block
        that runs only on some steps) would renumber same-named ops on the
        other branches; depth-first order only changes where branching
        itself changes.
        """
        seen: dict[tuple, int] = defaultdict(int)
        for n in self._dfs_order():
            if n.kind == "param" and n.param is not None:
                n.key = "param:" + n.param
                continue
            if n.kind == "op":
                scope = "?" if n.layer is None else (n.layer or "<top>")
                group = (n.kind, scope, n.call, n.op)
                base = f"op:{scope}[{n.call}]/{n.op}"
            else:
                group = (n.kind,)
                base = n.kind
            n.key = f"{base}#{seen[group]}"
            seen[group] += 1

    def _dfs_order(self) -> list[Node]:
        """Nodes in depth-first pre-order from the sources (roots), inputs in slot order."""
        children: dict[int, list[Edge]] = defaultdict(list)
        has_in: set[int] = set()
        for e in self.edges:
            children[e.src].append(e)
            has_in.add(e.dst)
        for outs in children.values():
            outs.sort(key=lambda e: e.slot)
        starts = [n.id for n in self.nodes if n.id not in has_in]
        seen: set[int] = set()
        order: list[Node] = []
        for s in starts + [n.id for n in self.nodes]:  # a cycle-only rest is still visited
            stack = [s]
            while stack:
                nid = stack.pop()
                if nid in seen:
                    continue
                seen.add(nid)
                order.append(self.nodes[nid])
                stack.extend(e.dst for e in reversed(children.get(nid, ())) if e.dst not in seen)
        return order

    # ------------------------------------------------------------ conversions
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "paddleviz-hooks/backward-graph",
            "version": FORMAT_VERSION,
            "meta": {k: _float_out(v) if isinstance(v, float) else v for k, v in self.meta.items()},
            "layers": self.layers,
            "nodes": [n.to_dict() for n in self.nodes],
            "edges": [e.to_dict() for e in self.edges],
        }

    def to_json(self, indent: int | None = None) -> str:
        """Serialize losslessly; ``from_json(g.to_json()) == g``."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BackwardGraph":
        if not isinstance(d, dict) or d.get("format") != "paddleviz-hooks/backward-graph":
            raise ValueError(
                "not a paddleviz-hooks backward graph (missing "
                "'format': 'paddleviz-hooks/backward-graph')"
            )
        if d.get("version", 0) > FORMAT_VERSION:
            raise ValueError(
                f"graph format version {d.get('version')} is newer than this "
                f"paddleviz-hooks understands ({FORMAT_VERSION}); upgrade paddleviz-hooks"
            )
        try:
            return cls(
                nodes=[Node.from_dict(n) for n in d["nodes"]],
                edges=[Edge.from_dict(e) for e in d["edges"]],
                layers=dict(d.get("layers", {})),
                meta={
                    k: float(v) if v in ("nan", "inf", "-inf") else v
                    for k, v in dict(d.get("meta", {})).items()
                },
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed backward graph JSON: {exc!r}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> "BackwardGraph":
        """Load a graph written by :meth:`to_json`.

        Raises:
            ValueError: the text is not JSON of a backward graph.
        """
        return cls.from_dict(parse_json(text))

    def to_dot(self, **options: Any) -> str:
        """DOT source of the graph; drawing and collapse options as for :meth:`render`."""
        from .render import prepare, to_dot

        return to_dot(prepare(self, options), **options)

    def render(self, path: str, format: str | None = None, **options: Any) -> str:
        """Write the graph to ``path`` as png, svg, dot or json.

        Args:
            path: output file; its suffix picks the format when ``format`` is None.
            format: ``"png"``, ``"svg"``, ``"dot"`` or ``"json"``.
            **options: drawing options (``depth``, ``max_nodes``, ``stats`` ...).

        Returns:
            The path written.

        Raises:
            ValueError: unknown format.
            RuntimeError: png/svg asked for and no layout engine is installed.
        """
        from .render import render_to_file

        return render_to_file(self, path, format=format, **options)

    def diff(self, older: "BackwardGraph") -> "Any":
        """Compare with an older capture; returns a :class:`GraphDiff`."""
        from .diff import diff_graphs

        return diff_graphs(older, self)

    def summary(self, top: int = 5) -> str:
        """A compact multi-line text summary (one fact per line).

        Lines still read well when a viewer joins them with spaces (VisualDL's
        text tab does), so each ends with a period-free, self-contained fact.
        """
        ops = sum(1 for n in self.nodes if n.kind == "op")
        params = self.params()
        lines = [
            f"step {self.meta['step']}:" if "step" in self.meta else "backward graph:",
            f"{len(self.nodes)} nodes ({ops} ops), {len(self.edges)} edges;",
            f"{len(params)} parameters reached;",
        ]
        leaves = sum(1 for n in self.nodes if n.kind == "input")
        if leaves and not params:
            lines.append(f"{leaves} unnamed leaf tensors reached (capture_backward(model) names parameters);")
        gn = self.global_grad_norm()
        if gn is not None:
            lines.append(f"global grad norm {gn:.4g};")
        norms = self.layer_grad_norms()
        if norms:
            biggest = sorted(norms.items(), key=lambda kv: -_sort_val(kv[1]))[:top]
            lines.append("largest grad norms: " + ", ".join(f"{k} {v:.3g}" for k, v in biggest) + ";")
        sites = self.nonfinite_sites()
        if sites:
            first = sites[0]
            where = f" in {first.layer or '<top>'}" if first.layer is not None else ""
            lines.append(
                f"NaN/Inf gradients at {len(sites)} nodes, first at {first.op}{where} (node {first.key});"
            )
        else:
            lines.append("no NaN/Inf gradients;" if self.meta.get("grad_stats") else "")
        unhooked = [n for n in self.nodes if n.kind == "op" and not n.hooked]
        if unhooked:
            kinds = sorted({n.op for n in unhooked})
            lines.append(f"no gradient data at {len(unhooked)} node{'' if len(unhooked) == 1 else 's'} ({', '.join(kinds)});")
        return "\n".join(x for x in lines if x)

    def __repr__(self) -> str:
        return (
            f"BackwardGraph({len(self.nodes)} nodes, {len(self.edges)} edges, "
            f"step={self.meta.get('step')})"
        )


def parse_json(text: str | bytes) -> Any:
    """``json.loads`` whose error is a one-line ``ValueError``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None


def _merge_metas(metas: Iterable[GradMeta]) -> GradMeta | None:
    """Combine the gradients a leaf received over several edges."""
    metas = list(metas)
    if not metas:
        return None
    if len(metas) == 1:
        return metas[0]
    first = metas[0]
    norms = [m.norm for m in metas]
    mins = [m.min for m in metas]
    maxs = [m.max for m in metas]
    return GradMeta(
        shape=first.shape,
        dtype=first.dtype,
        # Norm of the sum is not known from the parts; the root-sum-square is
        # exact for orthogonal contributions and a fair summary otherwise.
        norm=None if None in norms else math.sqrt(sum(v * v for v in norms)),
        min=None if None in mins else min(mins),
        max=None if None in maxs else max(maxs),
        nan=sum(m.nan for m in metas),
        inf=sum(m.inf for m in metas),
    )


def _sort_val(v: float) -> float:
    return v if math.isfinite(v) else math.inf


def _float_out(v: float | None) -> float | str | None:
    if v is None or math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _float_in(v: Any) -> float | None:
    if v is None:
        return None
    return float(v)
