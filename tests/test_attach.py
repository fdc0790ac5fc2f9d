"""attach(): loops written like the toolkits' tools/train.py, left unedited.

PaddleClas: ``loss / update_freq``, ``optimizer.step()`` every ``update_freq``
iterations on a list of optimizers; PaddleSeg: a plain loop; PaddleOCR under
AMP: ``scaler.minimize(optimizer, loss)``. Oracles: param.grad read in float64
by the optimizer right before it applies it, and the same loop run without
attach.
"""

from __future__ import annotations

import glob
import os
import pathlib

import numpy as np
import paddle
import paddle.nn as nn
import pytest

from _fitkit import mlp
from paddleviz_hooks import BackwardGraph, attach, summarize

QUIET = dict(verbose=0, visualdl=False, formats=("json",), every=1)


class SeenSGD(paddle.optimizer.SGD):
    """Keeps every param.grad it applies (float64), by parameter name."""

    def __init__(self, params, names, **kw):
        super().__init__(parameters=params, **kw)
        self.names = names
        self.applied: list[dict[str, float]] = []

    def _seen(self):
        self.applied.append({self.names[id(p)]: float(np.linalg.norm(p.grad.numpy().astype("float64")))
                             for p in self._parameter_list if p.grad is not None})

    def step(self):
        self._seen()
        return super().step()

    def minimize(self, loss, *a, **k):
        self._seen()
        return super().minimize(loss, *a, **k)


def _data(n=8):
    rng = np.random.default_rng(0)
    return [(paddle.to_tensor(rng.standard_normal((2, 8)).astype("float32")),
             paddle.to_tensor(rng.integers(0, 3, (2,)).astype("int64"))) for _ in range(n)]


def _setup(two_optimizers=False):
    paddle.seed(0)
    net = mlp()
    names = {id(p): n for n, p in net.named_parameters()}
    if two_optimizers:  # PaddleClas keeps engine.optimizer as a list
        opts = [SeenSGD(net[0].parameters(), names, learning_rate=0.1),
                SeenSGD(net[2].parameters(), names, learning_rate=0.1)]
    else:
        opts = [SeenSGD(net.parameters(), names, learning_rate=0.1)]
    return net, opts


def clas_loop(net, optimizers, update_freq=2, evaluate=False):
    """As ppcls/engine/train/train.py: loss / update_freq, step every update_freq iterations."""
    loss_fn = nn.CrossEntropyLoss()
    for it, (x, y) in enumerate(_data()):
        loss = loss_fn(net(x), y) / update_freq
        loss.backward()
        if (it + 1) % update_freq == 0:
            for o in optimizers:
                o.step()
            for o in optimizers:
                o.clear_grad()
            if evaluate:  # an evaluation forward in training mode, no backward
                net(x)


def seg_loop(net, optimizer):
    """As paddleseg/core/train.py: forward, loss, backward, optimizer.step(), clear_grad()."""
    for x, y in _data(4):
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        net.clear_gradients()


def ocr_amp_loop(net, optimizer, scaler):
    """As PaddleOCR's tools/program.py under AMP: scaler.scale(loss).backward(); scaler.minimize()."""
    for x, y in _data(4):
        with paddle.amp.auto_cast(level="O1", dtype="bfloat16"):
            loss = nn.functional.cross_entropy(net(x), y)
        scaler.scale(loss).backward()
        scaler.minimize(optimizer, loss)
        optimizer.clear_grad()


def _graphs(run_dir):
    return {os.path.basename(f): BackwardGraph.from_json(pathlib.Path(f).read_text(encoding="utf-8"))
            for f in sorted(glob.glob(os.path.join(run_dir, "step_*.json")))}


def _weights(net):
    return {k: v.numpy().copy() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("evaluate", [False, True], ids=["plain", "eval-forward"])
def test_paddleclas_loop_update_freq_2_with_a_list_of_optimizers(tmp_path, evaluate):
    net0, opts0 = _setup(True)
    clas_loop(net0, opts0, evaluate=evaluate)
    net, opts = _setup(True)
    with attach(net, opts, str(tmp_path), **QUIET) as h:
        clas_loop(net, opts, evaluate=evaluate)
    assert h.recorder.captured_steps == [1, 2, 3, 4]
    graphs = _graphs(h.recorder.run_dir)
    assert len(graphs) == 8  # two backwards per update; the eval forwards captured nothing
    for step in range(1, 5):
        first, second = graphs[f"step_{step:06d}.json"], graphs[f"step_{step:06d}_b2.json"]
        assert first.meta["backward"]["role"] == "micro-batch 1 of 2"
        assert second.meta["backward"]["role"] == "micro-batch 2 of 2"
        applied = {**opts[0].applied[step - 1], **opts[1].applied[step - 1]}
        assert set(first.params()) == set(applied) == set(second.params())
        for n, v in applied.items():
            assert first.meta["applied_grads"][n] == pytest.approx(v, rel=1e-6)
        assert "(this backward)" in summarize(first)  # its own gradients, labelled so
        assert "applied gradient norm" in summarize(first)
    # nothing of attach is left, and training was not changed
    for o in opts:
        assert "step" not in o.__dict__ and "minimize" not in o.__dict__
    assert not net._forward_pre_hooks
    for k, v in _weights(net0).items():
        assert np.array_equal(v, _weights(net)[k]), k


def test_paddleseg_loop(tmp_path):
    net, (opt,) = _setup()
    h = attach(net, opt, str(tmp_path), **QUIET)
    seg_loop(net, opt)
    h.detach()
    h.detach()  # harmless twice
    graphs = _graphs(h.recorder.run_dir)
    assert sorted(graphs) == [f"step_{i:06d}.json" for i in range(1, 5)]
    for i, g in enumerate(graphs.values()):
        assert g.meta["applied_grad_norm"] == pytest.approx(
            np.sqrt(sum(v ** 2 for v in opt.applied[i].values())), rel=1e-6)
        assert len(g.params()) == 4


def test_paddleocr_amp_loop_gradscaler_minimize(tmp_path):
    net, (opt,) = _setup()
    scaler = paddle.amp.GradScaler(init_loss_scaling=1024.0)
    with attach(net, opt, str(tmp_path), **QUIET) as h:
        ocr_amp_loop(net, opt, scaler)
    assert h.recorder.captured_steps == [1, 2, 3, 4]
    for i, g in enumerate(_graphs(h.recorder.run_dir).values()):
        # read where the optimizer applies them: unscaled by the scaler first
        for n, v in opt.applied[i].items():
            assert g.meta["applied_grads"][n] == pytest.approx(v, rel=1e-6)
    assert "minimize" not in opt.__dict__ and "minimize" not in scaler.__dict__


def test_detach_on_an_exception_restores_everything(tmp_path):
    net, (opt,) = _setup()
    own = opt.step
    opt.step = own  # an instance attribute of its own: put back as it was
    with pytest.raises(RuntimeError, match="boom"):
        with attach(net, opt, str(tmp_path), scaler=None, **QUIET):
            loss = net(_data(1)[0][0]).sum()
            loss.backward()
            raise RuntimeError("boom")
    assert opt.__dict__["step"] is own and "minimize" not in opt.__dict__
    assert not net._forward_pre_hooks


def test_grad_spikes_are_judged_on_the_applied_gradients_once_per_update(tmp_path):
    """With accumulation, param.grad after the first micro-batch is a partial sum: a spike
    watch fed after every backward mixes partial and whole sums (here ~100x apart) and
    fires on ordinary steps. attach feeds it the gradients each update applies."""
    net, (opt,) = _setup()
    rng = np.random.default_rng(1)
    batches = [paddle.to_tensor(rng.standard_normal((2, 8)).astype("float32")) for _ in range(2)]
    y = paddle.to_tensor(np.array([0, 1], dtype="int64"))
    with attach(net, opt, str(tmp_path), on_grad_spike=1.5, cooldown=1, steps=[], capture_first=False,
                verbose=0, visualdl=False, formats=("json",)) as h:
        for update in range(1, 11):
            for k, x in enumerate(batches):
                scale = 0.01 if k == 0 else 1.0  # a tiny first micro-batch
                if update == 8 and k == 1:
                    scale = 100.0  # a real spike in update 8
                (nn.functional.cross_entropy(net(x), y) * scale).backward()
            opt.step()
            opt.clear_grad()
    assert h.recorder.triggers == {9: "grad_spike"}


def test_attaching_twice_is_refused_at_attach_time_and_training_goes_on(tmp_path):
    """A notebook cell run again: the second attach() names the fix; the first stays working."""
    net, (opt,) = _setup()
    first = attach(net, opt, str(tmp_path / "a"), **QUIET)
    try:
        with pytest.raises(RuntimeError, match=r"already attached.*handle\.detach\(\)"):
            attach(net, opt, str(tmp_path / "b"), **QUIET)
        assert not (tmp_path / "b").exists()  # refused before anything was made
        seg_loop(net, opt)  # training untouched: the first handle still captures every update
    finally:
        first.detach()
    assert first.recorder.captured_steps == [1, 2, 3, 4]
    assert not net._forward_pre_hooks and "step" not in opt.__dict__
    with attach(net, opt, str(tmp_path / "c"), **QUIET) as again:  # after detach() it attaches again
        seg_loop(net, opt)
    assert again.recorder.captured_steps == [1, 2, 3, 4]


def test_on_nonfinite_finds_where_the_nan_started(tmp_path):
    # the step opens from the model's own pre-hook, after the recorder's hook has kept the
    # forward's inputs for the replay: opening the step used to drop them, so no origin was found
    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
            self.bad = False

        def forward(self, x):
            h = self.a(x)
            if self.bad:
                h = paddle.log(h)  # negative entries: NaN
            return self.b(paddle.tanh(h))

    paddle.seed(0)
    net = Net()
    opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=net.parameters())
    with attach(net, opt, str(tmp_path), every=100, on_nonfinite=True, verbose=0, formats=("json",),
                visualdl=False) as h:
        for it in range(5):
            net.bad = it == 3
            x, y = paddle.randn([4, 8]), paddle.randint(0, 4, [4, 1])
            paddle.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.clear_grad()
    g = BackwardGraph.from_json(pathlib.Path(h.recorder.run_dir, "step_000004.json").read_text())
    origin = g.nonfinite.origin
    assert origin is not None and (origin.kind, origin.op) == ("forward", "log"), origin


class _GAN(nn.Layer):
    def __init__(self):
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.D = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def test_updates_with_no_forward_of_the_attached_model_are_warned_about(tmp_path, recwarn):
    """A GAN loop calls model.G and model.D, never model itself: nothing can be captured,
    and one warning says why and what to do (it used to be silent: an empty run folder)."""
    paddle.seed(0)
    gan = _GAN()
    opt_d = paddle.optimizer.SGD(learning_rate=0.01, parameters=gan.D.parameters())
    opt_g = paddle.optimizer.SGD(learning_rate=0.01, parameters=gan.G.parameters())
    with attach(gan, [opt_d, opt_g], str(tmp_path), **QUIET) as h:
        for _ in range(3):
            fake = gan.G(paddle.randn([5, 4]))
            gan.D(fake.detach()).mean().backward()
            opt_d.step(), opt_d.clear_grad()
            (-gan.D(fake).mean()).backward()
            opt_g.step(), opt_g.clear_grad()
    assert h.recorder.captured_steps == []
    said = [str(w.message) for w in recwarn if "no training forward" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in recwarn]
    assert "_GAN" in said[0] and "BackwardGraphRecorder" in said[0], said[0]


def test_one_blind_update_is_warned_about_at_detach(tmp_path, recwarn):
    net, (opt,) = _setup()
    with attach(net, opt, str(tmp_path), **QUIET):
        net.eval()  # left in eval mode: its forward opens no step
        net(paddle.randn([3, 8])).sum().backward()
        opt.step()
    assert any("no training forward" in str(w.message) and "eval()" in str(w.message) for w in recwarn)
