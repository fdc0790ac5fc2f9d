"""Every op node knows the line of the user's code that made it (``Node.source``).

The oracle is the model file itself: each line of ``_source_model.py`` that
makes ops names them in a ``# ops:`` comment, and the code recorded must be
that line's text. Sources are recorded on captured steps only: Paddle's
call-stack flag is on for their forward and back to the user's value after,
and no dump folder is left behind.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import traceback

import paddle
import pytest

import _source_model as M
from _browser import CHROMIUM, launch_chromium
from paddleviz_hooks import BackwardGraph, BackwardGraphRecorder, capture_backward, collapse_graph, summarize
from paddleviz_hooks.graph import Node, SourceFrame
from paddleviz_hooks.hazards import PROGRAM_OP_NOTE
from paddleviz_hooks.render import to_dot
from paddleviz_hooks.render.engine import find_engine
from paddleviz_hooks.sinks.explorer import explorer_graph
from paddleviz_hooks.sinks.report import build_report
from paddleviz_hooks.sinks.vdl_graph import vdl_graph
from paddleviz_hooks.text import node_tooltip

FLAG = "FLAGS_call_stack_level"
STDLIB_FORMAT_STACK = traceback.format_stack
MODEL_FILE = os.path.abspath(M.__file__.replace(".pyc", ".py"))


@pytest.fixture(autouse=True)
def _own_tempdir(tmp_path, monkeypatch):
    """Dump folders go to this test's own folder: other processes' never count."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def _flag() -> int:
    return int(paddle.get_flags(FLAG)[FLAG])


def _dumps() -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), "pvh-stacks-*"))


def _capture(**kw):
    paddle.seed(0)
    net = M.Net()
    x = paddle.randn([3, 6])
    with capture_backward(net, **kw) as cap:
        M.loss_of(net, x).backward()  # the outermost user frame
    return net, cap.graph


def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as fh:
        return fh.read().splitlines()


RECOMPUTE_CALL = next(i for i, line in enumerate(_lines(MODEL_FILE), 1) if "recompute(self.block" in line)


def test_every_op_records_its_line_outermost_first():
    before = _flag()
    _, g = _capture()
    assert _flag() == before and not _dumps()
    marks = M.marked_lines()
    text = _lines(MODEL_FILE)
    this = os.path.abspath(__file__)
    ops = [n for n in g.nodes if n.kind == "op"]
    assert len(ops) == 13
    for n in ops:
        assert n.source and n.source_note is None, n
        inner = n.source[-1]
        assert os.path.abspath(inner.file) == MODEL_FILE, n
        assert n.op in marks[inner.line], (n.op, inner)  # the line that made it
        assert inner.code == text[inner.line - 1].strip()
        # outermost first: this test, _capture, loss_of, then inward; no Paddle, pytest or stdlib frame
        assert os.path.abspath(n.source[0].file) == this
        assert [f.function for f in n.source[:3]] == [test_every_op_records_its_line_outermost_first.__name__,
                                                      "_capture", "loss_of"]
        assert all(os.path.abspath(f.file) in (this, MODEL_FILE) for f in n.source)
    by = {(n.op, n.layer): n for n in ops}
    # inside a layer, in a helper called by a layer, in the top-level forward
    assert by[("Matmul", "inner.fc")].source[-1].function == "forward"
    assert [f.function for f in by[("Tanh", "inner")].source[-2:]] == ["forward", "squash"]
    assert by[("Sin", "")].source[-1].line == next(i for i, o in marks.items() if "Sin" in o and "Exp" not in o)
    # a recomputed block (made again inside the backward): called from the recompute line
    pylayer = by[("PyLayer:RecomputeFunction", "block")]
    assert pylayer.source[-1].line == RECOMPUTE_CALL
    recomputed = [n for n in ops if n.layer is not None and n.layer.startswith("block") and n is not pylayer]
    assert len(recomputed) == 4
    for n in recomputed:
        assert n.source[-2].line == RECOMPUTE_CALL and n.source[-1].function == "forward", n.source
        assert [f.function for f in n.source[1:3]] == ["_capture", "loss_of"]


def test_sources_survive_json_compactly():
    _, g = _capture()
    d = json.loads(g.to_json())
    table = d["frames"]
    assert len(table) == len({tuple(f) for f in table})  # unique frames
    assert all(isinstance(i, int) for n in d["nodes"] if n.get("source") for i in n["source"])
    assert not any("source" in n for n in d["nodes"] if n["kind"] != "op")
    back = BackwardGraph.from_json(g.to_json())
    assert back == g
    assert all(isinstance(f, SourceFrame) for n in back.nodes for f in (n.source or ()))
    with pytest.raises(ValueError, match="malformed"):
        BackwardGraph.from_dict({**d, "frames": []})


def test_sources_off_records_nothing_and_never_sets_the_flag():
    seen = []
    orig = paddle.set_flags
    paddle.set_flags = lambda f: (seen.append(dict(f)), orig(f))[1]
    try:
        _, g = _capture(sources=False)
    finally:
        paddle.set_flags = orig
    assert not any(FLAG in f for f in seen)
    assert all(n.source is None and n.source_note is None for n in g.nodes)
    assert "frames" not in json.loads(g.to_json())


class _FlagProbe(paddle.nn.Layer):
    """Notes Paddle's call-stack flag while its forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = paddle.nn.Linear(6, 6)
        self.seen: list[int] = []

    def forward(self, x):
        self.seen.append(_flag())
        return paddle.tanh(self.fc(x))


@pytest.mark.parametrize("watch", [False, True])
def test_recorder_records_captured_steps_only(tmp_path, watch):
    """Steps 1 and 3 captured: their forwards ran with the flag on, steps 2 and 4 with the user's
    value; with a trigger watch (active on every step) too. The graph files carry the lines."""
    paddle.seed(0)
    net = _FlagProbe()
    before = _flag()
    kw = {"on_structure_change": True} if watch else {}
    with BackwardGraphRecorder(str(tmp_path), net, steps=[1, 3], capture_first=False, formats=("json",),
                               visualdl=False, verbose=0, **kw) as rec:
        for step in range(1, 5):
            with rec.step(step):
                net(paddle.randn([2, 6])).mean().backward()
            assert _flag() == before
    assert net.seen == [3, before, 3, before]
    assert rec.captured_steps == [1, 3]
    g = BackwardGraph.from_json((tmp_path / "backward_graph" / "step_000003.json").read_text())
    tanh = next(n for n in g.nodes if n.op == "Tanh")
    assert tanh.source[-1].code == "return paddle.tanh(self.fc(x))"
    assert tanh.source[-2].code == "net(paddle.randn([2, 6])).mean().backward()"
    assert not _dumps()


def test_a_trigger_capture_says_the_line_was_not_recorded(tmp_path):
    """A structure change is only known at the backward: that forward ran unrecorded."""
    paddle.seed(0)
    net = _FlagProbe()
    with BackwardGraphRecorder(str(tmp_path), net, steps=[1], capture_first=False, formats=("json",),
                               visualdl=False, verbose=0, on_structure_change=True, cooldown=1) as rec:
        for step in range(1, 4):
            with rec.step(step):
                out = net(paddle.randn([2, 6]))
                (out.exp() if step == 3 else out).mean().backward()
    assert rec.triggers.get(3) == "structure_change", rec.triggers
    g = BackwardGraph.from_json((tmp_path / "backward_graph" / "step_000003.json").read_text())
    ops = [n for n in g.nodes if n.kind == "op"]
    assert ops and all(n.source is None and n.source_note == "unrecorded" for n in ops)
    assert "not recorded" in node_tooltip(ops[0])


def test_ops_inside_a_to_static_program_say_so():
    paddle.seed(0)
    net = _FlagProbe()
    static = paddle.jit.to_static(net, full_graph=True)
    x = paddle.randn([2, 6])
    static(x)  # compiled outside the capture
    with capture_backward(net) as cap:
        static(x).mean().backward()
    g = cap.graph
    program = [n for n in g.nodes if n.note == PROGRAM_OP_NOTE]
    assert program and all(n.source is None and n.source_note == "static" for n in program)
    mean = next(n for n in g.nodes if n.op == "Mean")  # an eager op after the program has its line
    assert mean.source[-1].code == "static(x).mean().backward()"
    assert "to_static program" in node_tooltip(program[0])


def test_every_view_shows_the_line():
    _, g = _capture()
    tanh = next(n for n in g.nodes if n.op == "Tanh")
    line = f"{MODEL_FILE}:{tanh.source[-1].line} in squash: h = paddle.tanh(h)"
    assert "line: " + line in node_tooltip(tanh)
    dot = to_dot(g)
    assert "_source_model.py:" in dot and "h = paddle.tanh(h)" in dot
    ex = explorer_graph(g, "g")
    attrs = {a["key"]: a["value"] for a in next(n for n in ex["nodes"] if n["id"] == str(tanh.id))["attrs"]}
    assert attrs["source"].startswith(f"_source_model.py:{tanh.source[-1].line}: h = paddle.tanh(h)")
    assert attrs["source file"] == f"{MODEL_FILE}:{tanh.source[-1].line} in squash"
    vdl = vdl_graph(g)
    assert any(n["attrs"].get("source", "").endswith("h = paddle.tanh(h)  # ops: Tanh") for n in vdl["nodes"])
    if find_engine() is not None:  # the notebook drawing keeps the tooltips through its sanitiser
        from paddleviz_hooks.notebook import svg_of

        svg = svg_of(g)
        assert f"_source_model.py:{tanh.source[-1].line} in squash: h = paddle.tanh(h)" in svg


def test_summary_names_the_line_of_the_first_nan():
    paddle.seed(0)
    net = M.Net()
    x = paddle.randn([3, 6])
    x[0, 0] = float("nan")
    with capture_backward(net) as cap:
        M.loss_of(net, x).backward()
    s = summarize(cap.graph)
    first = cap.graph.nonfinite_sites()[0]
    assert "first non-finite gradient at " in s and f"(_source_model.py:{first.source[-1].line}: " in s


def test_collapse_by_source_groups_ops_by_function():
    _, g = _capture()
    c = collapse_graph(g, by="source")
    boxes = {(n.layer, n.call): n for n in c.nodes if n.kind == "layer"}
    assert boxes[("squash", 0)].ops == 2 and boxes[("loss_of", 0)].ops == 1
    assert boxes[("squash", 0)].name == "def in _source_model.py"
    # three calls of a function named forward: Net's, Inner's (from line 52), Recomputed's (from the recompute)
    assert sorted(n.ops for (p, _), n in boxes.items() if p == "forward") == [2, 4, 4]
    assert sum(n.ops for n in boxes.values()) == sum(1 for n in g.nodes if n.kind == "op")
    assert c.meta["collapse"]["by"] == "source"
    with pytest.raises(ValueError, match="by must be"):
        collapse_graph(g, by="file")


def test_unknown_reasons_are_worded():
    n = Node(1, "op", "XGradNode", "X", source_note="internal")
    assert "made inside Paddle" in node_tooltip(n)


@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's Chromium at /usr/bin/chromium")
@pytest.mark.skipif(find_engine() is None, reason="no Graphviz layout engine installed")
def test_clicking_a_node_in_the_report_shows_its_line(tmp_path):
    from playwright.sync_api import sync_playwright

    _, g = _capture()
    g.meta["step"] = 1
    run = tmp_path / "log" / "backward_graph"
    run.mkdir(parents=True)
    (run / "step_000001.json").write_text(g.to_json())
    out = tmp_path / "report.html"
    build_report(str(tmp_path / "log"), str(out))
    tanh = next(n for n in g.nodes if n.op == "Tanh")
    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(out.as_uri())
            page.wait_for_selector("#stage svg")
            assert page.locator("#node-info").is_hidden()
            node = page.locator("#stage g.node").filter(has_text="Tanh").first
            node.click()
            info = page.locator("#node-info")
            assert info.is_visible()
            lines = [x.replace("\xa0", " ") for x in info.locator("li").all_inner_texts()]  # Graphviz keeps double spaces as nbsp
            assert f"line: {MODEL_FILE}:{tanh.source[-1].line} in squash: h = paddle.tanh(h)  # ops: Tanh" in lines
            assert any(x.startswith("called from: ") and ":30 in forward: return squash(h)" in x for x in lines)
            page.screenshot(path=str(tmp_path / "clicked.png"))
            # a drag is no click: the panel keeps the clicked node
            box = page.locator("#stage g.node").filter(has_text="Sin").first.bounding_box()
            page.mouse.move(box["x"] + 5, box["y"] + 5)
            page.mouse.down()
            page.mouse.move(box["x"] + 80, box["y"] + 60)
            page.mouse.up()
            assert any("squash" in x for x in info.locator("li").all_inner_texts())
            assert not errors
        finally:
            browser.close()
    shutil.copy(tmp_path / "clicked.png", os.environ.get("PVH_SHOT", str(tmp_path / "keep.png")))


def test_flag_and_dump_folder_restored_on_errors_and_interrupts():
    before = _flag()
    paddle.seed(0)
    net = M.Net()
    x = paddle.randn([3, 6])
    with pytest.raises(ZeroDivisionError):
        with capture_backward(net):
            net(x)
            assert _flag() == 3
            1 / 0  # an error in the user's forward
    assert _flag() == before

    def stop(grad):
        raise KeyboardInterrupt

    with pytest.raises((KeyboardInterrupt, OSError)):  # Paddle turns it into an OSError
        with capture_backward(net):
            h = net.inner(x)
            h.register_hook(stop)  # Ctrl-C in the middle of the backward
            (h * 2).sum().backward()
    assert _flag() == before and not _dumps()
    assert traceback.format_stack is STDLIB_FORMAT_STACK  # put back with the flag
    # the same model afterwards: captured normally
    _, g = _capture()
    assert all(n.source for n in g.nodes if n.kind == "op")


def test_a_forward_run_before_the_block_is_said_unrecorded():
    paddle.seed(0)
    net = M.Net()
    loss = M.loss_of(net, paddle.randn([3, 6]))  # before the capture: Paddle kept no stack
    # (the recomputed block is made again inside the backward, in the block: those lines are known)
    with capture_backward(net) as cap:
        loss.backward()
    ops = [n for n in cap.graph.nodes if n.kind == "op"]
    made_again = [n for n in ops if n.layer in ("block", "block.lin") and not n.op.startswith("PyLayer")]
    assert len(made_again) == 4 and all(n.source[-1].function == "forward" for n in made_again)
    assert all(n.source is None and n.source_note == "unrecorded" for n in ops if n not in made_again)


def test_ops_paddle_keeps_no_stack_for_have_their_line_too():
    """Conv2d and add_n grad nodes carry no stack in Paddle 3.3: their entry points are
    wrapped while the flag is on (and put back with it)."""
    from paddle import _C_ops

    before = (_C_ops.conv2d, _C_ops.add_n)
    paddle.seed(0)
    net = M.Convs()
    with capture_backward(net) as cap:
        net(paddle.randn([1, 2, 4, 4])).mean().backward()
    assert (_C_ops.conv2d, _C_ops.add_n) == before
    marks = M.marked_lines()
    ops = [n for n in cap.graph.nodes if n.kind == "op" and n.op != "Mean"]
    assert {"Conv2d", "AddN"} <= {n.op for n in ops}
    for n in ops:
        assert n.source and n.op in marks[n.source[-1].line], n


def test_sources_with_saved_memory_leave_every_op_as_paddle_had_it():
    """saved_memory wraps every _C_ops function as well: both come and go in any order."""
    from paddle import _C_ops

    before = {n: getattr(_C_ops, n) for n in ("conv2d", "add_n", "matmul")}
    paddle.seed(0)
    net = M.Convs()
    for _ in range(2):  # a second forward after the first backward re-arms both
        with capture_backward(net, saved_memory=True) as cap:
            net(paddle.randn([1, 2, 4, 4])).mean().backward()
            net(paddle.randn([1, 2, 4, 4])).mean().backward()
        assert {n: getattr(_C_ops, n) for n in before} == before
    conv = next(n for n in cap.graph.nodes if n.op == "Conv2d")
    assert conv.source and conv.saved_bytes > 0


def test_no_call_stack_is_formatted_once_the_backward_starts(monkeypatch):
    """The forward is over when a backward starts: the capture puts Paddle's flag back before
    it registers its gradient hooks, each of which Paddle would otherwise give a formatted
    call stack (about 40 ms a step for the 3,585 parameter hooks of a 224-layer encoder)."""
    from paddleviz_hooks.capture import BackwardCapture, source

    formatted: list[int] = []
    original = source._format_stack

    def counting(*args, **kwargs):
        formatted.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(source, "_format_stack", counting)  # what arm() puts in traceback's place
    at_start: list[int] = []

    def when(roots, walk):  # asked when the backward starts, before the hooks go in
        at_start.append(len(formatted))
        return "test"

    paddle.seed(0)
    net = paddle.nn.Sequential(*[paddle.nn.Linear(6, 6) for _ in range(8)])
    with BackwardCapture(net, when=when) as cap:
        net(paddle.randn([3, 6])).mean().backward()
    assert at_start and at_start[0] > 0  # the forward's ops had their stacks formatted
    assert len(formatted) == at_start[0]  # and nothing after it
    assert all(n.source for n in cap.graph.nodes if n.kind == "op")
    assert sum(n.kind == "param" for n in cap.graph.nodes) == 16


def _logged_stacks(folder) -> list[list[SourceFrame]]:
    from paddleviz_hooks.capture.source import parse_call_stacks

    logs = glob.glob(os.path.join(str(folder), "*_call_stack.log"))
    assert logs
    stacks: list[list[SourceFrame]] = []
    for log in logs:
        with open(log, encoding="utf-8") as fh:
            stacks += [s for s in parse_call_stacks(fh.read()).values() if s]
    return stacks


def test_paddle_keeps_only_the_frames_a_source_can_show(tmp_path):
    """The stack text Paddle stores on each grad node (and writes in its dump) leaves out
    Paddle's and the standard library's frames, which no Node.source shows: on a
    2,900-layer model it was most of the dump. The user's frames, installed packages'
    (pytest's here: the launcher) and this package's (a recomputed forward) stay."""
    paddle.seed(0)
    net = M.Net()
    x = paddle.randn([3, 6])
    dump = tmp_path / "own_dump"
    dump.mkdir()
    with capture_backward(net):  # the user's own dump path: Paddle writes there what it kept
        M.loss_of(net, x).backward(dump_backward_graph_path=str(dump))
    stacks = _logged_stacks(dump)
    files = {os.path.abspath(f.file) for s in stacks for f in s}
    paddle_dir = os.path.dirname(os.path.abspath(paddle.__file__)) + os.sep
    stdlib = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
    internal = [f for f in files if f.startswith(paddle_dir) or f.startswith("<frozen ")
                or (f.startswith(stdlib) and not any(d in f for d in ("site-packages", "dist-packages")))]
    assert not internal, internal
    assert MODEL_FILE in files and os.path.abspath(__file__) in files
    assert any(os.sep + "_pytest" + os.sep in f for f in files)  # a launcher's frames are kept
    # the sources are what they were: every op's own line, outermost first, with the test's frames
    _, g = _capture()
    marks = M.marked_lines()
    for n in (n for n in g.nodes if n.kind == "op"):
        assert n.source_note is None and n.op in marks[n.source[-1].line], n
        assert [f.function for f in n.source[:3]] == ["test_paddle_keeps_only_the_frames_a_source_can_show",
                                                      "_capture", "loss_of"]


class _StackReader(paddle.nn.Layer):
    """Calls traceback.format_stack itself in the middle of a captured forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = paddle.nn.Linear(6, 6)
        self.seen: list[list[str]] = []

    def forward(self, x):
        h = self.fc(x)
        self.seen.append(traceback.format_stack())
        return paddle.tanh(h)


def test_a_python_caller_of_format_stack_still_gets_every_frame():
    """Only Paddle's calls are given the short stack: the user's own call of
    traceback.format_stack, while a capture has it patched, gets every frame, one string each."""
    paddle.seed(0)
    net = _StackReader()
    with capture_backward(net) as cap:
        net(paddle.randn([2, 6])).mean().backward()
    seen = net.seen[-1]
    expected = traceback.extract_stack()  # this test's own frames, then the forward's
    assert len(seen) > len(expected) and all(s.startswith('  File "') for s in seen)
    assert any("paddle" + os.sep + "nn" + os.sep + "layer" + os.sep + "layers.py" in s for s in seen)
    assert [s.split("\n")[0] for s in seen[:len(expected) - 1]] == [
        f'  File "{f.filename}", line {f.lineno}, in {f.name}' for f in expected[:-1]]
    assert seen[-1].split("\n")[1].strip() == "self.seen.append(traceback.format_stack())"
    assert next(n for n in cap.graph.nodes if n.op == "Tanh").source[-1].code == "return paddle.tanh(h)"


def test_the_call_stack_flag_is_off_between_a_backward_and_the_next_forward():
    """After a backward the flag goes on again when the layer's next forward begins, not at once:
    the optimizer's update in between ran with it on (Paddle formats a stack for each of its ops,
    and a Ctrl-C landing there can crash Paddle). Ops of the next micro-batch, the loss's included,
    still get their lines."""
    flag = "FLAGS_call_stack_level"
    before = paddle.get_flags(flag)[flag]
    net = paddle.nn.Sequential(paddle.nn.Linear(4, 4), paddle.nn.Tanh(), paddle.nn.Linear(4, 1))
    opt = paddle.optimizer.Adam(parameters=net.parameters())
    seen = []
    with capture_backward(net) as cap:
        for _ in range(2):
            loss = (net(paddle.randn([3, 4])) ** 2).mean()
            seen.append(paddle.get_flags(flag)[flag])
            loss.backward()
            seen.append(paddle.get_flags(flag)[flag])
            opt.step()
            opt.clear_grad()
    assert seen == [3, before, 3, before]
    assert paddle.get_flags(flag)[flag] == before
    for g in cap.graphs:
        ops = [n for n in g.nodes if n.kind == "op"]
        assert ops and all(n.source is not None for n in ops), [(n.op, n.source_note) for n in ops]


def test_ops_of_paddles_own_models_get_the_models_lines():
    """paddle.vision.models.LeNet and nn.TransformerEncoder are model code written by Paddle:
    an op made in them gets its line there (``x = self.fc(x)`` in lenet.py), as a model
    library's ops do, after the user's line that ran the model. Before, every op of such a model
    had the same source, the user's call of the model (under Model.fit, the fit line)."""
    paddle.seed(0)
    lenet = paddle.vision.models.LeNet()
    enc = paddle.nn.TransformerEncoder(paddle.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), 1)
    with capture_backward(lenet) as a:
        lenet(paddle.randn([2, 1, 28, 28])).mean().backward()
    with capture_backward(enc) as b:
        enc(paddle.randn([2, 3, 8])).mean().backward()
    for g, file in ((a.graph, "lenet.py"), (b.graph, "transformer.py")):
        inside = [n for n in g.nodes if n.kind == "op" and n.layer]
        assert inside
        for n in inside:
            assert os.path.basename(n.source[-1].file) == file and n.source[-1].code, n
            assert os.path.abspath(n.source[0].file) == os.path.abspath(__file__)  # the user's line first
    lines = {n.source[-1].code for n in a.graph.nodes if n.kind == "op" and n.layer}
    assert len(lines) > 1  # not one line for every op
