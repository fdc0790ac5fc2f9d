"""Captures as VisualDL Graphs-tab files, loaded back by VisualDL's own reader.

A real TransformerEncoder (random weights) plus a layer called twice and a
LayerDict entry with a hostile name is captured; the written file is read with
``visualdl.reader.graph_reader.GraphReader`` and expanded with its ``Model``,
exactly as the VisualDL server does for the Graphs tab. The dashboard itself is
driven in ``tests/test_dashboard.py``.
"""

from __future__ import annotations

import pathlib
import json
import math
import os
import re

import numpy as np
import paddle
import pytest

from paddleviz_hooks import BackwardGraphRecorder, capture_backward
from paddleviz_hooks.options import RecorderOptions
from paddleviz_hooks.findings import nonfinite_record
from paddleviz_hooks.graph import NonfiniteOrigin
from paddleviz_hooks.sinks.vdl_graph import vdl_graph, write_vdl_graph
from paddleviz_hooks.text import fmt_num

GraphReader = pytest.importorskip("visualdl.reader.graph_reader").GraphReader
Model = pytest.importorskip("visualdl.component.graph").Model

HOSTILE = "a b&c#d+e%f"
URL_SAFE_NAME = re.compile(r"^/[A-Za-z0-9_/-]*$")


class Net(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = paddle.nn.TransformerEncoder(
            paddle.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), 2)
        self.shared = paddle.nn.Linear(8, 8)
        self.heads = paddle.nn.LayerDict({HOSTILE: paddle.nn.Linear(8, 2)})

    def forward(self, x):
        h = self.encoder(x)
        h = self.shared(paddle.tanh(self.shared(h)))  # one layer, two calls
        return self.heads[HOSTILE](h)


@pytest.fixture(scope="module")
def captured():
    paddle.seed(0)
    net = Net()
    with capture_backward(net) as cap:
        net(paddle.randn([2, 3, 8])).mean().backward()
    return net, cap.graph


def leaves_by_key(data):
    return {n["attrs"]["key"]: n for n in data["nodes"] if n["is_leaf_node"]}


def test_written_file_loads_through_visualdls_reader(captured, tmp_path):
    _, graph = captured
    run = tmp_path / "logs" / "run-step_000001"
    path = write_vdl_graph(str(run), graph)
    assert os.listdir(run) == [os.path.basename(path)]  # no temporary file left behind
    assert re.fullmatch(r"vdlgraph\.\d{10}\.log", os.path.basename(path))
    reader = GraphReader(str(tmp_path / "logs"))
    assert reader.runs() == [os.path.realpath(run)]
    first = reader.get_graph(os.path.realpath(run), refresh=True)
    json.dumps(first)  # what the server sends
    shown = {n["name"] for n in first["nodes"]}
    # the first view: the top-level layers as boxes, plus the few ops outside any sublayer
    assert {"/encoder", "/shared", "/heads"} <= shown
    data = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    by_name = {n["name"]: n for n in data["nodes"]}
    for name in shown - {"/encoder", "/shared", "/heads"}:
        key = by_name[name]["attrs"]["key"]
        node = graph.node_by_key()[key]
        assert node.kind == "op" and node.layer in (None, ""), (name, key)
    assert len(shown) < 15, shown
    assert [p["name"] for p in first["inputs"]] == ["loss"]  # the loss is the graph's input

    # expanding a layer shows its sublayers, as the "+" button does
    opened = reader.get_graph(os.path.realpath(run), nodeid="/encoder", expand=True)
    assert "/encoder/layers" in {n["name"] for n in opened["nodes"]}
    opened = reader.get_graph(os.path.realpath(run), nodeid="/encoder/layers", expand=True)
    assert {"/encoder/layers/0", "/encoder/layers/1"} <= {n["name"] for n in opened["nodes"]}


def test_every_node_edge_and_parameter_is_there(captured):
    net, graph = captured
    data = vdl_graph(graph)
    Model(data).make_graph(expand_all=True)
    names = [n["name"] for n in data["nodes"]]
    assert len(names) == len(set(names))
    assert all(URL_SAFE_NAME.match(n) for n in names), [n for n in names if not URL_SAFE_NAME.match(n)]
    leaves = leaves_by_key(data)
    assert set(leaves) == {n.key for n in graph.nodes}
    # one variable per gradient edge, between the two nodes' boxes
    leaf_of = {n.id: leaves[n.key]["name"] for n in graph.nodes}
    assert [(v["from_node"], v["to_nodes"]) for v in data["vars"]] == [
        (leaf_of[e.src], [leaf_of[e.dst]]) for e in graph.edges]
    for v, e in zip(data["vars"], graph.edges):
        if e.grad is not None and e.grad.norm is not None:
            assert f"|g| {fmt_num(e.grad.norm)}" in v["shape"][0], (v, e)
    # a collapsed box carries the gradients that cross its border
    enc = next(n for n in data["nodes"] if n["name"] == "/encoder")
    inside = {leaf_of[n.id] for n in graph.nodes if leaf_of[n.id].startswith("/encoder/")}
    crossing_in = sorted(v["name"] for v in data["vars"]
                         if v["from_node"] not in inside and v["to_nodes"][0] in inside)
    assert sorted(enc["input_vars"]["X"]) == crossing_in and crossing_in

    # parameters sit in their layer, with the gradient param.grad received
    for name, p in net.named_parameters():
        node = leaves[f"param:{name}"]
        layer, _, short = name.rpartition(".")
        assert node["name"].rsplit("/", 1)[0] == "/" + "/".join(
            "a_b_c_d_e_f" if part == HOSTILE else part for part in layer.split(".")), (name, node["name"])
        assert node["attrs"]["param"] == name
        want = float(np.linalg.norm(p.grad.numpy().astype("float64")))
        assert math.isclose(float(node["attrs"]["norm"]), want, rel_tol=1e-5), (name, node["attrs"]["norm"], want)
        assert node["attrs"]["shape"] == "[" + ", ".join(map(str, p.shape)) + "]"

    # each call of the shared layer is a box of its own; its parameters are shared, beside the calls
    calls = sorted(n["name"] for n in data["nodes"] if n["parent_node"] == "/shared" and not n["is_leaf_node"])
    assert calls == ["/shared/call1", "/shared/call2"]
    assert leaves["param:shared.weight"]["parent_node"] == "/shared"
    matmuls = sorted(n["attrs"]["layer"] for n in data["nodes"]
                     if n["is_leaf_node"] and n["parent_node"].startswith("/shared/call"))
    assert "shared (call 1)" in matmuls and "shared (call 2)" in matmuls
    node = next(n for n in data["nodes"] if n["is_leaf_node"] and n["type"] == "Matmul")  # named as every view names it
    assert {"op", "paddle", "layer", "shape", "dtype", "norm", "min", "max", "NaN", "Inf"} <= set(node["attrs"])
    assert node["attrs"]["paddle"].endswith("GradNode") and set(node["attr_types"]) == set(node["attrs"])


def test_nan_origin_is_flagged(tmp_path):
    class Bad(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.fc = paddle.nn.Linear(4, 4)
            self.out = paddle.nn.Linear(4, 1)

        def forward(self, x):
            return self.out(paddle.sqrt(self.fc(x) - 100.0))

    paddle.seed(0)
    net = Bad()
    with capture_backward(net) as cap:
        net(paddle.randn([2, 4])).mean().backward()
    graph = cap.graph
    sites = graph.nonfinite_sites()
    assert sites, "the test model must make a NaN gradient"
    sqrt = next(n for n in graph.nodes if n.op == "Sqrt")
    graph.nonfinite = nonfinite_record(graph, NonfiniteOrigin(
        "forward", op="sqrt", layer="", layer_class="Bad", file="model.py", line=16, code="h = paddle.sqrt(h)",
        key=sqrt.key, needs_grad=True))
    data = vdl_graph(graph)
    flagged = [n for n in data["nodes"] if n["type"].startswith("NaN/Inf starts here: sqrt")]
    assert [n["attrs"].get("key") for n in flagged] == [sqrt.key]  # the origin op's own node, named in its type
    assert "model.py:16: h = paddle.sqrt(h)" in flagged[0]["attrs"]["NaN/Inf origin"]
    firsts = [n["attrs"].get("key") for n in data["nodes"] if "first non-finite gradient" in n["attrs"]]
    assert firsts == [sites[0].key]  # the first non-finite gradient: an attribute of its own
    bad = [v for v in data["vars"] if "NaN" in v["shape"][0]]
    assert bad, "edges carrying NaN say so in their label"
    write_vdl_graph(str(tmp_path / "g"), graph)
    reader = GraphReader(str(tmp_path))
    reader.get_graph(reader.runs()[0], refresh=True)


def test_the_boxes_holding_a_nan_origin_say_so_in_their_headers():
    """The tab's first view shows only boxes: the ones on the way to the origin say 'NaN/Inf
    starts inside' in their header (before, only an attribute, seen after opening them)."""
    class Block(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.fc = paddle.nn.Linear(4, 4)

        def forward(self, x):
            return paddle.sqrt(self.fc(x) - 100.0)

    class Net(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.block, self.other, self.out = Block(), paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 1)

        def forward(self, x):
            return self.out(self.block(self.other(x)))

    paddle.seed(0)
    net = Net()
    with capture_backward(net) as cap:
        net(paddle.randn([2, 4])).mean().backward()
    graph = cap.graph
    sqrt = next(n for n in graph.nodes if n.op == "Sqrt")
    graph.nonfinite = nonfinite_record(graph, NonfiniteOrigin(
        "forward", op="sqrt", layer="block", layer_class="Block", file="model.py", line=9,
        code="return paddle.sqrt(h)", key=sqrt.key, needs_grad=True))
    boxes = {n["name"]: n for n in vdl_graph(graph)["nodes"] if not n["is_leaf_node"]}
    assert boxes["/block"]["show_name"].endswith("NaN/Inf starts inside")
    assert "NaN/Inf starts inside" in boxes["/block"]["type"]
    assert not any("NaN/Inf" in b["show_name"] for name, b in boxes.items() if name != "/block")
    ops = [n["type"] for n in vdl_graph(graph)["nodes"] if n["is_leaf_node"] and n["attrs"].get("op")]
    assert "Matmul" in ops and "Sqrt" not in ops  # ops named as in every view (the origin's own: its mark)


def test_recorder_writes_one_folder_per_capture(tmp_path):
    net = paddle.nn.Sequential(paddle.nn.Linear(4, 3), paddle.nn.ReLU(), paddle.nn.Linear(3, 2))
    log_dir = tmp_path / "exp_a"
    with BackwardGraphRecorder(str(log_dir), net, every=2, verbose=0, formats=("json",)) as rec:
        for step in range(1, 5):
            with rec.step(step):
                net(paddle.randn([2, 4])).sum().backward()
    graphs = log_dir / "backward_graph" / "graphs"
    assert sorted(os.listdir(graphs)) == [f"step_{s:06d}-exp_a.backward_graph" for s in (1, 2, 4)]
    reader = GraphReader(str(log_dir))
    assert [os.path.basename(r) for r in reader.runs()] == sorted(os.listdir(graphs))
    for run in reader.runs():
        assert reader.get_graph(run, refresh=True)["inputs"]

    off = tmp_path / "off"
    with BackwardGraphRecorder(str(off), net, every=1, verbose=0, formats=("json",), visualdl_graphs=False) as rec:
        with rec.step(1):
            net(paddle.randn([2, 4])).sum().backward()
    assert (off / "backward_graph" / "step_000001.json").exists()
    assert not (off / "backward_graph" / "graphs").exists()


def test_option_is_checked():
    with pytest.raises(TypeError, match="visualdl_graphs must be True or False, got 'yes'"):
        RecorderOptions.check(visualdl_graphs="yes")
    with pytest.raises(TypeError, match="visualdl_diagnostics must be True or False, got 1"):
        RecorderOptions.check(visualdl_diagnostics=1)
    with pytest.raises(ValueError, match="viewer_px must be an int from 64 to 32767 or None, got 10"):
        RecorderOptions.check(viewer_px=10)


def test_capture_folder_names_read_as_step_trigger_run(tmp_path):
    from paddleviz_hooks.sinks.visualdl import graph_dir

    directory = str(tmp_path / "exp_b" / "backward_graph")
    assert os.path.relpath(graph_dir(directory, "exp_b/backward_graph", 8, "nonfinite_loss"), directory) == (
        os.path.join("graphs", "step_000008-nonfinite_loss-exp_b.backward_graph"))
    assert os.path.basename(graph_dir(directory, "exp_b/backward_graph", 100, "scheduled")) == (
        "step_000100-exp_b.backward_graph")


def test_a_sublayers_ops_sit_inside_the_call_of_its_parent_that_ran_them():
    """A block called twice: its Linear's ops of each call lie in that call's box (the layer-call
    tree), not in one box of the Linear shared by both calls."""

    class Blk(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = paddle.nn.Linear(4, 4)

        def forward(self, x):
            return paddle.tanh(self.fc(x))

    class Twice(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.blk = Blk()

        def forward(self, x):
            return self.blk(self.blk(x))

    net = Twice()
    with capture_backward(net) as cap:
        net(paddle.randn([2, 4])).sum().backward()
    nodes = vdl_graph(cap.graph)["nodes"]
    matmul_boxes = sorted(n["parent_node"] for n in nodes if n["is_leaf_node"] and n["name"].startswith("/blk")
                          and "Matmul" in n["name"])
    assert [p.split("/")[2] for p in matmul_boxes] == ["call1", "call2"], matmul_boxes
    weight = next(n for n in nodes if n["is_leaf_node"] and n["name"].endswith("weight"))
    assert weight["parent_node"] == "/blk/fc"  # shared by both calls: in the Linear's box, beside them
