"""Several captures at once: two callbacks on one fit, a callback inside a
user's own ``capture_backward`` block, and a manual loop driving a callback
while the user captures too. Each captures exactly its steps, sees the same
gradients, and training is bit-identical to a fit without any of them.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn as nn
import pytest

from paddleviz_hooks import BackwardGraph, BackwardGraphCallback, capture_backward
from paddleviz_hooks.capture import dispatcher_installed

from _fitkit import (
    Synthetic,
    assert_same_run,
    image_steps,
    mlp,
    no_leftover_hooks,
    ours,
    recorded_warnings,
    run_fit,
    step_files,
    vdl_records,
)

STEPS = 12


def _cb(tmp_path, run_name, **kw):
    kw.setdefault("verbose", 0)
    kw.setdefault("view_max_px", 300)
    kw.setdefault("queue_size", 16)
    return BackwardGraphCallback(str(tmp_path / "vdl"), run_name=run_name, **kw)


def _graphs(run_dir, steps):
    return {s: BackwardGraph.from_json((run_dir / f"step_{s:06d}.json").read_text()) for s in steps}


def _same_gradients(a: BackwardGraph, b: BackwardGraph) -> None:
    """Same structure and the same recorded gradient statistics."""
    assert [(n.key, n.kind, n.op, n.layer, n.param) for n in a.nodes] == \
           [(n.key, n.kind, n.op, n.layer, n.param) for n in b.nodes]
    assert [e.to_dict() for e in a.edges] == [e.to_dict() for e in b.edges]


def test_two_callbacks_on_one_fit(tmp_path):
    base = run_fit(steps=STEPS, epochs=2)
    a = _cb(tmp_path, "every3", every=3)
    b = _cb(tmp_path, "every4", every=4, capture_first=False)
    with recorded_warnings() as got:
        res = run_fit(callbacks=[a, b], steps=STEPS, epochs=2)
    assert ours(got) == []
    assert_same_run(res, base)
    total = 2 * STEPS  # steps count across epochs
    want_a = [1] + list(range(3, total + 1, 3))
    want_b = list(range(4, total + 1, 4))
    assert a.captured_steps == want_a and b.captured_steps == want_b
    dir_a, dir_b = tmp_path / "vdl" / "every3", tmp_path / "vdl" / "every4"
    assert step_files(dir_a, "json") == want_a and step_files(dir_b, "json") == want_b
    assert image_steps(vdl_records(dir_a), "backward_graph") == want_a
    assert image_steps(vdl_records(dir_b), "backward_graph") == want_b
    # where both captured the same step they saw the same graph and gradients
    ga, gb = _graphs(dir_a, want_a), _graphs(dir_b, want_b)
    shared = sorted(set(want_a) & set(want_b))
    assert shared == [12, 24]
    for s in shared:
        _same_gradients(ga[s], gb[s])
        assert ga[s].meta["loss"] == gb[s].meta["loss"] == res.losses[s - 1]
    assert not dispatcher_installed() and no_leftover_hooks(res.net)


def test_callback_inside_users_capture_block(tmp_path):
    """The user captures every backward of a fit that also runs our callback."""
    base = run_fit(steps=STEPS)
    cb = _cb(tmp_path, "cb", every=5)
    paddle.seed(0)
    np.random.seed(0)
    net = mlp()
    model = paddle.Model(net)
    model.prepare(paddle.optimizer.SGD(learning_rate=0.1, parameters=net.parameters()), nn.CrossEntropyLoss())
    from _fitkit import Recorder

    rec = Recorder()
    with recorded_warnings() as got:
        with capture_backward(net) as cap:
            model.fit(Synthetic(STEPS * 4), epochs=1, batch_size=4, shuffle=False, verbose=0,
                      callbacks=[cb, rec])
        assert not dispatcher_installed()
    assert ours(got) == []
    assert rec.losses == base.losses.tolist()
    assert all(p.numpy().tobytes() == base.params[n].tobytes() for n, p in net.named_parameters())
    # the user's block saw every step; the callback exactly its own
    assert len(cap.graphs) == STEPS
    assert [g.meta["loss"] for g in cap.graphs] == rec.losses
    assert cb.captured_steps == [1, 5, 10]
    ours_graphs = _graphs(tmp_path / "vdl" / "cb", [1, 5, 10])
    for s, g in ours_graphs.items():
        _same_gradients(g, cap.graphs[s - 1])
    assert no_leftover_hooks(net)


def test_manual_loop_with_callback_and_user_capture(tmp_path):
    """A hand-written loop drives the callback (as a custom trainer would)
    and wraps some steps in its own capture_backward block."""
    paddle.seed(0)
    net = mlp()
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=net.parameters())
    data = Synthetic(STEPS * 4)
    x_all, y_all = paddle.to_tensor(data.x), paddle.to_tensor(data.y)

    def loop(cb=None, user_steps=()):
        paddle.seed(0)
        fresh = mlp()
        net.set_state_dict(fresh.state_dict())
        losses, user_graphs, grads = [], {}, {}
        if cb is not None:
            cb.set_model(paddle.Model(net))
            cb.on_train_begin()
        for step in range(STEPS):
            if cb is not None:
                cb.on_train_batch_begin(step)
            x, y = x_all[step * 4:(step + 1) * 4], y_all[step * 4:(step + 1) * 4]
            if step + 1 in user_steps:
                with capture_backward(net) as cap:
                    loss = nn.functional.cross_entropy(net(x), y)
                    loss.backward()
                user_graphs[step + 1] = cap.graph
            else:
                loss = nn.functional.cross_entropy(net(x), y)
                loss.backward()
            grads[step + 1] = [p.grad.numpy().copy() for p in net.parameters()]
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
            if cb is not None:
                cb.on_train_batch_end(step, {"loss": [losses[-1]]})
        if cb is not None:
            cb.on_train_end()
        return losses, user_graphs, grads

    base_losses, _, base_grads = loop()
    cb = _cb(tmp_path, "manual", every=4)
    with recorded_warnings() as got:
        losses, user_graphs, grads = loop(cb, user_steps=(2, 4, 7))
    assert ours(got) == []
    assert losses == base_losses
    for s in base_grads:
        assert all(a.tobytes() == b.tobytes() for a, b in zip(base_grads[s], grads[s])), s
    assert cb.captured_steps == [1, 4, 8, 12]
    assert sorted(user_graphs) == [2, 4, 7]
    # step 4 was captured by both: identical records
    g4 = _graphs(tmp_path / "vdl" / "manual", [4])[4]
    _same_gradients(g4, user_graphs[4])
    assert not dispatcher_installed() and no_leftover_hooks(net)


def test_nested_user_captures_and_callback_triggers(tmp_path):
    """Triggers (a capture active for the whole fit) plus two nested user blocks."""
    base = run_fit(steps=STEPS)
    cb = _cb(tmp_path, "trig", every=6, on_nonfinite=True, on_grad_spike=50.0, on_structure_change=True)
    paddle.seed(0)
    np.random.seed(0)
    net = mlp()
    model = paddle.Model(net)
    model.prepare(paddle.optimizer.SGD(learning_rate=0.1, parameters=net.parameters()), nn.CrossEntropyLoss())
    from _fitkit import Recorder

    rec = Recorder()
    with capture_backward(net) as outer:
        with capture_backward(grad_stats=False) as inner:
            model.fit(Synthetic(STEPS * 4), epochs=1, batch_size=4, shuffle=False, verbose=0,
                      callbacks=[cb, rec])
        assert dispatcher_installed()  # the outer block is still open
    assert not dispatcher_installed()
    assert rec.losses == base.losses.tolist()
    assert len(outer.graphs) == len(inner.graphs) == STEPS
    assert cb.captured_steps == [1, 6, 12]
    assert all(e.grad is None or e.grad.norm is None for g in inner.graphs for e in g.edges)
