"""Collapsing captured graphs into layer boxes, and the size policy of viewing PNGs.

Graphs are captured from real (tiny) Paddle models: a 3-layer
``paddle.nn.TransformerEncoder`` (d_model 16) and a small ResNet-like model
with repeated blocks; each capture takes well under a second.
"""

from __future__ import annotations

import math

import paddle
import paddle.nn as nn
import pytest

from paddleviz_hooks import BackwardGraph, capture_backward
from paddleviz_hooks.graph import Node
from paddleviz_hooks.render import LEGIBLE_DPI, fit_png, png_size, render_png, to_dot
from paddleviz_hooks.render import engine as engine_mod
from paddleviz_hooks.collapse import collapse_graph, layer_depths
from paddleviz_hooks.text import node_lines

needs_engine = pytest.mark.skipif(engine_mod.find_engine() is None, reason="no Graphviz engine installed")


# --------------------------------------------------------------------------
# models and captures
# --------------------------------------------------------------------------
class Block(nn.Layer):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2D(cin, cout, 3, padding=1, bias_attr=False)
        self.bn1 = nn.BatchNorm2D(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2D(cout, cout, 3, padding=1, bias_attr=False)
        self.bn2 = nn.BatchNorm2D(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2D(cin, cout, 1, bias_attr=False), nn.BatchNorm2D(cout)) if cin != cout else None
        )

    def forward(self, x):
        short = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + short)


class TinyResNet(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2D(3, 4, 3, padding=1, bias_attr=False)
        self.bn1 = nn.BatchNorm2D(4)
        self.relu = nn.ReLU()
        self.layer1 = nn.Sequential(Block(4, 4), Block(4, 4), Block(4, 4))
        self.layer2 = nn.Sequential(Block(4, 8), Block(8, 8))
        self.pool = nn.AdaptiveAvgPool2D(1)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(paddle.flatten(self.pool(x), 1))


def _capture(model: nn.Layer, x: paddle.Tensor) -> BackwardGraph:
    with capture_backward(model) as cap:
        loss = (model(x) ** 2).mean()
        loss.backward()
    return cap.graph


@pytest.fixture(scope="module")
def tr_graph() -> BackwardGraph:
    paddle.seed(7)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 3)
    return _capture(enc, paddle.randn([2, 4, 16]))


@pytest.fixture(scope="module")
def res_graph() -> BackwardGraph:
    paddle.seed(7)
    return _capture(TinyResNet(), paddle.randn([2, 3, 8, 8]))


def _top_level(graph: BackwardGraph) -> set[str]:
    """Top-level layer paths that own nodes (LayerList containers are not a level)."""
    depths = layer_depths(graph)
    found = set()
    for n in graph.nodes:
        path = n.layer if n.kind == "op" else (n.param.rsplit(".", 1)[0] if n.kind == "param" else None)
        if not path:
            continue
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            p = ".".join(parts[:i])
            if depths.get(p) == 1 and graph.layers.get(p) != "LayerList":
                found.add(p)
                break
    return found


def _outside(graph: BackwardGraph) -> int:
    """Nodes that no depth-1 box can hold: root, loss ops, ops of the top layer itself, inputs."""
    return sum(1 for n in graph.nodes if n.kind in ("root", "input") or (n.kind == "op" and not n.layer))


def _boxes(graph: BackwardGraph) -> list[Node]:
    return [n for n in graph.nodes if n.kind == "layer"]


# --------------------------------------------------------------------------
# depth
# --------------------------------------------------------------------------
def test_depth1_transformer_one_box_per_encoder_layer(tr_graph):
    c = collapse_graph(tr_graph, depth=1)
    top = _top_level(tr_graph)
    assert top == {"layers.0", "layers.1", "layers.2"}  # LayerList "layers" is not a level
    assert len(c.nodes) == len(top) + _outside(tr_graph)
    assert {b.layer for b in _boxes(c)} == top
    assert not [n for n in c.nodes if n.kind == "param"]  # parameters folded into boxes
    norms = tr_graph.layer_grad_norms(depth=2)
    for b in _boxes(c):
        ops = [n for n in tr_graph.nodes if n.kind == "op" and (n.layer or "").startswith(b.layer + ".")
               or n.kind == "op" and n.layer == b.layer]
        params = [n for n in tr_graph.nodes if n.kind == "param" and n.param.startswith(b.layer + ".")]
        assert b.name == "TransformerEncoderLayer" and b.count == 1
        assert b.ops == len(ops) and b.params == len(params) == 16
        assert f"{len(ops)} ops, 16 params" in node_lines(b)
        assert b.norm == pytest.approx(norms[b.layer], rel=1e-6)
        assert b.key == "layer:" + b.layer
    # edges between boxes keep their gradient shapes
    ids = {b.layer: b.id for b in _boxes(c)}
    e = [e for e in c.edges if (e.src, e.dst) == (ids["layers.2"], ids["layers.1"])]
    assert len(e) == 1 and e[0].grad.shape == (2, 4, 16) and e[0].grad.norm is not None


def test_depth1_resnet_counts_top_level_layers(res_graph):
    c = collapse_graph(res_graph, depth=1)
    top = _top_level(res_graph)
    assert top == {"conv1", "bn1", "relu", "layer1", "layer2", "pool", "fc"}
    assert len(c.nodes) == len(top) + _outside(res_graph)
    kinds = {b.layer: b.name for b in _boxes(c)}
    assert kinds["layer1"] == "Sequential" and kinds["fc"] == "Linear"
    assert any(n.kind == "op" and n.op == "Flatten" and n.layer == "" for n in c.nodes)  # top layer's own op stays


def test_depth_none_and_zero(tr_graph):
    full = collapse_graph(tr_graph)
    assert len(full.nodes) == len(tr_graph.nodes) and not _boxes(full)
    whole = collapse_graph(tr_graph, depth=0)
    assert [b.layer for b in _boxes(whole)] == [""]
    assert node_lines(_boxes(whole)[0])[0] == "the whole model"


def test_by_type(tr_graph, res_graph):
    c = collapse_graph(tr_graph, by_type="MultiHeadAttention")
    assert {b.layer for b in _boxes(c)} == {f"layers.{i}.self_attn" for i in range(3)}
    assert any(n.kind == "op" and n.op == "Relu" for n in c.nodes)  # the rest keeps every op
    r = collapse_graph(res_graph, by_type=("Block",))
    assert {b.layer for b in _boxes(r)} == {"layer1.0", "layer1.1", "layer1.2", "layer2.0", "layer2.1"}


# --------------------------------------------------------------------------
# folding repeats
# --------------------------------------------------------------------------
def test_fold_repeats_gives_one_x3_box(tr_graph):
    c = collapse_graph(tr_graph, depth=1, fold_repeats=True)
    boxes = _boxes(c)
    assert len(boxes) == 1
    b = boxes[0]
    assert (b.layer, b.name, b.count, b.params) == ("layers.0-2", "TransformerEncoderLayer", 3, 48)
    per = sum(1 for n in tr_graph.nodes if n.kind == "op" and (n.layer or "").startswith("layers.0"))
    assert b.ops == 3 * per
    lines = node_lines(b)
    assert f"{per} ops each, 16 params" in lines  # one block's counts: 48 params are 16 in each of 3
    assert lines[:2] == ["layers.0-2", "TransformerEncoderLayer x3"]
    assert any(line.startswith("|g| params ") for line in lines)
    assert len(c.nodes) == 1 + _outside(tr_graph)
    # without a depth, the repeated blocks fold and everything else keeps its ops
    assert len(_boxes(collapse_graph(tr_graph, fold_repeats=True))) == 1


def test_fold_repeats_needs_identical_structure(res_graph):
    c = collapse_graph(res_graph, depth=2, fold_repeats=True)
    by_path = {b.layer: b for b in _boxes(c)}
    assert by_path["layer1.0-2"].count == 3 and by_path["layer1.0-2"].name == "Block"
    # layer2.0 has a downsample branch, layer2.1 not: both stay
    assert "layer2.0" in by_path and "layer2.1" in by_path
    assert not any(p.startswith("layer2.0-") for p in by_path)


# --------------------------------------------------------------------------
# node budget
# --------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["tr", "res"])
def test_max_nodes_picks_deepest_depth_that_fits(which, tr_graph, res_graph):
    g = tr_graph if which == "tr" else res_graph
    deepest = max(layer_depths(g).values())
    sizes = {d: len(collapse_graph(g, depth=d).nodes) for d in range(deepest + 1)}
    sizes[None] = len(g.nodes)
    order = [None] + list(range(deepest, -1, -1))  # deeper first
    for budget in sorted(set(sizes.values())) + [sizes[1] + 1, len(g.nodes) - 1]:
        c = collapse_graph(g, max_nodes=budget)
        d = c.meta["collapse"]["depth"]
        assert len(c.nodes) <= budget, (budget, d)
        assert c.meta["collapse"]["fits"]
        i = order.index(d)
        if i > 0:  # the next deeper depth does not fit
            assert sizes[order[i - 1]] > budget, (budget, d)
    tiny = collapse_graph(g, max_nodes=1)
    assert tiny.meta["collapse"]["depth"] == 0 and not tiny.meta["collapse"]["fits"]


# --------------------------------------------------------------------------
# data model
# --------------------------------------------------------------------------
def test_json_roundtrip_and_input_untouched(tr_graph, res_graph):
    for g in (tr_graph, res_graph):
        before = g.to_json()
        for kw in ({"depth": 1}, {"depth": 2, "fold_repeats": True}, {"max_nodes": 20}, {"by_type": "Linear"}):
            c = collapse_graph(g, **kw)
            back = BackwardGraph.from_json(c.to_json())
            assert back.nodes == c.nodes and back.edges == c.edges and back.meta == c.meta
            assert not {id(n) for n in c.nodes} & {id(n) for n in g.nodes}
            assert not {id(e.grad) for e in c.edges if e.grad} & {id(e.grad) for e in g.edges if e.grad}
        assert g.to_json() == before
    # a non-finite box norm survives JSON too
    c = collapse_graph(tr_graph, depth=1)
    _boxes(c)[0].norm = math.nan
    _boxes(c)[1].nonfinite = 5
    back = BackwardGraph.from_json(c.to_json())
    assert math.isnan(_boxes(back)[0].norm) and _boxes(back)[1].nonfinite == 5


def test_plain_graph_json_has_no_box_fields(tr_graph):
    d = tr_graph.to_dict()
    assert not any(k in n for n in d["nodes"] for k in ("count", "params", "norm", "nonfinite"))
    # graphs written before boxes existed still load, with the defaults
    old = Node.from_dict({"id": 0, "kind": "op", "name": "MatmulGradNode", "op": "Matmul"})
    assert (old.count, old.params, old.norm, old.nonfinite) == (1, 0, None, 0)


def test_invalid_options(tr_graph):
    with pytest.raises(ValueError, match="depth"):
        collapse_graph(tr_graph, depth=-1)
    with pytest.raises(ValueError, match="max_nodes"):
        collapse_graph(tr_graph, max_nodes=0)
    with pytest.raises(TypeError, match="by_type"):
        collapse_graph(tr_graph, by_type=[3])
    with pytest.raises(TypeError, match="fold_repeats"):
        collapse_graph(tr_graph, fold_repeats="yes")


def test_box_label_is_escaped(tr_graph):
    c = collapse_graph(tr_graph, depth=1)
    b = _boxes(c)[0]
    b.layer, b.name = 'evil"path\\N', "Bad\nType"
    src = to_dot(c, clusters=False)
    assert 'evil\\"path\\\\N' in src and "Bad Type" in src


# --------------------------------------------------------------------------
# viewing PNG size policy
# --------------------------------------------------------------------------
def _spy_engine(monkeypatch) -> list[tuple[tuple, str, tuple]]:
    """The engine runs of the planner: (formats, DOT source, arguments)."""
    import paddleviz_hooks.render.plan as plan

    calls = []
    real = plan.run_engine_formats

    def spy(source, formats, **kw):
        calls.append((tuple(formats), source, tuple(kw.get("args", ()))))
        return real(source, formats, **kw)

    monkeypatch.setattr(plan, "run_engine_formats", spy)
    return calls


def _check_view(data: bytes, max_px: int) -> tuple[int, int]:
    w, h = png_size(data)
    assert max(w, h) <= max_px
    assert max(w, h) / min(w, h) <= 16 / 9 + 0.02, (w, h)
    return w, h


@needs_engine
def test_big_graph_png_is_collapsed_within_cap_and_aspect(res_graph, monkeypatch):
    calls = _spy_engine(monkeypatch)
    # 600 px cannot show this graph's ~100 nodes legibly: it is collapsed
    info: dict = {}
    data = render_png(res_graph, max_px=600, info=info)
    _check_view(data, 600)
    assert info["collapsed_depth"] is not None and info["nodes"] < len(res_graph.nodes)
    fmts, source, args = calls[-1]
    assert "png" in fmts and "box3d" in source and "collapsed to layer depth" in source
    assert LEGIBLE_DPI <= info["dpi"] <= 96


@needs_engine
def test_explicit_options_are_respected(res_graph, tr_graph, monkeypatch):
    calls = _spy_engine(monkeypatch)
    # depth=None asks for every op: no auto-collapse, still within cap and aspect
    _check_view(render_png(res_graph, max_px=600, depth=None), 600)
    assert "box3d" not in calls[-1][1]
    data = render_png(tr_graph, max_px=800, depth=1, fold_repeats=True)
    _check_view(data, 800)
    assert "x3" in calls[-1][1]
    # a small graph is drawn at its natural 96 dpi, never enlarged
    small = collapse_graph(tr_graph, depth=0)
    info: dict = {}
    render_png(small, max_px=2000, info=info)
    assert info["dpi"] == 96 and info["collapsed_depth"] is None
    # any DOT drawing can use the same policy
    _check_view(fit_png(lambda rd: to_dot(tr_graph, rankdir=rd), max_px=700), 700)


@needs_engine
def test_long_chain_is_wrapped_or_padded_into_the_aspect_window():
    nodes = [Node(0, "root", "loss", "loss", shape=())]
    nodes += [Node(i, "op", "ReluGradNode", "Relu", hooked=True, key=f"op:?[0]/Relu#{i}") for i in range(1, 40)]
    from paddleviz_hooks.graph import Edge, GradMeta

    edges = [Edge(i, i + 1, 0, GradMeta(shape=(2, 3), dtype="float32")) for i in range(39)]
    g = BackwardGraph(nodes=nodes, edges=edges)
    w, h = _check_view(render_png(g, max_px=1200, legend=False), 1200)
    assert max(w, h) > 300  # not shrunk to a sliver
