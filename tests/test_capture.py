"""capture_backward on real models: structure, names, gradients, and leaving Paddle as it was."""

from __future__ import annotations

import pathlib
import os
from collections import Counter

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest
from paddle.base import core

import paddleviz_hooks
from paddleviz_hooks import BackwardGraph, capture_backward, make_graph
from paddleviz_hooks.capture import dispatcher_installed
from paddleviz_hooks.render.dot import STYLE
from paddleviz_hooks import render_to_file, summarize
from paddleviz_hooks.text import node_tooltip
from paddleviz_hooks.render import to_dot

SEED = 11


# --------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------
class LeNet(nn.Layer):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2D(1, 6, 3, 1, 1), nn.ReLU(), nn.MaxPool2D(2, 2),
            nn.Conv2D(6, 16, 5), nn.ReLU(), nn.MaxPool2D(2, 2),
        )
        self.fc = nn.Sequential(nn.Linear(400, 120), nn.Linear(120, 84), nn.Linear(84, 10))

    def forward(self, x):
        x = self.features(x)
        x = paddle.flatten(x, 1)
        return self.fc(x)


class MLP(nn.Layer):
    """Three Linear layers (the last without bias) and a frozen embedding-like layer."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(6, 6)
        for p in self.frozen.parameters():
            p.stop_gradient = True
        self.l1 = nn.Linear(6, 16)
        self.l2 = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3, bias_attr=False)

    def forward(self, x):
        h = self.frozen(x)
        h = F.relu(self.l1(h))
        h = paddle.tanh(self.l2(h))
        return self.out(h)


def _lenet():
    return LeNet(), paddle.randn([2, 1, 28, 28]), lambda out: F.cross_entropy(out, paddle.to_tensor([3, 7]))


def _mlp():
    return MLP(), paddle.randn([4, 6]), lambda out: F.mse_loss(out, paddle.zeros([4, 3]))


def _resnet18():
    m = paddle.vision.models.resnet18(num_classes=10)
    return m, paddle.randn([1, 3, 32, 32]), lambda out: F.cross_entropy(out, paddle.to_tensor([4]))


def _transformer():
    m = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 2)
    return m, paddle.randn([2, 5, 16]), lambda out: out.mean()


MODELS = {"lenet": _lenet, "mlp": _mlp, "resnet18": _resnet18, "transformer": _transformer}


def _grads(model):
    return {n: (None if p.grad is None else p.grad.numpy().copy()) for n, p in model.named_parameters()}


class Captured:
    def __init__(self, name):
        paddle.seed(SEED)
        self.model, self.x, self.loss_fn = MODELS[name]()
        self.model.train()
        # uncaptured reference
        self.loss_fn(self.model(self.x)).backward()
        self.ref = _grads(self.model)
        self.model.clear_gradients()
        with capture_backward(self.model) as cap:
            loss = self.loss_fn(self.model(self.x))
            loss.backward()
        self.cap = cap
        self.graph = cap.graph
        self.grads = _grads(self.model)
        self.params = dict(self.model.named_parameters())


_CACHE: dict[str, Captured] = {}


@pytest.fixture(scope="module", params=list(MODELS))
def captured(request) -> Captured:
    if request.param not in _CACHE:
        _CACHE[request.param] = Captured(request.param)
    return _CACHE[request.param]


def _get(name) -> Captured:
    if name not in _CACHE:
        _CACHE[name] = Captured(name)
    return _CACHE[name]


def _ops_by_layer(g: BackwardGraph) -> dict:
    out: dict = {}
    for n in g.nodes:
        if n.kind == "op":
            out.setdefault(n.layer, Counter())[n.op] += 1
    return out


# --------------------------------------------------------------------------
# structure
# --------------------------------------------------------------------------
def test_lenet_exact_op_counts_and_attribution():
    g = _get("lenet").graph
    # 2 x Conv2D with bias = Conv2d + Reshape(bias) + Add; 2 ReLU; 2 MaxPool;
    # paddle.flatten; 3 x Linear = Matmul + Add; cross_entropy = fused op + mean.
    assert g.count_ops() == {
        "Conv2d": 2, "Reshape": 2, "Add": 2 + 3, "Relu": 2, "Pool2d": 2, "Flatten": 1,
        "Matmul": 3, "CrossEntropyWithSoftmax": 1, "MeanAll": 1,
    }
    kinds = Counter(n.kind for n in g.nodes)
    assert kinds == {"root": 1, "op": 19, "param": 10}
    assert len(g.edges) == 29  # a tree: every node but the root has one producer
    by_layer = _ops_by_layer(g)
    assert by_layer["features.0"] == {"Conv2d": 1, "Reshape": 1, "Add": 1}
    assert by_layer["features.3"] == {"Conv2d": 1, "Reshape": 1, "Add": 1}
    assert by_layer["features.1"] == {"Relu": 1}
    assert by_layer["features.2"] == {"Pool2d": 1}
    for i in range(3):
        assert by_layer[f"fc.{i}"] == {"Matmul": 1, "Add": 1}
    assert by_layer[""] == {"Flatten": 1}  # paddle.flatten in LeNet.forward itself
    assert by_layer[None] == {"CrossEntropyWithSoftmax": 1, "MeanAll": 1}  # loss, outside the model
    assert g.layers["features.0"] == "Conv2D" and g.layers["fc"] == "Sequential"
    assert all(n.hooked for n in g.nodes if n.kind == "op")
    assert g.meta["entry"] == "backward"
    assert g.meta["loss"] == pytest.approx(float(F.cross_entropy(_get("lenet").model(_get("lenet").x),
                                                                 paddle.to_tensor([3, 7]))), rel=1e-6)


def test_mlp_exact_op_counts_and_frozen_params_unreached():
    g = _get("mlp").graph
    # frozen Linear: no grad node at all (all its inputs stop gradient);
    # l1, l2 = Matmul + Add; out (no bias) = Matmul; relu, tanh; mse = Subtract, Square, Mean.
    assert g.count_ops() == {"Matmul": 3, "Add": 2, "Relu": 1, "Tanh": 1,
                             "Subtract": 1, "Square": 1, "Mean": 1}
    assert {n.param for n in g.nodes if n.kind == "param"} == {
        "l1.weight", "l1.bias", "l2.weight", "l2.bias", "out.weight"}
    by_layer = _ops_by_layer(g)
    assert by_layer["l1"] == {"Matmul": 1, "Add": 1}
    assert by_layer["out"] == {"Matmul": 1}
    assert by_layer[""] == {"Relu": 1, "Tanh": 1}
    assert "frozen" not in by_layer
    assert not [n for n in g.nodes if n.kind == "input"]


@pytest.mark.parametrize("registered", ["before the capture", "inside the capture"])
def test_ops_of_a_layers_own_forward_hooks_belong_to_that_layer_whenever_registered(registered):
    """A layer's forward pre-hook (changing its input) and post-hook (changing its output)
    run inside the layer's call: their ops are the layer's, as weight_norm's are, whether
    the hooks were registered before the capture was armed or inside it (with hooks on
    every sublayer, the order of registration decided it)."""
    paddle.seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))

    def register():
        net[2].register_forward_pre_hook(lambda layer, args: (args[0] * 2.0,))
        net[0].register_forward_post_hook(lambda layer, args, out: out * 3.0)

    if registered == "before the capture":
        register()
    with capture_backward(net) as cap:
        if registered == "inside the capture":
            register()
        net(paddle.randn([2, 3])).sum().backward()
    scales = sorted(n.layer for n in cap.graph.nodes if n.op == "Scale")
    assert scales == ["0", "2"]


def test_resnet18_structure_and_conv_attribution():
    c = _get("resnet18")
    g = c.graph
    counts = g.count_ops()
    # 20 convolutions (stem 1, 8 blocks x 2, 3 downsample), each followed by BatchNorm;
    # ReLU: stem + 2 per block; Add: 8 residuals + fc bias; Pool2d: max + adaptive avg.
    assert counts["Conv2d"] == 20 and counts["BatchNorm"] == 20
    assert counts["Relu"] == 17 and counts["Add"] == 9 and counts["Pool2d"] == 2
    assert counts["Matmul"] == 1 and counts["Flatten"] == 1
    stem = [n for n in g.nodes if n.op == "Conv2d" and n.layer == "conv1"]
    assert len(stem) == 1
    out = g.out_edges()
    for n in g.nodes:
        if n.op != "Conv2d":
            continue
        targets = [g.nodes[e.dst] for e in out[n.id] if g.nodes[e.dst].kind == "param"]
        # each conv node belongs to the Conv2D that owns the weight it feeds
        assert [t.param for t in targets] == [n.layer + ".weight"], n
        assert g.layers[n.layer] == "Conv2D"
    # the block's ReLU layer runs twice per forward: two calls, told apart
    assert sorted(n.call for n in g.nodes if n.layer == "layer1.0.relu") == [0, 1]
    for n in g.nodes:
        if n.op == "BatchNorm":
            assert g.layers[n.layer] == "BatchNorm2D"


def test_transformer_attribution():
    g = _get("transformer").graph
    counts = g.count_ops()
    # per layer: q,k,v,out projections + linear1, linear2 (Matmul + Add each),
    # two attention matmuls, two residual adds, two LayerNorms
    assert counts["Matmul"] == 2 * 8 and counts["Add"] == 2 * 8 and counts["LayerNorm"] == 2 * 2
    assert counts["Softmax"] == 2
    for i in range(2):
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            path = f"layers.{i}.self_attn.{proj}"
            assert _ops_by_layer(g)[path] == {"Matmul": 1, "Add": 1}, path
        assert _ops_by_layer(g)[f"layers.{i}.self_attn"]["Matmul"] == 2  # q@k^T and weights@v
    assert g.layers["layers.0.self_attn"] == "MultiHeadAttention"


def test_parameters_named_exactly(captured):
    g = captured.graph
    trainable = {n for n, p in captured.params.items() if not p.stop_gradient}
    reached = {n.param for n in g.nodes if n.kind == "param"}
    assert reached == trainable
    assert set(g.params()) == trainable
    frozen = {n for n, p in captured.params.items() if p.stop_gradient}
    if isinstance(captured.model, LeNet):
        assert not frozen
    assert not reached & frozen


def test_param_edge_shapes_and_norms(captured):
    g = captured.graph
    inn = g.in_edges()
    for n in g.nodes:
        if n.kind != "param":
            continue
        p = captured.params[n.param]
        assert n.shape == tuple(p.shape)
        edges = inn[n.id]
        assert len(edges) == 1, n.param  # each parameter used once in these models
        meta = edges[0].grad
        assert meta is not None and meta.shape == tuple(p.shape) and meta.dtype == "float32"
        grad = captured.grads[n.param].astype("float64")
        assert meta.norm == pytest.approx(float(np.linalg.norm(grad)), rel=1e-5)
        assert meta.min == pytest.approx(float(grad.min()), rel=1e-6, abs=1e-12)
        assert meta.max == pytest.approx(float(grad.max()), rel=1e-6, abs=1e-12)
        assert meta.nan == 0 and meta.inf == 0
    gn = np.sqrt(sum(float(np.sum(v.astype("float64") ** 2)) for v in captured.grads.values() if v is not None))
    assert g.global_grad_norm() == pytest.approx(gn, rel=1e-5)


def test_gradients_bit_identical(captured):
    assert captured.ref.keys() == captured.grads.keys()
    for name, ref in captured.ref.items():
        got = captured.grads[name]
        if ref is None:
            assert got is None, name
        else:
            assert got is not None and np.array_equal(ref, got), name
    assert paddle.is_grad_enabled()


def test_every_hooked_edge_has_data(captured):
    g = captured.graph
    for e in g.edges:
        src = g.nodes[e.src]
        if src.kind == "root" or src.hooked:
            assert e.grad is not None and e.grad.shape is not None and e.grad.norm is not None, (src, e)


def test_json_roundtrip(captured):
    g = captured.graph
    text = g.to_json()
    back = BackwardGraph.from_json(text)
    assert back == g
    assert back.to_json() == text
    assert len(back.nodes) == len(g.nodes) and back.nodes[0].kind == "root"


# --------------------------------------------------------------------------
# NaN
# --------------------------------------------------------------------------
def _nan_graph():
    w = paddle.create_parameter([3], "float32")
    w.set_value(paddle.to_tensor([-1.0, 0.0, 2.0]))
    mask = paddle.to_tensor([1.0, 0.0, 1.0])
    with capture_backward(params={"w": w}) as cap:
        # log(-1) = NaN and log(0) = -inf in the forward; d log/dx = 1/x is finite at -1,
        # but 0/0 = NaN at 0 where the mask zeroes the incoming gradient.
        loss = (paddle.log(w) * mask).sum()
        loss.backward()
    return cap.graph, w


def test_nan_is_recorded_at_its_origin():
    g, w = _nan_graph()
    sites = g.nonfinite_sites()
    assert sites and sites[0].op == "Log" and sites[0].name == "LogGradNode"
    log_edges = [e for e in g.edges if e.src == sites[0].id]
    assert len(log_edges) == 1
    meta = log_edges[0].grad
    assert meta.nan == 1 and meta.inf == 0 and meta.nonfinite == 1
    grad = w.grad.numpy()
    assert np.isnan(grad).sum() == 1 and np.isnan(grad[1])
    # log of the negative number: NaN in the forward (the loss), but d log/dx = 1/x = -1 is finite
    assert grad[0] == -1.0 and grad[2] == 0.5
    assert np.isnan(g.meta["loss"])
    assert g.nonfinite_count() >= 1
    assert paddle.is_grad_enabled()
    summary = summarize(g)
    assert "NaN/Inf gradients" in summary and "first non-finite gradient at Log" in summary


def test_nan_is_rendered():
    g, _ = _nan_graph()
    dot = to_dot(g)
    assert STYLE["nonfinite"]["fillcolor"] in dot
    assert "first non-finite gradient" in dot  # no replay here: no origin, the first bad gradient
    assert "NaN:1" in dot


def test_nan_graph_json_and_dot_files(tmp_path):
    g, _ = _nan_graph()
    p = render_to_file(g, str(tmp_path / "nan.json"))
    back = BackwardGraph.from_json(pathlib.Path(p).read_text(encoding="utf-8"))
    assert back.nonfinite_sites()[0].op == "Log"
    assert render_to_file(g, str(tmp_path / "nan.dot")).endswith("nan.dot")


# --------------------------------------------------------------------------
# leaving Paddle as it was
# --------------------------------------------------------------------------
def _hook_state(model):
    return {
        path: (len(sub._forward_pre_hooks) + len(sub._forward_pre_hooks_with_kwargs_flag),
               len(sub._forward_post_hooks) + len(sub._forward_post_hooks_with_kwargs_flag))
        for path, sub in model.named_sublayers(include_self=True)
    }


@pytest.fixture
def small():
    paddle.seed(SEED)
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    return m, paddle.randn([2, 3])


def _assert_clean(model, orig_backward, orig_grad, grad_mode=True):
    assert not dispatcher_installed()
    assert core.eager.run_backward is orig_backward
    assert core.eager.run_partial_grad is orig_grad
    assert paddle.is_grad_enabled() is grad_mode
    for path, (pre, post) in _hook_state(model).items():
        assert pre == 0 and post == 0, path


def test_exit_restores_everything(small):
    m, x = small
    ob, og = core.eager.run_backward, core.eager.run_partial_grad
    with capture_backward(m) as cap:
        assert dispatcher_installed()
        assert core.eager.run_backward is not ob
        assert any(pre for pre, _ in _hook_state(m).values())
        m(x).sum().backward()
    _assert_clean(m, ob, og)
    assert len(cap.graphs) == 1


def test_exit_on_exception_restores_everything(small):
    m, x = small
    ob, og = core.eager.run_backward, core.eager.run_partial_grad
    with pytest.raises(ZeroDivisionError):
        with capture_backward(m):
            m(x).sum().backward()
            1 / 0
    _assert_clean(m, ob, og)


def test_exit_on_keyboard_interrupt_restores_everything(small):
    m, x = small
    ob, og = core.eager.run_backward, core.eager.run_partial_grad
    with pytest.raises(KeyboardInterrupt):
        with capture_backward(m):
            loss = m(x).sum()
            raise KeyboardInterrupt
    _assert_clean(m, ob, og)
    loss.backward()  # the graph is still usable after the interrupted block
    assert m[0].weight.grad is not None


def test_exception_inside_backward_restores_grad_mode(small):
    """A user's tensor hook raising KeyboardInterrupt during a captured backward."""
    m, x = small

    def bad(grad):
        raise KeyboardInterrupt("stop")

    ob, og = core.eager.run_backward, core.eager.run_partial_grad
    h = m[2].weight.register_hook(bad)
    try:
        # Paddle turns the KeyboardInterrupt raised inside backward into an OSError;
        # a captured backward hands it to the user as the KeyboardInterrupt it was
        with pytest.raises(KeyboardInterrupt) as got:
            with capture_backward(m) as cap:
                m(x).sum().backward()
    finally:
        h.remove()
    assert "KeyboardInterrupt" in str(got.value.__cause__)  # Paddle's error is kept as the cause
    _assert_clean(m, ob, og)
    assert cap.graphs == []  # a failed backward gives no graph
    m.clear_gradients()
    m(x).sum().backward()  # autograd still works
    assert m[0].weight.grad is not None


def test_raising_node_hook_does_not_leave_grad_off(small):
    """Paddle leaves grad mode off after a raising node post-hook; a capture puts it back."""
    m, x = small

    def bad(outs, ins):
        raise KeyboardInterrupt("stop")

    ob, og = core.eager.run_backward, core.eager.run_partial_grad
    loss = m(x).sum()
    loss.grad_fn._register_post_hook(bad)
    try:
        loss.backward()
    except OSError:
        pass
    uncaptured_grad_mode = paddle.is_grad_enabled()
    paddle.set_grad_enabled(True)
    assert uncaptured_grad_mode is False  # the Paddle behaviour being guarded against

    loss = m(x).sum()
    loss.grad_fn._register_post_hook(bad)
    with pytest.raises(KeyboardInterrupt):  # Paddle's OSError, handed over as what it wraps
        with capture_backward(m) as cap:
            loss.backward()
    _assert_clean(m, ob, og, grad_mode=True)
    assert cap.graphs == []


def test_grad_mode_off_is_kept(small):
    m, x = small
    ob, og = core.eager.run_backward, core.eager.run_partial_grad
    loss = m(x).sum()
    with paddle.no_grad():
        with capture_backward(m):
            loss.backward()
        assert not paddle.is_grad_enabled()
        _assert_clean(m, ob, og, grad_mode=False)
    assert paddle.is_grad_enabled()


def test_nested_captures(small):
    m, x = small
    with capture_backward(m) as outer:
        with capture_backward() as inner:
            m(x).sum().backward()
        assert dispatcher_installed()
        m(x).mean().backward()
    assert not dispatcher_installed()
    assert len(inner.graphs) == 1 and len(outer.graphs) == 2
    assert inner.graph.count_ops() == outer.graphs[0].count_ops()
    # the outer capture named the parameters, the inner did not
    assert {n.kind for n in outer.graphs[0].nodes} == {"root", "op", "param"}
    assert "input" in {n.kind for n in inner.graph.nodes}


def test_capture_is_not_reentrant(small):
    m, x = small
    cap = capture_backward(m)
    with cap:
        with pytest.raises(RuntimeError):
            cap.__enter__()
    assert not dispatcher_installed()


# --------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------
def test_entry_points_each_give_one_graph(small):
    m, x = small
    params = [p for p in m.parameters()]
    with capture_backward(m) as cap:
        m(x).sum().backward()
    assert len(cap.graphs) == 1 and cap.graph.meta["entry"] == "backward"
    ref = _grads(m)
    m.clear_gradients()

    with capture_backward(m) as cap:
        paddle.autograd.backward([m(x).sum()])
    assert len(cap.graphs) == 1 and cap.graph.meta["entry"] == "backward"
    for n, g in _grads(m).items():
        assert np.array_equal(g, ref[n])
    m.clear_gradients(set_to_zero=False)

    with capture_backward(m) as cap:
        grads = paddle.grad([m(x).sum()], params)
    assert len(cap.graphs) == 1 and cap.graph.meta["entry"] == "grad"
    assert all(p.grad is None for p in params)  # paddle.grad leaves .grad alone
    for (n, _), g in zip(m.named_parameters(), grads):
        assert np.array_equal(g.numpy(), ref[n])
    assert {n.param for n in cap.graph.nodes if n.kind == "param"} == set(ref)


def test_backward_with_several_roots(small):
    m, x = small
    with capture_backward(m) as cap:
        out = m(x)
        paddle.autograd.backward([out[:, 0].sum(), out[:, 1].mean()])
    g = cap.graph
    roots = [n for n in g.nodes if n.kind == "root"]
    assert [r.name for r in roots] == ["output 0", "output 1"]
    assert len(cap.graphs) == 1


# --------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------
def test_bad_input():
    with pytest.raises(TypeError, match="paddle.nn.Layer"):
        capture_backward("x")
    with pytest.raises(TypeError):
        capture_backward(params=[1, 2])
    with pytest.raises(TypeError):
        capture_backward(grad_stats="yes")
    with capture_backward() as cap:
        pass
    with pytest.raises(RuntimeError, match="no backward graph"):
        cap.graph
    t = paddle.ones([2])  # stop_gradient=True: no grad_fn
    assert t.grad_fn is not None  # Paddle gives even a stop_gradient tensor an accumulation node
    with pytest.raises(ValueError, match="no backward graph"):
        make_graph(t)
    with paddle.no_grad():
        y = nn.Linear(2, 2)(paddle.ones([1, 2]))
    with pytest.raises(ValueError):
        make_graph(y)
    with pytest.raises(TypeError):
        make_graph("not a tensor")
    with pytest.raises(ValueError):
        BackwardGraph.from_json("{}")
    with pytest.raises(ValueError):
        BackwardGraph.from_json("not json")


def test_leaf_only_backward():
    x = paddle.ones([2])
    x.stop_gradient = False
    with capture_backward() as cap:
        x.sum().backward()
    # a leaf-only graph: the root's grad_fn is the SumGradNode
    assert len(cap.graphs) == 1
    assert cap.graph.count_ops() == {"Sum": 1}


# --------------------------------------------------------------------------
# the paddleviz README example
# --------------------------------------------------------------------------
def test_paddleviz_readme_example(tmp_path):
    paddle.seed(SEED)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    x = paddle.randn([2, 4])
    y = model(x)
    dot = make_graph(y, dpi="600")
    out = dot.render(str(tmp_path / "viz-result.gv"), format="png")
    assert os.path.basename(out) == "viz-result.gv.png"
    data = pathlib.Path(out).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.path.exists(tmp_path / "viz-result.gv")
    source = dot.source
    assert "Matmul" in source and "Relu" in source
    assert 'dpi="600"' in source or "dpi=600" in source
    # make_graph leaves the graph intact: the user's backward still works afterwards
    y.sum().backward()
    assert model[0].weight.grad is not None


def test_make_graph_with_params_labels_shapes():
    paddle.seed(SEED)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    y = model(paddle.randn([2, 4])).sum()
    dot = make_graph(y, params=model)
    assert "0.weight" in dot.source and "[4, 3]" in dot.source
    assert all(p.grad is None for p in model.parameters())  # .grad untouched
    y.backward()
    assert model[0].weight.grad is not None


# --------------------------------------------------------------------------
# the node kinds the notes flag
# --------------------------------------------------------------------------
class Cube(paddle.autograd.PyLayer):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensor()
        return dy * 3 * x * x


class Zoo(nn.Layer):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lstm = nn.LSTM(4, 4)
        self.gru = nn.GRU(4, 4)
        self.w = self.create_parameter([4, 4])

    def forward(self, x):  # x: [2, 3, 4]
        h = self.lin(x)
        a, _ = self.lstm(h)
        b, _ = self.gru(h)
        c = paddle.concat([a, b], axis=-1)                 # ConcatGradNode
        s = paddle.stack([a, b])                           # StackGradNode
        e = paddle.einsum("bti,ij->btj", a, self.w)        # EinsumGradNode
        p = Cube.apply(paddle.tanh(b))                     # PyLayer
        q = h * 1.0
        q.add_(e)                                          # in-place
        F.relu_(q)
        return [c.mean(), s.square().mean(), q.sum(), p.sum()]


def _zoo_run(capture):
    paddle.seed(SEED)
    m = Zoo()
    x = paddle.randn([2, 3, 4])
    cm = capture_backward(m) if capture else None
    if cm is not None:
        cm.__enter__()
    try:
        losses = m(x)
        paddle.add_n(losses).backward()                    # AddN of several losses: the root
    finally:
        if cm is not None:
            cm.__exit__(None, None, None)
    return m, _grads(m), cm


def test_flagged_node_kinds():
    _, ref, _ = _zoo_run(False)
    m, got, cap = _zoo_run(True)
    for n in ref:
        assert np.array_equal(ref[n], got[n]), n
    assert paddle.is_grad_enabled()
    assert not cap.errors
    g = cap.graph
    names = {n.name for n in g.nodes}
    for kind in ("ConcatGradNode", "StackGradNode", "AddNGradNodeFinal", "EinsumGradNode",
                 "RnnGradNode", "GradNodePyLayer_Cube", "AddGradNode", "ReluGradNode"):
        assert any(nm.startswith(kind) for nm in names), kind
    assert g.nodes[1].name == "AddNGradNodeFinal"  # the root's node
    unhooked = {n.name.split("_")[0] for n in g.nodes if n.kind == "op" and not n.hooked}
    assert unhooked == {"ConcatGradNode", "StackGradNode", "AddNGradNodeFinal", "EinsumGradNode",
                        "RnnGradNode", "GradNodePyLayer"}
    for n in g.nodes:
        if n.kind == "op" and not n.hooked:
            assert n.note
    assert {n.param for n in g.nodes if n.kind == "param"} == set(ref)
    # the graph is drawn with the unhooked nodes dashed
    assert STYLE["unhooked"]["style"] in to_dot(g)
    # every edge into a parameter knows its shape, even behind unhooked nodes
    inn = g.in_edges()
    for n in g.nodes:
        if n.kind == "param":
            assert all(e.grad is not None and e.grad.shape == n.shape for e in inn[n.id]), n.param


def _double(capture):
    paddle.seed(SEED)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    x = paddle.randn([5, 3])
    x.stop_gradient = False
    cm = capture_backward(m) if capture else None
    if cm is not None:
        cm.__enter__()
    try:
        y = m(x).sum()
        (gx,) = paddle.grad([y], [x], create_graph=True)
        penalty = (gx * gx).sum()
        penalty.backward()
    finally:
        if cm is not None:
            cm.__exit__(None, None, None)
    return _grads(m), x.grad.numpy().copy(), cm


def test_grad_create_graph_then_backward():
    ref, refx, _ = _double(False)
    got, gotx, cap = _double(True)
    for n in ref:
        assert np.array_equal(ref[n], got[n]), n
    assert np.array_equal(refx, gotx)
    assert paddle.is_grad_enabled()
    assert not cap.errors
    assert [g.meta["entry"] for g in cap.graphs] == ["grad", "backward"]
    second = cap.graphs[1]
    names = {n.name for n in second.nodes}
    assert "TanhDoubleGradNode" in names and "MatmulDoubleGradNode" in names
    # forward nodes keep their layers in the second graph (paddle.grad retained the graph)
    layers = {(n.name, n.layer) for n in second.nodes if n.kind == "op"}
    assert ("MatmulGradNode", "0") in layers and ("TanhGradNode", "1") in layers
    assert ("TanhDoubleGradNode", None) in layers  # made by paddle.grad, outside any forward
    # ... and said so, not "outside the model" nor "its forward ran before the capture"
    for n in second.nodes:
        tip = node_tooltip(n)
        if "Double" in n.name:
            assert (n.layer_note, n.source_note) == ("backward", "backward"), n.name
            assert "made by a backward with create_graph=True" in tip and "outside the model" not in tip
            assert "before the capture" not in tip, tip
        elif n.kind == "param":  # a parameter belongs to no layer call
            assert "layer:" not in tip and "outside the model" not in tip, tip
        elif n.kind == "op":
            assert n.layer_note is None and n.source is not None, n.name
    # the last bias does not influence d(sum)/dx, so the penalty never reaches it
    assert ref["2.bias"] is None
    assert {n.param for n in second.nodes if n.kind == "param"} == {n for n, g in ref.items() if g is not None}


def test_summary_says_how_to_name_unnamed_leaves():
    net = paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.Linear(8, 1))
    with capture_backward() as cap:  # no layer: parameters are anonymous leaves
        net(paddle.randn([3, 4])).mean().backward()
    text = summarize(cap.graph)
    assert "0 parameters reached" in text
    assert "4 unnamed leaf tensors reached" in text and "capture_backward(model)" in text
    with capture_backward(net) as cap:
        net(paddle.randn([3, 4])).mean().backward()
    assert "unnamed leaf" not in summarize(cap.graph)
    x = paddle.randn([3, 4])
    x.stop_gradient = False
    with capture_backward(net) as cap:  # the model is given: the leaf is paddle.grad's input
        paddle.grad(net(x).mean(), x)
    text = summarize(cap.graph)
    assert "1 leaf tensor reached, none a parameter of the model" in text
    assert "capture_backward(model)" not in text, text


def test_collections_wait_during_a_captured_backward_and_resume_as_they_were():
    """Cyclic collection is held off while a backward is captured (it walked the whole heap
    for every few hundred objects the capture made) and is back as it was afterwards."""
    import gc

    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    seen = []
    x = paddle.randn([3, 4])
    for user_gc in (True, False):
        (gc.enable if user_gc else gc.disable)()
        try:
            with capture_backward(net) as cap:
                h = net(x)
                h.register_hook(lambda g: seen.append(gc.isenabled()))
                h.sum().backward()
            assert gc.isenabled() is user_gc  # as the user had it
            h = net(x)
            h.register_hook(lambda g: seen.append(gc.isenabled()))
            h.sum().backward()  # not captured: collections as usual
        finally:
            gc.enable()
        assert cap.graph.count_ops()["Matmul"] == 2
    assert seen == [False, True, False, False]


def test_a_forward_taking_any_keyword_runs_under_capture():
    """The layer-call wrapper takes the layer positionally only: a forward with a keyword named
    like its parameters (``layer=``, ``self=``...) runs under capture as it does without (it
    raised TypeError: multiple values for argument 'layer')."""

    class Block(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x, layer=0, inputs=None, kwargs=None):
            return self.fc(x) * (layer + 1)

    paddle.seed(0)
    b = Block()
    with capture_backward(b) as cap:
        b(paddle.randn([2, 3]), layer=2, inputs=1, kwargs=2).sum().backward()
    assert {n.layer for n in cap.graph.nodes if n.op == "Matmul"} == {"fc"}


def test_two_forwards_then_two_backwards_keep_layers_and_lines_for_both():
    """l1 = net(a); l2 = net(b); l1.backward(); l2.backward(): the second backward's ops lost
    their layers and lines (the first backward dropped every layer claim and note, those of
    the second forward's graph too) and were said to come from a forward run before the
    capture was armed."""
    import warnings

    paddle.seed(18)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with capture_backward(net) as cap:
            l1 = net(paddle.randn([2, 4])).mean()
            l2 = net(paddle.randn([2, 4])).mean()  # the second forward's line
            l1.backward()
            l2.backward()
    assert not [w for w in got if "paddleviz_hooks" in str(w.message)]
    first, second = cap.graphs
    for g, line in ((first, "l1 = net"), (second, "l2 = net")):
        ops = [n for n in g.nodes if n.kind == "op" and n.op != "Mean"]
        assert {n.layer for n in ops} == {"0", "1", "2"}, [(n.op, n.layer, n.layer_note) for n in ops]
        assert all(n.source and n.source[-1].code.startswith(line) for n in ops), [n.source for n in ops]
    assert {n.call for n in second.nodes if n.kind == "op" and n.layer} == {1}  # the second call of each


def test_a_tools_own_layer_call_wrapper_made_during_a_capture_is_kept():
    """A profiler wrapping Layer.__call__ while a capture is armed keeps its wrapper when the
    capture ends (it was silently replaced by Paddle's own)."""
    original = paddle.nn.Layer.__dict__["__call__"]
    net = nn.Linear(3, 2)
    calls = []
    try:
        with capture_backward(net):
            under = paddle.nn.Layer.__dict__["__call__"]

            def tool(self, *args, **kwargs):
                calls.append(1)
                return under(self, *args, **kwargs)

            paddle.nn.Layer.__call__ = tool
            net(paddle.randn([2, 3])).sum().backward()
        assert paddle.nn.Layer.__dict__["__call__"] is tool
        net(paddle.randn([2, 3]))
        assert len(calls) == 2
    finally:
        paddle.nn.Layer.__call__ = original
