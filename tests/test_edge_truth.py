"""Every number on every edge is the gradient that flowed there, or says it was not observed.

Each test compares a capture with an independent oracle (tensor hooks registered here on the
forward's tensors, ``param.grad`` in float64, what ``paddle.grad`` returned), one per pattern
that used to draw a wrong number; ``tests/truth/`` runs the same comparison over a zoo of
architectures (its fast subset below, the whole zoo with ``--runslow``).
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

from paddleviz_hooks import BackwardGraph, BackwardGraphRecorder, capture_backward, collapse_graph
from paddleviz_hooks.render import to_dot
from paddleviz_hooks.text import graph_summary


def norm64(t) -> float:
    return float(np.linalg.norm(np.asarray(t.numpy(), dtype=np.float64)))


def edge(g, src_op: str, dst_op: str):
    return next(e for e in g.edges if g.nodes[e.src].op == src_op and g.nodes[e.dst].op == dst_op)


# --------------------------------------------------------------------------
# 1. in-place backward kernels
# --------------------------------------------------------------------------
@pytest.mark.parametrize("act", ["relu", "sigmoid", "tanh", "silu", "swish", "leaky_relu", "elu", "hardswish"])
def test_an_inplace_consumer_after_a_hookless_node_never_shows_what_it_passed_on(act):
    """relu -> concat -> linear: Concat takes no hook, and ReluGradNode rewrites the gradient it
    received in place. The edge Concat -> Relu used to show what relu passed on (0.4593 where the
    relu output's gradient is 0.6543); now it is the real gradient or it says it was not observed."""
    paddle.seed(1)
    lin = nn.Linear(6, 3)
    a = paddle.randn([4, 3])
    a.stop_gradient = False
    seen = {}
    with capture_backward(lin) as cap:
        r = getattr(F, act)(a)
        r.register_hook(lambda g: seen.__setitem__("r", norm64(g)))
        lin(paddle.concat([r, paddle.randn([4, 3])], axis=1)).sum().backward()
    g = cap.graph
    e = next(e for e in g.edges if g.nodes[e.src].op == "Concat" and g.nodes[e.dst].kind == "op")
    assert e.grad.norm == pytest.approx(seen["r"], rel=1e-6)  # cut from what Concat received


def test_an_edge_that_cannot_be_read_in_time_says_it_was_overwritten():
    """Three [3, 3] activations stacked: the stacking axis cannot be told from the shapes, so the
    Stack -> Relu edges cannot be cut from what Stack received, and Relu rewrote its input before
    its hook: each edge is drawn and recorded as not observed, with that reason."""
    paddle.seed(1)
    lin = nn.Linear(3, 3)
    xs = [paddle.randn([3, 3]) for _ in range(3)]
    for x in xs:
        x.stop_gradient = False
    with capture_backward(lin) as cap:
        lin(paddle.stack([F.relu(x) for x in xs])).sum().backward()
    g = cap.graph
    into = [e for e in g.edges if g.nodes[e.src].op == "Stack"]
    assert len(into) == 3 and all(e.grad.note == "overwritten" and e.grad.norm is None for e in into)
    dot = to_dot(g)
    for e in into:
        line = next(l for l in dot.split("\n") if l.strip().startswith(f"n{e.src} -> n{e.dst} "))
        assert "overwrote it in place" in line and "dashed" in line, line


@pytest.mark.parametrize("op", ["exp", "tanh", "sigmoid", "silu"])
def test_the_root_edge_of_a_loss_ending_in_an_inplace_kernel_is_one(op):
    """``loss = exp(z.mean())`` drew its root edge |g| 2.89 (what exp passed on): it is d loss/d loss = 1."""
    paddle.seed(0)
    lin = nn.Linear(4, 4)
    f = getattr(paddle, op, None) or getattr(F, op)
    with capture_backward(lin) as cap:
        loss = f(lin(paddle.randn([3, 4])).mean())
        loss.backward()
    g = cap.graph
    root = next(e for e in g.edges if g.nodes[e.src].kind == "root")
    assert root.grad.norm == 1.0


def test_the_root_edge_is_the_grad_tensor_the_user_passed():
    paddle.seed(0)
    lin = nn.Linear(4, 3)
    gt = paddle.randn([2, 3])
    with capture_backward(lin) as cap:
        paddle.exp(lin(paddle.randn([2, 4]))).backward(gt)
    root = next(e for e in cap.graph.edges if cap.graph.nodes[e.src].kind == "root")
    assert root.grad.norm == pytest.approx(norm64(gt), rel=1e-7)


# --------------------------------------------------------------------------
# 2. paddle.grad with some inputs only
# --------------------------------------------------------------------------
def _mlp():
    paddle.seed(3)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def test_paddle_grad_wrt_one_weight_puts_its_gradient_on_its_edge_and_lists_only_it():
    """GradNorm-style ``paddle.grad(loss, [last.weight])``: Paddle computes only the slots that lead
    to that weight. The weight's gradient used to land on the edge into the activation, the weight
    showed no norm, and three parameters Paddle never computed were counted as reached."""
    m = _mlp()
    x = paddle.randn([3, 4])
    with capture_backward(m) as cap:
        (gw,) = paddle.grad(m(x).mean(), [m[4].weight])
    g = cap.graph
    assert set(g.params()) == {"4.weight"}
    assert g.params()["4.weight"].norm == pytest.approx(norm64(gw), rel=1e-7)
    into = [e for e in g.edges if g.nodes[e.dst].param == "4.weight"]
    assert len(into) == 1 and into[0].grad.norm == pytest.approx(norm64(gw), rel=1e-7)
    assert not any(g.nodes[e.dst].op == "Tanh" for e in g.edges)  # never computed: not drawn
    assert "1 parameters reached" in graph_summary(g)


@pytest.mark.parametrize("create_graph", [False, True], ids=["plain", "gradient_penalty"])
def test_paddle_grad_wrt_the_input_reaches_no_parameter(create_graph):
    """``paddle.grad(out, x)`` (a gradient penalty with ``create_graph=True``) computes no parameter
    gradient: no parameter is listed, no edge is drawn into one, and the edge into x is its gradient."""
    m = _mlp()
    x = paddle.randn([3, 4])
    x.stop_gradient = False
    with capture_backward(m) as cap:
        out = m(x)
        (gx,) = paddle.grad(out, x, create_graph=create_graph)
    g = cap.graph
    assert g.params() == {}
    assert not any(g.nodes[e.dst].kind == "param" for e in g.edges)
    leaf = [e for e in g.edges if g.nodes[e.dst].kind == "input"]
    assert len(leaf) == 1 and leaf[0].grad.norm == pytest.approx(norm64(gx), rel=1e-7)
    assert all(p.grad is None for p in m.parameters())


def test_paddle_grad_wrt_a_hidden_tensor_and_a_weight():
    m = _mlp()
    x = paddle.randn([3, 4])
    with capture_backward(m) as cap:
        h = m[1](m[0](x))
        out = m[4](m[3](m[2](h)) + 0.5 * h)
        gh, gw = paddle.grad(out.mean(), [h, m[2].weight])
    g = cap.graph
    assert set(g.params()) == {"2.weight"}
    assert g.params()["2.weight"].norm == pytest.approx(norm64(gw), rel=1e-7)
    relu = next(n for n in g.nodes if n.op == "Relu")  # h's node: its gradient is the sum of two uses
    assert relu.received.norm == pytest.approx(norm64(gh), rel=1e-6)
    assert not any(e.src == relu.id for e in g.edges)  # Paddle does not run it


# --------------------------------------------------------------------------
# 3. the replayed NaN/Inf step: parameter rows are that step's parameter gradients
# --------------------------------------------------------------------------
class Tied(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mix = nn.Linear(8, 8)

    def forward(self, ids, s):
        h = F.gelu(self.mix(self.emb(ids) * paddle.sqrt(s)))
        return paddle.matmul(h, self.emb.weight, transpose_y=True)


def test_a_replayed_step_gives_a_tied_parameter_its_real_gradient_not_a_combination_of_its_uses():
    """A replay goes through ``paddle.grad(outputs, params)``: the rows of a parameter used twice
    are what it returns (the sum of both uses), exactly ``param.grad`` of a normal backward."""
    paddle.seed(0)
    net = Tied()
    ids = paddle.to_tensor(np.random.RandomState(0).randint(0, 16, (2, 5)).astype("int64"))
    s = paddle.full([2, 5, 1], 2.0)
    out = net(ids, s)
    gout = paddle.randn(out.shape)
    out.backward(gout)
    real = {n: norm64(p.grad) for n, p in net.named_parameters()}
    net.clear_gradients()
    with capture_backward(net) as cap:
        out = net(ids, s)
        paddle.grad([out], [p for p in net.parameters()], grad_outputs=[gout])
    rows = cap.graph.params()
    for n, v in real.items():
        assert rows[n].norm == pytest.approx(v, rel=1e-6), n


def test_a_replayed_nan_step_counts_a_tied_parameters_nan_once(tmp_path):
    """on_nonfinite replays the step: the tied embedding's row has the NaN count of the real
    ``param.grad`` (it used to add the NaN counts of its two uses: more NaN than elements)."""
    paddle.seed(0)
    net = Tied()
    opt = paddle.optimizer.SGD(0.01, parameters=net.parameters())
    rng = np.random.RandomState(0)
    rec = BackwardGraphRecorder(str(tmp_path / "vdl"), net, every=10**6, capture_first=False,
                                on_nonfinite=True, verbose=0, visualdl=False, formats=("json",))
    real = {}
    with rec:
        for step in (1, 2):
            ids = paddle.to_tensor(rng.randint(0, 16, (2, 5)).astype("int64"))
            s = paddle.full([2, 5, 1], 2.0 if step == 1 else -1.0)
            s[0, 0, 0] = 2.0 if step == 1 else 1.0
            with rec.step(step):
                loss = net(ids, s).square().mean()
                loss.backward()
            if step == 2:
                real = {n: p.grad.numpy().copy() for n, p in net.named_parameters()}
            opt.clear_grad()
    g = BackwardGraph.from_json((tmp_path / "vdl" / "backward_graph" / "step_000002.json").read_text())
    assert g.meta.get("replayed") is True
    rows = g.params()
    w = real["emb.weight"]
    assert rows["emb.weight"].nan == int(np.isnan(w).sum()) <= w.size
    assert rows["emb.weight"].nonfinite <= w.size


# --------------------------------------------------------------------------
# 4. collapsed views: a box edge standing for several real edges
# --------------------------------------------------------------------------
class Box(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, h):
        return F.relu(self.a(h)) * F.tanh(self.b(h))


class Net(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(6, 6)
        self.box = Box()

    def forward(self, x):
        return self.box(self.pre(x)).sum()


def test_a_box_edge_for_two_uses_of_one_tensor_carries_the_norm_of_their_sum():
    """``pre``'s output is used twice inside ``box``: collapsed to depth 1, one edge box -> pre stands
    for both. It used to show the root-sum-square of the two (not the norm of any tensor)."""
    paddle.seed(2)
    net = Net()
    seen = {}
    orig = net.pre.forward

    def pre(x):
        h = orig(x)
        h.register_hook(lambda g: seen.__setitem__("h", norm64(g)))
        return h

    net.pre.forward = pre
    with capture_backward(net) as cap:
        net(paddle.randn([5, 6])).backward()
    small = collapse_graph(cap.graph, depth=1)
    box = next(n for n in small.nodes if n.kind == "layer" and n.layer == "box")
    pre_box = next(n for n in small.nodes if n.kind == "layer" and n.layer == "pre")
    e = next(e for e in small.edges if e.src == box.id and e.dst == pre_box.id)
    assert e.grad.norm == pytest.approx(seen["h"], rel=1e-6)  # was 3.7% off on a MobileNetV2-style net
    assert e.grad.parts == 1


def test_a_box_edge_for_gradients_of_different_tensors_says_it_is_a_combined_figure():
    from paddleviz_hooks.graph import Edge, GradMeta, Node

    g = BackwardGraph(
        nodes=[Node(0, "root", "loss", "loss"), Node(1, "op", "AddGradNode", "Add", layer="box", hooked=True),
               Node(2, "op", "ExpGradNode", "Exp", layer="up", hooked=True),
               Node(3, "op", "TanhGradNode", "Tanh", layer="up", hooked=True)],
        edges=[Edge(0, 1, grad=GradMeta((), "float32", norm=1.0)),
               Edge(1, 2, 0, GradMeta((4,), "float32", norm=3.0)), Edge(1, 3, 1, GradMeta((4,), "float32", norm=4.0))],
        layers={"": "Net", "box": "B", "up": "U"}, meta={"grad_stats": True})
    small = collapse_graph(g, depth=1)
    e = next(e for e in small.edges if small.nodes[e.src].layer == "box")
    assert "2 gradients, root-sum-square of |g| 5" in to_dot(small)  # never drawn as one gradient's |g| 5
    assert e.grad.parts == 2 and e.grad.norm == 5.0


# --------------------------------------------------------------------------
# 6. the truth oracle over a zoo (fast subset here; all of it with --runslow)
# --------------------------------------------------------------------------
def _run_zoo(names):
    from truth.oracle import check_case
    from truth.zoo import ZOO

    bad = {}
    for name in names:
        res = check_case(ZOO[name])
        if not res.passed:
            bad[name] = res.failures[:3]
    assert not bad, bad


def test_truth_oracle_fast_subset():
    from truth.zoo import FAST

    _run_zoo(FAST)


@pytest.mark.slow
def test_truth_oracle_whole_zoo():
    from truth.zoo import ZOO

    assert len(ZOO) >= 25
    _run_zoo(list(ZOO))


# --------------------------------------------------------------------------
# the measured list of in-place backward kernels (hazards.py)
# --------------------------------------------------------------------------
def _unary(name, lo=-0.9, hi=0.9):
    f = getattr(F, name, None) or getattr(paddle, name)
    return f, lo, hi


_INPLACE_OPS = {
    "AcosGradNode": _unary("acos"), "AcoshGradNode": _unary("acosh", 1.5, 2.5), "AsinGradNode": _unary("asin"),
    "AsinhGradNode": _unary("asinh"), "AtanGradNode": _unary("atan"), "AtanhGradNode": _unary("atanh"),
    "CeilGradNode": _unary("ceil"), "CeluGradNode": _unary("celu"), "ClipGradNode": (lambda x: paddle.clip(x, -0.3, 0.3), -0.9, 0.9),
    "CosGradNode": _unary("cos"), "CoshGradNode": _unary("cosh"), "EluGradNode": _unary("elu"), "ExpGradNode": _unary("exp"),
    "Expm1GradNode": _unary("expm1"), "FloorGradNode": _unary("floor"),
    "GroupNormGradNode": (lambda x: F.group_norm(x.reshape([1, 2, 3]), 1), -0.9, 0.9),
    "HardshrinkGradNode": _unary("hardshrink"), "HardsigmoidGradNode": _unary("hardsigmoid"),
    "HardswishGradNode": _unary("hardswish"), "HardtanhGradNode": _unary("hardtanh"), "LeakyReluGradNode": _unary("leaky_relu"),
    "Log10GradNode": _unary("log10", 0.2, 0.9), "Log1pGradNode": _unary("log1p", 0.2, 0.9), "Log2GradNode": _unary("log2", 0.2, 0.9),
    "LogGradNode": _unary("log", 0.2, 0.9), "LogsigmoidGradNode": _unary("log_sigmoid"),
    "MaskedFillGradNode": (lambda x: paddle.masked_fill(x, x > 0, 0.0), -0.9, 0.9), "MishGradNode": _unary("mish"),
    "PowGradNode": (lambda x: x ** 3, -0.9, 0.9), "ReciprocalGradNode": _unary("reciprocal", 0.2, 0.9),
    "Relu6GradNode": _unary("relu6"), "ReluGradNode": _unary("relu"), "RoundGradNode": _unary("round"),
    "RsqrtGradNode": _unary("rsqrt", 0.2, 0.9), "SigmoidGradNode": _unary("sigmoid"), "SiluGradNode": _unary("silu"),
    "SinGradNode": _unary("sin"), "SinhGradNode": _unary("sinh"), "SoftplusGradNode": _unary("softplus"),
    "SoftshrinkGradNode": _unary("softshrink"), "SoftsignGradNode": _unary("softsign"), "SqrtGradNode": _unary("sqrt", 0.2, 0.9),
    "SquareGradNode": _unary("square"), "SwishGradNode": _unary("swish"), "TanGradNode": _unary("tan"),
    "TanhGradNode": _unary("tanh"), "TanhShrinkGradNode": _unary("tanhshrink"), "ThresholdedReluGradNode": _unary("thresholded_relu"),
}
_UNCHANGED_OPS = {
    "AddGradNode": lambda x: x + paddle.ones_like(x), "SubtractGradNode": lambda x: x - paddle.ones_like(x),
    "ReshapeGradNode": lambda x: x.reshape([3, 2]), "FlattenGradNode": lambda x: paddle.flatten(x),
    "SqueezeGradNode": lambda x: x.unsqueeze(0).squeeze(0), "TransposeGradNode": lambda x: x.t().t(),
    "IndexAddGradNode": lambda x: paddle.index_add(x, paddle.to_tensor([0]), 0, paddle.ones([1, 3])),
}


def _probe(fn, lo, hi):
    """(kind, what its hook read equals the gradient it received, that buffer shared with an output)."""
    from paddleviz_hooks.capture.stats import flat_tensors

    x = paddle.to_tensor(np.random.RandomState(0).uniform(lo, hi, (2, 3)).astype("float32"))
    x.stop_gradient = False
    y = fn(x)
    seen = {}
    y.register_hook(lambda g: seen.__setitem__("oracle", g.numpy().copy()))

    def post(outs, ins):
        r, o = flat_tensors(ins), flat_tensors(outs)
        seen["read"] = r[0].numpy().copy()
        seen["shared"] = any(a.data_ptr() == b.data_ptr() for a in r for b in o)
        return outs

    h = y.grad_fn._register_post_hook(post)
    kind = y.grad_fn.name()
    c = paddle.concat([y, paddle.zeros_like(y)], axis=0)  # Concat takes no hook: nothing else holds the buffer
    (c * paddle.arange(12, dtype="float32").reshape(c.shape)).sum().backward()
    h.remove()
    return kind, bool(np.array_equal(seen["read"], seen["oracle"])), seen["shared"]


def test_the_inplace_backward_kernels_are_the_measured_ones():
    """Each kind listed in ``hazards.INPLACE_BACKWARD`` writes what it passes on into the buffer it
    received (same address), and each in ``SHARES_RECEIVED_UNCHANGED`` shares it without changing it."""
    from paddleviz_hooks.hazards import INPLACE_BACKWARD, SHARES_RECEIVED_UNCHANGED

    assert set(_INPLACE_OPS) == set(INPLACE_BACKWARD) and set(_UNCHANGED_OPS) == set(SHARES_RECEIVED_UNCHANGED)
    for want, (fn, lo, hi) in _INPLACE_OPS.items():
        kind, _, shared = _probe(fn, lo, hi)  # where its local derivative is 1 the values even stay
        assert (kind, shared) == (want, True), (want, kind, shared)
    for want, fn in _UNCHANGED_OPS.items():
        kind, same, shared = _probe(fn, -0.9, 0.9)
        assert (kind, same, shared) == (want, True, True), (want, kind, same, shared)


def test_a_parameter_row_follows_the_users_own_hook():
    """A parameter used once reuses its edge's statistics only when its leaf hook receives that very
    tensor unchanged (same address, same in-place version; Paddle refuses in-place changes there);
    a user's hook that returns another gradient is seen."""
    paddle.seed(0)
    lin = nn.Linear(4, 3)
    lin.weight.register_hook(lambda g: g * 3.0)
    with capture_backward(lin) as cap:
        lin(paddle.randn([2, 4])).sum().backward()
    assert cap.graph.params()["weight"].norm == pytest.approx(norm64(lin.weight.grad), rel=1e-7)


# --------------------------------------------------------------------------
# gradient hooks that change a gradient between its producer and its receiver
# --------------------------------------------------------------------------
def test_an_edge_a_users_gradient_hook_changed_shows_both_what_was_sent_and_what_arrived():
    """``h.register_hook(lambda g: g * 10)`` on an intermediate and ``weight.register_hook(lambda g: g * 0.5)``
    on a parameter: the edge into h's node carries what its producer sent and, marked, what the
    node received after the hook (the node's own outputs follow from that); the edge into the
    parameter likewise, its row being param.grad. Before, the edges showed only what was sent, so
    a bias Add seemed to multiply its gradient by 10 and nothing said a hook was there."""
    paddle.seed(4)
    l1, l2, l3 = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)
    model = nn.LayerList([l1, l2, l3])
    seen: dict[str, float] = {}
    l1.weight.register_hook(lambda g: seen.__setitem__("w sent", norm64(g)))  # the oracle's, first
    l1.weight.register_hook(lambda g: g * 0.5)
    x = paddle.randn([3, 4])
    with capture_backward(model) as cap:
        h = l2(F.relu(l1(x)))
        h.register_hook(lambda g: seen.__setitem__("h sent", norm64(g)))
        h.register_hook(lambda g: g * 10.0)
        h.register_hook(lambda g: seen.__setitem__("h received", norm64(g)))
        (l3(F.sigmoid(h)) ** 2).sum().backward()
    g = cap.graph
    into_h = edge(g, "Sigmoid", "Add")
    assert into_h.grad.norm == pytest.approx(seen["h sent"], rel=1e-6)
    assert into_h.after_hook.norm == pytest.approx(seen["h received"], rel=1e-6)
    assert seen["h received"] == pytest.approx(10 * seen["h sent"], rel=1e-6)
    w = next(n for n in g.nodes if n.param == "0.weight")
    into_w = next(e for e in g.edges if e.dst == w.id)
    assert into_w.grad.norm == pytest.approx(seen["w sent"], rel=1e-6)
    assert into_w.after_hook.norm == pytest.approx(norm64(l1.weight.grad), rel=1e-6)
    assert g.params()["0.weight"].norm == pytest.approx(norm64(l1.weight.grad), rel=1e-6)
    assert [e for e in g.edges if e.after_hook is not None] == [into_h, into_w]  # nowhere else
    dot = to_dot(g)
    assert dot.count("a hook changed it: |g|") == 2  # the two edge labels (tooltips say it too)
    back = BackwardGraph.from_json(g.to_json())
    assert [e.after_hook for e in back.edges] == [e.after_hook for e in g.edges]


def test_no_edge_is_marked_changed_where_paddle_only_copied_the_gradient():
    """A transposed gradient is made contiguous before a Reshape receives it (another tensor,
    the same numbers): no hook changed it, and no edge says one did."""
    paddle.seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), 2)
    with capture_backward(enc) as cap:
        enc(paddle.randn([2, 3, 8])).mean().backward()
    g = cap.graph
    assert any(g.nodes[e.src].op == "Transpose" and g.nodes[e.dst].op == "Reshape" for e in g.edges)
    assert all(e.after_hook is None for e in g.edges)


def test_a_hook_that_scales_the_gradient_in_place_is_marked_too():
    """A hook may change the gradient where it lies (``g.scale_(3)`` under no_grad): the same
    tensor arrives, its in-place version moved; the edge says what arrived (it said nothing,
    and the bias Add after it seemed to triple the gradient)."""
    paddle.seed(1)
    lin, out = nn.Linear(4, 4), nn.Linear(4, 1)
    seen: dict[str, float] = {}

    def scale_in_place(g):
        seen["sent"] = norm64(g)
        with paddle.no_grad():
            g.scale_(3.0)
        seen["arrived"] = norm64(g)

    with capture_backward(nn.LayerList([lin, out])) as cap:
        h = out(paddle.tanh(lin(paddle.randn([3, 4]))))
        h.register_hook(scale_in_place)
        h.sum().backward()
    g = cap.graph
    changed = [e for e in g.edges if e.after_hook is not None]
    assert len(changed) == 1
    assert changed[0].grad.norm == pytest.approx(seen["sent"], rel=1e-6)
    assert changed[0].after_hook.norm == pytest.approx(seen["arrived"], rel=1e-6)


class _Two(nn.Layer):
    def forward(self, h):
        return paddle.tanh(h) + paddle.exp(h)


class _HookedSum(nn.Layer):
    """h feeds two ops of box ``two``; a hook on h may change the sum that reaches lin."""

    def __init__(self, hook=None):
        super().__init__()
        self.lin, self.two, self.head, self.hook = nn.Linear(4, 4), _Two(), nn.Linear(4, 1), hook

    def forward(self, x):
        h = self.lin(x)
        if self.hook is not None:
            h.register_hook(self.hook)
        return self.head(self.two(h))


@pytest.mark.parametrize("hooked", [False, True])
def test_a_collapsed_edge_never_gives_a_hook_changed_sum_as_the_sum_sent(hooked):
    """Box 'two' sends two gradients to lin's Add; drawn collapsed they are one edge, which
    carries the exact sum Add received. With a hook multiplying that sum by 10, the sum
    received is not what 'two' sent: the edge said |g| 129 as if sent; now it combines the
    two parts it knows and says so (without a hook: the exact sum, as before)."""
    paddle.seed(3)
    x = paddle.randn([3, 4])
    seen: dict[str, float] = {}

    def hook(g):
        seen["sum sent"] = norm64(g)
        return g * 10.0

    net = _HookedSum(hook if hooked else None)
    with capture_backward(net) as cap:
        net(x).sum().backward()
    c = collapse_graph(cap.graph, depth=1)
    e = next(e for e in c.edges if c.nodes[e.src].layer == "two" and c.nodes[e.dst].layer == "lin")
    if hooked:
        assert e.grad.parts == 2  # the parts combined, said to be (no one tensor's norm)
        assert e.grad.norm != pytest.approx(10 * seen["sum sent"], rel=1e-3)
    else:
        assert e.grad.parts == 1  # the exact sum Add received
