"""Collapsed graphs never draw a path the captured graph does not have.

For real models in which one layer object is called several times (a shared
ReLU in a residual block, a DropPath called twice per block, an unrolled
LSTMCell, resnet18, googlenet (its auxiliary heads need a
192x192 input), a small ViT) and for every op-zoo case, at
every collapse depth, with and without ``fold_repeats`` (and ``show_one``): the collapsed graph
is acyclic and keeps reachability (box A reaches box B only if some node of A
reaches some node of B in the captured graph). Each call of a layer is its
own box, labelled as the same layer called again.
"""

from __future__ import annotations

import time

import paddle
import paddle.nn as nn
import pytest

import test_op_zoo as zoo
from paddleviz_hooks import BackwardGraph, capture_backward
from paddleviz_hooks.collapse import collapse_graph, collapse_with_map, layer_depths
from paddleviz_hooks.text import node_lines
from test_collapse import TinyResNet


# --------------------------------------------------------------------------
# the property
# --------------------------------------------------------------------------
def _reach_into(graph: BackwardGraph, label: list[int]) -> list[int]:
    """Per node of ``graph``, the labels of the nodes it reaches (itself
    included), as an int bitset."""
    succ: list[list[int]] = [[] for _ in graph.nodes]
    for e in graph.edges:
        succ[e.src].append(e.dst)
    order = graph.topo_order()
    assert len(order) == len(graph.nodes), "the captured graph has a cycle"
    reach = [0] * len(graph.nodes)
    for v in reversed(order):
        r = 1 << label[v]
        for w in succ[v]:
            r |= reach[w]
        reach[v] = r
    return reach


def assert_honest(full: BackwardGraph, small: BackwardGraph, node_of: list[int]) -> None:
    """``small`` is acyclic, and every box it reaches is reached by the real graph."""
    assert len(small.topo_order()) == len(small.nodes), "the collapsed graph has a cycle"
    # what each collapsed node reaches in the collapsed graph
    reached = _reach_into(small, list(range(len(small.nodes))))
    # what the members of each collapsed node reach in the captured graph,
    # told by the collapsed node that holds each reached node
    real = _reach_into(full, node_of)
    truly = [0] * len(small.nodes)
    for e in full.edges:
        truly[node_of[e.src]] |= real[e.dst]
    for a in range(len(small.nodes)):
        false = reached[a] & ~truly[a] & ~(1 << a)
        assert not false, (
            f"{small.nodes[a].layer or small.nodes[a].op} reaches "
            f"{[small.nodes[b].layer or small.nodes[b].op for b in range(len(small.nodes)) if false >> b & 1]}"
            " only in the collapsed graph")


def assert_honest_everywhere(graph: BackwardGraph) -> int:
    """The property at every depth, with and without folding (and folding with one block of
    each run drawn beside its box); returns how many collapses were checked."""
    deepest = max(layer_depths(graph).values(), default=0)
    checked = 0
    for depth in [None, *range(deepest + 1)]:
        for fold, one in ((False, False), (True, False), (True, True)):
            small, node_of = collapse_with_map(graph, depth=depth, fold_repeats=fold, show_one=one)
            assert_honest(graph, small, node_of)
            checked += 1
    return checked


def _capture(model: nn.Layer, *xs: paddle.Tensor) -> BackwardGraph:
    with capture_backward(model) as cap:
        out = model(*xs)
        outs = out if isinstance(out, (list, tuple)) else [out]
        sum((o ** 2).mean() for o in outs).backward()
    return cap.graph


# --------------------------------------------------------------------------
# models with layers called several times
# --------------------------------------------------------------------------
class DropPath(nn.Layer):
    """Stochastic depth: a parameter-free layer, called twice per block."""

    def __init__(self, p: float = 0.2) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        keep = 1.0 - self.p
        mask = paddle.floor(keep + paddle.rand([x.shape[0]] + [1] * (len(x.shape) - 1)))
        return x / keep * mask


class Block(nn.Layer):
    """A pre-norm transformer block; ``self.drop`` serves both residual branches."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiHeadAttention(dim, 2)
        self.drop = DropPath()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.drop(self.attn(h, h, h))
        return x + self.drop(self.mlp(self.norm2(x)))


class TinyViT(nn.Layer):
    """Patch-embedding conv, a positional embedding added, 4 blocks, a head."""

    def __init__(self, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.patch = nn.Conv2D(3, dim, 4, stride=4)
        self.pos = self.create_parameter([1, 16, dim])
        self.blocks = nn.LayerList([Block(dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 5)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose([0, 2, 1]) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x).mean(1))


class Unrolled(nn.Layer):
    """An LSTMCell run over 4 time steps, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(4, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        state = None
        for t in range(x.shape[1]):
            out, state = self.cell(x[:, t], state)
        return self.head(out)


class Pair(nn.Layer):
    """Two independent branches in one layer call."""

    def forward(self, x, y):
        return paddle.tanh(x), paddle.exp(y)


class TwoBranch(nn.Layer):
    """``sin`` reaches only ``lin1``: a ``pair`` box drawn whole would let it reach ``lin2`` too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2, self.pair = nn.Linear(3, 3), nn.Linear(3, 3), Pair()

    def forward(self, x):
        a, b = self.pair(self.lin1(x), self.lin2(x))
        return paddle.sin(a) + paddle.cos(b)


def _vit_graph() -> BackwardGraph:
    paddle.seed(3)
    return _capture(TinyViT(), paddle.randn([2, 3, 16, 16]))


MODELS = {
    "basicblock_shared_relu": lambda: _capture(TinyResNet(), paddle.randn([2, 3, 8, 8])),
    "two_branch_layer": lambda: _capture(TwoBranch(), paddle.randn([2, 3])),
    "droppath_twice": lambda: _capture(Block(8), paddle.randn([2, 3, 8])),
    "unrolled_lstmcell": lambda: _capture(Unrolled(), paddle.randn([2, 4, 4])),
    "resnet18": lambda: _capture(paddle.vision.models.resnet18(num_classes=4), paddle.randn([1, 3, 64, 64])),
    "googlenet": lambda: _capture(paddle.vision.models.googlenet(num_classes=4), paddle.randn([1, 3, 192, 192])),
    "vit": _vit_graph,
}


@pytest.fixture(scope="module")
def graphs() -> dict[str, BackwardGraph]:
    return {}


def _graph(graphs: dict[str, BackwardGraph], name: str) -> BackwardGraph:
    if name not in graphs:
        paddle.seed(1)
        graphs[name] = MODELS[name]()
    return graphs[name]


@pytest.mark.parametrize("name", list(MODELS))
def test_collapse_is_acyclic_and_keeps_reachability(name, graphs):
    t0 = time.perf_counter()
    g = _graph(graphs, name)
    assert assert_honest_everywhere(g) >= 4
    assert time.perf_counter() - t0 < 30


def test_op_zoo_collapse_is_acyclic_and_keeps_reachability():
    checked = 0
    for c in zoo.RUNNABLE:
        m, xs, named = zoo.make_leaves(c)
        with capture_backward(m) if m is not None else capture_backward(params=named) as cap:
            out = c.fn(m, *xs) if m is not None else c.fn(*xs)
            zoo.reduce_outputs(out).backward()
        for g in cap.graphs:
            checked += assert_honest_everywhere(g)
    assert checked >= 2 * len(zoo.RUNNABLE)


# --------------------------------------------------------------------------
# calls stay apart
# --------------------------------------------------------------------------
def _boxes(graph: BackwardGraph, layer: str) -> list:
    return [n for n in graph.nodes if n.kind == "layer" and n.layer == layer]


def test_each_call_of_a_shared_relu_is_its_own_box(graphs):
    g = _graph(graphs, "basicblock_shared_relu")
    assert g.calls["layer1.0.relu#1"] == "layer1.0#0"
    assert BackwardGraph.from_json(g.to_json()).calls == g.calls
    c = collapse_graph(g, depth=3)
    relus = sorted(_boxes(c, "layer1.0.relu"), key=lambda b: b.call)
    assert [(b.call, b.calls, b.ops) for b in relus] == [(0, 2, 1), (1, 2, 1)]
    assert node_lines(relus[1])[0] == "layer1.0.relu (call 2 of 2)"
    assert {relus[0].key, relus[1].key} == {"layer:layer1.0.relu", "layer:layer1.0.relu#1"}
    # the gradient goes from the second call through the block to the first, never back
    ids = {b.call: b.id for b in relus}
    order = c.topo_order()
    assert order.index(ids[1]) < order.index(ids[0])


def test_droppath_called_twice_gives_two_boxes_in_gradient_order(graphs):
    g = _graph(graphs, "droppath_twice")
    c = collapse_graph(g, depth=1)
    drops = _boxes(c, "drop")
    assert sorted((b.call, b.calls) for b in drops) == [(0, 2), (1, 2)]
    order = c.topo_order()
    first, second = sorted(drops, key=lambda b: b.call)
    assert order.index(second.id) < order.index(_boxes(c, "mlp")[0].id) < order.index(first.id)


def test_unrolled_cell_calls_are_apart_and_its_weights_stay_shared(graphs):
    g = _graph(graphs, "unrolled_lstmcell")
    c = collapse_graph(g, depth=1)
    cells = sorted(_boxes(c, "cell"), key=lambda b: b.call)
    assert [(b.call, b.calls) for b in cells] == [(i, 4) for i in range(4)]
    # the weights every step uses are drawn once, outside the per-step boxes, with param.grad's norm
    shared = {n.param for n in c.nodes if n.kind == "param"}
    assert shared == {"cell.weight_ih", "cell.weight_hh", "cell.bias_ih", "cell.bias_hh"}
    assert [n.param for n in c.nodes if n.kind == "param"].count("cell.weight_ih") == 1


def test_a_layer_of_two_independent_branches_is_opened(graphs):
    g = _graph(graphs, "two_branch_layer")
    c = collapse_graph(g, depth=1)
    assert not _boxes(c, "pair") and c.meta["collapse"]["opened"] == 1
    assert {n.op for n in c.nodes if n.kind == "op" and n.layer == "pair"} == {"Tanh", "Exp"}
    assert {b.layer for b in c.nodes if b.kind == "layer"} == {"lin1", "lin2"}


def test_old_json_without_calls_still_collapses_honestly(graphs):
    g = _graph(graphs, "basicblock_shared_relu")
    d = g.to_dict()
    del d["calls"]
    old = BackwardGraph.from_dict(d)
    assert old.calls == {}
    assert assert_honest_everywhere(old) >= 4


def test_folds_keep_identical_blocks_and_never_merge_calls(graphs):
    g = _graph(graphs, "vit")
    c, node_of = collapse_with_map(g, depth=1, fold_repeats=True)
    assert [(b.layer, b.count) for b in c.nodes if b.kind == "layer" and b.count > 1] == [("blocks.0-3", 4)]
    assert_honest(g, c, node_of)
    # one level deeper, the blocks' DropPath calls are apart in every block
    c2 = collapse_graph(g, depth=2)
    for i in range(4):
        assert sorted(b.call for b in _boxes(c2, f"blocks.{i}.drop")) == [0, 1]


# --------------------------------------------------------------------------
# reading order of the viewing PNG
# --------------------------------------------------------------------------
def _drawn_layout(graph: BackwardGraph, monkeypatch) -> tuple[BackwardGraph, dict, list[tuple[int, int]]]:
    """The drawing render_png chose: the drawn graph, node id -> (distance along the
    gradient's direction, position across it) in inches, and the edges as drawn."""
    import paddleviz_hooks.render.draw as draw
    import paddleviz_hooks.render.plan as plan
    from paddleviz_hooks.render.engine import run_engine

    sources = []
    real = plan.run_engine_formats

    def spy(source, formats, **kw):
        sources.append((formats, source))
        return real(source, formats, **kw)

    monkeypatch.setattr(plan, "run_engine_formats", spy)
    draw.clear_plan_cache()
    info: dict = {}
    draw.render_png(graph, info=info)
    draw.render_png(graph, info=info)  # the drawing chosen, drawn again from the cached plan
    fmts, source = sources[-1]
    assert "png" in fmts, info
    drawn = collapse_graph(graph, depth=info["collapsed_depth"]) if info["collapsed_depth"] is not None else graph
    assert len(drawn.nodes) == info["nodes"]
    plain = run_engine(source, "plain").decode()
    height = float(plain.split("\n", 1)[0].split()[3])
    pos, edges = {}, []
    for line in plain.split("\n"):
        p = line.split()
        if p and p[0] == "node" and p[1].startswith("n"):
            x, y = float(p[2]), height - float(p[3])
            pos[int(p[1][1:])] = (y, x) if info["rankdir"] == "TB" else (x, y)
        elif p and p[0] == "edge":
            edges.append((int(p[1][1:]), int(p[2][1:])))
    return drawn, pos, edges


@pytest.mark.parametrize("name, block", [("vit", r"blocks\.(\d+)"), ("resnet18", r"layer(\d\.\d)")])
def test_viewing_png_reads_in_model_order(name, block, graphs, monkeypatch):
    """Blocks do not interleave: each is a column (a row, left to right) or a stretch of
    one in which the gradient flows down (to the right), and they follow one another as
    the gradient flows (for rows: lines of text, top to bottom)."""
    import re

    g = _graph(graphs, name)
    drawn, pos, edges = _drawn_layout(g, monkeypatch)
    of: dict[int, str] = {}
    for n in drawn.nodes:
        m = re.match(block, n.layer or "")
        if m:
            of[n.id] = m.group(1)
    for src, dst in edges:  # inside a block the gradient flows down the page (to the right)
        if of.get(src) is not None and of.get(src) == of.get(dst):
            assert pos[dst][0] > pos[src][0], (drawn.nodes[src].layer, drawn.nodes[dst].layer)
    blocks = sorted(set(of.values()), reverse=True)  # gradient order: the last block first
    assert len(blocks) >= 4
    box = {b: [pos[i] for i in of if of[i] == b] for b in blocks}
    for a, b in zip(blocks, blocks[1:]):
        # TB: a column to the left or above; LR: a row above or to the left
        beside = max(x for _, x in box[a]) < min(x for _, x in box[b])
        before = max(y for y, _ in box[a]) < min(y for y, _ in box[b])
        assert beside or before, f"block {b} is not after block {a} in reading order"


def test_collapsed_diff_keeps_calls_apart(graphs):
    """Two steps of one model: the per-call boxes match by key, nothing is flagged."""
    from paddleviz_hooks import diff_graphs
    from paddleviz_hooks.render.diff import diff_to_dot

    paddle.seed(1)
    model = TinyResNet()
    older, newer = (_capture(model, paddle.randn([2, 3, 8, 8])) for _ in range(2))
    old_c, new_c = (collapse_graph(g, depth=3) for g in (older, newer))
    keys = {n.key for n in new_c.nodes if n.kind == "layer"}
    assert {"layer:layer1.0.relu", "layer:layer1.0.relu#1"} <= keys
    d = diff_graphs(old_c, new_c)
    assert not d.added_nodes and not d.removed_nodes and not d.added_edges and not d.removed_edges
    dot = diff_to_dot(diff_graphs(older, newer), newer, older, depth=3)
    assert "layer1.0.relu (call 2 of 2)" in dot and "layer1.0.relu (call 1 of 2)" in dot
