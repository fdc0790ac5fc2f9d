"""Model Explorer export (issue 21): real captures, parsed strictly by Model Explorer's own dataclasses.

Every export is checked against ``model_explorer.graph_builder.GraphCollection``
and every overlay against ``model_explorer.node_data_builder.GraphNodeData``
with ``dacite`` in strict mode (an unknown or mistyped field fails), and
against the capture itself: the same edges, every parameter that got a
gradient named, norms equal to ``param.grad``.
"""

from __future__ import annotations

import pathlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import urllib.parse
import urllib.request

import numpy as np
import paddle
import paddle.nn as nn
import pytest

from paddleviz_hooks import capture_backward
from paddleviz_hooks.diff import diff_graphs
from paddleviz_hooks.graph import BackwardGraph, Edge, GradMeta, Node
from paddleviz_hooks.sinks import explorer as ex
from _browser import CHROMIUM, launch_chromium

dacite = pytest.importorskip("dacite")
graph_builder = pytest.importorskip("model_explorer.graph_builder")
node_data_builder = pytest.importorskip("model_explorer.node_data_builder")
STRICT = dacite.Config(strict=True)


def load_export(files: ex.ExplorerExport) -> tuple[dict, dict[str, dict]]:
    """The collection and the overlays, each parsed strictly by Model Explorer's dataclasses."""
    with open(files.graphs) as f:
        collection = json.load(f)
    dacite.from_dict(graph_builder.GraphCollection, collection, config=STRICT)
    overlays = {}
    for stem, path in files.overlays.items():
        with open(path) as f:
            data = json.load(f)
        for graph_data in data.values():
            dacite.from_dict(node_data_builder.GraphNodeData, graph_data, config=STRICT)
        overlays[stem] = data
    return collection, overlays


def attrs(node: dict) -> dict[str, str]:
    return {a["key"]: a["value"] for a in node["attrs"]}


def check_against_capture(me_graph: dict, g: BackwardGraph) -> None:
    """Same nodes and edges as the capture; no edge points at a missing node."""
    ids = [n["id"] for n in me_graph["nodes"]]
    assert ids == [str(n.id) for n in g.nodes]
    edges = sorted((int(e["sourceNodeId"]), int(n["id"]), int(e["sourceNodeOutputId"]))
                   for n in me_graph["nodes"] for e in n["incomingEdges"])
    assert edges == sorted((e.src, e.dst, e.slot) for e in g.edges)
    for n in me_graph["nodes"]:
        outs = [m["id"] for m in n["outputsMetadata"]]
        assert len(outs) == len(set(outs)), n  # one output per slot


def capture_one(net: nn.Layer, *inputs) -> tuple[BackwardGraph, dict[str, np.ndarray]]:
    with capture_backward(net) as cap:
        out = net(*inputs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.mean().backward()
    grads = {name: p.grad.numpy().astype(np.float64) for name, p in net.named_parameters() if p.grad is not None}
    return cap.graphs[0], grads


def resnet():
    paddle.seed(0)
    net = paddle.vision.models.resnet18(num_classes=4)
    return net, (paddle.randn([2, 3, 32, 32]),)


def encoder():
    paddle.seed(0)
    net = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 2)
    return net, (paddle.randn([2, 5, 16]),)


def lstm():
    paddle.seed(0)
    net = nn.LSTM(4, 8, num_layers=2)
    return net, (paddle.randn([2, 3, 4]),)


@pytest.mark.parametrize("build", [resnet, encoder, lstm])
def test_real_captures_parse_strictly_and_match(build, tmp_path):
    net, inputs = build()
    g, grads = capture_one(net, *inputs)
    files = ex.export_explorer(g, str(tmp_path))
    collection, overlays = load_export(files)
    (me_graph,) = collection["graphs"]
    check_against_capture(me_graph, g)

    # every parameter that got a gradient appears under its own name
    named = {attrs(n).get("parameter"): n for n in me_graph["nodes"] if attrs(n)["kind"] == "param"}
    assert set(named) == set(grads)
    assert grads, "the model got no gradient"

    # the norm overlay is log10 of the real gradient norm, parameter by parameter
    assert list(overlays)[:2] == [ex.GRAD_NORM, ex.NONFINITE]  # no NaN: the norm comes first
    assert files.start is None
    norm = overlays[ex.GRAD_NORM][files.graph_ids[0]]["results"]
    for name, grad in grads.items():
        want = float(np.sqrt(np.sum(grad * grad)))
        node = named[name]
        assert float(attrs(node)["grad norm"]) == pytest.approx(want, rel=1e-5), name
        if want > 0:
            assert 10 ** norm[node["id"]]["value"] == pytest.approx(want, rel=1e-5), name
        else:
            assert node["id"] not in norm  # log10(0): not coloured, never a made-up value
    nan = overlays[ex.NONFINITE][files.graph_ids[0]]["results"]
    assert nan and all(r["value"] == 0 and "bgColor" not in r for r in nan.values())


def test_namespaces_are_layer_calls_and_parameters_sit_in_their_layers(tmp_path):
    net, inputs = resnet()
    g, _ = capture_one(net, *inputs)
    me_graph = ex.explorer_graph(g, "step 1")
    spaces = {n["namespace"] for n in me_graph["nodes"]}
    # BasicBlock calls its relu twice: two boxes, calls kept apart
    assert {"layer1/0/relu (call 1 of 2)", "layer1/0/relu (call 2 of 2)"} <= spaces
    assert "layer2/0/downsample/0" in spaces
    by_param = {attrs(n).get("parameter"): n for n in me_graph["nodes"]}
    w = by_param["layer1.0.conv1.weight"]
    assert (w["namespace"], w["label"]) == ("layer1/0/conv1", "weight")
    for n in me_graph["nodes"]:
        node = g.nodes[int(n["id"])]
        if node.kind == "op" and node.layer:
            assert n["namespace"].split("/")[0].split(" ")[0] == node.layer.split(".")[0]
        elif node.kind in ("root", "input") or (node.kind == "op" and not node.layer):
            assert n["namespace"] == ""


def test_a_layer_called_three_times(tmp_path):
    class Block(nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(paddle.tanh(self.fc(paddle.tanh(self.fc(x)))))

    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.blk = Block()

        def forward(self, x):
            return self.blk(x)

    paddle.seed(0)
    net = Net()
    g, grads = capture_one(net, paddle.randn([2, 4]))
    me_graph = ex.explorer_graph(g, "step 1")
    spaces = {n["namespace"] for n in me_graph["nodes"]}
    assert {f"blk/fc (call {k} of 3)" for k in (1, 2, 3)} <= spaces
    layers = {attrs(n)["layer"] for n in me_graph["nodes"] if attrs(n)["kind"] == "op" and n["namespace"].startswith("blk/")}
    assert layers == {f"blk.fc (call {k} of 3)" for k in (1, 2, 3)}
    # the weight serves all three calls: it sits in blk, named relative to it
    params = {attrs(n)["parameter"]: (n["namespace"], n["label"]) for n in me_graph["nodes"] if attrs(n)["kind"] == "param"}
    assert params == {"blk.fc.weight": ("blk", "fc.weight"), "blk.fc.bias": ("blk", "fc.bias")}
    assert me_graph["groupNodeAttributes"]["blk/fc (call 2 of 3)"]["call"] == "2 of 3"


def nan_net():
    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.Tanh()

        def forward(self, x, scale, extra=False):
            h = self.act(self.fc(x))
            if extra:
                h = h * 2.0
            return paddle.log(paddle.abs(h) * scale).mean()

    paddle.seed(0)
    return Net()


def test_nan_origin_change_and_new_overlays(tmp_path):
    net = nan_net()
    x = paddle.randn([2, 4])
    with capture_backward(net) as cap:
        net(x, 1.0).backward()
        net(x, 0.0, extra=True).backward()  # log(0): NaN/Inf from Log, and one op more
    old, new = cap.graphs
    files = ex.export_explorer([old, new], str(tmp_path))
    collection, overlays = load_export(files)
    for me_graph, g in zip(collection["graphs"], (old, new)):
        check_against_capture(me_graph, g)
    assert files.graph_ids == ["capture 1 - backward 1 of 2", "capture 2 - backward 2 of 2"]
    assert files.start == (files.graph_ids[1], str(new.nonfinite_sites()[0].id))  # the page opens at the origin
    assert list(overlays)[:2] == [ex.NONFINITE, ex.GRAD_NORM]  # a NaN: its overlay comes first

    first, second = files.graph_ids
    origin = new.nonfinite_sites()[0]
    assert origin.op == "Log"
    nan = overlays[ex.NONFINITE][second]["results"]
    red = [nid for nid, r in nan.items() if r.get("bgColor") == ex._ORIGIN_RED]
    assert red == [str(origin.id)]
    assert nan[str(origin.id)]["value"] == sum(e.grad.nonfinite for e in new.edges if e.src == origin.id) > 0
    me_origin = collection["graphs"][1]["nodes"][origin.id]
    assert attrs(me_origin)["first non-finite gradient"].startswith("yes")  # no replay: no origin
    assert not any(r.get("bgColor") for r in overlays[ex.NONFINITE][first]["results"].values())

    d = diff_graphs(old, new)
    added = overlays[ex.ADDED][second]["results"]
    assert sorted(added) == sorted(str(n.id) for n in new.nodes if n.key in d.added_nodes)
    assert [new.nodes[int(i)].op for i in added] == ["Scale"]
    assert first not in overlays[ex.ADDED] and first not in overlays[ex.NORM_CHANGE]
    change = overlays[ex.NORM_CHANGE][second]["results"]
    by_key = {n.key: n.id for n in new.nodes}
    assert change and all(
        10 ** change[str(by_key[k])]["value"] == pytest.approx(r, rel=1e-9)
        for k, r in d.node_norm_ratios.items() if r > 0 and math.isfinite(r))


def test_not_observed_and_saved_bytes(tmp_path):
    g = BackwardGraph(
        [Node(0, "root", "loss", "loss"), Node(1, "op", "FooGradNode", "Foo", layer="blk", note="no hook"),
         Node(2, "param", "GradNodeAccumulation", "Parameter", param="blk.w", shape=(2,), dtype="float32",
              grad=GradMeta((2,), "float32", 3.0, -2.0, 2.0))],
        [Edge(0, 1, grad=GradMeta((), "float32", 1.0, 1.0, 1.0)), Edge(1, 2)],
        layers={"": "Net", "blk": "Block"}, meta={"step": 7})
    g.assign_keys()
    g.nodes[1].saved_bytes = 4096  # what a capture that measures saved tensors records
    g.meta["saved_memory"] = {"total_bytes": 4096}
    files = ex.export_explorer(g, str(tmp_path))
    collection, overlays = load_export(files)
    foo = collection["graphs"][0]["nodes"][1]
    assert foo["label"] == "Foo (not observed)"
    assert foo["outputsMetadata"][0]["attrs"][-1] == {"key": "gradient", "value": "not observed"}
    assert attrs(foo)["saved for backward (bytes)"] == "4096"
    assert overlays[ex.SAVED]["step 7"]["results"] == {"1": {"value": 4096}}
    assert ex.SAVED not in ex.explorer_overlays([("a", BackwardGraph([Node(0, "root", "loss")]), None)])


def test_log_dir_runs_sort_by_step(tmp_path):
    g = BackwardGraph([Node(0, "root", "loss"), Node(1, "op", "ExpGradNode", "Exp")], [Edge(0, 1)])
    for run in ("a", "b"):
        for step in (2, 10):
            d = tmp_path / "log" / run
            d.mkdir(parents=True, exist_ok=True)
            g.meta = {"step": step, "trigger": "nonfinite_loss" if step == 10 else "scheduled"}
            (d / f"step_{step:06d}.json").write_text(g.to_json())
    (tmp_path / "log" / "a" / "step_000011.json").write_text("not json")  # skipped, not fatal
    files = ex.export_explorer(str(tmp_path / "log"), str(tmp_path / "out"))
    assert files.graph_ids == ["a: step 02", "a: step 10 - trigger: nonfinite_loss",
                               "b: step 02", "b: step 10 - trigger: nonfinite_loss"]
    collection, overlays = load_export(files)
    assert collection["graphSorting"] == "name_asc"
    assert sorted(files.graph_ids) == files.graph_ids  # the page sorts ids as text
    # each run is compared with its own previous capture only
    assert sorted(overlays[ex.ADDED]) == ["a: step 10 - trigger: nonfinite_loss", "b: step 10 - trigger: nonfinite_loss"]


def test_bad_input_is_refused_clearly(tmp_path):
    from paddleviz_hooks.cli import main
    from paddleviz_hooks.explore import explore

    with pytest.raises(TypeError, match="got int"):
        ex.export_explorer(42, str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        ex.export_explorer(str(tmp_path / "nope"), str(tmp_path))
    with pytest.raises(TypeError, match="port must be an int"):
        explore(str(tmp_path), port="8080")
    with pytest.raises(ValueError, match="between 0 and 65535"):
        explore(str(tmp_path), port=70000)
    assert main(["explore", str(tmp_path / "nope")]) == 1
    g = BackwardGraph([Node(0, "root", "loss")])
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "model_explorer", None)  # as if the extra were not installed
        with pytest.raises(ImportError, match=r"paddleviz-hooks\[explorer\]"):
            explore(g, out_dir=str(tmp_path / "m"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        g = BackwardGraph([Node(0, "root", "loss")])
        with pytest.raises(ValueError, match="cannot listen"):
            explore(g, port=taken, out_dir=str(tmp_path / "o"))


def test_explore_returns_at_once_and_serves_offline(tmp_path, monkeypatch, capsys):
    from paddleviz_hooks.explore import explore

    g = BackwardGraph([Node(0, "root", "loss"), Node(1, "op", "ExpGradNode", "Exp")], [Edge(0, 1)],
                      meta={"step": 1})
    # any https request of the server (its PyPI version check) would reach this socket
    proxy = socket.socket()
    proxy.bind(("127.0.0.1", 0))
    proxy.listen()
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy.getsockname()[1]}")
    monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{proxy.getsockname()[1]}")
    with proxy, explore(g, out_dir=str(tmp_path), inline=True) as handle:
        assert "IPython.core.display.HTML" in capsys.readouterr().out  # the iframe, shown outside a notebook
        assert handle.running and handle.url.startswith("http://127.0.0.1:")
        base = handle.url.split("/?")[0]
        data = json.loads(urllib.parse.unquote(handle.url.split("data=", 1)[1]))
        assert data["models"] == [{"url": handle.files.graphs}]
        with urllib.request.urlopen(f"{base}/api/v1/read_text_file?path="
                                    f"{urllib.parse.quote(handle.files.graphs)}", timeout=10) as r:
            served = json.loads(json.loads(r.read())["content"])
        assert [x["id"] for x in served["graphs"]] == ["step 1"]
        # the version check would ask PyPI: it answers empty at once instead
        with urllib.request.urlopen(f"{base}/api/v1/check_new_version", timeout=10) as r:
            assert json.loads(r.read())["version"] == ""
        assert '<iframe src="http://127.0.0.1:' in handle.iframe()
        proxy.settimeout(1.0)
        with pytest.raises(socket.timeout):
            proxy.accept()  # nobody asked the web
    assert not handle.running


def test_explore_removes_its_own_temporary_export_when_stopped():
    pytest.importorskip("model_explorer")
    from paddleviz_hooks.explore import explore

    g = BackwardGraph([Node(0, "root", "loss", "loss"), Node(1, "op", "ExpGradNode", "Exp")], [Edge(0, 1)],
                      meta={"step": 1})
    with explore(g, inline=False) as handle:
        export_dir = os.path.dirname(handle.files.graphs)
        assert os.path.isdir(export_dir)
    assert not os.path.exists(export_dir)  # nothing left in the temporary directory


# --------------------------------------------------------------------------
# end to end: Model.fit with a NaN trigger, `paddleviz-hooks explore`, headless Chromium
# --------------------------------------------------------------------------
NAN_STEP = 4


class Penalty(nn.Layer):
    """mean(log(|h| * s)), s = 0 from call ``NAN_STEP`` on: Log turns a finite gradient into Inf."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, h):
        self.calls += 1
        return paddle.log(paddle.abs(h) * (0.0 if self.calls >= NAN_STEP else 1.0)).mean()


class NaNNet(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.penalty = Penalty()
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.body(x)
        return self.head(h), self.penalty(h)


class PenaltyLoss(nn.Layer):
    def forward(self, logits, penalty, label):
        return nn.functional.cross_entropy(logits, label) + 0.01 * penalty


def _explore_cli(log_dir, out_dir, log_file):
    """``paddleviz-hooks explore LOG_DIR`` in its own session; returns (process, page url)."""
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "paddleviz_hooks.cli", "explore", str(log_dir), "--port", str(port),
           "--out", str(out_dir)]
    log = open(log_file, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, pathlib.Path(log_file).read_text(encoding="utf-8")
        urls = [x for x in pathlib.Path(log_file).read_text(encoding="utf-8").splitlines() if x.startswith("http://127.0.0.1:")]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/check_health", timeout=2) as r:
                if urls and r.read() == b"model_explorer_ok":
                    return proc, urls[0]
        except OSError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"the explorer did not start: {pathlib.Path(log_file).read_text(encoding='utf-8')[-2000:]}")


def _stop(proc) -> None:
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


RED_IN_PANEL = r"""() => Array.from(document.querySelectorAll('*'))
  .filter(e => getComputedStyle(e).backgroundColor === 'rgb(214, 39, 40)')
  .map(e => e.innerText.split(/\s+/)[0])"""


@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Debian's Chromium at {CHROMIUM}")
def test_explore_a_nan_run_in_chromium(tmp_path):
    import shutil
    from pathlib import Path

    sync_api = pytest.importorskip("playwright.sync_api")
    from _fitkit import run_fit

    from paddleviz_hooks import BackwardGraphCallback

    log_dir = tmp_path / "log"
    cb = BackwardGraphCallback(str(log_dir), every=3, on_nonfinite=True, formats=("json",), visualdl=False,
                               verbose=0, queue_size=16)
    run_fit(NaNNet, callbacks=[cb], steps=5, loss=PenaltyLoss(), lr=0.05)
    assert cb.captured_steps == [1, 3, NAN_STEP] and cb.triggers[NAN_STEP] == "nonfinite_loss"
    nan_graph = BackwardGraph.from_json((log_dir / "backward_graph" / f"step_{NAN_STEP:06d}.json").read_text())
    origin = nan_graph.nonfinite_sites()[0]
    assert (origin.op, origin.layer) == ("Log", "penalty")
    bad = sum(e.grad.nonfinite for e in nan_graph.edges if e.src == origin.id)

    shots = []
    proc, url = _explore_cli(log_dir, tmp_path / "me", tmp_path / "server.log")
    try:
        with sync_api.sync_playwright() as p:
            browser = launch_chromium(p)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.set_default_timeout(30_000)
                outside, refused = [], []
                page.on("response", lambda r: r.status >= 400 and refused.append((r.status, r.url)))
                page.route(lambda u: not u.startswith("http://127.0.0.1:"),
                           lambda route: (outside.append(route.request.url), route.abort()))

                def shoot(name):
                    page.wait_for_timeout(500)
                    page.screenshot(path=str(tmp_path / name))
                    shots.append(tmp_path / name)

                page.goto(url, timeout=60_000)
                page.locator(".graph-selector-label").wait_for()
                # the page opens at the NaN/Inf origin: the triggered step, Log selected in its layer
                page.wait_for_function("() => document.body.innerText.includes('LogGradNode')")
                assert "trigger: nonfinite_loss" in page.locator(".graph-selector-label").inner_text()
                shoot("explorer_opened_at_origin.png")
                # every captured step is listed, the NaN one named by its trigger
                page.locator(".graph-selector-label").click()
                items = page.locator(".graph-item-container")
                items.first.wait_for()
                listed = [items.nth(i).get_attribute("data-id") for i in range(items.count())]
                assert listed == ["backward_graph: step 1", "backward_graph: step 3",
                                  f"backward_graph: step {NAN_STEP} - trigger: nonfinite_loss"]
                shoot("explorer_steps.png")
                page.locator(".graph-item-container[data-id*='trigger'] .graph-label").click()
                # the NaN/Inf overlay is listed first (this run has a NaN)
                providers = page.locator(".index-row .run-name")
                providers.first.wait_for()
                assert providers.first.inner_text().startswith("NaN/Inf elements")
                providers.first.click()
                shoot("explorer_nan_overlay.png")

                # find Log, open its layer (penalty) and select it (Alt+click)
                page.locator("input[placeholder*='Search']").first.fill("Log")
                hit = page.locator(f"mat-tree-node[data-id='{origin.id}'] .node-label")
                hit.wait_for()
                hit.click(modifiers=["Alt"])
                page.wait_for_function("() => document.body.innerText.includes('LogGradNode')")
                panel = page.locator("body").inner_text()
                for key in ("grad norm", "grad min", "grad max", "grad NaN", "grad Inf", "NaN/Inf origin",
                            "layer class", "Penalty"):
                    assert key in panel, key
                # the NaN overlay marks the origin: its value, in red, is the count it produced
                assert str(bad) in page.evaluate(RED_IN_PANEL)
                shoot("explorer_origin_selected.png")
            finally:
                browser.close()
    finally:
        _stop(proc)
    assert outside == []  # not even the page's web font: nothing leaves the machine
    assert refused == []  # the page's own requests are all answered (a model-path notice was refused)
    assert "Traceback" not in (tmp_path / "server.log").read_text(encoding="utf-8")
    printed = (tmp_path / "server.log").read_text(encoding="utf-8")
    assert printed.count("http://") == 1 and url in printed  # one address, the one that opens the NaN step
    assert not (tmp_path / "me").exists() or sorted(os.listdir(tmp_path / "me"))  # --out is the user's: kept
    out = Path(__file__).resolve().parents[1] / "test-output"
    out.mkdir(exist_ok=True)
    for shot in shots:
        assert shot.stat().st_size > 10_000, f"{shot} looks empty"
        shutil.copy(shot, out / shot.name)


def _locale_sorted(ids: list[str]) -> list[str] | None:
    """``ids`` sorted as the page sorts its graph list (``a.localeCompare(b)``, node's ICU); None without node."""
    import shutil

    node = shutil.which("node")
    if node is None:
        return None
    script = "const a = JSON.parse(require('fs').readFileSync(0, 'utf8')); " \
             "console.log(JSON.stringify(a.sort((x, y) => x.localeCompare(y))))"
    done = subprocess.run([node, "-e", script], input=json.dumps(ids), capture_output=True, text=True, timeout=60,
                          check=True)
    return json.loads(done.stdout)


def test_a_step_of_many_micro_batches_is_listed_in_order_and_opens_at_the_first_nan(tmp_path):
    """Twelve micro-batches a step, in a step's files ``step_N.json``, ``step_N_b2.json``...
    ``step_N_b12.json``: the list goes by step, then micro-batch (10 after 9, not after 1), in the
    page's own order too, and the page opens at the earliest NaN (step 3, micro-batch 11), not at
    step 4's first micro-batch, which a list grouped by micro-batch puts first."""
    run = tmp_path / "log" / "backward_graph"
    run.mkdir(parents=True)
    k = 12
    for step in (3, 4):
        for mb in range(1, k + 1):
            bad = (step, mb) in {(3, 11), (3, 12), (4, 1)}
            grad = GradMeta((2,), "float32", float("nan") if bad else 1.0, -1.0, 1.0, nan=2 if bad else 0)
            g = BackwardGraph([Node(0, "root", "loss"), Node(1, "op", "ExpGradNode", "Exp")], [Edge(0, 1, grad=grad)],
                              meta={"step": step, "trigger": "nonfinite_loss" if bad else "scheduled",
                                    "backward": {"index": mb, "of": k, "entry": "backward", "micro_batch": mb,
                                                 "micro_batches": k}})
            g.assign_keys()
            (run / (f"step_{step:06d}" + (f"_b{mb}" if mb > 1 else "") + ".json")).write_text(g.to_json())
    files = ex.export_explorer(str(tmp_path / "log"), str(tmp_path / "out"))
    listed = [tuple(int(x) for x in re.search(r"step (\d+).*micro-batch (\d+) of 12", g).groups())
              for g in files.graph_ids]
    assert listed == [(s, mb) for s in (3, 4) for mb in range(1, k + 1)]
    assert files.graph_ids[10] == "backward_graph: step 3 b11 - micro-batch 11 of 12 - trigger: nonfinite_loss"
    assert files.graph_ids[1] == "backward_graph: step 3 b02 - micro-batch 2 of 12"  # padded: sorts before b10
    assert files.start == (files.graph_ids[10], "0")
    assert sorted(files.graph_ids) == files.graph_ids
    in_page = _locale_sorted(files.graph_ids)
    assert in_page is None or in_page == files.graph_ids
    collection, overlays = load_export(files)
    assert [g["id"] for g in collection["graphs"]] == files.graph_ids
    # each micro-batch is compared with the same micro-batch of the step before
    assert sorted(overlays[ex.ADDED]) == sorted(files.graph_ids[k:])

    # a list of the same graphs in capture order names them the same way
    graphs = sorted((BackwardGraph.from_json(p.read_text()) for p in run.glob("step_000003*.json")),
                    key=lambda g: g.meta["backward"]["index"])
    listed = ex.export_explorer(graphs, str(tmp_path / "out2"))
    assert [f"backward_graph: {g}" for g in listed.graph_ids] == files.graph_ids[:k]
    assert listed.start == (listed.graph_ids[10], "0")


def test_a_nodes_received_gradient_is_the_one_every_view_gives():
    """An op receiving over two edges: its 'grad' attributes are the exact sum read when it ran
    (Node.received), as the report's tooltips give it; they were the two parts combined
    (root-sum-square), a different number. An edge a gradient hook changed: what arrived."""
    paddle.seed(0)
    lin, lin2 = nn.Linear(3, 3), nn.Linear(3, 3)
    x = paddle.randn([2, 3])
    with capture_backward(nn.LayerList([lin, lin2])) as cap:
        h = lin(x)
        k = lin2(h)
        k.register_hook(lambda g: g * 3.0)  # k has one consumer: its edge is checked
        (k.sum() + (h * h).sum()).backward()
    g = cap.graph
    me = {int(n["id"]): attrs(n) for n in ex.explorer_graph(g, "step 1")["nodes"]}
    summed = [n for n in g.nodes if n.received is not None]
    assert summed
    for n in summed:
        assert float(me[n.id]["grad norm"]) == pytest.approx(n.received.norm, rel=1e-12)
    changed = [e for e in g.edges if e.after_hook is not None]
    assert len(changed) == 1
    for e in changed:
        assert float(me[e.dst]["grad norm"]) == pytest.approx(e.after_hook.norm, rel=1e-12)
