"""Collapsing a BackwardGraph into layer boxes, so big graphs stay readable.

A backward graph of a real model has hundreds of nodes; drawn in full it is
either huge or illegible. :func:`collapse_graph` returns a smaller graph in
which whole layers are single boxes (``Node(kind="layer")``):

* ``depth``: every layer at that depth becomes one box holding all the op
  nodes and parameter leaves beneath it, and so does every shallower layer
  without sublayers (a top-level ``fc`` at ``depth=2``); only ops that belong
  directly to a layer with sublayers (a residual ``Add``) stay. Depth counts
  the dotted components
  of a layer path, except that pure containers (``LayerList``, ``LayerDict``,
  ``ParameterList``), which never run themselves, are not a level: the
  blocks ``layers.0``, ``layers.1`` ... of a ``TransformerEncoder`` are at
  depth 1. ``depth=0`` makes the whole model one box; ``None`` keeps every op.
* ``by_type``: layers of these classes (``"TransformerEncoderLayer"``,
  ``"BottleneckBlock"``) become boxes whatever their depth.
* ``fold_repeats``: runs of consecutive sibling layers (``layers.0`` ..
  ``layers.5``) of the same class and identical internal structure become
  one box ``layers.0-5  TransformerEncoderLayer x6``.
* ``max_nodes``: the deepest depth whose drawing has at most this many nodes
  is picked automatically.

Nodes outside every box (the root, loss ops outside the model, ops of a layer
above the cut depth, input leaves) stay as they are. Edges between boxes keep
their gradient metadata; parallel edges between the same two nodes with the
same gradient shape are merged into one (norms combined root-sum-square).
Nothing here imports paddle, and the input graph is never modified.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import replace
from typing import Iterable

from .graph import BackwardGraph, Edge, Node, merge_grad_metas

__all__ = ["collapse_graph", "layer_depths", "CONTAINER_TYPES"]

#: Layer classes that only hold other layers and never run themselves; they
#: do not count as a depth level.
CONTAINER_TYPES = frozenset({"LayerList", "LayerDict", "ParameterList"})

_INDEX = re.compile(r"^(.*)\.(\d+)$")


# --------------------------------------------------------------------------
# layer paths
# --------------------------------------------------------------------------
def _prefixes(path: str) -> list[str]:
    """``"a.b.c"`` -> ``["", "a", "a.b", "a.b.c"]`` (shallowest first)."""
    if path == "":
        return [""]
    parts = path.split(".")
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _inside(path: str, box: str) -> bool:
    """True when ``path`` is ``box`` or one of its sublayers."""
    return box == "" or path == box or path.startswith(box + ".")


class _Layers:
    """Depths and box choices for the layer paths of one graph."""

    def __init__(self, graph: BackwardGraph) -> None:
        self.types = graph.layers
        self._depth: dict[str, int] = {}
        self.parents: set[str] = set()  # layers that have sublayers
        for path in graph.layers:
            self.parents.update(_prefixes(path)[:-1])

    def is_container(self, path: str) -> bool:
        return self.types.get(path) in CONTAINER_TYPES

    def depth(self, path: str) -> int:
        d = self._depth.get(path)
        if d is None:
            d = sum(1 for p in _prefixes(path)[1:] if not self.is_container(p))
            self._depth[path] = d
        return d

    def box(self, path: str | None, depth: int | None, by_type: frozenset[str]) -> str | None:
        """The box a node of layer ``path`` goes into, or None to keep it."""
        if path is None:
            return None
        for p in _prefixes(path):  # shallowest first: the outermost box wins
            if self.is_container(p):
                continue
            if depth is not None and (
                self.depth(p) == depth
                # a layer without sublayers above the cut is a box too: its
                # ops are only shown at full detail (depth=None)
                or (p and self.depth(p) < depth and p not in self.parents)
            ):
                return p
            if by_type and self.types.get(p) in by_type:
                return p
        return None


def layer_depths(graph: BackwardGraph) -> dict[str, int]:
    """Depth of every layer path of ``graph`` as :func:`collapse_graph` counts it.

    Example:
        >>> from paddleviz_hooks.graph import BackwardGraph
        >>> g = BackwardGraph(layers={"": "Encoder", "layers": "LayerList", "layers.0": "EncoderLayer",
        ...                           "layers.0.self_attn": "MultiHeadAttention"})
        >>> layer_depths(g)["layers.0.self_attn"]   # layers is a LayerList: not a level
        2
    """
    lay = _Layers(graph)
    return {p: lay.depth(p) for p in graph.layers}


def _node_path(node: Node, graph: BackwardGraph) -> str | None:
    """The layer a node belongs to: its op layer, or a parameter's owner."""
    if node.kind == "op":
        return node.layer
    if node.kind == "param":
        if node.layer is not None:
            return node.layer
        if node.param is None or not graph.layers:
            return None
        owner = node.param.rsplit(".", 1)[0] if "." in node.param else ""
        # the owner is a known layer (or the top layer for a top-level parameter)
        return owner if (owner in graph.layers or owner == "") else None
    return None


# --------------------------------------------------------------------------
# repeated blocks
# --------------------------------------------------------------------------
def _signature(graph: BackwardGraph, path: str, members: list[int], paths: list[str | None]) -> tuple:
    """Structure of the subtree ``path``, with ``path`` itself taken out."""
    cut = len(path)

    def rel(p: str | None) -> str:
        return "" if p is None else p[cut:]

    member_set = set(members)
    ops = sorted(
        (rel(paths[i]), graph.nodes[i].call, graph.nodes[i].op)
        for i in members if graph.nodes[i].kind == "op"
    )
    prm = sorted(
        (rel(graph.nodes[i].param), tuple(graph.nodes[i].shape or ()))
        for i in members if graph.nodes[i].kind == "param"
    )

    def rkey(i: int) -> str:
        return graph.nodes[i].key.replace(path, "~", 1)

    keyed = all(graph.nodes[i].key for i in members)
    edges = sorted(
        (rkey(e.src), rkey(e.dst))
        for e in graph.edges if e.src in member_set and e.dst in member_set
    ) if keyed else len([e for e in graph.edges if e.src in member_set and e.dst in member_set])
    return (tuple(ops), tuple(prm), tuple(edges) if isinstance(edges, list) else edges)


def _find_folds(
    graph: BackwardGraph, lay: _Layers, paths: list[str | None], boxes: list[str | None]
) -> dict[str, tuple[str, list[str]]]:
    """Runs of identical consecutive siblings: member path -> (fold label, members)."""
    subtree: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(paths):
        if p is None:
            continue
        for pre in _prefixes(p)[1:]:
            subtree[pre].append(i)
    # candidates: indexed paths whose nodes are not inside a shallower box
    siblings: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for path, members in subtree.items():
        m = _INDEX.match(path)
        if m is None or lay.is_container(path):
            continue
        if any(boxes[i] is not None and not _inside(boxes[i], path) for i in members):
            continue
        siblings[m.group(1)].append((int(m.group(2)), path))
    folds: dict[str, tuple[str, list[str]]] = {}
    folded: list[str] = []
    for parent in sorted(siblings, key=lambda p: (lay.depth(p), p)):  # outermost first
        if any(_inside(parent, f) for f in folded):
            continue
        items = sorted(siblings[parent])
        sigs = {
            path: (lay.types.get(path), _signature(graph, path, subtree[path], paths))
            for _, path in items
        }
        run: list[tuple[int, str]] = []

        def close(run: list[tuple[int, str]]) -> None:
            if len(run) < 2:
                return
            members = [p for _, p in run]
            label = f"{parent}.{run[0][0]}-{run[-1][0]}"
            for p in members:
                folds[p] = (label, members)
            folded.extend(members)

        for idx, path in items:
            if run and idx == run[-1][0] + 1 and sigs[path] == sigs[run[-1][1]]:
                run.append((idx, path))
            else:
                close(run)
                run = [(idx, path)]
        close(run)
    return folds


# --------------------------------------------------------------------------
# one collapse
# --------------------------------------------------------------------------
def _collapse_once(
    graph: BackwardGraph, lay: _Layers, depth: int | None, by_type: frozenset[str], fold_repeats: bool
) -> BackwardGraph:
    paths = [_node_path(n, graph) for n in graph.nodes]
    boxes = [lay.box(p, depth, by_type) for p in paths]
    if fold_repeats:
        folds = _find_folds(graph, lay, paths, boxes)
        if folds:
            for i, p in enumerate(paths):
                if p is None:
                    continue
                for pre in _prefixes(p)[1:]:
                    if pre in folds:
                        boxes[i] = folds[pre][0]
                        break
    else:
        folds = {}
    fold_info = {label: members for label, members in folds.values()}

    # new nodes, in the order of their first member
    new_nodes: list[Node] = []
    new_id: list[int] = [0] * len(graph.nodes)
    box_id: dict[str, int] = {}
    members: dict[int, list[Node]] = defaultdict(list)
    for n, box in zip(graph.nodes, boxes):
        if box is None:
            new_id[n.id] = len(new_nodes)
            new_nodes.append(replace(n, id=len(new_nodes)))
            continue
        bid = box_id.get(box)
        if bid is None:
            bid = box_id[box] = len(new_nodes)
            count = len(fold_info.get(box, ())) or 1
            kind = lay.types.get(fold_info[box][0] if box in fold_info else box, "")
            new_nodes.append(Node(bid, "layer", kind or "layer", layer=box, count=count,
                                  key="layer:" + (box or "<top>")))
        new_id[n.id] = bid
        members[bid].append(n)

    # edges: internal ones vanish, parallel ones with the same gradient merge
    groups: dict[tuple, list[Edge]] = {}
    for e in graph.edges:
        s, d = new_id[e.src], new_id[e.dst]
        if s == d:
            if e.grad is not None and e.grad.nonfinite:
                new_nodes[s].nonfinite += e.grad.nonfinite
            continue
        g = e.grad
        k = (s, d, None if g is None else (g.shape, g.dtype))
        groups.setdefault(k, []).append(e)
    new_edges = []
    for (s, d, _), es in groups.items():
        metas = [e.grad for e in es if e.grad is not None]
        grad = merge_grad_metas(metas) if metas else None
        if grad is not None:
            grad = replace(grad)  # never share a GradMeta with the input graph
        new_edges.append(Edge(s, d, min(e.slot for e in es), grad))

    # box summaries
    param_meta = graph.params()
    for bid, ns in members.items():
        box = new_nodes[bid]
        ops = [n for n in ns if n.kind == "op"]
        prm = [n for n in ns if n.kind == "param"]
        box.ops = len(ops)
        box.params = len(prm)
        sq, known = 0.0, False
        for n in prm:
            m = param_meta.get(n.param) if n.param is not None else None
            if m is not None and m.norm is not None:
                sq += m.norm * m.norm
                known = True
        box.norm = math.sqrt(sq) if known else None
        box.hooked = bool(ops) and all(n.hooked for n in ops)
        box.unhooked = sum(1 for n in ops if not n.hooked)
        calls = {n.call for n in ops}
        box.call = min(calls) if calls else 0

    return BackwardGraph(
        nodes=new_nodes,
        edges=new_edges,
        layers=dict(graph.layers),
        meta=dict(graph.meta),
    )


def _check(depth, by_type, fold_repeats, max_nodes) -> frozenset[str]:
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise ValueError(f"depth must be an int >= 0 or None (every op), got {depth!r}")
    if max_nodes is not None and (isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1):
        raise ValueError(f"max_nodes must be an int >= 1 or None, got {max_nodes!r}")
    if not isinstance(fold_repeats, bool):
        raise TypeError(f"fold_repeats must be True or False, got {fold_repeats!r}")
    if by_type is None:
        return frozenset()
    if isinstance(by_type, str):
        by_type = (by_type,)
    try:
        types = frozenset(by_type)
    except TypeError:
        raise TypeError(
            f"by_type must be a layer class name or a list of them, e.g. ('TransformerEncoderLayer',); got {by_type!r}"
        ) from None
    for t in types:
        if not isinstance(t, str):
            raise TypeError(f"by_type entries must be layer class names (str), got {t!r}")
    return types


def collapse_graph(
    graph: BackwardGraph,
    *,
    depth: int | None = None,
    by_type: Iterable[str] | str = (),
    fold_repeats: bool = False,
    max_nodes: int | None = None,
) -> BackwardGraph:
    """A new, smaller graph in which layers are single boxes.

    Args:
        graph: a captured graph (captured with a layer, so ops know their
            layers; without layer information nothing can collapse).
        depth: layers at this depth become boxes (``1``: the top-level
            layers; containers such as ``LayerList`` do not count as a
            level); ``None`` keeps every op; ``0`` boxes the whole model.
        by_type: layer class names (``"BottleneckBlock"``) whose layers
            become boxes at any depth.
        fold_repeats: fold consecutive sibling layers of one class with
            identical internal structure into one box marked ``x N``.
        max_nodes: node budget: starting at ``depth`` (full detail when
            None) and going shallower, the first depth whose result has at
            most ``max_nodes`` nodes is used; when none fits, the shallowest
            (depth 0) is returned.

    Returns:
        A new :class:`BackwardGraph`. Boxes are ``Node(kind="layer",
        name=<layer class>, layer=<path>, ops=<op nodes inside>, count=N,
        params=P, unhooked=<ops without gradient data>, norm=<L2 norm of the
        parameter gradients inside>)``; folded boxes have
        ``layer="layers.0-5"`` and ``count=6``. Boxes carry numbers only;
        :func:`paddleviz_hooks.text.box_lines` words them.
        ``meta["collapse"]`` records the options, the depth used and the node
        count before and after. Without any option, an unchanged copy.

    Raises:
        ValueError: ``depth`` or ``max_nodes`` out of range.
        TypeError: ``by_type`` or ``fold_repeats`` of the wrong type.

    Example:
        >>> import paddle
        >>> from paddleviz_hooks import capture_backward
        >>> enc = paddle.nn.TransformerEncoder(paddle.nn.TransformerEncoderLayer(16, 2, 32), 3)
        >>> with capture_backward(enc) as cap:
        ...     enc(paddle.randn([2, 5, 16])).mean().backward()
        >>> small = collapse_graph(cap.graph, depth=1, fold_repeats=True)
        >>> [n.layer for n in small.nodes if n.kind == "layer"]
        ['layers.0-2']
    """
    types = _check(depth, by_type, fold_repeats, max_nodes)
    lay = _Layers(graph)
    if max_nodes is None:
        candidates: list[int | None] = [depth]
    else:
        deepest = max((lay.depth(p) for p in graph.layers), default=0)
        start = deepest if depth is None else min(depth, deepest)
        candidates = ([None] if depth is None else []) + list(range(start, -1, -1))
    result = None
    for d in candidates:
        result = _collapse_once(graph, lay, d, types, fold_repeats)
        chosen = d
        if max_nodes is None or len(result.nodes) <= max_nodes:
            break
    assert result is not None
    result.meta["collapse"] = {
        "depth": chosen,
        "by_type": sorted(types),
        "fold_repeats": fold_repeats,
        "max_nodes": max_nodes,
        "fits": max_nodes is None or len(result.nodes) <= max_nodes,
        "nodes_before": len(graph.nodes),
        "nodes_after": len(result.nodes),
    }
    return result
