"""Model Explorer export (issue 21): real captures, parsed strictly by Model Explorer's own dataclasses.

Every export is checked against ``model_explorer.graph_builder.GraphCollection``
and every overlay against ``model_explorer.node_data_builder.GraphNodeData``
with ``dacite`` in strict mode (an unknown or mistyped field fails), and
against the capture itself: the same edges, every parameter that got a
gradient named, norms equal to ``param.grad``.
"""

from __future__ import annotations

import json
import math
import os
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
    assert files.graph_ids == ["capture 1", "capture 2"]
    assert list(overlays)[:2] == [ex.NONFINITE, ex.GRAD_NORM]  # a NaN: its overlay comes first

    first, second = files.graph_ids
    origin = new.nonfinite_sites()[0]
    assert origin.op == "Log"
    nan = overlays[ex.NONFINITE][second]["results"]
    red = [nid for nid, r in nan.items() if r.get("bgColor") == ex._ORIGIN_RED]
    assert red == [str(origin.id)]
    assert nan[str(origin.id)]["value"] == sum(e.grad.nonfinite for e in new.edges if e.src == origin.id) > 0
    me_origin = collection["graphs"][1]["nodes"][origin.id]
    assert attrs(me_origin)["NaN/Inf origin"].startswith("yes")
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        g = BackwardGraph([Node(0, "root", "loss")])
        with pytest.raises(ValueError, match="cannot listen"):
            explore(g, port=taken, out_dir=str(tmp_path / "o"))


def test_explore_returns_at_once_and_serves_offline(tmp_path, monkeypatch):
    from paddleviz_hooks.explore import explore

    g = BackwardGraph([Node(0, "root", "loss"), Node(1, "op", "ExpGradNode", "Exp")], [Edge(0, 1)],
                      meta={"step": 1})
    # any https request of the server (its PyPI version check) would reach this socket
    proxy = socket.socket()
    proxy.bind(("127.0.0.1", 0))
    proxy.listen()
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy.getsockname()[1]}")
    monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{proxy.getsockname()[1]}")
    with proxy, explore(g, out_dir=str(tmp_path), inline=False) as handle:
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
