"""Comparing two captured backward graphs.

Nodes are matched by their stable ``key`` (see
:meth:`~paddleviz_hooks.graph.BackwardGraph.assign_keys`), edges by the pair
of their end keys. An op whose key changed only because an op was inserted
right before it, in its own layer call, is still the same node: leftover
removed and added ops of one layer and op that share a consumer are paired,
and so are the calls of a layer called once more or less
(``GraphDiff.renamed``). No paddle here: diffs work on saved JSON files too.

A diff holds numbers and keys; :func:`paddleviz_hooks.text.diff_summary`
words it and :mod:`paddleviz_hooks.render.diff` draws it.
"""

from __future__ import annotations

import json
import math
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .findings import record_of
from .graph import BackwardGraph, Edge, Node, float_from_json, float_to_json, merge_grad_metas, parse_json

__all__ = ["GraphDiff", "diff_graphs", "from_model_output", "node_norms", "edge_metas", "norm_ratio", "align_calls", "pair_leftovers",
           "DEFAULT_THRESHOLD"]

DIFF_FORMAT = "paddleviz-hooks/graph-diff"
DIFF_VERSION = 1
DEFAULT_THRESHOLD = 10.0


def _info(n: Node) -> dict[str, Any]:
    return {"kind": n.kind, "name": n.name, "op": n.op, "layer": n.layer, "call": n.call, "param": n.param}


def node_norms(graph: BackwardGraph) -> dict[str, float]:
    """Norm of the gradient each node received, by node key.

    For an op that is the gradient w.r.t. its forward output; for a parameter
    the gradient the backward added to ``param.grad``. Nodes without gradient statistics are left out.
    """
    metas: dict[int, list] = {}
    for e in graph.edges:
        if e.grad is not None:
            metas.setdefault(e.dst, []).append(e.grad)
    out: dict[str, float] = {}
    for nid, ms in metas.items():
        node = graph.nodes[nid]
        m = node.grad if node.grad is not None else merge_grad_metas(ms)
        if m is not None and m.norm is not None:
            out[node.key] = m.norm
    return out


def edge_metas(graph: BackwardGraph, renamed: dict[str, str] | None = None) -> dict[tuple[str, str], Any]:
    """(src key, dst key) -> metadata of the gradient along that edge; keys through ``renamed`` when given.

    Several edges between the same two keys (a folded repeat) are merged by
    :func:`~paddleviz_hooks.graph.merge_grad_metas`.
    """
    renamed = renamed or {}
    keys = [renamed.get(n.key, n.key) for n in graph.nodes]
    groups: dict[tuple[str, str], list] = {}
    for e in graph.edges:
        if e.grad is not None:
            groups.setdefault((keys[e.src], keys[e.dst]), []).append(e.grad)
    return {k: merge_grad_metas(v) for k, v in groups.items()}


def norm_ratio(old: float | None, new: float | None) -> float | None:
    """new/old for finite norms; 1 when both are 0, inf when only old is 0."""
    if old is None or new is None or not (math.isfinite(old) and math.isfinite(new)):
        return None
    if old == 0.0:
        return 1.0 if new == 0.0 else math.inf
    return new / old


def _role(graph: BackwardGraph) -> str:
    """Which backward of its step a recorded graph is, as the recorder worded it ("" if not said)."""
    info = graph.meta.get("backward")
    role = info.get("role") if isinstance(info, dict) else None
    return role if isinstance(role, str) else ""


@dataclass
class GraphDiff:
    """What changed from an older capture to a newer one.

    Attributes:
        older_step / newer_step: ``meta["step"]`` of the two graphs, if known.
        older_role / newer_role: which backward of its step each graph is
            (``meta["backward"]["role"]``: ``"micro-batch 2 of 4"``), ``""``
            for a step's only backward or when not known.
        added_nodes / removed_nodes: node keys only in the newer / older graph.
        added_edges / removed_edges: ``(src key, dst key)`` pairs (newer
            keys for added edges, older keys for removed ones).
        renamed: older key -> newer key of the nodes that are the same in
            both graphs although their keys differ (see :func:`diff_graphs`).
        params_started / params_stopped: parameters that the gradient reaches
            only in the newer / only in the older graph.
        node_norm_ratios: key -> newer/older norm of the gradient the node
            received, for nodes in both graphs with finite norms.
        layer_norm_ratios: layer path -> newer/older norm of its parameters'
            gradients (from :meth:`BackwardGraph.layer_grad_norms`).
        global_norm_ratio: newer/older global gradient norm.
        new_nonfinite / resolved_nonfinite: keys of NaN/Inf sites only in the
            newer / only in the older graph.
        first_nonfinite: the newer graph's first non-finite gradient (its
            record's ``first_gradient``: ``{"key", "kind", "name", "op",
            "layer", "call", "param"}``), None when it has none.
        replayed: ``"newer"`` or ``"older"`` when that graph (and only it) was
            replayed from the model output (``meta["replayed"]``): the other
            graph's part above the model output (the loss ops) was left out
            of the comparison; None otherwise.
        left_out: the keys of that part (in the other graph).
        node_info: kind, op, layer and param of every key listed above, so
            the diff reads well without the graphs.
        threshold: ratios above ``threshold`` or below ``1/threshold`` count
            as large changes.
    """

    older_step: Any = None
    newer_step: Any = None
    older_role: str = ""
    newer_role: str = ""
    added_nodes: list[str] = field(default_factory=list)
    removed_nodes: list[str] = field(default_factory=list)
    added_edges: list[tuple[str, str]] = field(default_factory=list)
    removed_edges: list[tuple[str, str]] = field(default_factory=list)
    renamed: dict[str, str] = field(default_factory=dict)
    params_started: list[str] = field(default_factory=list)
    params_stopped: list[str] = field(default_factory=list)
    node_norm_ratios: dict[str, float] = field(default_factory=dict)
    layer_norm_ratios: dict[str, float] = field(default_factory=dict)
    global_norm_ratio: float | None = None
    new_nonfinite: list[str] = field(default_factory=list)
    resolved_nonfinite: list[str] = field(default_factory=list)
    first_nonfinite: dict[str, Any] | None = None
    replayed: str | None = None
    left_out: list[str] = field(default_factory=list)
    node_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    threshold: float = DEFAULT_THRESHOLD

    # ------------------------------------------------------------- questions
    @property
    def structure_changed(self) -> bool:
        """Nodes or edges added or removed, or parameters started/stopped."""
        return bool(
            self.added_nodes or self.removed_nodes or self.added_edges or self.removed_edges
            or self.params_started or self.params_stopped
        )

    @property
    def nonfinite_changed(self) -> bool:
        """NaN/Inf sites appeared or went away."""
        return bool(self.new_nonfinite or self.resolved_nonfinite)

    def is_large(self, ratio: float | None) -> bool:
        """Whether a norm ratio is beyond ``threshold`` (either way)."""
        return ratio is not None and (ratio > self.threshold or ratio < 1.0 / self.threshold)

    def large_node_changes(self) -> dict[str, float]:
        """Node key -> ratio for the large changes, largest change first."""
        big = {k: r for k, r in self.node_norm_ratios.items() if self.is_large(r)}
        return dict(sorted(big.items(), key=lambda kv: -_magnitude(kv[1])))

    def large_layer_changes(self) -> dict[str, float]:
        """Layer -> ratio for the large changes, largest change first."""
        big = {k: r for k, r in self.layer_norm_ratios.items() if self.is_large(r)}
        return dict(sorted(big.items(), key=lambda kv: -_magnitude(kv[1])))

    @property
    def changed(self) -> bool:
        """Anything worth showing: structure, NaN/Inf sites or a large norm change."""
        return bool(
            self.structure_changed or self.nonfinite_changed
            or self.large_node_changes() or self.large_layer_changes()
        )

    def compared_graphs(self) -> tuple[BackwardGraph, BackwardGraph] | None:
        """The ``(older, newer)`` graphs this diff was computed from, while they are alive.

        Held weakly, so a diff never keeps captures in memory; None for a diff
        loaded from JSON or once either graph is gone.
        """
        refs = getattr(self, "_graphs", None)
        graphs = tuple(r() for r in refs) if refs else ()
        return graphs if len(graphs) == 2 and None not in graphs else None  # type: ignore[return-value]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_graphs", None)  # weak references do not pickle
        return state

    # ----------------------------------------------------------- conversions
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": DIFF_FORMAT,
            "version": DIFF_VERSION,
            "older_step": self.older_step,
            "newer_step": self.newer_step,
            "older_role": self.older_role,
            "newer_role": self.newer_role,
            "added_nodes": list(self.added_nodes),
            "removed_nodes": list(self.removed_nodes),
            "added_edges": [list(e) for e in self.added_edges],
            "removed_edges": [list(e) for e in self.removed_edges],
            "renamed": dict(self.renamed),
            "params_started": list(self.params_started),
            "params_stopped": list(self.params_stopped),
            "node_norm_ratios": {k: float_to_json(v) for k, v in self.node_norm_ratios.items()},
            "layer_norm_ratios": {k: float_to_json(v) for k, v in self.layer_norm_ratios.items()},
            "global_norm_ratio": float_to_json(self.global_norm_ratio),
            "new_nonfinite": list(self.new_nonfinite),
            "resolved_nonfinite": list(self.resolved_nonfinite),
            "first_nonfinite": self.first_nonfinite,
            "replayed": self.replayed,
            "left_out": list(self.left_out),
            "node_info": self.node_info,
            "threshold": self.threshold,
        }

    def to_json(self, indent: int | None = None) -> str:
        """Serialize losslessly; ``GraphDiff.from_json(d.to_json()) == d``."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GraphDiff":
        if not isinstance(d, dict) or d.get("format") != DIFF_FORMAT:
            raise ValueError(f"not a paddleviz-hooks graph diff (missing 'format': '{DIFF_FORMAT}')")
        if d.get("version", 0) > DIFF_VERSION:
            raise ValueError(
                f"graph diff format version {d.get('version')} is newer than this "
                f"paddleviz-hooks understands ({DIFF_VERSION}); upgrade paddleviz-hooks"
            )
        try:
            return cls(
                older_step=d.get("older_step"),
                newer_step=d.get("newer_step"),
                older_role=str(d.get("older_role") or ""),
                newer_role=str(d.get("newer_role") or ""),
                added_nodes=list(d["added_nodes"]),
                removed_nodes=list(d["removed_nodes"]),
                added_edges=[(str(s), str(t)) for s, t in d["added_edges"]],
                removed_edges=[(str(s), str(t)) for s, t in d["removed_edges"]],
                renamed={str(k): str(v) for k, v in d.get("renamed", {}).items()},
                params_started=list(d["params_started"]),
                params_stopped=list(d["params_stopped"]),
                node_norm_ratios={k: float_from_json(v) for k, v in d["node_norm_ratios"].items()},
                layer_norm_ratios={k: float_from_json(v) for k, v in d["layer_norm_ratios"].items()},
                global_norm_ratio=float_from_json(d.get("global_norm_ratio")),
                new_nonfinite=list(d["new_nonfinite"]),
                resolved_nonfinite=list(d["resolved_nonfinite"]),
                first_nonfinite=d.get("first_nonfinite", d.get("nonfinite_origin")),  # older files: its old name
                replayed=d.get("replayed"),
                left_out=list(d.get("left_out") or ()),
                node_info={k: dict(v) for k, v in d.get("node_info", {}).items()},
                threshold=float(d.get("threshold", DEFAULT_THRESHOLD)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed graph diff JSON: {exc!r}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> "GraphDiff":
        """Load a diff written by :meth:`to_json`.

        Raises:
            ValueError: the text is not JSON of a graph diff.
        """
        return cls.from_dict(parse_json(text))

    def __repr__(self) -> str:
        return (
            f"GraphDiff(step {self.older_step} -> {self.newer_step}: "
            f"+{len(self.added_nodes)}/-{len(self.removed_nodes)} nodes, "
            f"+{len(self.added_edges)}/-{len(self.removed_edges)} edges, "
            f"{len(self.new_nonfinite)} new NaN/Inf sites)"
        )


def _magnitude(r: float) -> float:
    if r <= 0:
        return math.inf
    return abs(math.log(r)) if math.isfinite(r) else math.inf


def _edge_keys(graph: BackwardGraph) -> list[tuple[str, str]]:
    seen: dict[tuple[str, str], None] = {}
    for e in graph.edges:
        seen[(graph.nodes[e.src].key, graph.nodes[e.dst].key)] = None
    return list(seen)


def _neighbours(graph: BackwardGraph) -> dict[int, set[tuple[str, str]]]:
    """Node id -> ``("in", key)`` of the nodes it receives gradient from, ``("out", key)`` of those it sends to."""
    found: dict[int, set[tuple[str, str]]] = defaultdict(set)
    for e in graph.edges:
        found[e.src].add(("out", graph.nodes[e.dst].key))
        found[e.dst].add(("in", graph.nodes[e.src].key))
    return found


_GONE = "\0gone"  # what an op of a call that has no counterpart is matched with: nothing
#: Calls of one layer aligned at most (older x newer); beyond, call indices are taken as they are.
_ALIGN_LIMIT = 250_000


def _calls(graph: BackwardGraph) -> dict[str, dict[int, list[Node]]]:
    """Layer path -> call index -> its op nodes."""
    found: dict[str, dict[int, list[Node]]] = defaultdict(lambda: defaultdict(list))
    for n in graph.nodes:
        if n.kind == "op" and n.layer is not None:
            found[n.layer][n.call].append(n)
    return found


def align_calls(older: BackwardGraph, newer: BackwardGraph) -> dict[str, str]:
    """Older op key -> newer op key for layers called a different number of times.

    A layer called once more (or less) before its other calls shifts their
    call index, and with it every key of their ops. For each such layer
    (shallowest first, so a block's calls are aligned before its
    sublayers'), the calls of both graphs are aligned in order, each pair
    scored by the neighbours outside the layer its ops share (parameters
    left out: every call shares them); ties keep the call index. An op of an
    aligned call takes the key with the newer call index; an op of an older
    call left without a partner is mapped to a key no node has, so that it
    shows as removed even when a newer call took its index. Layers called
    more than about 500 times in both graphs are left as they are.

    Examples:
        >>> from paddleviz_hooks.graph import Edge
        >>> def chain(*ops):  # the loss, then each op feeding the one before (gradient-flow order)
        ...     nodes = [Node(0, "root", "loss", "loss")] + [
        ...         Node(i + 1, "op", "", op, layer=layer, call=call) for i, (op, layer, call) in enumerate(ops)]
        ...     g = BackwardGraph(nodes, [Edge(i, i + 1) for i in range(len(ops))])
        ...     g.assign_keys()
        ...     return g
        >>> relu = lambda call: ("Relu", "act", call)
        >>> old = chain(("Mean", "", 0), relu(1), ("Tanh", "", 0), relu(0), ("Exp", "", 0))
        >>> new = chain(("Mean", "", 0), relu(2), ("Tanh", "", 0), relu(1), relu(0), ("Exp", "", 0))  # act twice
        >>> shifts = align_calls(old, new)
        >>> sorted((k.split("#")[0], v.split("#")[0]) for k, v in shifts.items() if k != v)
        [('op:act[1]/Relu', 'op:act[2]/Relu')]
    """
    old_calls, new_calls = _calls(older), _calls(newer)
    layers = sorted((p for p in old_calls.keys() & new_calls.keys() if len(old_calls[p]) != len(new_calls[p])
                     and len(old_calls[p]) * len(new_calls[p]) <= _ALIGN_LIMIT),
                    key=lambda p: (p.count(".") + bool(p), p))
    if not layers:
        return {}
    old_nb, new_nb = _neighbours(older), _neighbours(newer)
    shifts: dict[str, str] = {}

    def outside(nb: dict[int, set[tuple[str, str]]], ops: list[Node], layer: str, tr) -> set[tuple[str, str]]:
        """Neighbours of a call's ops outside the layer and its sublayers (their call indices shift too)."""
        inner = ("param:", "op:" + (layer or "<top>") + "[") + (("op:" + layer + ".",) if layer else ())
        return {(way, tr(k)) for n in ops for way, k in nb.get(n.id, ()) if not k.startswith(inner)}

    for layer in layers:
        olds, news = sorted(old_calls[layer]), sorted(new_calls[layer])
        octx = [outside(old_nb, old_calls[layer][c], layer, lambda k: shifts.get(k, k)) for c in olds]
        nctx = [outside(new_nb, new_calls[layer][c], layer, lambda k: k) for c in news]
        m, n = len(olds), len(news)
        # best[i][j]: (shared neighbours, calls keeping their index) aligning olds[i:] with news[j:]
        best = [[(0, 0)] * (n + 1) for _ in range(m + 1)]
        for i in range(m - 1, -1, -1):
            for j in range(n - 1, -1, -1):
                b = best[i + 1][j + 1]
                best[i][j] = max((b[0] + len(octx[i] & nctx[j]), b[1] + (olds[i] == news[j])),
                                 best[i][j + 1], best[i + 1][j])
        i = j = 0
        while i < m:
            b = best[i + 1][j + 1] if j < n else None
            if b is not None and best[i][j] == (b[0] + len(octx[i] & nctx[j]), b[1] + (olds[i] == news[j])):
                target, j = news[j], j + 1
            elif j < n and best[i][j] == best[i][j + 1]:
                j += 1
                continue
            else:
                target = None
            scope = "op:" + (layer or "<top>")
            for op in old_calls[layer][olds[i]]:
                rest = op.key.split("]/", 1)[1]
                shifts[op.key] = _GONE + op.key if target is None else f"{scope}[{target}]/{rest}"
            i += 1
    return shifts


def pair_leftovers(
    older: BackwardGraph, newer: BackwardGraph, removed: list[Node], added: list[Node],
    known: dict[str, str] | None = None,
) -> dict[str, str]:
    """Removed and added ops that are one node under two keys: older key -> newer key.

    An op's key changes when an op is inserted right before it in its own
    layer call (its signature names its inputs there), or when its layer is
    called once more earlier (its call index shifts). Such a removed op and
    such an added op ran in the same layer with the same op name and keep
    their consumers (the nodes they receive gradient from); the inserted op
    took over their inputs, so shared inputs alone prove nothing. In
    rounds, the pairs in which each side shares more consumers with the
    other than with any other candidate are made (then more neighbours of
    any kind, then the same call index); when there is none, the one best
    pair (then gradient-flow order). Each pair lets the nodes it feeds match
    in the next round, until no pair is left. Ops sharing no consumer stay
    removed and added.

    Args:
        older / newer: the two graphs, with keys.
        removed / added: nodes whose key is only in ``older`` / ``newer``,
            each in its graph's gradient-flow order.
        known: older key -> newer key of nodes already paired otherwise
            (:func:`align_calls`), used to compare neighbours.

    Returns:
        Older key -> newer key for every pair found here.

    Examples:
        >>> from paddleviz_hooks.graph import Edge
        >>> def chain(*ops):  # a loss and a chain of ops in layer "block"
        ...     nodes = [Node(0, "root", "loss", "loss")] + [
        ...         Node(i + 1, "op", op + "GradNode", op, layer="block") for i, op in enumerate(ops)]
        ...     g = BackwardGraph(nodes, [Edge(i, i + 1) for i in range(len(ops))])
        ...     g.assign_keys()
        ...     return g
        >>> old, new = chain("Tanh", "Relu"), chain("Tanh", "Exp", "Relu")  # Exp put before Tanh
        >>> tanh = lambda g: next(n for n in g.nodes if n.op == "Tanh")
        >>> tanh(old).key == tanh(new).key  # its input changed: so did its key
        False
        >>> pair_leftovers(old, new, [tanh(old)], [n for n in new.nodes if n.op in ("Tanh", "Exp")]) == {
        ...     tanh(old).key: tanh(new).key}
        True
    """
    old_nb, new_nb = _neighbours(older), _neighbours(newer)
    # (layer, op, consumer key) -> added ops with that consumer: the only candidates worth scoring
    by_consumer: dict[tuple, list[tuple[int, Node]]] = defaultdict(list)
    for j, a in enumerate(added):
        if a.kind == "op":
            for way, k in new_nb.get(a.id, ()):
                if way == "in":
                    by_consumer[(a.layer, a.op, k)].append((j, a))
    free_old = {n.key: (i, n) for i, n in enumerate(removed) if n.kind == "op"}
    free_new = {a.key for group in by_consumer.values() for _, a in group}
    renamed: dict[str, str] = dict(known or {})
    found: dict[str, str] = {}
    while free_old and free_new:
        pairs = []
        for i, o in free_old.values():
            mine = {(way, renamed.get(k, k)) for way, k in old_nb.get(o.id, ())}
            candidates = {j: a for way, k in mine if way == "in"
                          for j, a in by_consumer.get((o.layer, o.op, k), ()) if a.key in free_new}
            for j, a in candidates.items():
                shared = mine & new_nb.get(a.id, set())
                consumers = sum(1 for way, _ in shared if way == "in")
                pairs.append(((-consumers, -len(shared), o.call != a.call), i, j, o.key, a.key))
        if not pairs:
            break
        pairs.sort()
        best_old: dict[str, list] = {}
        best_new: dict[str, list] = {}
        for score, _, _, ok, ak in pairs:
            for best, mine_key, other in ((best_old, ok, ak), (best_new, ak, ok)):
                if mine_key not in best or best[mine_key][0] == score:
                    best.setdefault(mine_key, [score]).append(other)
        # pairs each side prefers over all others first; a tie is settled one pair at a time,
        # so that the pairs it allows weigh in on the rest
        sure = [(ok, ak) for *_, ok, ak in pairs if best_old[ok][1:] == [ak] and best_new[ak][1:] == [ok]]
        for ok, ak in sure or [pairs[0][-2:]]:
            renamed[ok] = found[ok] = ak
            del free_old[ok]
            free_new.discard(ak)
    return found


def from_model_output(graph: BackwardGraph) -> tuple[BackwardGraph, list[Node]]:
    """``graph`` as a replay would have captured it: rooted at the model output.

    A replayed step's graph (``meta["replayed"]``) starts at the model's
    outputs; an ordinary one at the loss, with the loss ops (ops outside
    every layer) between. Those ops, as far as they are reached from the
    root through ops outside every layer, are left out; the root sends
    their gradients straight to the model ops they fed.

    Returns:
        (the trimmed graph, keys kept; the nodes left out, in gradient-flow order).

    Examples:
        >>> from paddleviz_hooks.graph import Edge
        >>> g = BackwardGraph([Node(0, "root", "loss", "loss"), Node(1, "op", "MeanAllGradNode", "MeanAll"),
        ...                    Node(2, "op", "MatmulGradNode", "Matmul", layer="fc")], [Edge(0, 1), Edge(1, 2)])
        >>> g.assign_keys()
        >>> trimmed, gone = from_model_output(g)
        >>> [n.op for n in gone], [(trimmed.nodes[e.src].op, trimmed.nodes[e.dst].op) for e in trimmed.edges]
        (['MeanAll'], [('loss', 'Matmul')])
    """
    out = graph.out_edges()
    roots = [n.id for n in graph.nodes if n.kind == "root"]
    above: set[int] = set()
    stack = list(roots)
    while stack:
        for e in out.get(stack.pop(), []):
            n = graph.nodes[e.dst]
            if n.kind == "op" and n.layer is None and n.id not in above:
                above.add(n.id)
                stack.append(n.id)
    if not above:
        return graph, []
    kept = [n for n in graph.nodes if n.id not in above]
    ids = {n.id: i for i, n in enumerate(kept)}
    root = roots[0]
    edges, seen = [], set()
    for e in graph.edges:
        if e.dst in above:
            continue
        src = root if e.src in above else e.src
        if e.src in above and (src, e.dst) in seen:  # two loss ops fed the same model op
            continue
        seen.add((src, e.dst))
        edges.append(Edge(ids[src], ids[e.dst], e.slot, e.grad, e.note, e.after_hook))
    nodes = [replace(n, id=ids[n.id]) for n in kept]
    trimmed = BackwardGraph(nodes, edges, dict(graph.layers), dict(graph.meta), dict(graph.calls))
    order = graph.topo_order()
    return trimmed, [graph.nodes[i] for i in order if i in above]


def _ensure_keys(graph: BackwardGraph) -> None:
    """Keys for a graph without them, or saved with keys of an older kind (not a collapsed one:
    its boxes have keys of their own)."""
    if not graph.keys_current() and not any(n.kind == "layer" for n in graph.nodes):
        graph.assign_keys()


def diff_graphs(
    older: BackwardGraph,
    newer: BackwardGraph,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    layer_depth: int | None = None,
) -> GraphDiff:
    """Compare two captures.

    Args:
        older: the earlier graph.
        newer: the later graph.
        threshold: a gradient-norm ratio above ``threshold`` or below
            ``1/threshold`` is a large change (``GraphDiff.large_*_changes``).
        layer_depth: path components naming a layer group for
            ``layer_norm_ratios``; None groups by the full layer path (the
            layer owning each parameter).

    Returns:
        A :class:`GraphDiff`. Lists of keys are in the newer graph's
        gradient-flow order (removed ones in the older graph's order). Ops
        whose key differs only because of what was put next to them (a call
        of their layer added before them: :func:`align_calls`; an op put
        right before them in their layer call: :func:`pair_leftovers`) are
        neither added nor removed (``GraphDiff.renamed``); their edges and
        norms are compared as one node's.

    Raises:
        TypeError: an argument is not a :class:`BackwardGraph`.
        ValueError: ``threshold`` is not a number above 1.

    Examples:
        >>> import paddle
        >>> from paddleviz_hooks import capture_backward
        >>> net = paddle.nn.Sequential(paddle.nn.Linear(3, 3), paddle.nn.Linear(3, 1))
        >>> x = paddle.randn([2, 3])
        >>> with capture_backward(net) as cap:
        ...     net(x).sum().backward()
        ...     net[1](net[0](x).detach()).sum().backward()  # the gradient stops before layer 0
        >>> d = diff_graphs(cap.graphs[0], cap.graphs[1])
        >>> d.params_stopped
        ['0.bias', '0.weight']
    """
    for name, g in (("older", older), ("newer", newer)):
        if not isinstance(g, BackwardGraph):
            raise TypeError(f"{name} must be a BackwardGraph, got {type(g).__name__}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 1:
        raise ValueError(f"threshold must be a number above 1, got {threshold!r}")
    if layer_depth is not None and (not isinstance(layer_depth, int) or layer_depth < 1):
        raise ValueError(f"layer_depth must be a positive int or None, got {layer_depth!r}")
    _ensure_keys(older)
    _ensure_keys(newer)
    first = record_of(newer).first_gradient
    compared = (weakref.ref(older), weakref.ref(newer))  # for drawing it (see compared_graphs)
    replayed, left_out = None, []
    if bool(older.meta.get("replayed")) != bool(newer.meta.get("replayed")):
        # one graph starts at the model output: compare the other from there too
        replayed = "older" if older.meta.get("replayed") else "newer"
        if replayed == "older":
            newer, left_out = from_model_output(newer)
        else:
            older, left_out = from_model_output(older)

    def ordered(g: BackwardGraph) -> list[Node]:
        return [g.nodes[i] for i in g.topo_order()]

    old_nodes, new_nodes = ordered(older), ordered(newer)
    renamed = align_calls(older, newer)

    def same(key: str) -> str:  # an older key in the newer graph's terms
        return renamed.get(key, key)

    old_keys = {same(n.key) for n in old_nodes}
    new_keys = {n.key for n in new_nodes}
    added = [n for n in new_nodes if n.key not in old_keys]
    removed = [n for n in old_nodes if same(n.key) not in new_keys]
    paired = pair_leftovers(older, newer, removed, added, renamed)
    renamed.update(paired)
    added = [n for n in added if n.key not in paired.values()]
    removed = [n for n in removed if n.key not in paired]

    old_edges, new_edges = _edge_keys(older), _edge_keys(newer)
    old_as_new = {(same(a), same(b)) for a, b in old_edges}
    new_edge_set = set(new_edges)

    old_params, new_params = older.params(), newer.params()

    old_norms = {same(k): v for k, v in node_norms(older).items()}
    new_norms = node_norms(newer)
    ratios = {}
    for n in new_nodes:
        r = norm_ratio(old_norms.get(n.key), new_norms.get(n.key))
        if r is not None:
            ratios[n.key] = r

    depth = layer_depth or 10_000
    old_layers, new_layers = older.layer_grad_norms(depth), newer.layer_grad_norms(depth)
    layer_ratios = {}
    for name in new_layers:
        r = norm_ratio(old_layers.get(name), new_layers[name])
        if r is not None:
            layer_ratios[name] = r

    old_sites, new_sites = older.nonfinite_sites(), newer.nonfinite_sites()
    old_site_keys = {same(n.key) for n in old_sites}
    new_site_keys = {n.key for n in new_sites}
    new_bad = [n for n in new_sites if n.key not in old_site_keys]
    resolved = [n for n in old_sites if same(n.key) not in new_site_keys]
    first_bad = {**asdict(first), "name": ""} if first is not None else None

    info: dict[str, dict[str, Any]] = {}
    for n in added + new_bad:
        info[n.key] = _info(n)
    for n in removed + resolved + left_out:
        info.setdefault(n.key, _info(n))
    d = GraphDiff(
        older_step=older.meta.get("step"),
        newer_step=newer.meta.get("step"),
        older_role=_role(older),
        newer_role=_role(newer),
        added_nodes=[n.key for n in added],
        removed_nodes=[n.key for n in removed],
        added_edges=[e for e in new_edges if e not in old_as_new],
        removed_edges=[e for e in old_edges if (same(e[0]), same(e[1])) not in new_edge_set],
        renamed={k: v for k, v in renamed.items() if k != v and not v.startswith(_GONE)},
        params_started=[p for p in new_params if p not in old_params],
        params_stopped=[p for p in old_params if p not in new_params],
        node_norm_ratios=ratios,
        layer_norm_ratios=layer_ratios,
        global_norm_ratio=norm_ratio(older.global_grad_norm(), newer.global_grad_norm()),
        new_nonfinite=[n.key for n in new_bad],
        resolved_nonfinite=[n.key for n in resolved],
        first_nonfinite=first_bad,
        replayed=replayed,
        left_out=[n.key for n in left_out],
        node_info=info,
        threshold=float(threshold),
    )
    by_key = {n.key: n for n in new_nodes}
    for key in d.large_node_changes():
        info.setdefault(key, _info(by_key[key]))
    d._graphs = compared
    return d
