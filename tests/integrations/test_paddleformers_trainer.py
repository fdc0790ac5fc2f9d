"""PaddleFormers' Trainer with BackwardGraphTrainerCallback: a tiny random-weight
Llama on the CPU, gradient accumulation 2 and full (reentrant) recompute.

Runs in the venv `make test` builds for PaddleFormers (``.venv-pf``; it pins
numpy<=1.26.4); skipped where PaddleFormers is not installed. Oracles: the
Trainer's own ``param.grad`` read in float64 by a probe callback, and the
weights of an identical run without the callback.
"""

from __future__ import annotations

import glob
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("paddleformers")

import paddle  # noqa: E402
from paddleformers.trainer import TrainerCallback  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import _pfkit  # noqa: E402

from paddleviz_hooks import BackwardGraph, diff_graphs  # noqa: E402
from paddleviz_hooks.integrations import paddleformers as pv_pf  # noqa: E402

QUIET = dict(verbose=0, visualdl=False, formats=("json",))


def _norm(a) -> float:
    return float(np.linalg.norm(np.asarray(a, dtype="float64").ravel()))


class GradProbe(TrainerCallback):
    """param.grad after the first micro-batch (on_substep_end) and at on_optimizer_begin."""

    def __init__(self) -> None:
        self.after_first: list[dict[str, np.ndarray]] = []
        self.applied: list[dict[str, np.ndarray]] = []

    @staticmethod
    def _grads(model):
        return {n: p.grad.numpy().astype("float64") for n, p in model.named_parameters() if p.grad is not None}

    def on_substep_end(self, args, state, control, model=None, **kw):
        self.after_first.append(self._grads(model))

    def on_optimizer_begin(self, args, state, control, model=None, **kw):
        self.applied.append(self._grads(model))


def _graphs(run_dir: str) -> dict[str, BackwardGraph]:
    return {os.path.basename(f): BackwardGraph.from_json(Path(f).read_text(encoding="utf-8"))
            for f in sorted(glob.glob(os.path.join(run_dir, "step_*.json")))}


def test_every_micro_batch_is_a_graph_and_applied_gradients_are_param_grad(tmp_path):
    probe = GradProbe()
    cb = pv_pf.BackwardGraphTrainerCallback(every=1, **QUIET)
    model, _, _ = _pfkit.train(tmp_path / "cap", [cb], probes=[probe])
    plain, _, _ = _pfkit.train(tmp_path / "plain", [])
    # training is bit-identical with and without the callback
    for (n, a), (_, b) in zip(model.state_dict().items(), plain.state_dict().items()):
        assert np.array_equal(a.numpy(), b.numpy()), n
    # the run lies in the Trainer's logging_dir, beside its own scalars
    assert cb.run_dir == os.path.join(str(tmp_path / "cap" / "vdl"), "backward_graph")
    assert cb.captured_steps == [1, 2, 3]
    graphs = _graphs(cb.run_dir)
    names = {n for n, _ in model.named_parameters()}
    for step in (1, 2, 3):
        first, second = graphs[f"step_{step:06d}.json"], graphs[f"step_{step:06d}_b2.json"]
        assert first.meta["backward"]["role"] == "micro-batch 1 of 2"
        assert second.meta["backward"]["role"] == "micro-batch 2 of 2"
        applied = probe.applied[step - 1]
        g1 = probe.after_first[step - 1]
        for g in (first, second):
            assert set(g.params()) == names  # every parameter reached through recompute
            # applied gradients: what param.grad holds in on_optimizer_begin (after the /k)
            for n, a in applied.items():
                assert g.meta["applied_grads"][n] == pytest.approx(_norm(a), rel=1e-6, abs=1e-9)
            total = math.sqrt(sum(_norm(a) ** 2 for a in applied.values()))
            assert g.meta["applied_grad_norm"] == pytest.approx(total, rel=1e-6)
            assert g.meta["accumulated_grad_norm"] == pytest.approx(total, rel=1e-6)
        # local gradients: each micro-batch's own (g2 = k * applied - g1)
        for n in names:
            assert first.params()[n].norm == pytest.approx(_norm(g1[n]), rel=1e-5, abs=1e-7)
            assert second.params()[n].norm == pytest.approx(_norm(2 * applied[n] - g1[n]), rel=1e-4, abs=1e-6)
        assert first.global_grad_norm() != pytest.approx(first.meta["applied_grad_norm"], rel=1e-3)


class Poison(TrainerCallback):
    """From the given optimizer step on, the loss ignores every label (all are LABEL): its
    mean divides 0 by 0 in PaddleFormers' own loss function (a NaN weight would not do:
    the loss stays finite, only the gradients go NaN)."""

    LABEL = 5

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, model=None, **kw):
        if state.global_step + 1 == self.step:
            model.criterion.ignored_index = self.LABEL


@pytest.mark.parametrize("scheduled", [True, False], ids=["scheduled", "replayed"])
def test_a_nan_loss_that_makes_train_raise_leaves_its_capture_on_disk(tmp_path, scheduled):
    opts = dict(steps=[2]) if scheduled else dict(steps=[1])
    cb = pv_pf.BackwardGraphTrainerCallback(on_nonfinite=True, verbose=0, formats=("json", "png"), **opts)
    try:
        with pytest.raises(ValueError, match="nan"):
            _pfkit.train(tmp_path, [cb], probes=[Poison(2)], steps=4, label=Poison.LABEL)
        _check_nan_capture(tmp_path)  # before any close(): train() raised, no on_train_end
    finally:
        cb.close()


def _check_nan_capture(tmp_path):
    run = os.path.join(str(tmp_path / "vdl"), "backward_graph")
    # written before train() raised: no on_train_end, no close()
    assert os.path.exists(os.path.join(run, "step_000002.json")), os.listdir(run)
    assert os.path.exists(os.path.join(run, "step_000002.png"))
    g = BackwardGraph.from_json(Path(run, "step_000002.json").read_text(encoding="utf-8"))
    assert g.meta["trigger"] == "nonfinite_loss"
    origin = g.nonfinite.origin if g.nonfinite is not None else None
    assert origin is not None and (origin.kind, origin.op, origin.layer) == ("forward", "divide", "criterion"), origin
    assert glob.glob(os.path.join(run, "vdlrecords.*")), os.listdir(run)


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_a_replay_leaves_param_grad_as_it_was_and_reaches_every_parameter(recompute):
    """The NaN replay re-runs the step's forward and backward: under reentrant recompute,
    whose block backward adds to param.grad even under paddle.grad, param.grad must still
    be left exactly as the step made it."""
    from paddleviz_hooks.capture import BackwardCapture
    from paddleviz_hooks.capture.nan_origin import StepInputs, replay_step

    model = _pfkit.tiny_llama()
    if recompute:
        model.config.recompute_granularity = "full"
        model.config.recompute_method = "uniform"
        model.config.recompute_num_layers = 1
    kept = StepInputs(model).install()
    try:
        ids = paddle.to_tensor(np.arange(16).reshape(2, 8) % _pfkit.VOCAB, dtype="int64")
        model(input_ids=ids, labels=ids)[0].backward()
        before = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        with BackwardCapture(model) as cap:
            assert replay_step(model, kept)
        after = {n: p.grad.numpy() for n, p in model.named_parameters()}
    finally:
        kept.remove()
    for n in before:
        assert np.array_equal(before[n], after[n]), n
    assert len(cap.graphs) == 1 and set(cap.graphs[0].params()) == set(before)


def test_recomputed_loss_function_keeps_its_layer(tmp_path):
    """PaddleFormers recomputes its loss function (not a Layer): its ops stay in `criterion`."""
    keys = {}
    for recompute in (False, True):
        cb = pv_pf.BackwardGraphTrainerCallback(steps=[1], **QUIET)
        _pfkit.train(tmp_path / str(recompute), [cb], recompute=recompute, steps=1)
        g = _graphs(cb.run_dir)["step_000001.json"]
        keys[recompute] = {n.key for n in g.nodes if n.kind == "op" and not n.op.startswith("PyLayer")}
        unattributed = [n.key for n in g.nodes if n.kind == "op" and not n.layer and not n.op.startswith("PyLayer")]
        assert not unattributed, (recompute, unattributed)
    assert keys[True] == keys[False]


def test_report_to_paddleviz_after_register(tmp_path, monkeypatch):
    monkeypatch.setenv(pv_pf.ENV_OPTIONS, '{"steps": [2], "capture_first": false, "verbose": 0, "formats": ["json"]}')
    saved = dict(pv_pf._pf_integrations.INTEGRATION_TO_CALLBACK)
    try:
        pv_pf.register()
        _, trainer, _ = _pfkit.train(tmp_path, report_to=("visualdl", "paddleviz"), steps=2)
    finally:
        pv_pf._pf_integrations.INTEGRATION_TO_CALLBACK.clear()
        pv_pf._pf_integrations.INTEGRATION_TO_CALLBACK.update(saved)
    ours = [c for c in trainer.callback_handler.callbacks if isinstance(c, pv_pf.BackwardGraphTrainerCallback)]
    assert len(ours) == 1 and ours[0].captured_steps == [2]
    logdir = str(tmp_path / "vdl")
    ours_dir = os.listdir(os.path.join(logdir, "backward_graph"))
    assert sorted(f for f in ours_dir if f.startswith("step_")) == ["step_000002.json", "step_000002_b2.json"]
    assert [f for f in ours_dir if f.startswith("vdlrecords")]  # our VisualDL run beside the Trainer's
    assert [f for f in os.listdir(logdir) if f.startswith("vdlrecords")]  # the Trainer's own VisualDL scalars


def test_wrong_options_fail_when_the_callback_is_made(monkeypatch):
    with pytest.raises(ValueError):
        pv_pf.BackwardGraphTrainerCallback(every=0)
    with pytest.raises(TypeError, match=r"^BackwardGraphTrainerCallback\(\) got an unexpected keyword argument "
                                        r"'evry'; did you mean 'every'\?"):
        pv_pf.BackwardGraphTrainerCallback(evry=5)
    with pytest.raises(TypeError, match=r"^register\(\) got an unexpected keyword"):
        pv_pf.register(evry=5)
    monkeypatch.setenv(pv_pf.ENV_OPTIONS, "every=5")
    with pytest.raises(ValueError, match=pv_pf.ENV_OPTIONS):
        pv_pf.BackwardGraphTrainerCallback()
