"""Rendering with the system ``dot`` and with ``graphviz-pure``: structure, not pixels."""

from __future__ import annotations

import pathlib
import io
import os
import re
import shlex
import sys
from collections import Counter

import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

import paddleviz_hooks.render.engine as engine_mod
from paddleviz_hooks import BackwardGraph, EngineNotFound, capture_backward, make_graph
from paddleviz_hooks.render import png_size, render_png, render_svg, render_to_file, to_dot
from paddleviz_hooks.render.engine import find_engine, run_engine

ENGINES = ["dot", "graphviz-pure"]


@pytest.fixture(scope="module")
def graph() -> BackwardGraph:
    paddle.seed(3)
    m = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    with capture_backward(m) as cap:
        F.cross_entropy(m(paddle.randn([2, 4])), paddle.to_tensor([0, 2])).backward()
    return cap.graph


@pytest.fixture(params=ENGINES)
def engine(request, monkeypatch, tmp_path):
    """Select an engine through PADDLEVIZ_ENGINE; for graphviz-pure also hide the system dot."""
    eng = find_engine(request.param)
    if eng is None:
        pytest.skip(f"{request.param} is not installed")
    monkeypatch.setenv("PADDLEVIZ_ENGINE", request.param)
    if request.param == "graphviz-pure":
        empty = tmp_path / "emptybin"
        empty.mkdir()
        monkeypatch.setenv("PATH", str(empty))  # no `dot` anywhere: the pure engine must do it all
        assert find_engine("dot") is None
    assert find_engine() == eng
    return eng


def parse_plain(text: str) -> tuple[dict[str, str], Counter]:
    """Node name -> label, and a multiset of (tail, head) edges, from ``-Tplain`` output."""
    nodes: dict[str, str] = {}
    edges: Counter = Counter()
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = shlex.split(line, posix=True)
        if fields[0] == "node":
            assert fields[1] not in nodes, f"duplicate node {fields[1]!r}"
            nodes[fields[1]] = fields[6]
        elif fields[0] == "edge":
            edges[(fields[1], fields[2])] += 1
        else:
            assert fields[0] in ("graph", "stop"), line
    return nodes, edges


def expected_structure(g: BackwardGraph, legend: bool = True):
    names = {f"n{n.id}" for n in g.nodes} | ({"legend"} if legend else set())
    edges = Counter((f"n{e.src}", f"n{e.dst}") for e in g.edges)
    return names, edges


# --------------------------------------------------------------------------
# both engines agree on the structure
# --------------------------------------------------------------------------
def test_plain_layouts_agree_between_engines(graph):
    dot_eng, pure_eng = find_engine("dot"), find_engine("graphviz-pure")
    if dot_eng is None or pure_eng is None:
        pytest.skip("needs both engines")
    source = to_dot(graph)
    a = parse_plain(run_engine(source, "plain", engine=dot_eng).decode())
    b = parse_plain(run_engine(source, "plain", engine=pure_eng).decode())
    names, edges = expected_structure(graph)
    assert set(a[0]) == set(b[0]) == names
    assert a[1] == b[1] == edges
    # and the labels they place are the same text
    assert {k: v for k, v in a[0].items() if k != "legend"} == {k: v for k, v in b[0].items() if k != "legend"}
    assert a[0]["n1"] == b[0]["n1"] == graph.nodes[1].op


def test_layout_plain(graph, engine):
    nodes, edges = parse_plain(run_engine(to_dot(graph), "plain").decode())
    assert (set(nodes), edges) == expected_structure(graph)
    params = {n.id: n for n in graph.nodes if n.kind == "param"}
    for nid, n in params.items():
        assert nodes[f"n{nid}"].startswith(n.param)


def test_render_png_within_max_px(graph, engine):
    from PIL import Image

    for max_px in (200, 640):
        data = render_png(graph, max_px=max_px)
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        w, h = png_size(data)
        assert 0 < w <= max_px and 0 < h <= max_px
        img = Image.open(io.BytesIO(data))
        img.load()  # decodes the whole bitmap: the PNG is valid
        assert img.size == (w, h)
    small = png_size(render_png(graph, max_px=200))
    big = png_size(render_png(graph, max_px=640))
    assert max(big) > max(small)


def test_svg_has_full_names_and_op_labels(graph, engine, tmp_path):
    path = render_to_file(graph, tmp_path / "g.svg")
    svg = pathlib.Path(path).read_text(encoding="utf-8")
    assert svg.lstrip().startswith("<?xml") or "<svg" in svg[:500]
    tooltips = re.findall(r'xlink:title="([^"]*)"', svg)
    for name in ("MatmulGradNode", "AddGradNode", "ReluGradNode", "CrossEntropyWithSoftmaxGradNode"):
        assert any(t.startswith(name + " | ") for t in tooltips), name
    matmul_tips = [t for t in tooltips if t.startswith("MatmulGradNode")]
    assert len(matmul_tips) == graph.count_ops()["Matmul"] == 2
    assert any("layer: 0" in t for t in matmul_tips) and any("layer: 2" in t for t in matmul_tips)
    texts = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
    for op in ("Matmul", "Add", "Relu", "MeanAll"):
        assert op in texts, op
    assert "0.weight" in texts
    assert svg == render_svg(graph).decode("utf-8")


def test_png_file(graph, engine, tmp_path):
    path = render_to_file(graph, str(tmp_path / "g.png"), max_px=300)
    data = pathlib.Path(path).read_bytes()
    assert max(png_size(data)) <= 300
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]  # atomic write left nothing


def test_make_graph_renders_with_selected_engine(engine, tmp_path):
    paddle.seed(1)
    m = nn.Linear(3, 2)
    dot = make_graph(m(paddle.randn([1, 3])))
    import graphviz

    assert str(graphviz.backend.dot_command.DOT_BINARY) == engine.path
    out = dot.render(str(tmp_path / "mg.gv"), format="svg")
    assert "Matmul" in pathlib.Path(out).read_text(encoding="utf-8")


# --------------------------------------------------------------------------
# no engine at all
# --------------------------------------------------------------------------
@pytest.fixture
def no_engine(monkeypatch, tmp_path):
    empty = tmp_path / "emptybin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("PADDLEVIZ_ENGINE", raising=False)
    # graphviz-pure is also looked for beside the interpreter (an unactivated venv)
    monkeypatch.setattr(sys, "executable", str(empty / "python"))
    assert find_engine() is None and find_engine("dot") is None and find_engine("graphviz-pure") is None


def test_dot_and_json_without_engine(graph, no_engine, tmp_path):
    p = render_to_file(graph, tmp_path / "g.dot")
    text = pathlib.Path(p).read_text(encoding="utf-8")
    assert text.startswith("digraph backward {") and "MatmulGradNode" in text
    p = render_to_file(graph, tmp_path / "g.json")
    assert BackwardGraph.from_json(pathlib.Path(p).read_text(encoding="utf-8")) == graph
    p = render_to_file(graph, tmp_path / "g.txt", format="dot")
    assert pathlib.Path(p).read_text(encoding="utf-8") == text


@pytest.mark.parametrize("fmt", ["png", "svg"])
def test_png_svg_without_engine_raise(graph, no_engine, tmp_path, fmt):
    with pytest.raises(EngineNotFound) as info:
        render_to_file(graph, tmp_path / f"g.{fmt}")
    assert isinstance(info.value, RuntimeError)
    msg = str(info.value)
    assert "apt-get install -y graphviz" in msg and "graphviz-pure" in msg
    assert not os.path.exists(tmp_path / f"g.{fmt}")
    with pytest.raises(EngineNotFound):
        (render_png if fmt == "png" else render_svg)(graph)


def test_engine_not_found_when_find_engine_returns_none(graph, monkeypatch, tmp_path):
    monkeypatch.setattr(engine_mod, "find_engine", lambda prefer=None: None)
    with pytest.raises(RuntimeError, match="apt-get install -y graphviz"):
        render_svg(graph)
    assert render_to_file(graph, tmp_path / "ok.dot").endswith("ok.dot")


def test_engine_choice_validated(monkeypatch):
    monkeypatch.setenv("PADDLEVIZ_ENGINE", "neato")
    with pytest.raises(ValueError, match="the environment variable PADDLEVIZ_ENGINE must be 'dot'"):
        find_engine()


def test_bad_format(graph, tmp_path):
    with pytest.raises(ValueError, match="format"):
        render_to_file(graph, tmp_path / "g.bmp")
    with pytest.raises(FileNotFoundError):
        render_to_file(graph, tmp_path / "missing" / "g.dot")


# --------------------------------------------------------------------------
# escaping: hostile names cannot break or inject into the DOT
# --------------------------------------------------------------------------
HOSTILE = [
    'quote"d',
    "br{ace}s",
    "back\\slash",
    "new\nline",
    "<b>html</b>",
    "per%cent",
    "ünï名字",
    'x"]; evil [label="pwned"]; y [label="',
    "end\\",
    "}; digraph z {",
]


class Hostile(nn.Layer):
    def __init__(self):
        super().__init__()
        for name in HOSTILE:
            self.add_sublayer(name, nn.Linear(2, 2))
        self.add_parameter('w"}\\\n<%>é', self.create_parameter([2]))

    def forward(self, x):
        for sub in self._sub_layers.values():
            x = sub(x)
        return x * self._parameters['w"}\\\n<%>é']


@pytest.fixture(scope="module")
def hostile_graph() -> BackwardGraph:
    paddle.seed(5)
    m = Hostile()
    with capture_backward(m) as cap:
        m(paddle.randn([1, 2])).sum().backward()
    g = cap.graph
    assert {n.param for n in g.nodes if n.kind == "param"} == {n for n, _ in m.named_parameters()}
    assert {n.layer for n in g.nodes if n.kind == "op"} >= set(HOSTILE)
    return g


@pytest.mark.parametrize("clusters", [True, False])
def test_hostile_names_cannot_inject(hostile_graph, engine, clusters):
    g = hostile_graph
    source = to_dot(g, clusters=clusters)
    nodes, edges = parse_plain(run_engine(source, "plain").decode("utf-8"))
    names, expected_edges = expected_structure(g)
    assert set(nodes) == names  # no "evil", no "y", no extra graph
    assert "evil" not in nodes and "y" not in nodes
    assert edges == expected_edges
    # parameter labels show the names literally (a newline becomes a space)
    for n in g.nodes:
        if n.kind == "param":
            assert nodes[f"n{n.id}"].startswith(n.param.replace("\n", " ")), n.param


def test_hostile_names_render_svg_and_png(hostile_graph, engine):
    svg = render_svg(hostile_graph).decode("utf-8")
    assert "ünï名字" in svg
    assert "evil" not in re.findall(r'<g id="node\d+" class="node">\s*<title>([^<]*)</title>', svg)
    assert "&lt;b&gt;html&lt;/b&gt;" in svg  # markup in names is text, never markup
    data = render_png(hostile_graph, max_px=400)
    assert max(png_size(data)) <= 400


def test_hostile_names_dot_has_no_open_strings(hostile_graph, tmp_path):
    """Every DOT line closes the strings it opens: no raw newline inside a quoted string."""
    p = render_to_file(hostile_graph, tmp_path / "h.dot")
    source = pathlib.Path(p).read_text(encoding="utf-8")
    for line in source.splitlines():
        bare = line.replace("\\\\", "").replace('\\"', "")
        assert bare.count('"') % 2 == 0, line
    assert "ünï名字" in source  # non-ASCII kept, not mangled
    eng = find_engine("dot") or find_engine("graphviz-pure")
    if eng is None:
        pytest.skip("no engine")
    nodes, _ = parse_plain(run_engine(source, "plain", engine=eng).decode("utf-8"))
    assert len(nodes) == len(hostile_graph.nodes) + 1


def test_edges_around_an_op_without_a_hook_carry_what_flowed():
    """paddle.Model sums its losses with add_n (AddN takes no hook): the root's gradient into it is
    read by a tensor hook on the root (1, drawn solid), and AddN passes that same gradient on to each
    loss unchanged, so its outgoing edges carry it too."""
    import paddle

    from paddleviz_hooks import capture_backward
    from paddleviz_hooks.render import to_dot

    net = paddle.nn.Linear(3, 2)
    with capture_backward(net) as cap:
        out = net(paddle.randn([2, 3]))
        paddle.add_n([out.mean(), out.sum()]).backward()
    g = cap.graph
    addn = next(n for n in g.nodes if n.op.startswith("AddN"))
    assert not addn.hooked
    line = next(l for l in to_dot(g).split("\n") if l.strip().startswith(f"n0 -> n{addn.id} "))
    assert "|g| 1" in line and "dashed" not in line, line
    outs = [e for e in g.edges if e.src == addn.id]
    assert len(outs) == 2 and all(e.grad is not None and e.grad.norm == 1.0 for e in outs)

def test_a_missing_preferred_engine_is_named_as_missing(monkeypatch):
    from paddleviz_hooks.render.engine import EngineNotFound, require_engine

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(EngineNotFound, match="the layout engine 'dot' is not installed"):
        require_engine("dot")


def test_the_legend_names_the_layer_box_colour_when_boxes_are_drawn():
    from paddleviz_hooks.render.dot import to_dot
    from paddleviz_hooks.text import LAYER_BOX_LEGEND
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with capture_backward(net) as cap:
        net(paddle.randn([2, 4])).sum().backward()
    from paddleviz_hooks import collapse_graph
    assert LAYER_BOX_LEGEND.split(":")[0] in to_dot(collapse_graph(cap.graph, depth=0))  # one box: the model
    assert LAYER_BOX_LEGEND.split(":")[0] not in to_dot(cap.graph)  # every op: no box


# --------------------------------------------------------------------------
# the first look: a legend of what is drawn, no dashed node whose gradients are all known
# --------------------------------------------------------------------------
def _legend_of(dot: str) -> str:
    return next(line for line in dot.splitlines() if line.strip().startswith("legend "))


def test_the_legend_lists_only_what_the_drawing_shows(graph):
    """A plain step of a small MLP: no input leaf, no NaN/Inf, nothing dashed; the legend used to
    list all three anyway. A step with an input leaf and a NaN lists them. Both say which way
    the arrows go."""
    legend = _legend_of(to_dot(graph))
    assert "parameter" in legend and "arrows: the backward" in legend
    assert "input leaf" not in legend and "NaN/Inf" not in legend and "dashed" not in legend
    x = paddle.to_tensor([[1.0, -1.0]], stop_gradient=False)
    with capture_backward(None) as cap:
        paddle.sqrt(x).sum().backward()  # sqrt(-1): a NaN gradient into the input leaf
    legend = _legend_of(to_dot(cap.graph))
    assert "input leaf" in legend and "NaN/Inf" in legend


def test_an_op_without_a_hook_whose_gradients_are_all_known_is_not_drawn_dashed():
    """add_n takes no hook; what it passes on is copied from what it received, exact on every
    edge: the node was drawn dashed, under a legend saying dashed means 'gradient not observed'."""
    paddle.seed(0)
    m = nn.Linear(3, 3)
    x = paddle.randn([2, 3])
    with capture_backward(m) as cap:
        paddle.add_n([m(x), m(x) * 2.0]).sum().backward()
    g = cap.graph
    add_n = next(n for n in g.nodes if n.op == "AddN")
    assert not add_n.hooked and all(e.grad is not None and e.grad.norm is not None
                                    for e in g.edges if e.src == add_n.id)
    line = next(x for x in to_dot(g).splitlines() if x.strip().startswith(f"n{add_n.id} [label="))
    assert "filled,dashed" not in line and "filled" in line
