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
* ``by="source"``: instead of layers, the user functions that made the ops
  (``Node.source``, innermost frame) are the boxes, one per call site: for
  models written as functions rather than layers.

Each call of a layer is its own box: a ``relu`` called twice in a block is
two boxes (``BackwardGraph.calls``, the layer-call tree of the forward, says
which call of every enclosing layer an op belongs to), and only layers
called once are folded. The result never draws a path the captured graph
does not have: a box is kept only when each node outside it that sends it a
gradient reaches, inside the captured graph, each node of the box that sends
one out of it; a box that fails is opened one level deeper (a fold into its
blocks, a layer into its sublayers and own ops). So the collapsed graph is
acyclic whenever the captured one is, and box A reaches box B only if some
node of A reaches some node of B. A parameter joins a box only when every op
that feeds it is in that box (a weight shared by several calls or layers
stays a node of its own).

Nodes outside every box (the root, loss ops outside the model, ops of a layer
above the cut depth, input leaves) stay as they are. Edges between boxes keep
their gradient metadata; parallel edges between the same two nodes with the
same gradient shape are merged into one: when they are every edge into one
node, it carries the exact sum of their gradients (``Node.received``, summed
at capture time, or the parameter's gradient); otherwise its figure is marked
as combining several gradients (``GradMeta.parts``, root-sum-square of their
norms), never passed off as one gradient's norm.
Nothing here imports paddle, and the input graph is never modified.
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from dataclasses import replace
from typing import Iterable, Sequence

from .findings import record_of
from .graph import BackwardGraph, Edge, GradMeta, Node, merge_grad_metas

__all__ = ["collapse_graph", "collapse_with_map", "collapse_alike", "layer_depths", "call_paths", "CONTAINER_TYPES"]

#: Layer classes that only hold other layers and never run themselves; they
#: do not count as a depth level.
CONTAINER_TYPES = frozenset({"LayerList", "LayerDict", "ParameterList"})

_INDEX = re.compile(r"^(?:(.*)\.)?(\d+)$")  # the children of a top-level Sequential are "0", "1" ...


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

    Examples:
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
# layer calls
# --------------------------------------------------------------------------
def call_paths(graph: BackwardGraph) -> list[tuple[tuple[str, int], ...]]:
    """The layer calls each node lies in: the namespace of a node, by layer path and call.

    Args:
        graph: a captured graph.

    Returns:
        One tuple per node (``result[node.id]``) of ``(layer path, call
        index)`` pairs, outermost first, from the first layer below the model
        down to the node's own layer: an op of ``encoder.layers.0.linear1``
        gets ``(("encoder", 0), ("encoder.layers", 0), ("encoder.layers.0",
        0), ("encoder.layers.0.linear1", 0))``, with the call of each
        enclosing layer taken from ``BackwardGraph.calls`` (0 where unknown).
        Ops of the model itself, nodes outside the model, the root and input
        leaves get ``()``. A parameter lies in the call of its owner layer
        that used it; used by several calls (or by ops outside its layer), it
        lies in the innermost call holding all the ops that used it, never
        deeper than its owner. A collapsed box lies in the calls around it.

    Examples:
        >>> g = BackwardGraph([Node(0, "root", "loss"), Node(1, "op", "ReluGradNode", "Relu", layer="b.act", call=1),
        ...                    Node(2, "op", "ReluGradNode", "Relu", layer="b.act", call=0)],
        ...                   [Edge(0, 1), Edge(1, 2)], layers={"": "Net", "b": "Block", "b.act": "ReLU"},
        ...                   calls={"b.act#1": "b#0", "b.act#0": "b#0", "b#0": "#0"})
        >>> call_paths(g)[1]
        (('b', 0), ('b.act', 1))
    """
    paths: list[tuple[tuple[str, int], ...]] = [()] * len(graph.nodes)
    chains: dict[tuple[str, int], tuple[tuple[str, int], ...]] = {}

    def of(layer: str, call: int) -> tuple[tuple[str, int], ...]:
        got = chains.get((layer, call))
        if got is None:
            chain = graph.call_chain(layer, call)
            got = chains[(layer, call)] = tuple((p, chain.get(p, 0)) for p in _prefixes(layer)[1:])
        return got

    for n in graph.nodes:
        if n.kind == "op" and n.layer:
            paths[n.id] = of(n.layer, n.call)
        elif n.kind == "layer" and n.layer and n.layer in graph.layers:
            paths[n.id] = of(n.layer, n.call)[:-1]
    users: dict[int, list[int]] = defaultdict(list)
    for e in graph.edges:
        if graph.nodes[e.dst].kind == "param":
            users[e.dst].append(e.src)
    for n in graph.nodes:
        if n.kind != "param":
            continue
        owner = _node_path(n, graph)
        if not owner or not users.get(n.id):
            continue
        depth = len(_prefixes(owner)) - 1
        own = [paths[u][:depth] for u in users[n.id]]
        common = own[0]
        for p in own[1:]:
            k = 0
            while k < min(len(common), len(p)) and common[k] == p[k]:
                k += 1
            common = common[:k]
        # never deeper than the owner, nor in another layer's calls
        k = 0
        owner_prefixes = _prefixes(owner)[1:]
        while k < len(common) and common[k][0] == owner_prefixes[k]:
            k += 1
        paths[n.id] = common[:k]
    return paths


class _Calls:
    """Which call of each enclosing layer made a node (``BackwardGraph.calls``)."""

    def __init__(self, graph: BackwardGraph, paths: list[str | None]) -> None:
        chains: dict[tuple[str, int], dict[str, int]] = {}
        self.node: list[dict[str, int]] = []
        self.seen: dict[str, set[int]] = defaultdict(set)  # layer path -> calls that made nodes
        for n, p in zip(graph.nodes, paths):
            chain = {}
            if n.kind == "op" and p is not None:
                chain = chains.get((p, n.call)) or chains.setdefault((p, n.call), graph.call_chain(p, n.call))
            self.node.append(chain)
            for q, c in chain.items():
                self.seen[q].add(c)

    def of(self, i: int, path: str) -> int:
        """The call of layer ``path`` that node ``i`` belongs to (0 when unknown)."""
        return self.node[i].get(path, 0)

    def count(self, path: str) -> int:
        """How many calls of ``path`` the graph shows (up to the last one seen)."""
        seen = self.seen.get(path)
        return max(seen) + 1 if seen else 1


# --------------------------------------------------------------------------
# repeated blocks
# --------------------------------------------------------------------------
def _signature(graph: BackwardGraph, path: str, members: list[int], paths: list[str | None],
               out: dict[int, list[Edge]]) -> tuple:
    """Structure of the subtree ``path``, with ``path`` itself taken out (``out``: the edges
    leaving each node)."""
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
    inner = [e for i in members for e in out.get(i, ()) if e.dst in member_set]
    edges = sorted((rkey(e.src), rkey(e.dst)) for e in inner) if keyed else len(inner)
    return (tuple(ops), tuple(prm), tuple(edges) if isinstance(edges, list) else edges)


def _find_folds(
    graph: BackwardGraph, lay: _Layers, paths: list[str | None], boxes: list["_Box | None"], calls: _Calls,
    show_one: bool = False,
) -> tuple[dict[str, tuple[str, list[str]]], dict[str, tuple[str, int]]]:
    """Runs of identical consecutive siblings: member path -> (fold label, members), and
    with ``show_one`` the block of each run left out of its fold: fold label -> (that
    block's path, blocks in the whole run).

    Only layers called once are folded: the calls of one layer stay apart. With
    ``show_one`` the last block of a run (the first one its gradient reaches in a
    stack) is not folded, so runs inside it are found too (nested repeats).
    """
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
        if m is None or lay.is_container(path) or len(calls.seen.get(path, ())) > 1:
            continue
        if any(boxes[i] is not None and not _inside(boxes[i][0], path) for i in members):
            continue
        siblings[m.group(1) or ""].append((int(m.group(2)), path))
    out: dict[int, list[Edge]] = defaultdict(list)
    for e in graph.edges:
        out[e.src].append(e)
    folds: dict[str, tuple[str, list[str]]] = {}
    shown: dict[str, tuple[str, int]] = {}
    folded: list[str] = []
    for parent in sorted(siblings, key=lambda p: (lay.depth(p), p)):  # outermost first
        if any(_inside(parent, f) for f in folded):
            continue
        items = sorted(siblings[parent])
        sigs = {
            path: (lay.types.get(path), _signature(graph, path, subtree[path], paths, out))
            for _, path in items
        }
        run: list[tuple[int, str]] = []

        def close(run: list[tuple[int, str]]) -> None:
            if len(run) < 2:
                return
            members = [p for _, p in run]
            if show_one:  # the last block is drawn as it is, the others are the fold
                *run, (_, one) = run
                members = members[:-1]
            span = f"{run[0][0]}-{run[-1][0]}"
            label = (f"{parent}.{span}" if parent else span) if len(run) > 1 else members[0]
            if show_one:
                shown[label] = (one, len(members) + 1)
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
    return folds, shown


# --------------------------------------------------------------------------
# boxes
# --------------------------------------------------------------------------
#: A box: (layer path or fold label, call of that layer; -1 for a fold).
_Box = tuple


class _Assign:
    """The box of every node, and how to open a box that would mislead."""

    def __init__(self, graph: BackwardGraph, lay: _Layers, paths: list[str | None], calls: _Calls,
                 folds: dict[str, tuple[str, list[str]]]) -> None:
        self.graph, self.lay, self.paths, self.calls = graph, lay, paths, calls
        self.fold_of = {label: members for label, members in folds.values()}
        self._fold_sets = {label: frozenset(members) for label, members in self.fold_of.items()}
        self.preds: list[list[int]] = [[] for _ in graph.nodes]
        self.succs: list[list[int]] = [[] for _ in graph.nodes]
        for e in graph.edges:
            self.preds[e.dst].append(e.src)
            self.succs[e.src].append(e.dst)

    def layer_box(self, i: int, path: str) -> _Box:
        return (path, self.calls.of(i, path))

    def holds(self, box: _Box, path: str) -> bool:
        """Whether layer ``path`` lies inside ``box``."""
        members = self._fold_sets.get(box[0]) if box[1] < 0 else None
        if members is not None:
            return any(p in members for p in _prefixes(path)[1:])
        return _inside(path, box[0])

    def param_box(self, i: int, boxes: list[_Box | None]) -> _Box | None:
        """A parameter joins the box of the ops that use it when they are all
        in one box that holds its layer; one used by several calls of its
        layer (an unrolled cell) or by other layers stays its own node."""
        path = self.paths[i]
        if path is None:
            return None
        found = {boxes[j] for j in self.preds[i]}
        if len(found) != 1:
            return None
        box = found.pop()
        return box if box is not None and self.holds(box, path) else None

    def open(self, box: _Box, members: list[int], boxes: list[_Box | None]) -> None:
        """Replace ``box`` by the boxes one level deeper (a fold by its blocks)."""
        path, call = box
        ops = [i for i in members if self.graph.nodes[i].kind != "param"]
        for i in ops:
            p = self.paths[i]
            if call < 0:  # a fold: its blocks
                boxes[i] = next((self.layer_box(i, m) for m in self.fold_of[path] if _inside(p, m)), None)
                continue
            deeper = [q for q in _prefixes(p) if len(q) > len(path) and _inside(q, path)
                      and not self.lay.is_container(q)] if p is not None else []
            boxes[i] = self.layer_box(i, deeper[0]) if deeper else None
        for i in members:
            if self.graph.nodes[i].kind == "param":
                boxes[i] = self.param_box(i, boxes)


def _reach(graph: BackwardGraph, succs: list[list[int]]) -> list[int] | None:
    """Per node, the set of nodes it reaches (itself included) as an int bitset;
    None when the graph has a cycle."""
    order = graph.topo_order()
    if len(order) != len(graph.nodes):
        return None
    reach = [0] * len(graph.nodes)
    for v in reversed(order):
        r = 1 << v
        for w in succs[v]:
            r |= reach[w]
        reach[v] = r
    return reach


def _keep_honest(assign: _Assign, boxes: list[_Box | None]) -> list[_Box]:
    """Open boxes until the collapsed graph draws no false path.

    A box is kept when every node outside it that feeds it reaches each of
    its exit nodes (those feeding outside it) in the captured graph (an entry
    that only feeds the box's own parameters, like a bias gradient, does not
    have to). Then every path between boxes is a path between their nodes
    (by induction along the path), so the collapsed
    graph is acyclic when the captured one is, and box A reaches box B only
    if some node of A reaches some node of B. A box that fails is opened one
    level deeper and its parts are checked in turn.

    Returns:
        The boxes opened.
    """
    members: dict[_Box, list[int]] = defaultdict(list)
    for i, b in enumerate(boxes):
        if b is not None:
            members[b].append(i)
    todo = {b for b, ms in members.items() if len(ms) > 1}
    if not todo:
        return []
    reach = _reach(assign.graph, assign.succs)
    if reach is None:
        return []
    opened = []
    while todo:
        box = todo.pop()
        ms = members[box]
        inside = set(ms)
        exits = 0
        for i in ms:
            if any(j not in inside for j in assign.succs[i]):
                exits |= 1 << i
        if all(reach[j] & exits == exits for i in ms for j in assign.preds[i] if j not in inside):
            continue
        opened.append(box)
        del members[box]
        assign.open(box, ms, boxes)
        for i in ms:
            b = boxes[i]
            if b is not None:
                members[b].append(i)  # a part may join a box of the same call (calls unknown)
                if len(members[b]) > 1:
                    todo.add(b)
    return opened


# --------------------------------------------------------------------------
# one collapse
# --------------------------------------------------------------------------
def _open_boxes(assign: _Assign, boxes: list[_Box | None], wanted: frozenset[_Box]) -> None:
    """Open every box of ``wanted`` (and a part of it that is wanted too)."""
    while True:
        members: dict[_Box, list[int]] = defaultdict(list)
        for i, b in enumerate(boxes):
            if b in wanted:
                members[b].append(i)
        if not members:
            return
        for b, ms in members.items():
            assign.open(b, ms, boxes)


def _collapse_once(
    graph: BackwardGraph, lay: _Layers, depth: int | None, by_type: frozenset[str], fold_repeats: bool,
    open_first: frozenset[_Box] = frozenset(), show_one: bool = False,
) -> tuple[BackwardGraph, list[int], list[_Box]]:
    """The collapsed graph, the new id of every node, and the boxes opened to keep it honest
    (``open_first``: boxes opened before that check). With ``show_one``, the collapsed
    graph's ``meta["collapse_shown"]`` maps each fold box's label to the block drawn
    for it and the blocks of the whole run (only folds that stayed closed)."""
    paths = [_node_path(n, graph) for n in graph.nodes]
    calls = _Calls(graph, paths)
    boxes: list[_Box | None] = [None] * len(graph.nodes)
    for i, (n, p) in enumerate(zip(graph.nodes, paths)):
        if n.kind != "param":
            b = lay.box(p, depth, by_type)
            boxes[i] = None if b is None else (b, calls.of(i, b))
    folds, shown = _find_folds(graph, lay, paths, boxes, calls, show_one) if fold_repeats else ({}, {})
    for i, p in enumerate(paths):
        if p is None or not folds or graph.nodes[i].kind == "param":
            continue
        for pre in _prefixes(p)[1:]:
            if pre in folds:
                boxes[i] = (folds[pre][0], -1)
                break
    assign = _Assign(graph, lay, paths, calls, folds)
    for i, n in enumerate(graph.nodes):
        if n.kind == "param":
            boxes[i] = assign.param_box(i, boxes)
    _open_boxes(assign, boxes, open_first)
    opened = _keep_honest(assign, boxes)
    fold_info = assign.fold_of

    # new nodes, in the order of their first member
    new_nodes: list[Node] = []
    new_id: list[int] = [0] * len(graph.nodes)
    box_id: dict[_Box, int] = {}
    members: dict[int, list[Node]] = defaultdict(list)
    for n, box in zip(graph.nodes, boxes):
        if box is None:
            new_id[n.id] = len(new_nodes)
            new_nodes.append(replace(n, id=len(new_nodes)))
            continue
        bid = box_id.get(box)
        if bid is None:
            bid = box_id[box] = len(new_nodes)
            path, call = box
            folded = fold_info.get(path) if call < 0 else None
            kind = lay.types.get(folded[0] if folded else path, "")
            total = 1 if folded else calls.count(path)
            new_nodes.append(Node(bid, "layer", kind or "layer", layer=path, count=len(folded or ()) or 1,
                                  call=max(call, 0), calls=max(total, call + 1),
                                  key="layer:" + (path or "<top>") + (f"#{call}" if call > 0 else "")))
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
    into = graph.in_edges()
    for (s, d, _), es in groups.items():
        grad = _merged_grad(graph, es, into)
        if grad is not None:
            grad = replace(grad)  # never share a GradMeta with the input graph
        new_edges.append(Edge(s, d, min(e.slot for e in es), grad,
                              next((e.note for e in es if e.note is not None), None), _merged_after_hook(es)))

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
        box.saved_bytes = sum(n.saved_bytes for n in ops)

    # the block drawn for each fold still closed, and how many blocks its whole run has
    closed = {b[0] for b in box_id if b[1] < 0}
    meta = dict(graph.meta)
    meta["collapse"] = {"shown": {label: list(v) for label, v in shown.items() if label in closed}}
    return BackwardGraph(
        nodes=new_nodes,
        edges=new_edges,
        layers=dict(graph.layers),
        meta=meta,
        calls=dict(graph.calls),
        nonfinite=record_of(graph),  # the full graph's facts; views find their boxes (findings.marks)
    ), new_id, opened


def _merged_after_hook(es: list[Edge]) -> GradMeta | None:
    """What the receivers got along the real edges ``es`` when a gradient hook changed
    one of them (``Edge.after_hook``): that edge's; of several, combined as their
    gradients are (a hook-changed part counting as what it became)."""
    if all(e.after_hook is None for e in es):
        return None
    got = [e.after_hook if e.after_hook is not None else e.grad for e in es]
    if any(m is None for m in got):
        return None
    return replace(got[0]) if len(got) == 1 else merge_grad_metas(got)


def _merged_grad(graph: BackwardGraph, es: list[Edge], into: dict[int, list[Edge]]):
    """The gradient of one drawn edge standing for the real edges ``es``.

    Several real edges into one node that are all of its incoming edges carry
    the parts of the one gradient that node received: the edge gets their
    exact sum, summed at capture time (``Node.received``; for a parameter the
    gradient added to ``param.grad``). Otherwise the figure is a combination
    of different gradients and says so (``GradMeta.parts``).
    """
    metas = [e.grad for e in es if e.grad is not None]
    if len(es) == 1 or not metas:
        return metas[0] if metas else None
    dsts = {e.dst for e in es}
    if len(dsts) == 1:
        d = graph.nodes[next(iter(dsts))]
        whole = d.grad if d.kind == "param" else d.received
        if whole is not None and {id(e) for e in es} == {id(e) for e in into.get(d.id, [])}:
            return whole
    return merge_grad_metas(metas)
def _source_view(graph: BackwardGraph) -> BackwardGraph:
    """A copy of ``graph`` in which each op's "layer" is the user function that made it.

    The function is the innermost frame of ``Node.source``; each distinct
    place it was called from (the outer frames) is one call of it. Functions
    are flat paths (a function name, ``~2`` for a second file with the same
    name), typed ``def in <file>``; ops without a source lie outside every box.
    """
    names: dict[tuple[str, str], str] = {}
    types: dict[str, str] = {}
    calls: dict[tuple[str, tuple], int] = {}
    ncalls: dict[str, int] = defaultdict(int)
    nodes: list[Node] = []
    for n in graph.nodes:
        if n.kind == "op" and n.source:
            inner = n.source[-1]
            path = names.get((inner.file, inner.function))
            if path is None:
                base = inner.function.replace(".", "_") or "?"
                path, k = base, 2
                while path in types:
                    path, k = f"{base}~{k}", k + 1
                names[(inner.file, inner.function)] = path
                types[path] = "def in " + (os.path.basename(inner.file) or inner.file)
            site = (path, tuple(n.source[:-1]))
            if site not in calls:
                calls[site] = ncalls[path]
                ncalls[path] += 1
            nodes.append(replace(n, layer=path, call=calls[site]))
        elif n.kind in ("op", "param"):
            nodes.append(replace(n, layer=None, call=0, param=None if n.kind == "op" else n.param))
        else:
            nodes.append(replace(n))
    return BackwardGraph(nodes=nodes, edges=list(graph.edges), layers=types, meta=dict(graph.meta))


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
    by: str = "layer",
    show_one: bool = False,
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
        show_one: with ``fold_repeats``, the last block of each run (the
            first one the gradient reaches in a stack) is not folded but
            drawn at ``depth`` like any layer (its own repeats folded in
            turn), and the box stands for the other blocks of the run:
            ``layers.0-222  TransformerEncoderLayer x223`` next to
            ``layers.223`` drawn op by op. ``meta["collapse"]["shown"]``
            maps each such box to ``[the block drawn, blocks in the run]``.
        max_nodes: node budget: starting at ``depth`` (full detail when
            None) and going shallower, the first depth whose result has at
            most ``max_nodes`` nodes is used; when none fits, the shallowest
            (depth 0) is returned.
        by: ``"layer"`` (the default) boxes layers; ``"source"`` boxes the
            user functions that made the ops instead (from ``Node.source``,
            one box per call site of a function; ``depth``, ``by_type``,
            ``fold_repeats`` and ``max_nodes`` do not apply), for models
            written as functions rather than layers.

    Returns:
        A new :class:`BackwardGraph`. Boxes are ``Node(kind="layer",
        name=<layer class>, layer=<path>, call=<call index>, calls=<calls of
        that layer>, ops=<op nodes inside>, count=N, params=P,
        unhooked=<ops without gradient data>, norm=<L2 norm of the
        parameter gradients inside>)``; folded boxes have
        ``layer="layers.0-5"`` and ``count=6``. Boxes carry numbers only;
        :func:`paddleviz_hooks.text.box_lines` words them.
        ``meta["collapse"]`` records the options, the depth used, the node
        count before and after and how many boxes were opened to keep the
        drawing honest. Without any option, an unchanged copy.

    Raises:
        ValueError: ``depth`` or ``max_nodes`` out of range.
        TypeError: ``by_type`` or ``fold_repeats`` of the wrong type.

    Examples:
        >>> import paddle
        >>> from paddleviz_hooks import capture_backward
        >>> enc = paddle.nn.TransformerEncoder(paddle.nn.TransformerEncoderLayer(16, 2, 32), 3)
        >>> with capture_backward(enc) as cap:
        ...     enc(paddle.randn([2, 5, 16])).mean().backward()
        >>> small = collapse_graph(cap.graph, depth=1, fold_repeats=True)
        >>> [n.layer for n in small.nodes if n.kind == "layer"]
        ['layers.0-2']
        >>> small = collapse_graph(cap.graph, depth=1, fold_repeats=True, show_one=True)
        >>> [n.layer for n in small.nodes if n.kind == "layer"], small.meta["collapse"]["shown"]
        (['layers.2', 'layers.0-1'], {'layers.0-1': ['layers.2', 3]})
    """
    return collapse_with_map(graph, depth=depth, by_type=by_type, fold_repeats=fold_repeats,
                             max_nodes=max_nodes, by=by, show_one=show_one)[0]


def collapse_with_map(
    graph: BackwardGraph,
    *,
    depth: int | None = None,
    by_type: Iterable[str] | str = (),
    fold_repeats: bool = False,
    max_nodes: int | None = None,
    by: str = "layer",
    show_one: bool = False,
) -> tuple[BackwardGraph, list[int]]:
    """:func:`collapse_graph`, and where each node of ``graph`` went.

    Args:
        graph, depth, by_type, fold_repeats, max_nodes, by, show_one: as for
            :func:`collapse_graph`.

    Returns:
        ``(collapsed, node_of)``: ``collapsed.nodes[node_of[i]]`` is the box
        (or the copy) that holds ``graph.nodes[i]``.

    Examples:
        >>> from paddleviz_hooks.graph import BackwardGraph, Edge, Node
        >>> g = BackwardGraph([Node(0, "root", "loss"), Node(1, "op", "ExpGradNode", "Exp", layer="f"),
        ...                    Node(2, "op", "TanhGradNode", "Tanh", layer="f")],
        ...                   [Edge(0, 1), Edge(1, 2)], layers={"": "Net", "f": "Act"})
        >>> small, node_of = collapse_with_map(g, depth=1)
        >>> node_of, [n.kind for n in small.nodes]
        ([0, 1, 1], ['root', 'layer'])
    """
    types = _check(depth, by_type, fold_repeats, max_nodes)
    if not isinstance(show_one, bool):
        raise TypeError(f"show_one must be True or False, got {show_one!r}")
    if by == "source":
        return _collapse_by_source(graph)
    if by != "layer":
        raise ValueError(f"by must be 'layer' or 'source', got {by!r}")
    lay = _Layers(graph)
    if max_nodes is None:
        candidates: list[int | None] = [depth]
    else:
        deepest = max((lay.depth(p) for p in graph.layers), default=0)
        start = deepest if depth is None else min(depth, deepest)
        candidates = ([None] if depth is None else []) + list(range(start, -1, -1))
    result = None
    for d in candidates:
        result, node_of, opened = _collapse_once(graph, lay, d, types, fold_repeats, show_one=show_one)
        chosen = d
        if max_nodes is None or len(result.nodes) <= max_nodes:
            break
    assert result is not None
    _note(result, graph, chosen, types, fold_repeats, max_nodes, len(opened), show_one and fold_repeats)
    return result, node_of


def _collapse_by_source(graph: BackwardGraph) -> tuple[BackwardGraph, list[int]]:
    """:func:`collapse_with_map` with ``by="source"``."""
    view = _source_view(graph)
    result, node_of, opened = _collapse_once(view, _Layers(view), 1, frozenset(), False)
    for n in graph.nodes:  # nodes left out of every box are the graph's own again
        j = node_of[n.id]
        if result.nodes[j].kind != "layer":
            result.nodes[j] = replace(n, id=j)
    result.layers = {**graph.layers, **view.layers}
    result.calls = dict(graph.calls)
    _note(result, graph, None, frozenset(), False, None, len(opened))
    result.meta["collapse"]["by"] = "source"
    return result, node_of


def _note(result: BackwardGraph, graph: BackwardGraph, depth: int | None, types: frozenset[str],
          fold_repeats: bool, max_nodes: int | None, opened: int, show_one: bool = False) -> None:
    shown = result.meta.get("collapse", {}).get("shown", {})
    result.meta["collapse"] = {
        "depth": depth,
        "by_type": sorted(types),
        "fold_repeats": fold_repeats,
        "max_nodes": max_nodes,
        "fits": max_nodes is None or len(result.nodes) <= max_nodes,
        "nodes_before": len(graph.nodes),
        "nodes_after": len(result.nodes),
        "opened": opened,  # boxes opened so that no false path is drawn
        "show_one": show_one,  # one block of each folded run drawn, the box stands for the others
        "shown": shown,  # fold label -> [the block drawn, blocks in the whole run]
    }


def collapse_alike(
    graphs: Sequence[BackwardGraph],
    *,
    depth: int | None = None,
    by_type: Iterable[str] | str = (),
    fold_repeats: bool = False,
) -> list[BackwardGraph]:
    """Several graphs of one model (two steps of a diff) collapsed alike.

    Alone, one graph may have to open a box to draw no false path (see the
    module docstring) where another keeps it closed; the same layer would
    then be one box in one drawing and its parts in the other, and a diff
    would call the box removed and its parts added. Here a box opened in any
    of the graphs is opened in all of them (again until none opens another).

    Args:
        graphs: the graphs.
        depth, by_type, fold_repeats: as for :func:`collapse_graph`.

    Returns:
        The collapsed graphs, in the order given.

    Examples:
        >>> from paddleviz_hooks.graph import BackwardGraph, Edge, Node
        >>> layers = {"": "Net", "e": "Linear", "b": "Block", "b.p": "Linear", "b.q": "Linear", "h": "Linear"}
        >>> op = lambda i, layer: Node(i, "op", "MatmulGradNode", "Matmul", layer=layer)
        >>> one = BackwardGraph([Node(0, "root", "loss"), op(1, "h"), op(2, "b.p"), op(3, "e")],
        ...                     [Edge(0, 1), Edge(1, 2), Edge(2, 3)], layers=layers)
        >>> two = BackwardGraph(one.nodes + [op(4, "b.q")], one.edges + [Edge(0, 4), Edge(4, 3)], layers=layers)
        >>> [n.layer for n in collapse_graph(one, depth=1).nodes[1:]]   # alone, b stays one box
        ['h', 'b', 'e']
        >>> [[n.layer for n in g.nodes[1:]] for g in collapse_alike([one, two], depth=1)]
        [['h', 'b.p', 'e'], ['h', 'b.p', 'e', 'b.q']]
    """
    types = _check(depth, by_type, fold_repeats, None)
    lays = [_Layers(g) for g in graphs]
    wanted: frozenset[_Box] = frozenset()
    while True:
        results = [_collapse_once(g, lay, depth, types, fold_repeats, wanted) for g, lay in zip(graphs, lays)]
        opened = frozenset(b for _, _, o in results for b in o)
        if opened <= wanted:
            break
        wanted |= opened
    for g, (result, _, o) in zip(graphs, results):
        _note(result, g, depth, types, fold_repeats, None, len(o))
    return [r for r, _, _ in results]
