"""Several backwards in one step: each keeps its own graph, labelled with its role and order.

``Model.fit(accumulate_grad_batches=k)``: a selected step is one optimizer
step; each of its k backwards is recorded as "micro-batch i of k" with that
micro-batch's own gradients, plus the norm of the accumulated ``param.grad``
the optimizer applies. Hand-written loops label micro-batches, ``paddle.grad``
penalties and repeated ``backward()`` calls, and no file overwrites another.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn as nn
import pytest

from paddleviz_hooks import BackwardGraph, BackwardGraphCallback, BackwardGraphRecorder, capture_backward, summarize


def _norm64(a) -> float:
    a = a.numpy() if hasattr(a, "numpy") else a
    return float(np.linalg.norm(np.asarray(a, dtype="float64").ravel()))


class Net(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(nn.functional.relu(self.body(x)))


class Data(paddle.io.Dataset):
    def __init__(self, n: int = 16) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((n, 8)).astype("float32")
        self.y = rng.integers(0, 3, size=(n, 1)).astype("int64")

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self):
        return len(self.x)


class GradsSeen(paddle.callbacks.Callback):
    """After every batch: param.grad as it is then (a micro-batch that is not the last keeps it)."""

    def __init__(self) -> None:
        super().__init__()
        self.after_batch: list[dict[str, np.ndarray]] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, step, logs=None):
        net = self.model.network
        self.after_batch.append({n: p.grad.numpy().copy() for n, p in net.named_parameters()
                                 if p.grad is not None})
        self.losses.append(float(np.asarray(logs["loss"]).ravel()[0]))


class Applied(paddle.optimizer.SGD):
    """SGD that keeps every param.grad it is about to apply."""

    def __init__(self, net, **kw):
        super().__init__(parameters=net.parameters(), **kw)
        self.names = {id(p): n for n, p in net.named_parameters()}
        self.applied: list[dict[str, np.ndarray]] = []

    def minimize(self, loss, *args, **kwargs):
        self.applied.append({self.names[id(p)]: p.grad.numpy().copy() for p in self._parameter_list})
        return super().minimize(loss, *args, **kwargs)


def _fit(callbacks, accumulate):
    paddle.seed(0)
    model = paddle.Model(Net())
    opt = Applied(model.network, learning_rate=0.1)
    model.prepare(opt, nn.CrossEntropyLoss())
    seen = GradsSeen()
    model.fit(Data(), epochs=1, batch_size=2, shuffle=False, verbose=0, callbacks=[seen, *callbacks],
              accumulate_grad_batches=accumulate)
    weights = {k: v.numpy().copy() for k, v in model.network.state_dict().items()}
    return seen, opt, weights


def test_model_fit_accumulation_records_every_micro_batch_and_the_applied_norm(tmp_path):
    base_seen, _, base_weights = _fit([], accumulate=2)
    cb = BackwardGraphCallback(str(tmp_path), steps=[2], capture_first=False, verbose=0, formats=("json",),
                               visualdl=False)
    seen, opt, weights = _fit([cb], accumulate=2)
    assert seen.losses == base_seen.losses
    for k in base_weights:
        assert np.array_equal(weights[k], base_weights[k]), k
    # 8 batches, accumulation 2: 4 optimizer steps; step 2 is batches 3 and 4
    assert len(opt.applied) == 4 and cb.captured_steps == [2]
    run = tmp_path / "backward_graph"
    assert sorted(p.name for p in run.glob("*.json")) == ["step_000002.json", "step_000002_b2.json"]
    first = BackwardGraph.from_json((run / "step_000002.json").read_text())
    second = BackwardGraph.from_json((run / "step_000002_b2.json").read_text())
    assert first.meta["backward"] == {"index": 1, "of": 2, "entry": "backward", "micro_batch": 1,
                                      "micro_batches": 2, "role": "micro-batch 1 of 2"}
    assert second.meta["backward"]["role"] == "micro-batch 2 of 2"
    assert summarize(second).startswith("step 2, micro-batch 2 of 2:")
    # each micro-batch's own gradients: batch 3's param.grad, then what batch 4 added
    own = [seen.after_batch[2], {n: opt.applied[1][n] - seen.after_batch[2][n] for n in opt.applied[1]}]
    for graph, grads in zip((first, second), own):
        got = graph.params()
        assert set(got) == set(grads)
        for name, g in grads.items():
            assert got[name].norm == pytest.approx(_norm64(g), rel=1e-4), name
    # both carry the norm of what the optimizer applied
    applied = float(np.sqrt(sum(_norm64(g) ** 2 for g in opt.applied[1].values())))
    assert first.meta["accumulated_grad_norm"] == pytest.approx(applied, rel=1e-5)
    assert second.meta["accumulated_grad_norm"] == pytest.approx(applied, rel=1e-5)


def test_hand_loop_labels_micro_batches_and_a_grad_penalty(tmp_path):
    paddle.seed(0)
    net = Net()
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=net.parameters())
    xs = [paddle.randn([2, 8]) for _ in range(2)]
    with BackwardGraphRecorder(str(tmp_path), net, verbose=0, formats=("json",), visualdl=False) as rec:
        with rec.step(1, micro_batches=2):
            for x in xs:
                x.stop_gradient = False
                out = net(x).sum()
                (gx,) = paddle.grad(out, x, create_graph=True)  # a gradient penalty
                (out + (gx * gx).sum()).backward()
        opt.step()
        opt.clear_grad()
    run = tmp_path / "backward_graph"
    roles = {p.name: BackwardGraph.from_json(p.read_text()).meta["backward"]["role"] for p in run.glob("*.json")}
    assert roles == {
        "step_000001.json": "paddle.grad in micro-batch 1 of 2",
        "step_000001_b2.json": "micro-batch 1 of 2",
        "step_000001_b3.json": "paddle.grad in micro-batch 2 of 2",
        "step_000001_b4.json": "micro-batch 2 of 2",
    }
    assert rec.captured_steps == [1]


def test_capture_backward_numbers_the_backwards_of_its_block():
    paddle.seed(0)
    net = Net()
    x = paddle.randn([2, 8])
    x.stop_gradient = False
    with capture_backward(net) as cap:
        net(x).sum().backward()
        paddle.grad(net(x).sum(), x)
        net(x).mean().backward()
    assert [g.meta["backward"] for g in cap.graphs] == [
        {"index": 1, "of": 3, "entry": "backward"},
        {"index": 2, "of": 3, "entry": "grad"},
        {"index": 3, "of": 3, "entry": "backward"},
    ]
    assert [summarize(g).splitlines()[0] for g in cap.graphs] == [
        "backward graph, backward 1 of 3:", "backward graph, paddle.grad (backward 2 of 3):",
        "backward graph, backward 3 of 3:"]


def test_bad_micro_batches_fail_with_the_value_received(tmp_path):
    rec = BackwardGraphRecorder(str(tmp_path), verbose=0, visualdl=False)
    with pytest.raises(TypeError, match="micro_batches must be an int, 'counted' or None, got '2'"):
        rec.begin_step(1, micro_batches="2")
    with pytest.raises(ValueError, match="micro_batches must be >= 1 or None, got 0"):
        rec.begin_step(1, micro_batches=0)
    rec.close()


def _nan_in_micro_batch(tmp_path, nan_at: int, micro_batches, backwards: int = 4, **options):
    """Two steps of `backwards` micro-batches each; step 2's micro-batch `nan_at` (1-based) has a NaN loss."""
    paddle.seed(0)
    net = nn.Linear(4, 2)
    opt = paddle.optimizer.SGD(learning_rate=0.0, parameters=net.parameters())
    kw = {} if micro_batches is None else {"micro_batches": micro_batches}
    with BackwardGraphRecorder(str(tmp_path), net, every=1, capture_first=False, on_nonfinite=True, verbose=0,
                               formats=("json",), visualdl=False, **options) as rec:
        for step in (1, 2):
            with rec.step(step, **kw):
                for mb in range(1, backwards + 1):
                    loss = net(paddle.full([2, 4], float(mb))).mean()
                    if step == 2 and mb == nan_at:
                        loss = loss * paddle.sqrt(paddle.to_tensor(-1.0))
                    (loss / backwards).backward()
            opt.step()
            opt.clear_grad()
    run = tmp_path / "backward_graph"
    graphs = {p.name: BackwardGraph.from_json(p.read_text()) for p in run.glob("step_000002*.json")
              if "diff" not in p.name}
    return rec, graphs


@pytest.mark.parametrize("nan_at", [1, 3])
def test_a_nan_micro_batch_before_the_last_keeps_its_own_file(tmp_path, nan_at):
    # the NaN step is written at once after its last backward; a graph delivered after that
    # write used to be numbered from 0 again and overwrite step_000002.json (the NaN's own file)
    rec, graphs = _nan_in_micro_batch(tmp_path, nan_at, 4)
    assert sorted(graphs) == ["step_000002.json", "step_000002_b2.json", "step_000002_b3.json",
                              "step_000002_b4.json"]
    for i, name in enumerate(sorted(graphs), start=1):
        info = graphs[name].meta["backward"]
        assert (info["index"], info["micro_batch"], info["micro_batches"]) == (i, i, 4), name
        loss = graphs[name].meta["loss"]
        assert (loss != loss) == (i == nan_at), (name, loss)  # only the NaN micro-batch's loss is NaN
    assert rec.captured_steps == [1, 2] and rec.triggers[2] == "nonfinite_loss"


def test_a_nan_backward_of_an_unannounced_step_keeps_its_own_file(tmp_path):
    # without micro_batches every backward may be the last: the NaN one is written at once,
    # and the step's next backward goes to a file of its own
    rec, graphs = _nan_in_micro_batch(tmp_path, 1, None, backwards=2)
    assert sorted(graphs) == ["step_000002.json", "step_000002_b2.json"]
    first, second = graphs["step_000002.json"], graphs["step_000002_b2.json"]
    assert first.meta["loss"] != first.meta["loss"] and first.meta["backward"]["index"] == 1
    assert second.meta["loss"] == second.meta["loss"] and second.meta["backward"]["index"] == 2
    assert rec.captured_steps == [1, 2] and rec.triggers[2] == "nonfinite_loss"


def test_a_diff_names_the_micro_batches_it_compares(tmp_path):
    from paddleviz_hooks import diff_graphs
    from paddleviz_hooks.diff import GraphDiff
    from paddleviz_hooks.text import diff_summary
    paddle.seed(0)
    net = Net()
    with BackwardGraphRecorder(str(tmp_path), net, every=2, verbose=0, formats=("json",), visualdl=False) as rec:
        for step in (1, 2):
            with rec.step(step, micro_batches=2):
                for _ in range(2):
                    net(paddle.randn([2, 8])).sum().backward()
            net.clear_gradients()
    run = tmp_path / "backward_graph"
    older = BackwardGraph.from_json((run / "step_000001.json").read_text())
    newer = BackwardGraph.from_json((run / "step_000002_b2.json").read_text())
    d = diff_graphs(older, newer)
    assert diff_summary(d).splitlines()[0] == "step 2 (micro-batch 2 of 2) vs step 1 (micro-batch 1 of 2):"
    assert GraphDiff.from_json(d.to_json()).newer_role == "micro-batch 2 of 2"
