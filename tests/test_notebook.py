"""Notebook display: graphs and diffs evaluated in a Jupyter cell are drawn inline as SVG."""

from __future__ import annotations

import gc
import os
import pickle
import re
import warnings

import paddle
import paddle.nn as nn
import pytest

from paddleviz_hooks import capture_backward, diff_graphs
from paddleviz_hooks.diff import GraphDiff
from paddleviz_hooks.escape import clean_svg
from paddleviz_hooks.notebook import NOTEBOOK_MAX_HEIGHT_PX, NOTEBOOK_MAX_PX, register, show, svg_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETUP = f"""
import sys
sys.path.insert(0, {REPO!r})
import paddle, paddle.nn as nn
from paddleviz_hooks import capture_backward, diff_graphs
paddle.seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
x = paddle.randn([2, 8])
with capture_backward(net) as cap:
    net(x).sum().backward()
    (net(x).sum() + net[0](x).mean()).backward()  # a second path: a structure change
small, changed = cap.graphs
big_net = paddle.vision.models.resnet18(num_classes=4)
with capture_backward(big_net) as big:
    big_net(paddle.randn([2, 3, 32, 32])).mean().backward()
"""


def _svg_size_px(svg: str) -> tuple[float, float]:
    m = re.search(r'<svg width="([\d.]+)px" height="([\d.]+)px"', svg)
    assert m, svg[:300]
    return float(m.group(1)), float(m.group(2))


def _texts(svg: str) -> str:
    return " ".join(re.findall(r"<text[^>]*>([^<]*)</text>", svg))


def test_a_real_notebook_shows_graphs_and_diffs_as_svg(tmp_path, monkeypatch):
    """nbclient runs a notebook in a real ipykernel: evaluating a captured graph, a diff
    and a big graph each gives an image/svg+xml output, sanitised, sized for the cell;
    the big one is collapsed and says how to see every op."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))  # the kernel's history stays here
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in (
        SETUP, "small", "diff_graphs(small, changed)", "big.graph", "len(big.graph.nodes), len(small.nodes)")]
    nbclient.NotebookClient(nb, timeout=60, kernel_name="python3").execute()
    outs = [c.outputs for c in nb.cells]
    # set-up: no error and no warning of ours (Paddle's own warnings may show)
    assert all(o.output_type == "stream" and "paddleviz_hooks" not in o.text for o in outs[0]), outs[0]
    shown = {}
    for i, name in ((1, "graph"), (2, "diff"), (3, "big")):
        (out,) = outs[i]
        assert out.output_type == "execute_result", out
        assert "image/svg+xml" in out.data and "text/plain" in out.data, list(out.data)
        svg = out.data["image/svg+xml"]
        assert clean_svg(svg) == svg and svg.startswith("<svg")
        width, height = _svg_size_px(svg)
        assert width <= NOTEBOOK_MAX_PX and height <= (NOTEBOOK_MAX_HEIGHT_PX if name != "diff" else NOTEBOOK_MAX_PX)
        shown[name] = svg
    big_nodes, small_nodes = eval(outs[4][0].data["text/plain"])
    # the small graph: every parameter drawn, not collapsed
    texts = _texts(shown["graph"])
    for p in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert p in texts, p
    assert "collapsed" not in texts
    # the diff: the new path is marked as added
    assert 'class="node pvh&#45;added"' in shown["diff"] and 'class="edge pvh&#45;added"' in shown["diff"]
    assert "changes from step" in _texts(shown["diff"]) or "changes since" in _texts(shown["diff"])
    # the big graph: collapsed for the cell, with the way to every op in its title
    big_texts = _texts(shown["big"])
    assert f"of {big_nodes} nodes" in big_texts and "collapsed to layer depth" in big_texts
    assert "every op: show(graph, full=True)" in big_texts


def _two_graphs():
    paddle.seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    x = paddle.randn([2, 4])
    with capture_backward(net) as cap:
        net(x).sum().backward()
        (net(x).sum() + net[0](x).mean()).backward()
    return cap.graphs


def test_formatters_registered_on_ipythons_display_formatter():
    """IPython's own DisplayFormatter (what a kernel's shell holds), without starting a shell."""
    from types import SimpleNamespace

    from IPython.core.formatters import DisplayFormatter

    shell = SimpleNamespace(display_formatter=DisplayFormatter())
    assert register(shell) is True
    assert register(SimpleNamespace()) is False
    old, new = _two_graphs()
    d = diff_graphs(old, new)
    for obj in (new, d):
        data, _ = shell.display_formatter.format(obj)
        assert data["image/svg+xml"].startswith("<svg") and data["text/plain"] == repr(obj)
    # a diff loaded from JSON has no graphs to draw: only its text, and no warning
    loaded = GraphDiff.from_json(d.to_json())
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        data, _ = shell.display_formatter.format(loaded)
    assert list(data) == ["text/plain"] and got == []


def test_show_full_detail_and_bad_input():
    old, new = _two_graphs()
    full = show(new, full=True).svg
    assert len(re.findall(r'class="node', full)) == len(new.nodes) + 1  # + the legend
    with pytest.raises(TypeError, match="BackwardGraph or a GraphDiff, got str"):
        show("graph")
    with pytest.raises(TypeError, match="full must be True or False, got 'yes'"):
        show(new, full="yes")
    loaded = GraphDiff.from_json(diff_graphs(old, new).to_json())
    with pytest.raises(ValueError, match=r"render_diff\(diff, newer, older"):
        show(loaded)
    assert svg_of(loaded) is None


def test_a_diff_does_not_keep_its_graphs_alive_and_still_pickles():
    old, new = _two_graphs()
    d = diff_graphs(old, new)
    assert d.compared_graphs() == (old, new)
    assert pickle.loads(pickle.dumps(d)) == d
    del old, new
    gc.collect()
    assert d.compared_graphs() is None


def test_hostile_layer_names_reach_the_notebook_escaped():
    class Evil(nn.Layer):
        def __init__(self):
            super().__init__()
            self.add_sublayer("<script>alert(1)</script>", nn.Linear(3, 2))

        def forward(self, x):
            return next(iter(self.children()))(x)

    net = Evil()
    with capture_backward(net) as cap:
        net(paddle.randn([2, 3])).sum().backward()
    svg = svg_of(cap.graph)
    assert svg is not None and clean_svg(svg) == svg
    assert "<script" not in svg and "&lt;script&gt;" in svg


def test_a_collapsed_diff_draws_removed_layers_as_ghost_boxes():
    """Collapsing only the drawn graph would leave the ghosts of removed ops pointing at
    nodes that are no longer drawn (Graphviz then invents bare 'n12' nodes): both graphs
    are collapsed to the same depth and compared again, so a removed layer is one ghost box."""
    paddle.seed(0)
    net = paddle.vision.models.resnet18(num_classes=4)
    x = paddle.randn([2, 3, 32, 32])
    with capture_backward(net) as cap:
        net(x).mean().backward()
        h = net.layer1(net.maxpool(net.relu(net.bn1(net.conv1(x))))).detach()  # layer1 and the stem: no gradient
        net.fc(paddle.flatten(net.avgpool(net.layer4(net.layer3(net.layer2(h)))), 1)).mean().backward()
    old, new = cap.graphs
    svg = show(diff_graphs(old, new)).svg
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
    assert [t for t in texts if re.fullmatch(r"n\d+", t)] == []  # no invented node
    title = " ".join(texts[:4])  # a long title wraps over lines
    assert "collapsed to layer depth" in title and "every op: show(diff, full=True)" in title
    ghost_lines = {line for i, t in enumerate(texts) if t == "(removed)" for line in texts[max(0, i - 4):i]}
    # the first line of a ghost box is its layer: layer1 itself or its blocks, whichever depth fits
    assert "layer1" in ghost_lines or {"layer1.0", "layer1.1"} <= ghost_lines, ghost_lines


class _Attn(nn.Layer):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h, self.qkv, self.proj, self.ln = h, nn.Linear(d, 3 * d), nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (t.reshape([b, n, self.h, d // self.h]).transpose([0, 2, 1, 3])
                   for t in paddle.split(self.qkv(self.ln(x)), 3, axis=-1))
        a = paddle.nn.functional.softmax(q @ k.transpose([0, 1, 3, 2]) / (d // self.h) ** 0.5, -1)
        return x + self.proj((a @ v).transpose([0, 2, 1, 3]).reshape([b, n, d]))


class _TinyViT(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2D(3, 16, 4, stride=4)
        self.cls = self.create_parameter([1, 1, 16])
        self.pos = self.create_parameter([1, 5, 16])
        self.blk, self.head = _Attn(16, 2), nn.Linear(16, 5)

    def forward(self, x):
        p = self.patch(x).flatten(2).transpose([0, 2, 1])
        t = paddle.concat([self.cls.expand([x.shape[0], 1, 16]), p], 1) + self.pos
        return self.head(self.blk(t)[:, 0])


def test_a_tall_chain_of_a_few_dozen_ops_is_drawn_op_by_op_in_a_cell():
    # a cell scrolls down: the drawing may be taller than wide (it used to fold this 40-node
    # ViT into one box, the long side held to the cell's width)
    paddle.seed(0)
    net = _TinyViT()
    with capture_backward(net) as cap:
        net(paddle.randn([2, 3, 8, 8])).mean().backward()
    svg = show(cap.graph).svg
    width, height = _svg_size_px(svg)
    assert width <= NOTEBOOK_MAX_PX < height <= NOTEBOOK_MAX_HEIGHT_PX
    texts = _texts(svg)
    assert "collapsed" not in texts and "Softmax" in texts and "blk.qkv.weight" in texts
