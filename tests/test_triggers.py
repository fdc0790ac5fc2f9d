"""Triggered captures (issue 7): NaN/Inf, gradient spikes, structure changes.

Each model misbehaves at a known step through a known op, so the test can
say exactly which step must be captured and what the capture must name.
"""

from __future__ import annotations

import json
import math

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

from paddleviz_hooks import BackwardGraph, BackwardGraphCallback, BackwardGraphRecorder

from paddleviz_hooks.diff import GraphDiff

from _fitkit import (
    Synthetic,
    image_steps,
    ours,
    recorded_warnings,
    run_fit,
    step_files,
    text_records,
    vdl_records,
)

K = 6  # the step where things go wrong


def _cb(tmp_path, **kw) -> BackwardGraphCallback:
    kw.setdefault("every", 10**6)  # no scheduled captures: only triggers
    kw.setdefault("capture_first", False)
    kw.setdefault("verbose", 1)
    kw.setdefault("view_max_px", 300)
    kw.setdefault("queue_size", 32)
    return BackwardGraphCallback(str(tmp_path / "vdl"), **kw)


def _graph(tmp_path, step: int) -> BackwardGraph:
    path = tmp_path / "vdl" / "backward_graph" / f"step_{step:06d}.json"
    return BackwardGraph.from_json(path.read_text())


# --------------------------------------------------------------------------
# NaN/Inf: log(0) inside block.penalty from step K
# --------------------------------------------------------------------------
class Penalty(nn.Layer):
    """mean(log(|h| * s)): s = 1 before step ``k``, 0 from then on.

    At step k the forward gives log(0) = -inf (the loss is -inf) and Log's
    backward divides by 0: Log is the first node to produce a non-finite
    gradient from finite ones. Every later step is NaN (the update wrote
    NaN into the parameters).
    """

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.calls = 0

    def forward(self, h):
        self.calls += 1
        s = 0.0 if self.calls >= self.k else 1.0
        return paddle.log(paddle.abs(h) * s).mean()


class Block(nn.Layer):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.penalty = Penalty(k)

    def forward(self, h):
        return self.penalty(h)


class NaNNet(nn.Layer):
    def __init__(self, k: int = K) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.block = Block(k)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.body(x)
        return self.head(h), self.block(h)


class LossWithPenalty(nn.Layer):
    def forward(self, logits, penalty, label):
        return F.cross_entropy(logits, label) + 0.01 * penalty


def _nan_fit(tmp_path, steps=12, **kw):
    cb = _cb(tmp_path, on_nonfinite=True, **kw)
    with recorded_warnings() as got:
        res = run_fit(NaNNet, callbacks=[cb], steps=steps, loss=LossWithPenalty(), lr=0.05)
    assert ours(got) == []
    return cb, res


def test_nonfinite_captures_the_step_and_names_the_origin(tmp_path, capsys):
    cb, res = _nan_fit(tmp_path, steps=12)
    assert np.isfinite(res.losses[: K - 1]).all() and not np.isfinite(res.losses[K - 1:]).any()
    assert cb.captured_steps == [K]  # once: the default cooldown (100) covers the rest
    assert cb.triggers == {K: "nonfinite_loss"}

    g = _graph(tmp_path, K)
    assert g.meta["trigger"] == "nonfinite_loss" and g.meta["step"] == K
    origin = g.nonfinite_sites()[0]
    assert origin.op == "Log" and origin.layer == "block.penalty"

    # named in the VisualDL text record ...
    reader = vdl_records(tmp_path / "vdl" / "backward_graph")
    texts = text_records(reader, "summary")
    assert list(texts) == [K]
    assert "trigger: nonfinite_loss" in texts[K]
    assert "first non-finite gradient at Log in block.penalty" in texts[K]
    # ... under its own image tag as well as the main one ...
    assert image_steps(reader, "backward_graph/trigger_nonfinite_loss") == [K]
    assert image_steps(reader, "backward_graph") == [K]
    assert "backward_graph/trigger_nonfinite_loss_from_step_%06d" % K in reader.get_tags()["image"]
    # ... and in the printed notice
    out = capsys.readouterr().out
    assert f"captured step {K} (trigger: nonfinite_loss)" in out
    assert "first non-finite gradient at Log in block.penalty" in out
    # NaN losses are not mistaken for "finite loss, non-finite gradients"
    assert "with a finite loss" not in out


def test_nonfinite_gradients_with_finite_loss_capture_the_next_step(tmp_path, capsys):
    """Inf inputs: Linear gives NaN, ReLU maps NaN to 0, the loss stays finite,
    only the weight gradient is NaN; that is seen after the backward. The
    step is replayed at once, but the forward depends on a counter, so the
    replay is finite: rather than show a finite graph for a NaN step, the
    next step is captured (tests/test_nan_origin.py has replays that work)."""

    class Blowup(nn.Layer):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.body(x * (math.inf if self.calls == K else 1.0))

    cb = _cb(tmp_path, on_nonfinite=True)
    with recorded_warnings() as got:
        res = run_fit(Blowup, callbacks=[cb], steps=10)
    assert ours(got) == []
    assert np.isfinite(res.losses[:K]).all()
    assert cb.captured_steps == [K + 1]
    assert cb.triggers == {K + 1: "nonfinite_grad"}
    g = _graph(tmp_path, K + 1)
    assert g.meta["trigger_note"] == f"nonfinite_grad seen at step {K}"
    out = capsys.readouterr().out
    assert f"non-finite gradients at step {K} with a finite loss; capturing step {K} (replayed" in out
    assert f"the replay of step {K} did not reproduce its NaN/Inf gradients; capturing step {K + 1}" in out
    assert out.count("non-finite gradients at step") == 1
    # that capture is of the real backward, its ops attributed to layers
    assert {n.layer for n in g.nodes if n.kind == "op"} >= {"body.0", "body.2"}
    # by then the update has written NaN into the weights, and the capture says so
    o = g.nonfinite.origin.to_dict()
    assert (o["kind"], o["layer"], o["layer_class"]) == ("weights", "body.0", "Linear")
    assert f"captured step {K + 1} (trigger: nonfinite_grad); NaN/Inf already in the weights, first in " \
           "layer 'body.0' (Linear): an earlier update wrote it" in out


@pytest.mark.parametrize("cooldown,max_captures,want", [
    (10, None, [K + 10 * i for i in range(11)]),  # NaN for 100 steps: one capture per 10
    (10, 3, [K, K + 10, K + 20]),
    (0, 3, [K, K + 1, K + 2]),
])
def test_cooldown_and_max_captures_in_a_long_nan_run(tmp_path, capsys, cooldown, max_captures, want):
    steps = K + 100
    cb, res = _nan_fit(tmp_path, steps=steps, cooldown=cooldown, max_captures=max_captures,
                       formats=("json",), visualdl=False)
    assert not np.isfinite(res.losses[K - 1:]).any() and len(res.losses) == steps
    assert cb.captured_steps == want
    assert set(cb.triggers.values()) == {"nonfinite_loss"}
    assert step_files(tmp_path / "vdl" / "backward_graph", "json") == want
    # one notice per capture, not one per NaN step
    out = capsys.readouterr().out
    assert out.count("captured step") == len(want)
    assert "with a finite loss" not in out


# --------------------------------------------------------------------------
# gradient spike: a branch scaled by 100 at step K
# --------------------------------------------------------------------------
class SpikeNet(nn.Layer):
    def __init__(self, k: int = K + 2, scale: float = 100.0) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.k, self.scale, self.calls = k, scale, 0

    def forward(self, x):
        self.calls += 1
        h = self.body(x)
        s = self.scale if self.calls == self.k else 1.0  # same ops every step, only a factor changes
        return self.head(h + self.branch(h) * s)


def test_grad_spike_captures_the_next_step(tmp_path, capsys):
    k = K + 2  # the running median needs 5 steps first
    cb = _cb(tmp_path, on_grad_spike=10)
    with recorded_warnings() as got:
        res = run_fit(lambda: SpikeNet(k), callbacks=[cb], steps=12, lr=0.001)
    assert ours(got) == []
    assert np.isfinite(res.losses).all()
    # the spike is seen when step k's backward has finished: step k+1 is captured
    assert cb.captured_steps == [k + 1]
    assert cb.triggers == {k + 1: "grad_spike"}
    g = _graph(tmp_path, k + 1)
    assert g.meta["trigger"] == "grad_spike"
    assert g.meta["trigger_note"] == f"grad_spike seen at step {k}"
    reader = vdl_records(tmp_path / "vdl" / "backward_graph")
    assert image_steps(reader, "backward_graph/trigger_grad_spike") == [k + 1]
    assert f"grad_spike seen at step {k}" in text_records(reader, "summary")[k + 1]
    out = capsys.readouterr().out
    assert f"at step {k} is" in out and f"capturing step {k + 1}" in out


def test_no_spike_no_capture(tmp_path):
    cb = _cb(tmp_path, on_grad_spike=10)
    run_fit(lambda: SpikeNet(k=10**6), callbacks=[cb], steps=12, lr=0.001)
    assert cb.captured_steps == []


# --------------------------------------------------------------------------
# structure change: a branch switched on at step K
# --------------------------------------------------------------------------
class BranchNet(nn.Layer):
    def __init__(self, k: int = K) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.extra = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.k, self.calls = k, 0

    def forward(self, x):
        self.calls += 1
        h = self.body(x)
        if self.calls >= self.k:
            h = h + self.extra(h)
        return self.head(h)


def test_structure_change_captured_with_its_diff(tmp_path):
    # capture_first gives the diff a previous capture to compare with
    cb = _cb(tmp_path, on_structure_change=True, capture_first=True)
    with recorded_warnings() as got:
        run_fit(BranchNet, callbacks=[cb], steps=12)
    assert ours(got) == []
    assert cb.captured_steps == [1, K]  # and not again: the structure stays the new one
    assert cb.triggers == {1: "scheduled", K: "structure_change"}
    run_dir = tmp_path / "vdl" / "backward_graph"
    g = _graph(tmp_path, K)
    assert g.meta["trigger"] == "structure_change"
    assert "extra.weight" in g.params() and "extra.weight" not in _graph(tmp_path, 1).params()
    diff = GraphDiff.from_json((run_dir / f"step_{K:06d}_diff.json").read_text())
    assert diff.structure_changed and diff.removed_nodes == []
    assert {"param:extra.weight", "param:extra.bias"} <= set(diff.added_nodes)
    assert sorted(diff.params_started) == ["extra.bias", "extra.weight"]
    assert (run_dir / f"step_{K:06d}_diff.png").exists()
    reader = vdl_records(run_dir)
    assert image_steps(reader, "backward_graph/structure_change") == [K]
    assert image_steps(reader, "backward_graph/trigger_structure_change") == [K]
    assert f"step {K} vs step " in text_records(reader, "summary")[K]


def test_structure_change_without_previous_capture(tmp_path):
    """With capture_first=False the change is still captured at step K; there
    is no earlier capture to diff against, so no diff files are written."""
    cb = _cb(tmp_path, on_structure_change=True)
    run_fit(BranchNet, callbacks=[cb], steps=12)
    assert cb.captured_steps == [K]
    run_dir = tmp_path / "vdl" / "backward_graph"
    assert not (run_dir / f"step_{K:06d}_diff.json").exists()


def test_triggers_and_schedule_together(tmp_path):
    """Scheduled steps and triggers share the budget and never double-capture a step."""
    cb = _cb(tmp_path, every=K, capture_first=True, on_nonfinite=True, cooldown=3, max_captures=4)
    with recorded_warnings() as got:
        run_fit(NaNNet, callbacks=[cb], steps=20, loss=LossWithPenalty(), lr=0.05)
    assert ours(got) == []
    # 1 scheduled; K scheduled (and NaN: one capture, labelled scheduled); K+3 NaN; 2K scheduled
    assert cb.captured_steps == [1, K, K + 3, 2 * K]
    assert cb.triggers[K + 3] == "nonfinite_loss"


def test_structure_change_compares_each_backward_with_the_same_backward_of_earlier_steps(tmp_path):
    # a step of two different backwards (a paddle.grad penalty, then backward()), the same code every
    # step: nothing changes, so nothing is captured (it used to fire on every step, comparing
    # the penalty's graph with the previous step's main graph and back)
    paddle.seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    rec = BackwardGraphRecorder(str(tmp_path), net, every=None, capture_first=False, on_structure_change=True,
                                cooldown=0, verbose=0, formats=("json",), visualdl=False)
    for step in range(1, 7):
        with rec.step(step):
            x = paddle.randn([3, 4])
            x.stop_gradient = False
            out = net(x).sum()
            (gx,) = paddle.grad(out, x, create_graph=True)
            total = out + (gx * gx).sum()
            (total.abs() if step == 5 else total).backward()  # a real change, in the second backward only
        net.clear_gradients()
    rec.close()
    # step 5 changed its second backward, step 6 changed it back: two changes, nothing else
    assert rec.captured_steps == [5, 6] and rec.triggers == {5: "structure_change", 6: "structure_change"}


def test_a_grad_spike_in_a_micro_batch_is_judged_on_the_step_and_captures_all_of_the_next(tmp_path, capsys):
    # the spike used to be judged after every backward on a half-accumulated param.grad, and its
    # "next step" capture took the same step's next micro-batch
    paddle.seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = paddle.optimizer.SGD(1e-6, parameters=m.parameters())
    with BackwardGraphRecorder(str(tmp_path), m, every=1000, capture_first=False, on_grad_spike=5,
                               formats=("json",), visualdl=False) as rec:
        for step in range(1, 10):
            with rec.step(step, micro_batches=2):
                for mb in range(2):
                    scale = 1000.0 if (step == 6 and mb == 0) else 1.0
                    (F.cross_entropy(m(paddle.randn([4, 6])), paddle.randint(0, 3, [4])) * scale / 2).backward()
            opt.step()
            opt.clear_grad()
    assert rec.captured_steps == [7] and rec.triggers == {7: "grad_spike"}
    run = tmp_path / "backward_graph"
    assert sorted(p.name for p in run.glob("step_*.json")) == ["step_000007.json", "step_000007_b2.json"]
    out = capsys.readouterr().out
    assert "at step 6 is" in out and "capturing step 7" in out
    assert "captured step 7 (micro-batch 1 of 2; trigger: grad_spike)" in out
    assert "captured step 7 (micro-batch 2 of 2; trigger: grad_spike)" in out
