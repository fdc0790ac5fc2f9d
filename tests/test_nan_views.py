"""One answer in every view (issue 27): where the NaN/Inf starts, and what changed.

Each scenario trains a small model in a hand-written loop under the recorder
(``on_nonfinite=True``); the model makes its NaN/Inf on a line marked
``# origin:<tag>`` (or only in the backward, or adds an op), so the answer is
known before anything is captured. Then every view of the capture is produced
and read back: the JSON record, the DOT and SVG drawings (titles and marks),
the VisualDL summary text and Graphs-tab file, the HTML report's panels, the
Model Explorer graphs, overlays and start node, ``summarize`` and the CLI's
``diff``. Each must state the same origin, the same first non-finite gradient
and the same changes.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import numpy as np
import paddle
import paddle.nn as nn
import pytest

from paddleviz_hooks import BackwardGraph, BackwardGraphRecorder, summarize
from paddleviz_hooks.cli import main as cli_main
from paddleviz_hooks.notebook import show
from paddleviz_hooks.sinks import explorer as ex
from paddleviz_hooks.sinks.report import build_report

from _fitkit import page_tags, vdl_records
from _nanruns import tagged_line
from test_nan_origin import positive_linear

D, H = 4, 6
HERE = Path(__file__).name


def line_of(tag: str) -> int:
    return tagged_line(__file__, tag)


class SqrtBlock(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.lin = positive_linear(D, H)

    def forward(self, x):
        return paddle.sqrt(self.lin(x))  # origin:sqrt


class InLayerNet(nn.Layer):
    """sqrt of a negative inside the sublayer ``block`` (its output needs a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = SqrtBlock()
        self.head = nn.Linear(H, 2)

    def forward(self, x):
        return self.head(self.block(x))


class LogOfDataNet(nn.Layer):
    """log of the batch itself: the op's output needs no gradient, so it has no grad node."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(D, H), nn.Tanh())
        self.head = nn.Linear(H, 2)

    def forward(self, x):
        x = paddle.log(x)  # origin:log
        return self.head(self.enc(x))


class LogFeatureNet(nn.Layer):
    """log of one column of the batch, multiplied into the encoder's output: its output enters
    the graph at that Multiply, not inside ``enc``."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(D, H), nn.Tanh())
        self.head = nn.Linear(H, 2)
        self.twice = twice

    def forward(self, x):
        feat = paddle.log(x[:, :1])  # origin:log_feature
        h = self.enc(x)
        if self.twice:  # two Multiply nodes in this layer: which one takes feat is not said
            h = h * h
        return self.head(h * feat)


class BackwardOnlyNet(nn.Layer):
    """sqrt(relu(h)): finite forward (sqrt(0) = 0), its backward divides by 0."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(positive_linear(D, H), nn.ReLU())
        self.head = nn.Linear(H, 2)

    def forward(self, x):
        return self.head(paddle.sqrt(self.block(x)))


class CompiledBlock(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.lin = positive_linear(D, H)

    def forward(self, x):
        return paddle.sqrt(self.lin(x))


class CompiledNet(nn.Layer):
    """sqrt of a negative inside a ``to_static`` program: the graph holds the program's ops."""

    def __init__(self) -> None:
        super().__init__()
        self.block = paddle.jit.to_static(CompiledBlock(), full_graph=True)
        self.head = nn.Linear(H, 2)

    def forward(self, x):
        return self.head(self.block(x))  # origin:program


class GrowingNet(nn.Layer):
    """From step 2 on, the model's own forward runs two ops more (a Scale, an Exp): a structure
    change, no NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(D, H)
        self.head = nn.Linear(H, 2)
        self.extra = False

    def forward(self, x):
        h = self.block(x)
        if self.extra:
            h = paddle.exp(h * 0.1)
        return self.head(h)


def _run(tmp_path: Path, net: nn.Layer, batches, every: int = 2, micro_batches: int = 1, before=None) -> Path:
    """Train ``net`` on ``batches`` (step -> list of micro-batch inputs) under the recorder."""
    with BackwardGraphRecorder(str(tmp_path / "log"), net, every=every, on_nonfinite=True, verbose=0,
                               formats=("json", "dot", "svg"), visualdl=True) as rec:
        for step, xs in batches.items():
            if before is not None:
                before(net, step)
            with rec.step(step, **({"micro_batches": micro_batches} if micro_batches > 1 else {})):
                for x in xs:
                    net(paddle.to_tensor(x)).mean().backward()
            net.clear_gradients()
    return tmp_path / "log" / "backward_graph"


def _batch(step: int, bad: int | None = None, zero: bool = False, seed: int = 0) -> np.ndarray:
    x = (np.abs(np.random.RandomState(seed + step).randn(2, D)) + 0.5).astype("float32")
    if zero:
        x = np.zeros_like(x) - 1.0  # relu(negative) = 0 everywhere: sqrt'(0) = inf
    return -x if step == bad else x


# --------------------------------------------------------------------------
# every view of one capture, read back
# --------------------------------------------------------------------------
class Views:
    """What each view says about the capture ``step`` (``suffix``: ``b2`` for a second backward)."""

    def __init__(self, run: Path, step: int, suffix: str = "", tmp: Path | None = None) -> None:
        stem = f"step_{step:06d}" + (f"_{suffix}" if suffix else "")
        self.graph = BackwardGraph.from_json((run / f"{stem}.json").read_text())
        self.dot = (run / f"{stem}.dot").read_text()
        self.svg = (run / f"{stem}.svg").read_text()
        texts = {}
        reader = vdl_records(str(run))
        for tag in page_tags(reader.get_tags().get("text", []), "summary" + (f"_{suffix}" if suffix else "")):
            for r in reader.get_data("text", tag):
                texts[r.id] = r.text.encoded_text_string
        self.vdl_text = texts[step]
        folders = sorted((run / "graphs").glob(stem + "-*")) or sorted((run / "graphs").glob(stem + "_*"))
        folders = [f for f in folders if not suffix or f.name.startswith(stem)]
        (folder,) = [f for f in folders if f.name.split("-")[0] == stem]
        (vdl_file,) = folder.glob("vdlgraph.*")
        self.vdl_graph = json.loads(vdl_file.read_text())
        out = tmp or run.parent
        out.mkdir(parents=True, exist_ok=True)
        report = build_report(str(run), str(out / "report.html"))
        self.report_html = Path(report).read_text()
        self.report_panel = self._panel(self.report_html, step, suffix)
        self.explorer = ex.export_explorer(str(run), str(out / "me"))
        self.collection = json.loads(Path(self.explorer.graphs).read_text())
        self.overlays = {k: json.loads(Path(p).read_text()) for k, p in self.explorer.overlays.items()}
        (self.gid,) = [g for g in self.explorer.graph_ids if re.search(rf"\bstep {step}\b", g)
                       and (("micro-batch 2" in g) == (suffix == "b2"))]
        self.me_graph = next(g for g in self.collection["graphs"] if g["id"] == self.gid)

    @staticmethod
    def _panel(page: str, step: int, suffix: str) -> str:
        """The report's panel of the capture, as text."""
        panels = re.findall(r'<section class="step-panel" id="panel-\d+-\d+" hidden>(.*?)</section>', page, re.S)
        want = f"step {step}" + (" - micro-batch 2 of 2" if suffix == "b2" else "")
        for p in panels:
            heading = html.unescape(re.search(r"<h2>(.*?)</h2>", p).group(1))
            if heading == want or (heading.startswith(want) and not suffix and "micro-batch" not in heading):
                return html.unescape(re.sub(r"<[^>]+>", " ", p))
        raise AssertionError(f"no panel {want!r}")

    # what each view says
    def dot_title(self) -> str:
        m = re.search(r'^  label="(.*)"$', self.dot, re.M)
        return m.group(1).replace("\\n", " ") if m else ""

    def svg_texts(self) -> list[str]:
        return [html.unescape(t) for t in re.findall(r"<text[^>]*>(.*?)</text>", self.svg)]

    def dot_nodes_with(self, words: str) -> list[str]:
        """DOT statement lines of the nodes whose label holds ``words``."""
        return [line.strip() for line in self.dot.splitlines()
                if re.match(r"\s*(n\d+|nan_origin) \[label=", line) and words in line.split(", tooltip=")[0]]

    def vdl_typed(self, prefix: str) -> list[dict]:
        return [n for n in self.vdl_graph["nodes"] if n["type"].startswith(prefix)]

    def vdl_attr(self, key: str) -> list[dict]:
        return [n for n in self.vdl_graph["nodes"] if key in n["attrs"] and n["is_leaf_node"]]

    def red(self) -> list[str]:
        results = self.overlays[ex.NONFINITE][self.gid]["results"]
        return [k for k, r in results.items() if r.get("bgColor") == ex._ORIGIN_RED]

    def me_node(self, node_id: str) -> dict:
        return next(n for n in self.me_graph["nodes"] if n["id"] == node_id)


def _key_of_tooltip(stmt: str) -> str:
    return re.search(r"key: ([^|\"]+)", stmt).group(1).strip()


def assert_forward_origin(v: Views, op: str, layer: str, line: int, in_graph: bool, first_op: str,
                          file: str = HERE) -> None:
    """Every view of ``v`` names the forward origin ``op`` in ``layer`` at ``file:line`` (its own
    node when ``in_graph``, else a node added where its output enters the graph) and, apart,
    the first non-finite gradient at an ``first_op`` node."""
    at = f"{file}:{line}"
    rec = v.graph.nonfinite
    # the record (JSON): the origin, and the first non-finite gradient as a fact of its own
    o = rec.origin
    assert (o.kind, o.op, o.layer, o.line) == ("forward", op, layer, line)
    assert o.needs_grad is in_graph and (o.key is not None) is in_graph
    assert (o.nan or o.inf) and o.dtype == "float32"  # the tensor it made
    assert rec.first_gradient is not None and rec.first_gradient.op == first_op.removeprefix("the ")
    node = v.graph.node_by_key()[o.key] if in_graph else v.graph.node_by_key()[rec.entry.key]
    said = f"first produced by op '{op}'"

    # DOT: the title names it (wrapped, never cut); one node says "starts here": the op's own
    # node (violet), or a node added where its output enters the graph
    assert f"NaN/Inf starts at {op}" in v.dot_title() and at in v.dot_title()
    marked = v.dot_nodes_with("starts here")
    assert len(marked) == 1, marked
    if in_graph:
        assert _key_of_tooltip(marked[0]) == o.key and 'color="#7b1fa2"' in marked[0]
    else:
        assert marked[0].startswith("nan_origin [") and "on data that needs no gradient" in marked[0]
        assert f"n{node.id} -> nan_origin" in v.dot  # where its output enters the graph
    assert "where the NaN/Inf starts" in v.dot  # legend row
    firsts = v.dot_nodes_with("first non-finite gradient")
    assert [_key_of_tooltip(s) for s in firsts] == ([] if rec.first_gradient.key == o.key
                                                    else [rec.first_gradient.key])
    # SVG: the same, as drawn
    texts = v.svg_texts()
    assert sum("starts here" in t for t in texts) == 1
    assert any(at in t for t in texts) and any(f"NaN/Inf starts at {op}" in t for t in texts)
    # the notebook's drawing (sized for a cell, collapsed where it must be): the same mark, once
    nb = [html.unescape(t) for t in re.findall(r"<text[^>]*>(.*?)</text>", show(v.graph).svg)]
    assert sum("starts here" in t for t in nb) == 1 and any(at in t for t in nb)
    # VisualDL text and summarize: the same sentence, and the first gradient under its own name
    for text in (v.vdl_text, summarize(v.graph)):
        assert said in text and at in text
        assert f"first non-finite gradient at {first_op}" in text
        assert "NaN origin" not in text
    # Graphs tab: one node typed as the origin (its own, or one added in its layer's box)
    typed = v.vdl_typed("NaN/Inf starts here")
    assert len(typed) == 1 and typed[0]["type"] == f"NaN/Inf starts here: {op}", typed
    assert at in typed[0]["attrs"]["NaN/Inf origin"]
    if in_graph:
        assert typed[0]["attrs"]["key"] == o.key
    else:
        assert typed[0]["name"].rsplit("/", 1)[-1] == op and typed[0]["input_nodes"]
    assert said in v.vdl_graph["nodes"][0]["attrs"]["NaN/Inf origin"] or said in typed[0]["attrs"]["NaN/Inf origin"]
    assert [n["attrs"]["key"] for n in v.vdl_attr("first non-finite gradient")] == [rec.first_gradient.key]
    # report: one "starts here", naming the op and line; the first gradient badged apart
    assert v.report_panel.count("starts here") == 1 and said in v.report_panel and at in v.report_panel
    assert v.report_panel.count("first non-finite gradient") >= 1
    # explorer: opens on the origin (its node, or the one added for it), found by the op's name
    start_id = str(node.id) if in_graph else ex.ORIGIN_NODE
    assert v.explorer.start == (v.gid, start_id)
    start = v.me_node(start_id)
    assert op in start["label"] and at in start["label"]
    assert said in {a["key"]: a["value"] for a in start["attrs"]}["NaN/Inf origin"]
    assert v.red() == [start_id]
    if not in_graph:
        assert start["incomingEdges"][0]["sourceNodeId"] == str(node.id)
    first_nodes = [n["id"] for n in v.me_graph["nodes"]
                   if any(a["key"] == "first non-finite gradient" for a in n["attrs"])]
    assert first_nodes == [str(v.graph.node_by_key()[rec.first_gradient.key].id)]


# --------------------------------------------------------------------------
# the scenarios
# --------------------------------------------------------------------------
def test_origin_inside_a_layer_and_the_replay_compared_from_the_model_output(tmp_path):
    paddle.seed(0)
    run = _run(tmp_path, InLayerNet(), {s: [_batch(s, bad=3)] for s in (1, 2, 3, 4)})
    v = Views(run, 3)
    assert v.graph.meta["replayed"] is True  # step 3 was not scheduled: replayed before the update
    assert_forward_origin(v, "sqrt", "block", line_of("sqrt"), in_graph=True, first_op="Sqrt")
    # compared with step 2 (an ordinary capture rooted at the loss), from the model output
    for text in (v.vdl_text, v.report_panel):
        assert "replayed from the model output" in text, text
        assert "ops gone" not in text and "structure changed" not in text
    assert "First capture" not in v.report_panel and "Changes since step 2" in v.report_panel
    # step 4 (ordinary) against the replayed step 3: the same, the other way round
    assert "older capture replayed from the model output" in Views(run, 4, tmp=tmp_path / "v4").vdl_text


def test_cli_diff_aligns_a_replayed_graph(tmp_path, capsys):
    paddle.seed(0)
    run = _run(tmp_path, InLayerNet(), {s: [_batch(s, bad=3)] for s in (1, 2, 3)})
    assert cli_main(["diff", str(run / "step_000002.json"), str(run / "step_000003.json")]) == 0
    out = capsys.readouterr().out
    assert "newer capture replayed from the model output" in out and "same graph structure" in out.splitlines()
    assert "ops gone" not in out and "Mean" in out  # the loss op left out is named


def test_origin_on_data_that_needs_no_gradient(tmp_path):
    paddle.seed(0)
    run = _run(tmp_path, LogOfDataNet(), {s: [_batch(s, bad=3)] for s in (1, 2, 3, 4)})
    assert_forward_origin(Views(run, 3), "log", "", line_of("log"), in_graph=False, first_op="Tanh")  # tanh(NaN)


def test_origin_without_a_node_is_linked_to_the_op_taking_its_output(tmp_path):
    paddle.seed(0)
    run = _run(tmp_path, LogFeatureNet(), {s: [_batch(s, bad=3)] for s in (1, 2, 3)})
    v = Views(run, 3)
    assert_forward_origin(v, "log", "", line_of("log_feature"), in_graph=False, first_op="Multiply")
    # the one node that takes log's output: the top layer's only Multiply (its other input is enc's)
    (mul,) = [n for n in v.graph.nodes if n.op == "Multiply"]
    assert mul.layer == "" and v.graph.nonfinite.entry.key == mul.key
    assert {v.graph.nodes[e.dst].layer for e in v.graph.edges if e.src == mul.id} == {"enc.1"}
    assert "not linked" not in v.dot


def test_origin_without_a_node_is_left_unlinked_when_its_entry_is_not_certain(tmp_path):
    paddle.seed(0)
    run = _run(tmp_path, LogFeatureNet(twice=True), {s: [_batch(s, bad=3)] for s in (1, 2, 3)})
    v = Views(run, 3)
    assert [n.layer for n in v.graph.nodes if n.op == "Multiply"] == ["", ""]
    rec = v.graph.nonfinite
    assert (rec.origin.op, rec.origin.line, rec.origin.key, rec.entry) == ("log", line_of("log_feature"), None, None)
    (stmt,) = v.dot_nodes_with("starts here")
    assert stmt.startswith("nan_origin [") and "not linked: where its output enters the graph was not found" in stmt
    assert "-> nan_origin" not in v.dot  # no guessed edge
    start = v.me_node(ex.ORIGIN_NODE)
    assert start["incomingEdges"] == [] and "not linked" in start["label"]
    (typed,) = v.vdl_typed("NaN/Inf starts here")
    assert typed["input_nodes"] == []


def test_origin_inside_a_compiled_program(tmp_path):
    paddle.seed(0)
    run = _run(tmp_path, CompiledNet(), {s: [_batch(s, bad=3)] for s in (1, 2, 3)})
    v = Views(run, 3)
    o = v.graph.nonfinite.origin
    assert (o.op.rstrip("_"), o.layer, o.line, o.in_program) == ("sqrt", "block", line_of("program"), True)
    node = v.graph.node_by_key()[o.key]
    assert node.op == "sqrt_grad" and node.layer == "block"  # the program's own op carries the mark
    (marked,) = v.dot_nodes_with("starts here")
    assert _key_of_tooltip(marked) == o.key and 'color="#7b1fa2"' in marked
    said = f"first produced by op '{o.op}', inside a compiled program,"
    assert said in v.vdl_text and said in v.report_panel and said in summarize(v.graph)
    assert v.explorer.start == (v.gid, str(node.id)) and v.report_panel.count("starts here") == 1
    assert [n["attrs"]["key"] for n in v.vdl_typed("NaN/Inf starts here")] == [o.key]


def test_nan_made_only_in_the_backward(tmp_path):
    paddle.seed(0)
    run = _run(tmp_path, BackwardOnlyNet(), {s: [_batch(s, zero=(s == 3))] for s in (1, 2, 3)})
    v = Views(run, 3)
    rec = v.graph.nonfinite
    assert rec.origin.kind == "backward" and rec.first_gradient.op == "Sqrt"
    sqrt = v.graph.node_by_key()[rec.first_gradient.key]
    said = "NaN/Inf made in the backward"
    assert said in v.dot_title()
    assert v.dot_nodes_with("starts here") == [] and not any("starts here" in t for t in v.svg_texts())
    assert [_key_of_tooltip(s) for s in v.dot_nodes_with("first non-finite gradient")] == [sqrt.key]
    for text in (v.vdl_text, summarize(v.graph), v.report_panel):
        assert said in text and "first non-finite gradient at Sqrt" in text
    assert "starts here" not in v.report_panel, v.report_panel
    assert v.vdl_typed("NaN/Inf starts here") == []
    assert [n["attrs"]["key"] for n in v.vdl_attr("first non-finite gradient")] == [sqrt.key]
    assert v.explorer.start == (v.gid, str(sqrt.id)) and v.red() == [str(sqrt.id)]


def test_a_structure_change_is_the_same_change_everywhere(tmp_path, capsys):
    paddle.seed(0)

    def grow(net, step):
        net.extra = step >= 2

    run = _run(tmp_path, GrowingNet(), {s: [_batch(s)] for s in (1, 2)}, every=1, before=grow)
    v = Views(run, 2)
    change = "new ops: Exp in the model's own forward, Scale in the model's own forward"
    assert change in v.vdl_text and change in v.report_panel
    assert cli_main(["diff", str(run / "step_000001.json"), str(run / "step_000002.json")]) == 0
    assert change in capsys.readouterr().out
    new = sorted(str(n.id) for n in v.graph.nodes if n.op in ("Exp", "Scale"))
    assert sorted(v.overlays[ex.ADDED][v.gid]["results"]) == new
    for op in ("Exp", "Scale"):
        assert re.search(rf"added\s+{op} in the model's own forward", v.report_panel)
    # no NaN anywhere: nothing says where one starts
    assert v.graph.nonfinite is None or not v.graph.nonfinite.any
    assert "starts here" not in v.dot and "starts here" not in v.report_panel and v.explorer.start is None


def test_gradient_accumulation_micro_batches(tmp_path):
    paddle.seed(0)
    batches = {1: [_batch(1), _batch(11)], 2: [_batch(2), _batch(12, bad=12)]}
    run = _run(tmp_path, InLayerNet(), batches, every=10**6, micro_batches=2)
    v = Views(run, 2, "b2")
    assert v.graph.meta["backward"]["role"] == "micro-batch 2 of 2"
    assert_forward_origin(v, "sqrt", "block", line_of("sqrt"), in_graph=True, first_op="Sqrt")


class NormedNet(nn.Layer):
    """sqrt of a negative before a BatchNorm: this step's forward writes NaN into its running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.block = SqrtBlock()
        self.bn = nn.BatchNorm1D(H)
        self.head = nn.Linear(H, 2)

    def forward(self, x):
        return self.head(self.bn(self.block(x)))


def test_buffers_the_forward_wrote_are_not_called_weights(tmp_path):
    paddle.seed(0)
    run = _run(tmp_path, NormedNet(), {s: [_batch(s, bad=2)] for s in (1, 2)}, every=1)
    g = BackwardGraph.from_json((run / "step_000002.json").read_text())
    assert g.nonfinite.origin.op == "sqrt" and g.nonfinite.weights == ()  # no update ran: weights are finite
    assert set(g.nonfinite.buffers) == {"bn._mean", "bn._variance"}
    text = summarize(g)
    assert "NaN/Inf in 2 buffers the forward writes (running statistics; no update wrote them): " in text
    assert "in the weights" not in text


def test_long_titles_wrap_and_are_never_cut():
    from paddleviz_hooks.graph import Node
    from paddleviz_hooks.render import to_dot

    title = ("step 13 - trigger: nonfinite_loss - NaN/Inf starts at log in the model's own forward, "
             "tiny_transformer_with_a_long_name.py:18, on data that needs no gradient - "
             "collapsed to layer depth 4: 50 of 100 nodes (the SVG has every op)")
    dot = to_dot(BackwardGraph([Node(0, "root", "loss", "loss")]), title=title)
    label = re.search(r'^  label="(.*)"$', dot, re.M).group(1)
    def words(text):
        return text.replace(" - ", " ").split()

    assert words(label.replace("\\n", " ")) == words(title)  # every word kept, in order (parts start lines)
    assert all(len(line) <= 72 for line in label.split("\\n")) and label.count("\\n") >= 3


def test_a_graph_saved_before_the_record_reads_the_same():
    """A graph saved by an older version kept the origin in ``meta["nonfinite_origin"]``:
    its record is built from it (and from its gradients) and survives a JSON round trip."""
    from paddleviz_hooks.findings import record_of
    from paddleviz_hooks.graph import Edge, GradMeta, Node

    g = BackwardGraph([Node(0, "root", "loss", "loss"), Node(1, "op", "SqrtGradNode", "Sqrt", layer="block"),
                       Node(2, "param", "GradNodeAccumulation", "Parameter", param="block.w")],
                      [Edge(0, 1, grad=GradMeta((2,), "float32", 1.0)),
                       Edge(1, 2, grad=GradMeta((2,), "float32", float("nan"), nan=2))],
                      meta={"step": 3, "nonfinite_origin": {"kind": "forward", "op": "sqrt", "layer": "block",
                                                            "file": "/m.py", "line": 9, "key": None}})
    g.assign_keys()
    old = BackwardGraph.from_json(g.to_json())
    rec = record_of(old)
    assert (rec.origin.op, rec.origin.line, rec.first_gradient.op, rec.gradient_sites) == ("sqrt", 9, "Sqrt", 1)
    again = BackwardGraph.from_json(old.to_json())
    assert again.nonfinite == old.nonfinite and again.to_json() == old.to_json()  # lossless through JSON
    assert "NaN/Inf starts at sqrt in block, m.py:9" in to_dot_title(old)


def to_dot_title(g: BackwardGraph) -> str:
    from paddleviz_hooks.render import to_dot
    from paddleviz_hooks.text import graph_title

    dot = to_dot(g, title=graph_title(g))
    return re.search(r'^  label="(.*)"$', dot, re.M).group(1).replace("\\n", " ")


def test_a_parameter_whose_gradient_is_nan_is_red_in_every_view(tmp_path):
    """A NaN input makes the weights' gradients NaN, not the biases': the weight nodes are red
    like the ops that passed NaN on (DOT, the SVG the report shows, the explorer's overlay)."""
    from paddleviz_hooks import capture_backward
    from paddleviz_hooks.render import render_svg
    from paddleviz_hooks.render.dot import STYLE, to_dot
    paddle.seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    x = paddle.to_tensor(np.array([[1.0, np.nan, 2.0]], "float32"))
    with capture_backward(net) as cap:
        net(x).sum().backward()
    truth = {name: not np.isfinite(p.grad.numpy().astype("float64")).all() for name, p in net.named_parameters()}
    assert truth == {"0.weight": True, "0.bias": False, "1.weight": True, "1.bias": False}
    g = cap.graph
    ids = {n.param: n.id for n in g.nodes if n.kind == "param"}
    assert set(ids) == set(truth)
    red, green = STYLE["nonfinite"]["fillcolor"], STYLE["param"]["fillcolor"]
    dot = to_dot(g)
    svg = render_svg(g).decode()
    overlay = ex.export_explorer(g, str(tmp_path / "me"))
    results = next(iter(json.loads(Path(overlay.overlays[ex.NONFINITE]).read_text()).values()))["results"]
    for name, bad in truth.items():
        nid = ids[name]
        stmt = re.search(rf"^\s*n{nid} \[.*$", dot, re.M).group(0)
        assert f'fillcolor="{red if bad else green}"' in stmt, stmt
        node_svg = re.search(rf"<title>n{nid}</title>.*?</g>", svg, re.S).group(0)
        assert f'fill="{red if bad else green}"' in node_svg, node_svg
        assert (results.get(str(nid), {"value": 0})["value"] > 0) == bad, (name, results.get(str(nid)))



def test_the_first_nan_is_opened_and_listed_first_with_micro_batches(tmp_path):
    """The NaN starts in step 2's last micro-batch; the update then writes it into the weights,
    so step 3's first micro-batch is NaN too. Every view lists captures by (step, backward), and
    the explorer opens step 2, micro-batch 3, at the origin (not step 3, which came first when
    captures were grouped by which backward of their step they are)."""
    paddle.seed(0)
    net = InLayerNet()
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=net.parameters())
    with BackwardGraphRecorder(str(tmp_path / "log"), net, every=1, on_nonfinite=True, verbose=0,
                               formats=("json",), visualdl=False) as rec:
        for step in (1, 2, 3):
            with rec.step(step, micro_batches=3):
                for mb in (1, 2, 3):
                    x = _batch(10 * step + mb, bad=23)  # step 2, micro-batch 3
                    (net(paddle.to_tensor(x)).mean() / 3).backward()
            opt.step()
            opt.clear_grad()
    run = tmp_path / "log" / "backward_graph"
    bad = BackwardGraph.from_json((run / "step_000002_b3.json").read_text())
    assert bad.nonfinite.origin is not None and bad.nonfinite.origin.op == "sqrt"
    later = BackwardGraph.from_json((run / "step_000003.json").read_text())
    assert later.nonfinite_count() > 0  # the weights carry it on: a NaN, not the first one

    files = ex.export_explorer(str(tmp_path / "log"), str(tmp_path / "me"))
    first_two = [f"step {s} - micro-batch {b} of 3" for s in (1, 2) for b in (1, 2, 3)]
    shown = [g.split(": ", 1)[1] for g in files.graph_ids]
    assert [re.sub(r" b\d+ - ", " - ", g).replace(" - trigger: nonfinite_loss", "") for g in shown[:6]] == first_two
    assert all(g.startswith("step 3") for g in shown[6:]) and shown[6:], shown
    assert sorted(files.graph_ids) == files.graph_ids  # the page lists them by name: the same order
    gid, node = files.start
    assert "step 2" in gid and "micro-batch 3 of 3" in gid, files.start
    assert node == str(bad.node_by_key()[bad.nonfinite.origin.key].id)

    page = Path(build_report(str(run), str(tmp_path / "report.html"))).read_text()
    titles = [html.unescape(t) for t in re.findall(r"<h2>(.*?)</h2>", page)]
    assert titles[:6] == first_two and all(t.startswith("step 3") for t in titles[6:])
    sites = re.search(r'<ul class="sites">(.*?)</ul>', page, re.S).group(1)
    first_site = html.unescape(re.search(r'class="jump"[^>]*>(.*?)</button>', sites).group(1))
    assert first_site == "step 2 - micro-batch 3 of 3"
