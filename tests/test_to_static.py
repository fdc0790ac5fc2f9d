"""``paddle.jit.to_static`` models: the compiled program is opened, its numbers are exact.

Under to_static the whole model is one ``Dy2StGradNode``. The capture opens it
into the program's backward ops (drawn as not observed), connects them to the
parameters they produce gradients for, keeps every parameter's gradient exact
(the parameter hooks fire under to_static), shows NaN/Inf, changes no
gradient and leaves Paddle's program run hook as it found it.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest
from paddle.jit.dy2static.pir_partial_program import PartialProgramLayer

from paddleviz_hooks import BackwardGraph, BackwardGraphRecorder, capture_backward, collapse_graph, diff_graphs, summarize
from paddleviz_hooks.hazards import PROGRAM_OP_NOTE
from paddleviz_hooks.render import to_dot

MODES = {"sot": False, "full_graph": True}


class ConvMLP(nn.Layer):
    """Two convolutions, a BatchNorm, three Linears: well over SOT's 10-op minimum."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2D(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2D(4)
        self.conv2 = nn.Conv2D(4, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * 8 * 8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 3)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        h = F.relu(self.conv2(h)) + h
        h = paddle.tanh(self.fc1(h.flatten(1)))
        h = F.gelu(self.fc2(h)) * h
        return self.fc3(h)


def _model(full_graph: bool):
    paddle.seed(0)
    net = ConvMLP()
    return net, paddle.jit.to_static(net, full_graph=full_graph)


def _input(nan: bool = False):
    paddle.seed(1)
    x = paddle.randn([2, 3, 8, 8])
    if nan:
        x[0, 0, 0, 0] = float("nan")
    return x


def _step(static, x):
    out = static(x)
    loss = (out * out).mean()
    loss.backward()


def _capture(net, static, x):
    net.clear_gradients()
    with capture_backward(net) as cap:
        _step(static, x)
    return cap.graph


def _norm64(t) -> float:
    return float(np.linalg.norm(t.numpy().astype("float64").ravel()))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_program_opened_into_its_grad_ops(mode):
    net, static = _model(MODES[mode])
    g = _capture(net, static, _input())
    ops = g.count_ops()
    assert ops.get("Dy2St") == 1, ops  # the model ran as one program, also under capture
    program = [n for n in g.nodes if n.note == PROGRAM_OP_NOTE]
    assert program and all(n.kind == "op" and not n.hooked for n in program)
    # at least one grad op per Linear and per Conv2D, each placed in its layer
    assert sorted(n.layer for n in program if n.op == "matmul_grad") == ["fc1", "fc2", "fc3"]
    assert sorted(n.layer for n in program if n.op == "conv2d_grad") == ["conv", "conv2"]
    assert [n.layer for n in program if n.op == "batch_norm_grad"] == ["bn"]
    trainable = {name for name, p in net.named_parameters() if not p.stop_gradient}
    assert set(g.params()) == trainable
    # every parameter gets its gradient from the program op that computes it
    by_id = {n.id: n for n in g.nodes}
    for e in g.edges:
        dst = by_id[e.dst]
        if dst.kind == "param":
            src = by_id[e.src]
            assert src.note == PROGRAM_OP_NOTE and src.layer == dst.param.rsplit(".", 1)[0], (src, dst)
            assert e.grad is not None and e.grad.shape == dst.shape
    # the Dy2St node feeds the program; the graph stays acyclic and connected
    dy2st = next(n for n in g.nodes if n.op == "Dy2St")
    assert {by_id[e.dst].op for e in g.edges if e.src == dy2st.id} == {"add_grad"}
    assert len(g.topo_order()) == len(g.nodes)
    reach, todo = {0}, [0]
    out = g.out_edges()
    while todo:
        for e in out.get(todo.pop(), []):
            if e.dst not in reach:
                reach.add(e.dst)
                todo.append(e.dst)
    assert reach == set(by_id)
    # inner edges carry the program's shapes and are drawn as not observed
    inner = [e for e in g.edges if by_id[e.src].note == PROGRAM_OP_NOTE and by_id[e.dst].note == PROGRAM_OP_NOTE]
    assert inner and all(e.grad.shape and e.grad.dtype == "float32" and e.grad.norm is None for e in inner)
    dot = to_dot(g)
    assert dot.count("not observed") >= len(inner) and "matmul_grad" in dot
    assert f"{len(program)} ops {PROGRAM_OP_NOTE}" in summarize(g)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_parameter_norms_behind_the_program_are_exact(mode):
    net, static = _model(MODES[mode])
    g = _capture(net, static, _input())
    recorded = g.params()
    want = {name: _norm64(p.grad) for name, p in net.named_parameters() if p.grad is not None}
    assert set(recorded) == set(want)
    for name, v in want.items():
        assert math.isclose(recorded[name].norm, v, rel_tol=1e-5), (name, recorded[name].norm, v)
    assert math.isclose(g.global_grad_norm(), math.sqrt(sum(v * v for v in want.values())), rel_tol=1e-5)
    for layer, norm in g.layer_grad_norms().items():
        mine = [v for n, v in want.items() if n.split(".")[0] == layer]
        assert math.isclose(norm, math.sqrt(sum(v * v for v in mine)), rel_tol=1e-5), layer


@pytest.mark.parametrize("mode", sorted(MODES))
def test_nan_behind_the_program_is_reported(mode):
    net, static = _model(MODES[mode])
    g = _capture(net, static, _input(nan=True))
    nans = {n: int(np.isnan(p.grad.numpy()).sum()) for n, p in net.named_parameters() if p.grad is not None}
    assert sum(nans.values()) > 0
    assert {n: m.nan for n, m in g.params().items()} == nans
    assert g.nonfinite_count() > 0
    # the graph shows the NaN leaving the program ops that produce those gradients
    sites = g.nonfinite_sites()
    assert sites and sites[0].note == PROGRAM_OP_NOTE
    assert {n.op for n in sites} >= {"batch_norm_grad", "conv2d_grad"}
    text = summarize(g)
    assert "NaN/Inf gradients at" in text and "no NaN/Inf" not in text, text
    assert "NaN:" in to_dot(g)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_gradients_bit_identical_with_and_without_capture(mode):
    net, static = _model(MODES[mode])
    x = _input()
    # traced under capture first: the capture must not change how the model runs
    g = _capture(net, static, x)
    assert g.count_ops().get("Dy2St") == 1
    captured = {n: p.grad.numpy().copy() for n, p in net.named_parameters() if p.grad is not None}
    net.clear_gradients()
    _step(static, x)
    plain = {n: p.grad.numpy() for n, p in net.named_parameters() if p.grad is not None}
    assert plain.keys() == captured.keys()
    for n in plain:
        assert np.array_equal(plain[n], captured[n]), n


def test_run_hook_restored_and_chained():
    net, static = _model(False)
    x = _input()
    calls = []

    def theirs(run, inputs, parameters, attrs):
        calls.append(1)
        return run(inputs, parameters, attrs)

    PartialProgramLayer.HOOKED_RUN_IMPL = theirs
    try:
        g = _capture(net, static, x)
        assert calls and PartialProgramLayer.HOOKED_RUN_IMPL is theirs
        assert g.count_ops().get("matmul_grad") == 3
    finally:
        PartialProgramLayer.HOOKED_RUN_IMPL = None
    with pytest.raises(ZeroDivisionError):
        with capture_backward(net):
            _step(static, x)
            1 / 0
    assert PartialProgramLayer.HOOKED_RUN_IMPL is None
    # a later backward outside the block is not opened and nothing is left recording
    with capture_backward(net) as cap:
        pass
    _step(static, x)
    assert cap.graphs == []


class Body(nn.Layer):
    """Two outputs, an input that needs a gradient and a residual from that input."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 8)

    def forward(self, h):
        a = F.gelu(self.fc1(h))
        b = paddle.tanh(self.fc2(a)) * a
        return F.relu(self.fc3(b)) + h, b.mean(axis=-1) * 2.0 + a.sum(axis=-1)


class EagerAroundStatic(nn.Layer):
    """An eager embedding and head around a to_static block."""

    def __init__(self, full_graph: bool):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.body = paddle.jit.to_static(Body(), full_graph=full_graph)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        c, d = self.body(self.emb(ids))
        return self.head(c).mean() + d.mean()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_program_inside_an_eager_model_connects_both_ways(mode):
    paddle.seed(0)
    net = EagerAroundStatic(MODES[mode])
    ids = paddle.randint(0, 20, [2, 5])
    net.clear_gradients()
    with capture_backward(net) as cap:
        net(ids).backward()
    g = cap.graph
    by_id = {n.id: n for n in g.nodes}
    dy2st = next(n for n in g.nodes if n.op == "Dy2St")
    assert dy2st.layer == "body"
    # both program outputs receive a gradient from outside and hand it to the program
    assert len([e for e in g.edges if e.dst == dy2st.id]) == 2
    entries = [e for e in g.edges if e.src == dy2st.id]
    assert len(entries) == 2 and all(by_id[e.dst].note == PROGRAM_OP_NOTE for e in entries)
    # the program's input gradient goes on to the eager Embedding, observed there
    into_emb = [e for e in g.edges if by_id[e.dst].op == "Embedding"]
    assert len(into_emb) == 1 and by_id[into_emb[0].src].note == PROGRAM_OP_NOTE
    assert into_emb[0].grad is not None and into_emb[0].grad.shape == (2, 5, 8) and into_emb[0].grad.norm > 0
    program = [n for n in g.nodes if n.note == PROGRAM_OP_NOTE]
    assert {n.layer for n in program} == {"body", "body.fc1", "body.fc2", "body.fc3"}
    assert sorted(n.layer for n in program if n.op == "matmul_grad") == ["body.fc1", "body.fc2", "body.fc3"]
    want = {n: _norm64(p.grad) for n, p in net.named_parameters() if p.grad is not None}
    assert set(g.params()) == set(want) and len(want) == 9
    for n, v in want.items():
        assert math.isclose(g.params()[n].norm, v, rel_tol=1e-5), n
    assert len(g.topo_order()) == len(g.nodes)


def test_recorder_steps_keep_the_opened_program_with_stable_keys(tmp_path):
    net, static = _model(False)
    opt = paddle.optimizer.SGD(parameters=net.parameters(), learning_rate=0.01)
    x = _input()
    with BackwardGraphRecorder(str(tmp_path), net, every=1, formats=("json",)) as rec:
        for step in (1, 2):
            with rec.step(step):
                _step(static, x)
            opt.step()
            opt.clear_grad()
    assert PartialProgramLayer.HOOKED_RUN_IMPL is None
    graphs = [BackwardGraph.from_json((tmp_path / "backward_graph" / f"step_00000{i}.json").read_text())
              for i in (1, 2)]
    for g in graphs:
        assert g.count_ops().get("matmul_grad") == 3 and g.count_ops().get("conv2d_grad") == 2
    d = diff_graphs(*graphs)
    assert not d.structure_changed and not d.added_nodes and not d.removed_nodes
    boxes = collapse_graph(graphs[1], depth=1)
    assert {n.layer for n in boxes.nodes if n.kind == "layer"} >= {"fc1", "fc2", "fc3", "conv", "conv2", "bn"}


class SharedTwice(nn.Layer):
    """``shared`` runs twice inside the program."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.shared = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        h = F.relu(self.shared(F.relu(self.inp(x))))
        h = paddle.tanh(self.mid(h))
        return self.out(F.gelu(self.shared(h)) * 2.0)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_layer_called_twice_in_the_program_keeps_its_calls_apart(mode):
    paddle.seed(0)
    net = SharedTwice()
    static = paddle.jit.to_static(net, full_graph=MODES[mode])
    x = paddle.randn([2, 8])
    with capture_backward(net) as cap:
        (static(x) ** 2).mean().backward()
    g = cap.graph
    calls = sorted((n.op, n.call) for n in g.nodes if n.layer == "shared")
    assert calls == [("add_grad", 0), ("add_grad", 1), ("matmul_grad", 0), ("matmul_grad", 1)]
    # gradient order: the second call (nearer the loss) comes first
    order = [g.nodes[i] for i in g.topo_order()]
    first = [n.call for n in order if n.layer == "shared" and n.op == "matmul_grad"]
    assert first == [1, 0]
    # the same model run eagerly numbers its calls the same way
    net.clear_gradients()
    eager = SharedTwice()
    eager.set_state_dict(net.state_dict())
    with capture_backward(eager) as cap2:
        (eager(x) ** 2).mean().backward()
    assert sorted((n.op, n.call) for n in cap2.graph.nodes if n.layer == "shared") == [
        ("Add", 0), ("Add", 1), ("Matmul", 0), ("Matmul", 1)]


def test_captures_ending_in_any_order_leave_the_run_hook_as_found():
    net, static = _model(False)
    x = _input()
    outer = capture_backward(net)
    inner = capture_backward(net)
    outer.__enter__()
    inner.__enter__()
    try:
        _step(static, x)
    finally:
        outer.__exit__(None, None, None)  # not the last one in: the hook stays for `inner`
        assert PartialProgramLayer.HOOKED_RUN_IMPL is not None
        inner.__exit__(None, None, None)
    assert PartialProgramLayer.HOOKED_RUN_IMPL is None
    assert inner.graph.count_ops().get("matmul_grad") == 3
    assert outer.graph.count_ops().get("matmul_grad") == 3


class Branchy(nn.Layer):
    """A data-dependent ``if``: under full_graph the gradient crosses a ``pd_op.if``."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 2)

    def forward(self, x):
        h = paddle.tanh(self.fc1(x))
        if h.mean() > 0:
            h = self.fc2(h) * 2.0
        else:
            h = self.fc2(h) - 1.0
        return self.fc3(h)


def test_control_flow_op_is_crossed_by_the_gradient():
    paddle.seed(0)
    net = Branchy()
    static = paddle.jit.to_static(net, full_graph=True)
    with capture_backward(net) as cap:
        (static(paddle.randn([2, 8])) ** 2).mean().backward()
    g = cap.graph
    ops = g.count_ops()
    assert ops.get("if") == 1, ops
    # the ops on both sides of the `if` are in the graph, connected through it
    assert sorted(n.layer for n in g.nodes if n.op == "matmul_grad") == ["fc1", "fc3"]
    by_id = {n.id: n for n in g.nodes}
    if_node = next(n for n in g.nodes if n.op == "if")
    assert {by_id[e.src].layer for e in g.edges if e.dst == if_node.id} == {"fc3"}
    assert "tanh_grad" in {by_id[e.dst].op for e in g.edges if e.src == if_node.id}
    assert set(g.params()) == {n for n, _ in net.named_parameters()}
    assert len(g.topo_order()) == len(g.nodes)


def test_full_graph_resnet18_ops_placed_in_their_blocks():
    """Under full_graph Paddle records each forward op's name scope: a parameterless
    grad op (the blocks' ReLU and residual Add) lands in its BasicBlock, and a gradient
    sum in the block whose ops it adds up; collapsed views then have no loops."""
    paddle.seed(0)
    net = paddle.vision.models.resnet18(num_classes=10)
    static = paddle.jit.to_static(net, full_graph=True)
    with capture_backward(net) as cap:
        static(paddle.randn([2, 3, 32, 32])).sum().backward()
    g = cap.graph
    blocks = {f"layer{i}.{j}" for i in range(1, 5) for j in range(2)}
    relus = [n.layer for n in g.nodes if n.op == "relu_grad"]
    assert len(relus) == 17 and relus.count("") == 1  # the stem's ReLU runs in the top layer
    assert set(relus) - {""} == blocks
    assert sorted(n.layer for n in g.nodes if n.op == "add_grad" and n.layer in blocks) == sorted(blocks)
    assert {n.layer for n in g.nodes if n.op == "add_n"} <= blocks
    for depth in (1, 2, 3):
        boxes = collapse_graph(g, depth=depth)
        assert len(boxes.topo_order()) == len(boxes.nodes), depth
