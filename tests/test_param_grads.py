"""Every parameter's recorded gradient is the one ``param.grad`` receives.

Parameters used several times (tied embeddings, an unrolled cell), parameters
behind grad nodes that take no hook (RNN, concat, PyLayer) and parameters with
a user's own hook: the recorded norm equals the norm of ``param.grad``, and the
global and per-layer norms are computed from those.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import paddle.nn as nn
import pytest
from paddle.autograd import PyLayer

from paddleviz_hooks import capture_backward, summarize


def _norm64(t) -> float:
    return float(np.linalg.norm(t.numpy().astype("float64").ravel()))


class LSTMNet(nn.Layer):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(6, 8, num_layers=2, direction="bidirect")
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y[:, -1])


class GRUNet(nn.Layer):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y.mean(axis=1))


class UnrolledCell(nn.Layer):
    """One LSTMCell applied at every time step: each weight is used 8 times."""

    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        state = None
        for t in range(x.shape[1]):
            out, state = self.cell(x[:, t], state)
        return self.head(out)


class Tied(nn.Layer):
    """Input embedding and output projection share one weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 6)
        self.mix = nn.Linear(6, 6)

    def forward(self, x):
        h = self.mix(self.emb(x.astype("int64").abs() % 20))
        return paddle.matmul(h.mean(axis=1), self.emb.weight, transpose_y=True)


class _Twice(PyLayer):
    @staticmethod
    def forward(ctx, w):
        return w * 2.0

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


class Unhookable(nn.Layer):
    """Parameters reached only through Concat and a PyLayer (nodes that take no hook)."""

    def __init__(self):
        super().__init__()
        self.a = self.create_parameter([6, 3])
        self.b = self.create_parameter([6, 3])
        self.c = self.create_parameter([6, 6])

    def forward(self, x):
        w = paddle.concat([self.a, self.b], axis=1)
        return paddle.matmul(x.mean(axis=1), w + _Twice.apply(self.c))


def _input(model):
    paddle.seed(3)
    return paddle.randn([4, 8, 6])


def _backward(model, x):
    out = model(x)
    loss = (out * out).mean()
    loss.backward()


MODELS = {"lstm_bidirectional_2_layers": LSTMNet, "gru": GRUNet, "unrolled_lstm_cell": UnrolledCell,
          "tied_embeddings": Tied, "concat_and_pylayer": Unhookable}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_recorded_parameter_norms_equal_param_grad(name):
    paddle.seed(0)
    model = MODELS[name]()
    x = _input(model)
    model.clear_gradients()
    with capture_backward(model) as cap:
        _backward(model, x)
    g = cap.graph
    recorded = g.params()
    expected = {n: _norm64(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    assert set(recorded) == set(expected)
    for n, want in expected.items():
        assert recorded[n] is not None and recorded[n].norm == pytest.approx(want, rel=1e-5), n
        assert recorded[n].shape == tuple(model.state_dict()[n].shape)
    assert g.global_grad_norm() == pytest.approx(math.sqrt(sum(v * v for v in expected.values())), rel=1e-5)
    groups: dict[str, float] = {}
    for n, v in expected.items():
        key = n.split(".")[0] if "." in n else "(self)"
        groups[key] = groups.get(key, 0.0) + v * v
    got = g.layer_grad_norms()
    assert set(got) == set(groups)
    for k, sq in groups.items():
        assert got[k] == pytest.approx(math.sqrt(sq), rel=1e-5), k


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_are_bit_identical_with_and_without_capture(name):
    grads = []
    for capture in (False, True):
        paddle.seed(0)
        model = MODELS[name]()
        x = _input(model)
        if capture:
            with capture_backward(model):
                _backward(model, x)
        else:
            _backward(model, x)
        grads.append({n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert grads[0][n].tobytes() == grads[1][n].tobytes(), n


def test_a_users_parameter_hook_is_seen_as_param_grad_receives_it():
    paddle.seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    handle = model[0].weight.register_hook(lambda g: g * 3.0)
    try:
        with capture_backward(model) as cap:
            model(paddle.randn([5, 6])).sum().backward()
    finally:
        handle.remove()
    assert cap.graph.params()["0.weight"].norm == pytest.approx(_norm64(model[0].weight.grad), rel=1e-5)


def test_each_backward_reports_its_own_gradient_under_accumulation():
    """param.grad accumulates over two backwards; each graph holds its backward's share."""
    paddle.seed(0)
    model = nn.Linear(6, 2)
    x1, x2 = paddle.randn([3, 6]), paddle.randn([3, 6])
    with capture_backward(model) as cap:
        model(x1).sum().backward()
        first = model.weight.grad.numpy().copy()
        model(x2).sum().backward()
    second = model.weight.grad.numpy() - first
    assert cap.graphs[0].params()["weight"].norm == pytest.approx(float(np.linalg.norm(first)), rel=1e-5)
    assert cap.graphs[1].params()["weight"].norm == pytest.approx(float(np.linalg.norm(second)), rel=1e-4)


def test_nan_behind_an_rnn_is_reported():
    """The Rnn grad node takes no hook; the NaN of its weight's gradient is still counted and named."""
    paddle.seed(0)
    model = LSTMNet()
    w = model.rnn.weight_ih_l0 if hasattr(model.rnn, "weight_ih_l0") else dict(model.named_parameters())[
        "rnn.0.cell_fw.weight_ih"]
    name = next(n for n, p in model.named_parameters() if p is w)
    handle = w.register_hook(lambda g: g * float("nan"))
    try:
        with capture_backward(model) as cap:
            _backward(model, _input(model))
    finally:
        handle.remove()
    g = cap.graph
    assert math.isnan(g.params()[name].norm)
    assert g.nonfinite_count() == w.size
    text = summarize(g)
    assert "NaN/Inf" in text and "no NaN/Inf" not in text


def test_recorder_records_the_accumulated_gradient_the_optimizer_applies(tmp_path):
    """Gradient accumulation 2: the captured step's graph has its own backward's norms and,
    under a distinct name, the norm of the accumulated param.grad before the optimizer step."""
    from paddleviz_hooks import BackwardGraph, BackwardGraphRecorder

    paddle.seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    applied = {}
    with BackwardGraphRecorder(str(tmp_path), model, steps=[2], capture_first=False, verbose=0,
                               formats=("json",), visualdl=False) as rec:
        for step in range(1, 5):
            with rec.step(step):
                model(paddle.randn([3, 6])).sum().backward()
            if step % 2 == 0:
                applied[step] = math.sqrt(sum(_norm64(p.grad) ** 2 for p in model.parameters()))
                opt.step()
                opt.clear_grad()
    g = BackwardGraph.from_json((tmp_path / "backward_graph" / "step_000002.json").read_text())
    assert g.meta["accumulated_grad_norm"] == pytest.approx(applied[2], rel=1e-5)
    assert g.global_grad_norm() != pytest.approx(applied[2], rel=1e-3)  # one micro-batch's share
    assert "accumulated param.grad norm" in summarize(g)
    assert "before the optimizer's own clipping and weight decay" in summarize(g)  # not "what it applies"


@pytest.mark.parametrize("uses", [1, 2])
def test_a_sparse_embedding_gradient_is_its_dense_gradient(uses, capfd):
    """Embedding(sparse=True) passes its gradient as rows of values, an index used n times
    listed n times: the numbers shown are those of the dense gradient (rows summed, [10, 4]),
    checked against the same model with a dense embedding. They were those of the listed
    rows ([4, 4], 1.749 against 3.027), and Paddle warned about an in-place version read."""
    def build(sparse):
        paddle.seed(0)
        return nn.Embedding(10, 4, sparse=sparse)

    a, b = paddle.to_tensor([1, 2, 2, 2]), paddle.to_tensor([2, 5])

    def loss(emb):
        out = (emb(a) ** 2).sum()
        return out + emb(b).sum() if uses == 2 else out

    dense = build(False)
    loss(dense).backward()
    want = dense.weight.grad.numpy().astype("float64")
    sparse = build(True)
    with capture_backward(sparse) as cap:
        loss(sparse).backward()
    (row,) = [n.grad for n in cap.graph.nodes if n.kind == "param"]
    assert row.shape == (10, 4)
    assert row.norm == pytest.approx(float(np.linalg.norm(want)), rel=1e-6)
    assert (row.min, row.max) == (pytest.approx(want.min(), rel=1e-6), pytest.approx(want.max(), rel=1e-6))
    assert "inplace_version" not in capfd.readouterr().err
