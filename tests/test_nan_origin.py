"""Where a NaN/Inf really starts (issue 13): the forward op, its layer and source line, at the very step.

Every model misbehaves through its *data* at a known step (a replay of the
step reproduces it), and names the op on a line marked ``# origin:<tag>``,
so each test asserts the exact op, layer and line.
"""

from __future__ import annotations

import pathlib
import json
import math
import os

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

from paddleviz_hooks import BackwardGraph, BackwardGraphCallback, BackwardGraphRecorder, find_nonfinite_origin, summarize
from paddleviz_hooks.capture import dispatcher_installed
from paddleviz_hooks.text import describe_origin

from _fitkit import assert_same_run, no_leftover_hooks, ours, recorded_warnings, run_fit, text_records, vdl_records

K = 4  # the step where things go wrong
D, H, C = 6, 8, 3
FLAGS = ["FLAGS_check_nan_inf", "FLAGS_check_nan_inf_level"]


def line_of(tag: str) -> int:
    """The line of this file marked ``# origin:<tag>``."""
    with open(__file__, encoding="utf-8") as f:
        hits = [i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# origin:{tag}")]
    assert len(hits) == 1, tag
    return hits[0]


def positive_linear(d_in: int, d_out: int) -> nn.Linear:
    """A Linear whose output is positive for positive inputs (and negative for negative ones)."""
    lin = nn.Linear(d_in, d_out)
    lin.weight.set_value(lin.weight.abs() + 0.05)
    lin.bias.set_value(paddle.zeros_like(lin.bias))
    return lin


class SqrtBlock(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.lin = positive_linear(D, H)

    def forward(self, x):
        h = self.lin(x)
        return paddle.sqrt(h)  # origin:sqrt


class SqrtNet(nn.Layer):
    """Finite for positive inputs; sqrt of a negative in ``block`` for negative ones.
    BatchNorm and Dropout make a replay that forgot to restore visible."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1D(D)
        self.block = SqrtBlock()
        self.post = nn.Identity()
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(H, C)

    def forward(self, x):
        x = paddle.abs(self.bn(x)) * paddle.sign(x)  # the input's sign survives BatchNorm
        return self.head(self.drop(self.post(self.block(x))))


class SwallowNet(SqrtNet):
    """relu(NaN) == 0 on CPU: the loss stays finite, only gradients under ``block`` turn NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.post = nn.ReLU()


class BackwardOnlyNet(nn.Layer):
    """sqrt(relu(h)): sqrt(0) == 0 in the forward, its backward divides by 0."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(positive_linear(D, H), nn.ReLU())
        self.head = nn.Linear(H, C)

    def forward(self, x):
        return self.head(paddle.sqrt(self.block(x)))


class SignedData(paddle.io.Dataset):
    """Positive features; the batch of step ``bad`` (batch size ``bs``) is negated."""

    def __init__(self, n: int, bad: int, bs: int = 2, nan: bool = False) -> None:
        rng = np.random.RandomState(0)
        self.x = (np.abs(rng.randn(n, D)) + 0.1).astype("float32")
        self.x[(bad - 1) * bs: bad * bs] *= -1.0
        if nan:
            self.x[(bad - 1) * bs, 0] = np.nan
        self.y = rng.randint(0, C, (n, 1)).astype("int64")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def _graph(tmp_path, step: int) -> BackwardGraph:
    path = tmp_path / "vdl" / "backward_graph" / f"step_{step:06d}.json"
    return BackwardGraph.from_json(path.read_text())


def _cb(tmp_path, **kw) -> BackwardGraphCallback:
    kw = {"every": 10**6, "capture_first": False, "on_nonfinite": True, "verbose": 1, "view_max_px": 300,
          "formats": ("json", "dot"), **kw}
    return BackwardGraphCallback(str(tmp_path / "vdl"), **kw)


def _fit(net_cls, callbacks=(), steps=K, loss=None, nan=False):
    return run_fit(net_cls, callbacks=callbacks, steps=steps, batch_size=2, loss=loss, lr=0.05,
                   dataset=SignedData(2 * steps, K, nan=nan))


def _next_draw() -> bytes:
    return paddle.rand([4]).numpy().tobytes()


def _assert_sqrt_origin(o: dict) -> None:
    assert o["kind"] == "forward"
    assert (o["op"], o["layer"], o["layer_class"]) == ("sqrt", "block", "SqrtBlock")
    assert os.path.basename(o["file"]) == "test_nan_origin.py" and o["line"] == line_of("sqrt")
    assert o["code"] == "return paddle.sqrt(h)  # origin:sqrt"


# --------------------------------------------------------------------------
# Model.fit: a NaN loss through sqrt in a sublayer, bit-identical training
# --------------------------------------------------------------------------
def test_sqrt_in_a_sublayer_is_named_everywhere_and_training_is_bit_identical(tmp_path, capsys):
    plain = _fit(SqrtNet)
    after_plain = _next_draw()
    cb = _cb(tmp_path, visualdl=True)
    with recorded_warnings() as got:
        res = _fit(SqrtNet, callbacks=[cb])
    after_ours = _next_draw()
    assert ours(got) == []
    assert np.isfinite(res.losses[:K - 1]).all() and not np.isfinite(res.losses[K - 1])
    # losses, parameters, BatchNorm statistics and the next random draw are untouched by the replay
    assert_same_run(plain, res)
    assert after_ours == after_plain
    assert no_leftover_hooks(res.net) and not dispatcher_installed()
    assert paddle.get_flags(FLAGS) == {"FLAGS_check_nan_inf": False, "FLAGS_check_nan_inf_level": 0}

    assert cb.captured_steps == [K] and cb.triggers == {K: "nonfinite_loss"}
    g = _graph(tmp_path, K)
    o = g.nonfinite.origin.to_dict()
    _assert_sqrt_origin(o)
    node = g.node_by_key()[o["key"]]
    assert (node.op, node.layer) == ("Sqrt", "block")
    # replayed before the update (the model's part, from the gradient its output received):
    # gradients alone would name the model output, NaN from the loss on; the origin is the forward op
    assert g.meta["replayed"] is True and math.isnan(g.meta["loss"])
    assert g.nonfinite_sites()[0].kind == "root" and g.nonfinite_sites()[0].op == "model output"

    text = describe_origin(o)
    assert text == (f"NaN/Inf first produced by op 'sqrt' in layer 'block' (SqrtBlock) at "
                    f"test_nan_origin.py:{line_of('sqrt')}: return paddle.sqrt(h)  # origin:sqrt")
    out = capsys.readouterr().out
    assert f"captured step {K} (trigger: nonfinite_loss); {text}; NaN/Inf gradients at {g.nonfinite.gradient_sites} nodes, first non-finite gradient at the model output" in out
    assert "[PRECISION]" not in out and "op=sqrt" not in out  # the checker's own line is swallowed
    texts = text_records(vdl_records(tmp_path / "vdl" / "backward_graph"), "summary")
    assert text in texts[K]
    dot = (tmp_path / "vdl" / "backward_graph" / f"step_{K:06d}.dot").read_text()
    assert f"NaN/Inf starts here: sqrt, test_nan_origin.py:{line_of('sqrt')}" in dot
    assert "#7b1fa2" in dot  # the origin's frame colour

    from paddleviz_hooks import build_report

    html = pathlib.Path(build_report(str(tmp_path / "vdl"), str(tmp_path / "report.html"))).read_text(encoding="utf-8")
    assert "starts here</span> NaN/Inf first produced by op &#x27;sqrt&#x27; in layer &#x27;block&#x27;" in html


# --------------------------------------------------------------------------
# relu swallows the NaN: finite loss, captured at that same step
# --------------------------------------------------------------------------
def test_nan_swallowed_by_relu_is_captured_at_the_same_step_before_the_update(tmp_path, capsys):
    paddle.seed(0)
    net = SwallowNet()
    net.head.weight.set_value(net.head.weight.abs())
    opt = paddle.optimizer.SGD(0.05, parameters=net.parameters())
    data = SignedData(2 * K, K)
    rec = BackwardGraphRecorder(str(tmp_path / "vdl"), net, every=10**6, capture_first=False,
                                on_nonfinite=True, verbose=1, visualdl=False, formats=("json", "dot"))
    real: dict[str, np.ndarray] = {}
    with recorded_warnings() as got, rec:
        for step in range(1, K + 1):
            x = paddle.to_tensor(data.x[(step - 1) * 2: step * 2])
            with rec.step(step):
                loss = net(x).square().mean()
                loss.backward()
            if step == K:
                assert math.isfinite(float(loss))
                real = {n: p.grad.numpy().copy() for n, p in net.named_parameters() if p.grad is not None}
                weights = {n: p.numpy().copy() for n, p in net.named_parameters()}
            opt.step()
            opt.clear_grad()
    assert ours(got) == []
    assert rec.captured_steps == [K] and rec.triggers == {K: "nonfinite_grad"}
    assert all(np.isfinite(w).all() for w in weights.values())  # the captured step ran on finite weights
    g = BackwardGraph.from_json((tmp_path / "vdl" / "backward_graph" / f"step_{K:06d}.json").read_text())
    assert g.meta["replayed"] is True and g.meta["step"] == K
    _assert_sqrt_origin(g.nonfinite.origin.to_dict())
    # the replayed graph carries the real step's gradients: NaN exactly where param.grad is NaN,
    # and the finite ones equal to it
    params = g.params()
    bad = {n for n, v in real.items() if not np.isfinite(v).all()}
    assert bad == {"bn.weight", "bn.bias", "block.lin.weight", "block.lin.bias"}  # head.* stay finite
    assert {n for n, m in params.items() if m is not None and m.nonfinite} == bad
    for n in set(real) - bad:
        ref = float(np.linalg.norm(real[n].astype("float64")))
        assert params[n].norm == pytest.approx(ref, rel=1e-5, abs=1e-12), n
    out = capsys.readouterr().out
    assert f"non-finite gradients at step {K} with a finite loss; capturing step {K} (replayed" in out
    assert f"captured step {K} (trigger: nonfinite_grad); NaN/Inf first produced by op 'sqrt'" in out


# --------------------------------------------------------------------------
# find_nonfinite_origin: one checked forward, no side effects
# --------------------------------------------------------------------------
class LogTop(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, H)

    def forward(self, x):
        return paddle.log(self.lin(x))  # origin:log


class DivNet(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, H)

    def forward(self, x):
        h = self.lin(x)
        return h / (h - h)  # origin:div


class Amplify(nn.Layer):
    def forward(self, h):
        return paddle.exp(h * 1000.0)  # origin:exp


class ExpNet(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.lin = positive_linear(D, H)
        self.amp = nn.Sequential(nn.Tanh(), Amplify())

    def forward(self, x):
        return self.amp(self.lin(x))


@pytest.mark.parametrize("net_cls,op,layer,layer_class,tag", [
    (LogTop, "log", "", "LogTop", "log"),            # log in the top layer
    (DivNet, "divide", "", "DivNet", "div"),         # 0/0 through the `/` operator
    (ExpNet, "exp", "amp.1", "Amplify", "exp"),      # exp overflow to Inf in a nested sublayer
])
def test_find_nonfinite_origin_names_op_layer_and_line(net_cls, op, layer, layer_class, tag, capfd):
    paddle.seed(1)
    net = net_cls()
    x = paddle.to_tensor(np.abs(np.random.RandomState(1).randn(2, D)).astype("float32") + 0.5)
    if net_cls is LogTop:
        x = -x
    flags = paddle.get_flags(FLAGS)
    before = {k: v.numpy().tobytes() for k, v in net.state_dict().items()}
    o = find_nonfinite_origin(net, x)
    assert (o["kind"], o["op"], o["layer"], o["layer_class"]) == ("forward", op, layer, layer_class)
    assert o["line"] == line_of(tag) and o["code"].endswith(f"# origin:{tag}")
    assert paddle.get_flags(FLAGS) == flags and paddle.is_grad_enabled()
    assert {k: v.numpy().tobytes() for k, v in net.state_dict().items()} == before
    assert capfd.readouterr().out == ""


def test_an_origin_in_paddles_own_layers_names_no_standard_library_line():
    """A Sequential of Paddle's layers fed a batch holding Inf: BatchNorm makes the NaN. No
    frame of the user's code runs the op (the batch's Inf is located in a fresh thread):
    no line is named, rather than threading.py's bootstrap line."""
    paddle.seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1D(16), nn.ReLU(), nn.Linear(16, 2))
    x = np.random.RandomState(0).randn(8, 4).astype("float32")
    x[0, 0] = np.inf
    o = find_nonfinite_origin(net, paddle.to_tensor(x))
    assert (o["op"], o["layer"]) == ("batch_norm", "1")
    assert o["file"] is None and o["line"] is None, o


def test_find_nonfinite_origin_restores_rng_batchnorm_and_the_users_flags(capfd):
    paddle.seed(3)
    net = SqrtNet()
    x = paddle.to_tensor(-np.abs(np.random.RandomState(2).randn(4, D)).astype("float32") - 0.1)
    paddle.set_flags({"FLAGS_check_nan_inf_level": 3})  # a user's own setting survives
    try:
        state = paddle.get_rng_state()
        bn = {k: v.numpy().tobytes() for k, v in net.state_dict().items()}
        _assert_sqrt_origin(find_nonfinite_origin(net, x))
        assert find_nonfinite_origin(net, -x) is None  # a finite forward: dropout draws, BatchNorm updates
        after = _next_draw()
        paddle.set_rng_state(state)
        assert _next_draw() == after  # the replay's dropout draws were given back
        assert {k: v.numpy().tobytes() for k, v in net.state_dict().items()} == bn
        assert paddle.get_flags(FLAGS) == {"FLAGS_check_nan_inf": False, "FLAGS_check_nan_inf_level": 3}
    finally:
        paddle.set_flags({"FLAGS_check_nan_inf_level": 0})
    assert capfd.readouterr().out == ""
    x.stop_gradient = True
    with pytest.raises(TypeError, match="model must be a paddle.nn.Layer, got Tensor"):
        find_nonfinite_origin(x)


def test_nan_in_the_input_batch_is_the_input_data(tmp_path, capsys):
    o = find_nonfinite_origin(SqrtNet(), paddle.to_tensor([[math.nan] * D]))
    assert o["kind"] == "input" and o["op"] is None and o["layer"] is None and o["line"] is None
    cb = _cb(tmp_path)
    _fit(SqrtNet, callbacks=[cb], nan=True)
    assert cb.captured_steps == [K]
    o = _graph(tmp_path, K).nonfinite.origin.to_dict()
    assert (o["kind"], o["op"], o["layer"], o["line"]) == ("input", None, None, None)
    assert "NaN/Inf already in the input data" in capsys.readouterr().out


def test_nan_made_only_in_the_backward_falls_back_to_the_first_gradient(tmp_path):
    cb = _cb(tmp_path)
    res = _fit(BackwardOnlyNet, callbacks=[cb])
    assert np.isfinite(res.losses).all()  # sqrt(0) = 0: the forward is finite
    assert cb.captured_steps == [K] and cb.triggers == {K: "nonfinite_grad"}
    g = _graph(tmp_path, K)
    o = g.nonfinite.origin.to_dict()
    assert (o["kind"], o["op"], o["layer"], o["line"]) == ("backward", None, None, None)
    first = g.nonfinite.first_gradient  # a fact of its own, under its own name
    assert (first.op, first.layer) == ("Sqrt", "")
    assert describe_origin(o) == "the forward is finite everywhere: NaN/Inf made in the backward"
    assert ("first non-finite gradient at Sqrt in the model's own forward (test_nan_origin.py:92: "
            "return self.head(paddle.sqrt(self.block(x))));") in summarize(g)  # with its line (paddle.grad's)


class SqrtLoss(nn.Layer):
    def forward(self, pred, label):
        return paddle.sqrt(pred.mean() - 1e3)  # NaN made outside the model


def test_nan_in_the_loss_function_is_outside_the_model(tmp_path):
    cb = _cb(tmp_path)
    res = _fit(SqrtNet, callbacks=[cb], loss=SqrtLoss(), steps=2)
    assert not np.isfinite(res.losses).any()
    assert cb.captured_steps == [1]
    g = _graph(tmp_path, 1)
    o = g.nonfinite.origin.to_dict()
    assert (o["kind"], o["layer"], o["line"]) == ("outside", None, None)
    assert g.nonfinite.first_gradient.op == g.nonfinite_sites()[0].op and g.nonfinite_sites()[0].layer is None
    assert describe_origin(o).startswith("the model's forward is finite: NaN/Inf made outside the model")


def test_on_nonfinite_alone_keeps_two_hooks_on_the_model_and_scheduled_steps_still_name_layers(tmp_path):
    """The per-step cost of on_nonfinite: two hooks on the top layer (no layer-call patch);
    a scheduled capture still attributes ops to layers; an exception removes it all."""
    from paddleviz_hooks.capture.attribution import _LAYER_CALLS

    paddle.seed(0)
    net = SqrtNet()
    data = SignedData(8, bad=99)
    rec = BackwardGraphRecorder(str(tmp_path / "vdl"), net, every=2, capture_first=False, on_nonfinite=True,
                                verbose=0, visualdl=False, formats=("json",))
    hooks, patched = [], []
    for step in (1, 2):
        with rec.step(step):
            hooks.append({path: len(sub._forward_pre_hooks) + len(sub._forward_post_hooks)
                          for path, sub in net.named_sublayers(include_self=True)})
            patched.append(_LAYER_CALLS.installed())
            net(paddle.to_tensor(data.x[:2])).mean().backward()
        net.clear_gradients()
    assert hooks[0] == {path: (2 if path == "" else 0) for path in hooks[0]}  # step 1: not scheduled
    assert patched == [False, True]  # step 2 is scheduled: its capture sees the layer calls
    assert all(n == 0 for path, n in hooks[1].items() if path)  # ... with no hook on any sublayer
    with pytest.raises(ZeroDivisionError):
        with rec.step(3):
            net(paddle.to_tensor(data.x[:2]))
            1 / 0
    assert no_leftover_hooks(net) and not dispatcher_installed()  # the exception removed every hook
    assert not _LAYER_CALLS.installed()
    rec.close()  # ... and left the recorder open for the next step: its files are written by close()
    g = BackwardGraph.from_json((tmp_path / "vdl" / "backward_graph" / "step_000002.json").read_text())
    assert {n.layer for n in g.nodes if n.kind == "op"} >= {"block", "block.lin", "head", "bn"}
    assert g.nonfinite is None or g.nonfinite.origin is None


def test_model_fit_with_a_swallowed_nan_is_bit_identical_and_captured_at_that_step(tmp_path):
    plain = _fit(SwallowNet)
    after_plain = _next_draw()
    cb = _cb(tmp_path)
    res = _fit(SwallowNet, callbacks=[cb])
    after_ours = _next_draw()
    assert np.isfinite(res.losses).all()  # relu(NaN) == 0: every loss is finite
    assert_same_run(plain, res)  # two replays (graph, checked forward) changed nothing
    assert after_ours == after_plain
    assert cb.captured_steps == [K] and cb.triggers == {K: "nonfinite_grad"}
    g = _graph(tmp_path, K)
    assert g.meta["replayed"] is True and math.isfinite(g.meta["loss"])
    _assert_sqrt_origin(g.nonfinite.origin.to_dict())


def test_the_checked_forward_runs_in_a_fresh_thread_each_time():
    """Paddle's checker grows a per-thread string with every op it checks, so a thread that
    checked forwards before checks slower: each locate gets a new thread (constant cost)."""
    import threading

    seen = []

    class Probe(nn.Layer):
        def forward(self, x):
            seen.append(threading.current_thread())  # the object: idents are reused
            return paddle.log(x)

    for _ in range(3):
        assert find_nonfinite_origin(Probe(), paddle.to_tensor([-1.0]))["op"] == "log"
    assert len({id(t) for t in seen}) == 3 and threading.main_thread() not in seen


def test_nan_already_in_the_weights_is_named_with_its_layer():
    net = SqrtNet()
    with paddle.no_grad():
        net.head.weight[0, 0] = math.nan
    o = find_nonfinite_origin(net, paddle.ones([2, D]))
    assert (o["kind"], o["op"], o["layer"], o["layer_class"], o["line"]) == ("weights", None, "head", "Linear", None)
    assert describe_origin(o) == ("NaN/Inf already in the weights, first in layer 'head' (Linear): "
                                  "an earlier update wrote it")


def test_gradient_accumulation_replays_the_micro_batch_that_went_wrong(tmp_path):
    """Two micro-batches per step; the second of step 2 is negative: that one is replayed."""
    paddle.seed(0)
    net = SwallowNet()
    data = SignedData(8, bad=4)  # batch 4 = step 2, micro-batch 2
    rec = BackwardGraphRecorder(str(tmp_path / "vdl"), net, every=10**6, capture_first=False,
                                on_nonfinite=True, verbose=0, visualdl=False, formats=("json",))
    with rec:
        for step in (1, 2):
            with rec.step(step, micro_batches=2):
                for mb in (0, 1):
                    b = 2 * (step - 1) + mb
                    net(paddle.to_tensor(data.x[2 * b: 2 * b + 2])).square().mean().backward()
            net.clear_gradients()
    assert rec.captured_steps == [2] and rec.triggers == {2: "nonfinite_grad"}
    # the step's second backward, saved as such
    g = BackwardGraph.from_json((tmp_path / "vdl" / "backward_graph" / "step_000002_b2.json").read_text())
    assert g.meta["replayed"] is True and g.nonfinite_count() > 0
    assert g.meta["backward"]["role"] == "micro-batch 2 of 2"
    _assert_sqrt_origin(g.nonfinite.origin.to_dict())


class _SqrtNet(nn.Layer):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.b(paddle.sqrt(self.a(x).abs() + x.mean()))  # NaN when the batch mean is very negative


def _sqrt_run(tmp_path, every, bad_step, steps=4):
    paddle.seed(3)
    net = _SqrtNet()
    with BackwardGraphRecorder(str(tmp_path), net, every=every, on_nonfinite=True, verbose=0,
                               formats=("json", "dot")) as rec:
        for step in range(1, steps + 1):
            x = paddle.rand([2, 4]) - (1000.0 if step == bad_step else 0.0)
            with rec.step(step):
                net(x).mean().backward()
            net.clear_gradients()
    return tmp_path / "backward_graph"


def test_a_scheduled_step_that_goes_nan_is_filed_and_named_as_nan(tmp_path):
    run = _sqrt_run(tmp_path, every=3, bad_step=3)
    g = BackwardGraph.from_json((run / "step_000003.json").read_text())
    assert g.meta["trigger"] == "nonfinite_loss"  # not just 'scheduled': the user is told
    assert g.nonfinite.origin.op == "sqrt"
    # the picture says it too, also where the sqrt has no grad node to frame
    assert "NaN/Inf starts at sqrt in the model's own forward, test_nan_origin.py:" in (run / "step_000003.dot").read_text().replace("\\n", " ")


def test_a_replayed_step_is_compared_from_the_model_output(tmp_path):
    run = _sqrt_run(tmp_path, every=2, bad_step=3)
    replayed = BackwardGraph.from_json((run / "step_000003.json").read_text())
    assert replayed.meta.get("replayed") and replayed.nonfinite.origin.op == "sqrt"
    # the replay is rooted at the model output: compared with step 2 or 4 from there, the loss
    # ops are neither gone nor back again
    assert not list(run.glob("step_*_diff.json")), sorted(p.name for p in run.iterdir())


def test_nan_weights_are_reported_when_the_gradients_are_finite(tmp_path):
    """An update wrote NaN into conv weights; relu turns the NaN activations into 0 on CPU, so
    loss and gradients are finite: the summary must not read as a healthy model."""
    paddle.seed(4)
    net = nn.Sequential(nn.Conv2D(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    with paddle.no_grad():
        w = net[0].weight.numpy()
        w[0, 0, 0, 0] = float("nan")
        net[0].weight.set_value(w)
    with BackwardGraphRecorder(str(tmp_path), net, every=1, verbose=0, formats=("json",)) as rec:
        with rec.step(1):
            net(paddle.rand([2, 3, 8, 8])).mean().backward()
    g = BackwardGraph.from_json((tmp_path / "backward_graph" / "step_000001.json").read_text())
    assert g.nonfinite.weights == ("0.weight",) and g.nonfinite.buffers == ()
    assert "NaN/Inf in the weights of 1 parameter: 0.weight;" in summarize(g)


# --------------------------------------------------------------------------
# ±inf in the inputs is a legitimate value (attention masks)
# --------------------------------------------------------------------------
class MaskedScores(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, H)

    def forward(self, x, mask):
        h = self.q(x)
        scores = h @ h.T + mask  # -inf where masked: not what goes wrong
        return F.softmax(scores, axis=-1)  # origin:masked_softmax


class MaskedNet(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.attn = MaskedScores()
        self.head = nn.Linear(3, C)

    def forward(self, x, mask):
        return self.head(self.attn(x, mask))


def _mask(full_row: int | None = None) -> paddle.Tensor:
    """A [3, 3] additive mask: column 2 (padding) is -inf; row ``full_row`` is masked entirely."""
    m = np.zeros([3, 3], "float32")
    m[:, 2] = -np.inf
    if full_row is not None:
        m[full_row, :] = -np.inf
    return paddle.to_tensor(m)


def _softmax_nans(net: MaskedNet, x: paddle.Tensor, mask: paddle.Tensor) -> int:
    """NaNs of the masked softmax, recomputed in float64 numpy from the layer's weights."""
    w, b = net.attn.q.weight.numpy().astype("float64"), net.attn.q.bias.numpy().astype("float64")
    h = x.numpy().astype("float64") @ w + b
    s = h @ h.T + mask.numpy().astype("float64")
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(-1, keepdims=True))
        return int(np.isnan(e / e.sum(-1, keepdims=True)).sum())


def test_a_mask_holding_inf_is_not_the_origin_the_softmax_over_a_fully_masked_row_is(capfd):
    paddle.seed(5)
    net = MaskedNet()
    x = paddle.randn([3, D])
    assert find_nonfinite_origin(net, x, _mask()) is None  # -inf padding every step: finite
    bad = _mask(full_row=1)
    o = find_nonfinite_origin(net, x, bad)
    assert (o["kind"], o["op"], o["layer"], o["layer_class"]) == ("forward", "softmax", "attn", "MaskedScores")
    assert o["line"] == line_of("masked_softmax") and o["code"].endswith("# origin:masked_softmax")
    assert o["nan"] == _softmax_nans(net, x, bad) == 3 and o["needs_grad"] is True
    assert paddle.get_flags(FLAGS)["FLAGS_check_nan_inf"] is False
    assert capfd.readouterr().out == ""
    # NaN in the inputs is still the input data; NaN weights come before a mask's -inf
    nan_x = x.numpy().copy()
    nan_x[0, 0] = np.nan
    assert find_nonfinite_origin(net, paddle.to_tensor(nan_x), bad)["kind"] == "input"
    with paddle.no_grad():
        net.head.weight[0, 0] = math.nan
    o = find_nonfinite_origin(net, x, bad)
    assert (o["kind"], o["layer"]) == ("weights", "head")


def test_a_fully_masked_row_in_a_hand_loop_names_the_softmax_then_the_weights(tmp_path, capsys):
    paddle.seed(6)
    net = MaskedNet()
    opt = paddle.optimizer.SGD(0.1, parameters=net.parameters())
    rec = BackwardGraphRecorder(str(tmp_path), net, every=10**6, capture_first=False, on_nonfinite=True,
                                cooldown=0, verbose=1, visualdl=False, formats=("json",))
    with rec:
        for step in (1, 2, 3, 4):
            x = paddle.randn([3, D])
            with rec.step(step):
                net(x, _mask(full_row=1 if step == 3 else None)).mean().backward()
            opt.step()
            opt.clear_grad()
    assert rec.captured_steps == [3, 4]
    g3, g4 = (BackwardGraph.from_json((tmp_path / "backward_graph" / f"step_{s:06d}.json").read_text())
              for s in (3, 4))
    o = g3.nonfinite.origin
    assert (o.kind, o.op, o.layer, o.line) == ("forward", "softmax", "attn", line_of("masked_softmax"))
    node = g3.node_by_key()[o.key]  # its own grad node
    assert (node.op, node.layer) == ("Softmax", "attn")
    assert g4.nonfinite.origin.kind == "weights"  # the update of step 3 wrote NaN into them
    out = capsys.readouterr().out
    assert "captured step 3 (trigger: nonfinite_loss); NaN/Inf first produced by op 'softmax' in layer 'attn'" in out
    assert "captured step 4 (trigger: nonfinite_loss); NaN/Inf already in the weights" in out
    assert "already in the input data" not in out


def test_a_scheduled_step_whose_replay_differs_is_not_reproduced_not_made_in_the_backward(tmp_path):
    # the forward makes a NaN only on its 2nd call (state outside the inputs and the RNG), and
    # relu(NaN) = 0 keeps the loss finite: the replay is finite but is not the step's forward, so it
    # cannot say the NaN was made in the backward (it used to, on scheduled steps)
    class OnceBad(nn.Layer):
        def __init__(self):
            super().__init__()
            self.l, self.o, self.calls = nn.Linear(4, 4), nn.Linear(4, 2), 0

        def forward(self, x):
            self.calls += 1
            h = self.l(x)
            if self.calls == 2:
                h = paddle.sqrt(h - 100.0)
            return self.o(F.relu(h))

    paddle.seed(0)
    m = OnceBad()
    with BackwardGraphRecorder(str(tmp_path), m, every=1, on_nonfinite=True, verbose=0, formats=("json",),
                               visualdl=False) as rec:
        for step in (1, 2):
            with rec.step(step):
                F.cross_entropy(m(paddle.randn([3, 4])), paddle.randint(0, 2, [3])).backward()
            m.clear_gradients()
    g = BackwardGraph.from_json((tmp_path / "backward_graph" / "step_000002.json").read_text())
    assert g.nonfinite.first_gradient.op == "Sqrt"
    assert g.nonfinite.origin.kind == "not_reproduced", g.nonfinite.origin
