"""Hostile input: names that try to break DOT, file paths, VisualDL or HTML,
and wrong arguments to every public function.

Layer, parameter and op names are chosen by whoever wrote the model; they reach
DOT source, SVG text, file names, VisualDL tags and the HTML report. None of
them may inject DOT, escape the output directory or crash a sink, and each
must still be shown (escaped, shortened when very long).
"""

from __future__ import annotations

import pathlib
import json
import math
import os
import re
import subprocess
import xml.etree.ElementTree as ET

import paddle
import paddle.nn as nn
import pytest
from paddle.autograd import PyLayer

from paddleviz_hooks import (
    BackwardGraph,
    BackwardGraphCallback,
    capture_backward,
    graph_of,
    make_graph,
    render_png,
    render_svg,
)
from paddleviz_hooks.render import to_dot
from paddleviz_hooks.render.engine import find_engine
from paddleviz_hooks.escape import MAX_TEXT, shorten

from _fitkit import files_under, image_steps, ours, recorded_warnings, run_fit, step_files, text_records, vdl_records
from paddleviz_hooks import diff_graphs, render_to_file

INJECT = 'inj"]; pwned [shape=box]; x["'
HOSTILE = [
    'q"uote',
    "br{ace}",
    "<angle>",
    "new\nline",
    "pct%s%d",
    "sl/ash",
    "..",
    "L" * 300,
    "日本語ñ",
    "back\\slash\\N",
    INJECT,
    "<script>alert(1)</script>",
    "x&amp;y&z &#60;b&#62;",  # Graphviz decodes entities: shown as x&y&z <b> unless & is escaped
]

# a PyLayer whose class name (and so its grad node name) is hostile too
EvilOp = type('Ev"il<op>{x}%s\n/..', (PyLayer,), {
    "forward": staticmethod(lambda ctx, x: x * 2.0),
    "backward": staticmethod(lambda ctx, g: g * 2.0),
})


class Hostile(nn.Layer):
    """Hostile names at the top level and nested, then a hostile op."""

    def __init__(self) -> None:
        super().__init__()
        self.names = list(HOSTILE)
        for n in HOSTILE:
            self.add_sublayer(n, nn.Linear(8, 8))
        self.inner = nn.Sequential()
        for n in HOSTILE[:4]:
            self.inner.add_sublayer(n, nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for n in self.names:
            x = paddle.tanh(getattr(self, "_sub_layers")[n](x))
        x = self.inner(x)
        return self.head(EvilOp.apply(x))


def _hostile_graph() -> BackwardGraph:
    paddle.seed(0)
    net = Hostile()
    with capture_backward(net) as cap:
        net(paddle.randn([2, 8])).mean().backward()
    return cap.graph


def _plain_nodes(dot_source: str) -> list[str]:
    out = subprocess.run(["dot", "-Tplain"], input=dot_source.encode("utf-8"), capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    return [line.split()[1] for line in out.stdout.decode("utf-8").splitlines() if line.startswith("node ")]


def _svg_texts(svg: bytes) -> list[str]:
    root = ET.fromstring(svg)
    return ["".join(el.itertext()) for el in root.iter() if el.tag.endswith("}text")]


needs_dot = pytest.mark.skipif(find_engine("dot") is None, reason="needs Graphviz dot")


# --------------------------------------------------------------------------
# DOT and drawings
# --------------------------------------------------------------------------
def test_hostile_names_reach_the_graph():
    g = _hostile_graph()
    layers = {n.layer for n in g.nodes if n.kind == "op"}
    for name in HOSTILE:
        assert name in layers, name
        assert f"{name}.weight" in g.params()
    assert any(n.op.startswith('PyLayer:Ev"il<op>{x}%s\n/..') for n in g.nodes)
    # JSON round trip is lossless whatever the names
    again = BackwardGraph.from_json(g.to_json())
    assert [n.to_dict() for n in again.nodes] == [n.to_dict() for n in g.nodes]


@needs_dot
@pytest.mark.parametrize("options", [{}, {"stats": False, "clusters": False}, {"rankdir": "LR", "legend": False}])
def test_hostile_names_cannot_inject_dot(options):
    g = _hostile_graph()
    title = 'title "with" {braces} <b>\n' + INJECT
    names = _plain_nodes(to_dot(g, title=title, **options))
    want = {f"n{n.id}" for n in g.nodes} | ({"legend"} if options.get("legend", True) else set())
    assert sorted(names) == sorted(want)  # no node was injected, none lost
    assert "pwned" not in names


@needs_dot
def test_hostile_names_render_correctly_in_svg():
    g = _hostile_graph()
    texts = _svg_texts(render_svg(g, title="<t>"))
    joined = "\n".join(texts)
    # cluster captions show every layer name, escaped by Graphviz, newlines as spaces
    for name in HOSTILE:
        shown = shorten(f"{name} (Linear)").replace("\n", " ")
        assert any(shown in t for t in texts), (name, shown)
    assert shorten("L" * 300) != "L" * 300 and len(shorten("L" * 300)) == MAX_TEXT
    # parameter leaves carry the hostile names too
    assert 'q"uote.weight' in joined and "日本語ñ.weight" in joined
    assert "back\\slash\\N" in joined  # the backslash escape \N is shown, not expanded
    assert any(t.startswith('PyLayer:Ev"il<op>{x}%s /..') for t in texts)


@needs_dot
def test_hostile_names_in_node_and_edge_tooltips():
    """Hover texts (and so the report's click panel) carry hostile layer and op names as text:
    every edge's says from -> to and its gradient, every node's its gradient, none injects."""
    from paddleviz_hooks.escape import MAX_TOOLTIP, visible
    from paddleviz_hooks.text import edge_tooltip, node_tooltip

    g = _hostile_graph()
    root = ET.fromstring(render_svg(g))
    titles = [el.get("{http://www.w3.org/1999/xlink}title") for el in root.iter() if el.tag.endswith("}a")]

    def shown(text: str) -> str:  # one line, shortened, invisible characters made visible
        return visible(shorten(text, MAX_TOOLTIP).replace("\n", " "))

    ins = g.in_edges()
    for e in g.edges:
        assert shown(edge_tooltip(g.nodes[e.src], g.nodes[e.dst], e)) in titles, e
    for n in g.nodes:
        tip = node_tooltip(n, ins.get(n.id, ()))
        if "\\N" in tip:  # Graphviz 2.43 still expands \N (the node's name) in a node's tooltip after a
            continue       # doubled backslash, as it did before the gradient was added (not fixed here)
        assert shown(tip) in titles, n.key
    joined = "\n".join(titles)
    for name in ("<script>alert(1)</script>", 'q"uote', "back\\slash\\N", "x&amp;y&z &#60;b&#62;"):
        assert any(name in t.split(" -> ")[0] for t in titles if " -> " in t), name  # an edge from its layer
    assert "norm " in joined and "min " in joined


@needs_dot
@pytest.mark.parametrize("max_nodes", [6, 30])
def test_hostile_names_collapsed_png(max_nodes):
    g = _hostile_graph()
    png = render_png(g, max_nodes=max_nodes, max_px=300)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    from paddleviz_hooks.collapse import collapse_graph

    small = collapse_graph(g, max_nodes=max_nodes)
    names = _plain_nodes(to_dot(small, legend=False))
    assert len(names) == len(small.nodes) and "pwned" not in names


@needs_dot
def test_hostile_names_in_make_graph(tmp_path):
    paddle.seed(0)
    net = Hostile()
    y = net(paddle.randn([2, 8])).mean()
    dot = make_graph(y, params=net)
    names = _plain_nodes(dot.source)
    assert "pwned" not in names and len(names) == len(graph_of(y, net).nodes) + 1


# --------------------------------------------------------------------------
# a real fit with hostile names: files stay in place, VisualDL copes
# --------------------------------------------------------------------------
def test_hostile_names_through_the_callback(tmp_path, capsys):
    cb = BackwardGraphCallback(str(tmp_path / "vdl"), every=2, run_name="hostile-run", verbose=1,
                               view_max_px=400, queue_size=16, on_nonfinite=True)
    with recorded_warnings() as got:
        run_fit(Hostile, callbacks=[cb], steps=4, lr=0.01)
    assert ours(got) == []
    assert cb.captured_steps == [1, 2, 4]
    # files appear only inside log_dir/run_name, nowhere else under tmp_path
    everything = files_under(tmp_path)
    assert everything and all(f.startswith(os.path.join("vdl", "hostile-run") + os.sep) for f in everything), everything
    run_dir = tmp_path / "vdl" / "hostile-run"
    for ext in ("png", "svg", "dot", "json"):
        assert step_files(run_dir, ext) == [1, 2, 4]
    # VisualDL: tags are clean, every record is there, text keeps the names verbatim
    reader = vdl_records(run_dir)
    tags = reader.get_tags()
    for kind in ("image", "text", "scalar"):
        for tag in tags.get(kind, []):
            assert "%" not in tag and ".." not in tag and " " not in tag and "\n" not in tag, tag
    # (the layer named ".." has parameters "...weight": at depth 3 its group is "..", its tag "~grad_norm/_")
    grad_tags = [t for t in tags["scalar"] if t == "~grad_norm" or t.startswith("~grad_norm/")]
    # one per top-level layer, inner's four and head (the default scalar depth reaches inner's layers)
    assert len(grad_tags) == len(HOSTILE) + 5, grad_tags
    for t in grad_tags:
        assert len(reader.get_data("scalar", t)) == 3, t
    assert image_steps(reader, "backward_graph") == [1, 2, 4]
    texts = text_records(reader, "summary")
    assert sorted(texts) == [1, 2, 4]
    assert any("pct%s%d" in t or "<script>" in t or 'q"uote' in t for t in texts.values())
    assert "hostile-run" in capsys.readouterr().out


@pytest.mark.parametrize("run_name", ["../x", "..", ".", "", "a/b", "/abs", "x y", "ü", "a\\b", "x\n", None, 5])
def test_run_name_cannot_leave_log_dir(tmp_path, run_name):
    # wrong type: TypeError; a str that is not a plain folder name: ValueError
    exc, match = (ValueError, "run_name must be a plain folder name") if isinstance(run_name, str) else \
        (TypeError, "run_name must be a str")
    with pytest.raises(exc, match=match) as info:
        BackwardGraphCallback(str(tmp_path), run_name=run_name)
    assert repr(run_name) in str(info.value)
    assert os.listdir(tmp_path) == []


def test_plain_run_names_are_accepted(tmp_path):
    for name in ("run.1_a-b", "backward_graph", "A9"):
        assert BackwardGraphCallback(str(tmp_path), run_name=name).recorder.options.run_name == name


def test_graph_render_to_hostile_file_name(tmp_path):
    g = _hostile_graph()
    target = tmp_path / 'we"ird {name} <ü>.json'
    assert render_to_file(g, str(target)) == str(target)
    assert BackwardGraph.from_json(target.read_text()).to_json() == g.to_json()
    assert sorted(os.listdir(tmp_path)) == [target.name]  # no temporary file left


# --------------------------------------------------------------------------
# wrong arguments: clear errors quoting the value
# --------------------------------------------------------------------------
CB_BAD = [
    (dict(every=0), ValueError, "every", "0"),
    (dict(every=-1), ValueError, "every", "-1"),
    (dict(every=1.5), TypeError, "every", "1.5"),
    (dict(every="10"), TypeError, "every", "'10'"),
    (dict(every=True), TypeError, "every", "True"),
    (dict(steps=[0]), ValueError, "steps", "0"),
    (dict(steps="1,2"), TypeError, "steps", "'1,2'"),
    (dict(steps=5), TypeError, "steps", "5"),
    (dict(steps=[1, 2.5]), TypeError, "steps", "2.5"),
    (dict(every=10, steps=[1, 2]), ValueError, "not both", "every=10"),
    (dict(max_captures=0), ValueError, "max_captures", "0"),
    (dict(max_captures="3"), TypeError, "max_captures", "'3'"),
    (dict(formats=("gif",)), ValueError, "formats", "'gif'"),
    (dict(formats=()), ValueError, "formats", "()"),
    (dict(formats=None), TypeError, "formats", "None"),
    (dict(ranks="some"), ValueError, "ranks", "'some'"),
    (dict(ranks=-1), ValueError, "ranks", "-1"),
    (dict(ranks=[0, "a"]), TypeError, "ranks", "'a'"),
    (dict(on_grad_spike=0.5), ValueError, "on_grad_spike", "0.5"),
    (dict(on_grad_spike=1), ValueError, "on_grad_spike", "1"),
    (dict(on_grad_spike="10"), TypeError, "on_grad_spike", "'10'"),
    (dict(on_grad_spike=math.nan), ValueError, "on_grad_spike", "nan"),
    (dict(on_grad_spike=True), TypeError, "on_grad_spike", "True"),
    (dict(render_timeout=-1), ValueError, "render_timeout", "-1"),
    (dict(render_timeout=0), ValueError, "render_timeout", "0"),
    (dict(render_timeout=math.nan), ValueError, "render_timeout", "nan"),
    (dict(render_timeout="5"), TypeError, "render_timeout", "'5'"),
    (dict(cooldown=-1), ValueError, "cooldown", "-1"),
    (dict(queue_size=0), ValueError, "queue_size", "0"),
    (dict(view_max_nodes=1), ValueError, "view_max_nodes", "1"),
    (dict(view_max_px=10), ValueError, "view_max_px", "10"),
    (dict(verbose="x"), TypeError, "verbose", "'x'"),
    (dict(on_nonfinite=1), TypeError, "on_nonfinite", "1"),
    (dict(on_structure_change="yes"), TypeError, "on_structure_change", "'yes'"),
    (dict(grad_stats=None), TypeError, "grad_stats", "None"),
    (dict(log_dir=None), TypeError, "log_dir", "None"),
    (dict(log_dir=""), ValueError, "log_dir", "''"),
    (dict(log_dir=5), TypeError, "log_dir", "5"),
]


@pytest.mark.parametrize("kwargs,exc,name,value", CB_BAD, ids=[repr(c[0]) for c in CB_BAD])
def test_callback_bad_arguments(tmp_path, kwargs, exc, name, value):
    kwargs = dict(kwargs)
    log_dir = kwargs.pop("log_dir", str(tmp_path))
    with pytest.raises(exc) as info:
        BackwardGraphCallback(log_dir, **kwargs)
    msg = str(info.value)
    assert name in msg and value in msg, msg


def test_callback_good_edge_values(tmp_path):
    BackwardGraphCallback(str(tmp_path), every=1, max_captures=1, cooldown=0, queue_size=1,
                          formats="json", ranks=[0, 1], on_grad_spike=1.5, render_timeout=0.5, verbose=True)
    BackwardGraphCallback(str(tmp_path), steps=range(1, 4), ranks="all")
    BackwardGraphCallback(tmp_path)  # a pathlib.Path


def _loss_and_net():
    net = nn.Linear(3, 2)
    return net(paddle.randn([2, 3])).sum(), net


def _graph():
    loss, net = _loss_and_net()
    with capture_backward(net) as cap:
        loss.backward()
    return cap.graph


FN_BAD = [
    ("capture_backward('x')", lambda: capture_backward("x"), TypeError, ["layer", "str"]),
    ("capture_backward(model='x')", lambda: capture_backward(model="x"), TypeError, ["model"]),
    ("capture_backward(grad_stats=1)", lambda: capture_backward(None, grad_stats=1), TypeError, ["grad_stats", "1"]),
    ("capture_backward(params=5)", lambda: capture_backward(params=5), TypeError, ["params", "int"]),
    ("make_graph(None)", lambda: make_graph(None), TypeError, ["paddle.Tensor", "NoneType"]),
    ("make_graph([])", lambda: make_graph([]), ValueError, ["at least one tensor"]),
    ("make_graph(to_tensor(1.0))", lambda: make_graph(paddle.to_tensor(1.0)), ValueError,
     ["stop_gradient", "grad_fn"]),
    ("make_graph(no_grad)", lambda: make_graph(_no_grad_tensor()), ValueError, ["stop_gradient", "no_grad"]),
    ("make_graph(y, params='x')", lambda: make_graph(_loss_and_net()[0], params="x"), TypeError, ["params", "str"]),
    ("graph_of('x')", lambda: graph_of("x"), TypeError, ["paddle.Tensor", "str"]),
    ("render('x.gif')", lambda: render_to_file(_graph(), "x.gif"), ValueError, ["'gif'", "png, svg, dot, json"]),
    ("render_to_file(format='gif')", lambda: render_to_file(_graph(), "x.svg", format="gif"), ValueError, ["'gif'"]),
    ("render(5)", lambda: render_to_file(_graph(), 5), TypeError, ["path", "int"]),
    ("render_png(None)", lambda: render_png(None), TypeError, ["BackwardGraph", "NoneType"]),
    ("render_svg('x')", lambda: render_svg("x"), TypeError, ["BackwardGraph", "str"]),
    ("to_dot(None)", lambda: to_dot(None), TypeError, ["BackwardGraph", "NoneType"]),
    ("render_png(max_px=10)", lambda: render_png(_graph(), max_px=10), ValueError, ["max_px", "10"]),
    ("render_png(timeout=-1)", lambda: render_png(_graph(), timeout=-1), ValueError, ["timeout", "-1"]),
    ("render_png(max_nodes=0)", lambda: render_png(_graph(), max_nodes=0), ValueError, ["max_nodes", "0"]),
    ("render_png(depth=-1)", lambda: render_png(_graph(), depth=-1), ValueError, ["depth", "-1"]),
    ("to_dot(rankdir='XX')", lambda: to_dot(_graph(), rankdir="XX"), ValueError, ["rankdir", "'XX'"]),
    ("from_json('garbage')", lambda: BackwardGraph.from_json("garbage"), ValueError, ["not JSON"]),
    ("from_json('{}')", lambda: BackwardGraph.from_json("{}"), ValueError, ["paddleviz-hooks/backward-graph"]),
    ("diff(None)", lambda: diff_graphs(None, _graph()), TypeError, ["BackwardGraph", "NoneType"]),
    ("find_engine('neato')", lambda: find_engine("neato"), ValueError, ["'neato'"]),
]


def _no_grad_tensor():
    net = nn.Linear(3, 2)
    with paddle.no_grad():
        return net(paddle.randn([2, 3])).sum()


@pytest.mark.parametrize("call,exc,words", [(c[1], c[2], c[3]) for c in FN_BAD], ids=[c[0] for c in FN_BAD])
def test_public_functions_bad_arguments(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    for w in words:
        assert w in msg, msg


def test_render_into_missing_directory(tmp_path):
    g = _graph()
    target = tmp_path / "no" / "such" / "dir" / "g.svg"
    with pytest.raises(FileNotFoundError, match="does not exist; create it first") as info:
        render_to_file(g, str(target))
    assert str(tmp_path / "no" / "such" / "dir") in str(info.value)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------
# the HTML report escapes what it shows
# --------------------------------------------------------------------------
from paddleviz_hooks.sinks import report  # noqa: E402


class ScriptNamed(nn.Layer):
    def __init__(self):
        super().__init__()
        self.add_sublayer("<script>alert(1)</script>", nn.Linear(8, 8))
        self.add_sublayer('"><img src=x onerror=alert(2)>', nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for name in ("<script>alert(1)</script>", '"><img src=x onerror=alert(2)>'):
            x = paddle.tanh(self._sub_layers[name](x))
        return self.head(x)


def test_report_html_escapes_layer_names(tmp_path):
    cb = BackwardGraphCallback(str(tmp_path / "vdl"), steps=[1, 2], verbose=0, view_max_px=300, queue_size=8)
    run_fit(ScriptNamed, callbacks=[cb], steps=2)
    out = report.build_report(str(tmp_path / "vdl"), str(tmp_path / "report.html"))
    page = pathlib.Path(out).read_text(encoding="utf-8")
    assert "<script>alert(1)</script>" not in page
    assert "<img src=x" not in page
    # the names are still on the page, escaped (HTML entities or JSON \u003c escapes)
    assert re.search(r"(&lt;|\\u003c)script(&gt;|\\u003e)alert\(1\)", page)
    # parsed as a browser would: no element or handler came from a layer name
    found = _elements(page)
    assert not found["img"] and not found["handlers"]
    # the only scripts are the report's own: its JSON data block (where the
    # names are data) and its code (where they are not)
    for attrs, body in found["scripts"]:
        if attrs.get("type") == "application/json":
            assert "<" not in body
            json.loads(body)
        else:
            assert "alert(" not in body
    assert len(found["scripts"]) == page.count("<script")


def _elements(page: str) -> dict:
    from html.parser import HTMLParser

    found = {"scripts": [], "img": [], "handlers": []}

    class P(HTMLParser):
        in_script = False

        def handle_starttag(self, tag, attrs):
            if tag == "script":
                self.in_script = True
                found["scripts"].append((dict(attrs), ""))
            if tag == "img":
                found["img"].append(attrs)
            found["handlers"].extend(a for a, _ in attrs if a.startswith("on"))

        def handle_endtag(self, tag):
            if tag == "script":
                self.in_script = False

        def handle_data(self, data):
            if self.in_script:
                attrs, body = found["scripts"][-1]
                found["scripts"][-1] = (attrs, body + data)

    P().feed(page)
    return found
