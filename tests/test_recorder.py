"""BackwardGraphRecorder driven by a hand-written loop, against Model.fit + the callback."""

from __future__ import annotations

import os
import re

import numpy as np
import paddle
import paddle.nn as nn
import pytest

from paddleviz_hooks import BackwardGraphCallback, BackwardGraphRecorder
from paddleviz_hooks.capture import dispatcher_installed

from _fitkit import (
    Synthetic,
    files_under,
    no_leftover_hooks,
    probed_mlp,
    run_fit,
    vdl_records,
)

STEPS, BATCH = 12, 4
OPTIONS = dict(every=4, on_structure_change=True, on_nonfinite=True, verbose=0, view_max_px=400)


def hand_loop(rec: BackwardGraphRecorder | None, make_net=probed_mlp, steps: int = STEPS, raise_at: int | None = None):
    """The loop Model.fit runs, written out: same seed, data, loss and optimizer."""
    paddle.seed(0)
    np.random.seed(0)
    net = make_net()
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=net.parameters())
    data = Synthetic(steps * BATCH)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    if rec is not None:
        rec.open(net)
    for step in range(1, steps + 1):
        x = paddle.to_tensor(data.x[(step - 1) * BATCH: step * BATCH])
        y = paddle.to_tensor(data.y[(step - 1) * BATCH: step * BATCH])
        ctx = rec.step(step) if rec is not None else _nothing()
        with ctx:
            loss = loss_fn(net(x), y)
            loss.backward()
            if step == raise_at:
                raise KeyboardInterrupt
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    if rec is not None:
        rec.close()
    return net, losses


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _tags_and_steps(run_dir):
    reader = vdl_records(run_dir)
    out = {}
    for kind, tags in reader.get_tags().items():
        for tag in tags:
            out[(kind, tag)] = [r.id for r in reader.get_data(kind, tag)]
    return out


def test_hand_loop_and_model_fit_write_the_same_records(tmp_path):
    rec = BackwardGraphRecorder(str(tmp_path / "loop"), **OPTIONS)
    hand_loop(rec)
    cb = BackwardGraphCallback(str(tmp_path / "fit"), **OPTIONS)
    run_fit(probed_mlp, [cb], steps=STEPS, batch_size=BATCH)

    assert rec.captured_steps == cb.captured_steps == [1, 4, 8, 12]
    assert rec.triggers == cb.triggers
    loop_dir, fit_dir = tmp_path / "loop" / "backward_graph", tmp_path / "fit" / "backward_graph"
    def same_names(files, run):  # Graphs-tab folders name their log dir; files their time
        return [re.sub(r"vdlgraph\.\d+\.log$", "vdlgraph.T.log", f.replace(f"-{run}.backward_graph", "-RUN"))
                for f in files if not f.startswith("vdlrecords")]

    loop_files = same_names(files_under(loop_dir), "loop")
    fit_files = same_names(files_under(fit_dir), "fit")
    assert loop_files == fit_files
    assert os.path.join("graphs", "step_000012-RUN", "vdlgraph.T.log") in loop_files
    assert "step_000012.png" in loop_files and "step_000012.json" in loop_files
    assert _tags_and_steps(loop_dir) == _tags_and_steps(fit_dir)


def test_recorder_leaves_training_unchanged_and_unselected_steps_unpatched(tmp_path):
    _, base = hand_loop(None)
    rec = BackwardGraphRecorder(str(tmp_path), every=5, verbose=0, formats=("json",), visualdl=False)
    net, losses = hand_loop(rec)
    assert losses == base
    assert rec.captured_steps == [1, 5, 10]
    # seen from inside each step's backward
    assert net[1].seen == [s in (1, 5, 10) for s in range(1, STEPS + 1)]
    assert not dispatcher_installed() and no_leftover_hooks(net)


def test_steps_count_from_one_when_the_loop_says_nothing(tmp_path):
    net = probed_mlp()
    x, y = paddle.randn([4, 8]), paddle.randint(0, 3, [4, 1])
    with BackwardGraphRecorder(str(tmp_path), net, steps=[2, 3], capture_first=False, verbose=0,
                               formats=("json",), visualdl=False) as rec:
        for _ in range(4):
            with rec.step():
                nn.functional.cross_entropy(net(x), y).backward()
    assert rec.global_step == 4 and rec.captured_steps == [2, 3]
    assert sorted(p.name for p in (tmp_path / "backward_graph").iterdir()) == [
        "step_000002.json", "step_000003.json"]


def test_an_exception_in_a_step_cleans_up(tmp_path):
    rec = BackwardGraphRecorder(str(tmp_path), every=3, on_nonfinite=True, verbose=0, visualdl=False)
    with pytest.raises(KeyboardInterrupt):
        hand_loop(rec, raise_at=3)
    assert not dispatcher_installed()
    assert rec.captured_steps == [1, 3]
    assert rec.pipeline is None  # closed: the capture of step 3 was written first
    assert (tmp_path / "backward_graph" / "step_000003.json").exists()


def test_bad_arguments_fail_when_the_recorder_is_made():
    with pytest.raises(TypeError, match="model must be a paddle.nn.Layer"):
        BackwardGraphRecorder("logs", "net")
    with pytest.raises(TypeError, match="every must be an int"):
        BackwardGraphRecorder("logs", every="10")
    with pytest.raises(ValueError, match="every must be an int >= 1 or None, got 0"):
        BackwardGraphRecorder("logs", every=0)
    rec = BackwardGraphRecorder("logs", verbose=0)
    with pytest.raises(TypeError, match="step must be an int"):
        rec.begin_step("3")


def test_the_closing_line_counts_in_words(tmp_path, capsys):
    """One capture: '1 step captured', not '1 steps captured'."""
    net = nn.Linear(2, 1)
    with BackwardGraphRecorder(str(tmp_path), net, steps=[1], verbose=1, formats=("json",), visualdl=False) as rec:
        with rec.step(1):
            net(paddle.ones([1, 2])).sum().backward()
    out = capsys.readouterr().out
    assert rec.captured_steps == [1]
    assert "[paddleviz-hooks] 1 step captured: 1 written" in out, out


def test_a_step_begun_and_never_ended_is_ended_by_the_next_begin_step(tmp_path):
    """A loop that skips a bad batch with ``continue`` after ``begin_step`` (so ``end_step`` is not
    reached): the next ``begin_step`` ends it, nothing stays installed after ``close()``, and later
    steps are whole graphs of their own (``step_N.json``, backward 1 of 1)."""
    import json

    import paddle
    import paddle.nn.functional as F

    from paddleviz_hooks import BackwardGraphRecorder

    net = paddle.nn.Sequential(paddle.nn.Linear(10, 8), paddle.nn.LayerNorm(8), paddle.nn.Linear(8, 3))

    def hooks():
        return sum(len(l._forward_pre_hooks) + len(l._forward_post_hooks) for l in net.sublayers(include_self=True))

    flags = paddle.get_flags(["FLAGS_call_stack_level"])
    rec = BackwardGraphRecorder(str(tmp_path), net, every=1, formats=("json",), visualdl=False, verbose=0)
    for step in range(1, 5):
        rec.begin_step(step)
        try:
            x = paddle.randn([2, 10] if step != 2 else [2, 7])  # step 2: a bad batch
            F.cross_entropy(net(x), paddle.randint(0, 3, [2, 1])).backward()
        except ValueError:
            continue
        rec.end_step()
    rec.close()
    assert hooks() == 0
    assert paddle.get_flags(["FLAGS_call_stack_level"]) == flags
    run = tmp_path / "backward_graph"
    assert sorted(p.name for p in run.glob("step_*.json")) == ["step_000001.json", "step_000003.json",
                                                                "step_000004.json"]
    for p in run.glob("step_*.json"):
        assert json.loads(p.read_text())["meta"]["backward"]["of"] == 1, p.name


def test_close_says_what_it_waits_for_when_pictures_are_still_being_drawn(tmp_path, dot_shim, capsys):
    """A slow drawing at close(): the recorder says it is drawing what is left, and for how long
    at most, before it waits."""
    dot_shim('sleep 1\nexec {real} "$@"\n')  # each layout takes a second more
    net = paddle.nn.Linear(3, 2)
    rec = BackwardGraphRecorder(str(tmp_path / "log"), net, every=1, formats=("json", "png"), visualdl=False,
                                verbose=1, close_timeout=60)
    with rec.step(1):
        net(paddle.randn([2, 3])).sum().backward()
    rec.close()
    out = capsys.readouterr().out
    assert "drawing the captures still waiting (at most close_timeout=60 s;" in out
    assert out.index("drawing the captures still waiting") < out.index("1 drawn")


def test_a_reopened_recorder_adds_up_its_own_run(tmp_path, capsys):
    # the second run (a new run folder) used to report the first run's step 4 as lost
    model = paddle.nn.Linear(4, 2)
    rec = BackwardGraphRecorder(str(tmp_path), model, every=2, formats=("json",), visualdl=False)
    for last in (5, 3):
        for s in range(1, last + 1):
            with rec.step(s):
                model(paddle.randn([2, 4])).mean().backward()
        rec.close()
    assert rec.lost_steps == {}
    lines = [line for line in capsys.readouterr().out.splitlines() if "steps captured" in line]
    assert lines[0].startswith("[paddleviz-hooks] 3 steps captured: 3 written, 0 lost"), lines
    assert lines[1].startswith("[paddleviz-hooks] 2 steps captured: 2 written, 0 lost"), lines


def test_steps_that_could_not_be_saved_are_lost_not_captured(tmp_path, capsys):
    # a log_dir that is a file: one warning, training goes on, and the steps are counted as lost
    # (they used to be listed in captured_steps with nothing on disk, and no summary was printed)
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    model = paddle.nn.Linear(4, 2)
    with pytest.warns(RuntimeWarning, match="Pass a writable log_dir"):
        rec = BackwardGraphRecorder(str(blocker), model, every=1, formats=("json",), visualdl=False)
        for s in (1, 2):
            with rec.step(s):
                model(paddle.randn([2, 4])).mean().backward()
        rec.close()
    assert rec.captured_steps == [] and sorted(rec.lost_steps) == [1, 2]
    assert "could not be written" in rec.lost_steps[1]
    out = capsys.readouterr().out
    assert "2 steps captured: 0 written, 2 lost" in out, out


def test_numpy_step_numbers_are_steps(tmp_path):
    model = paddle.nn.Linear(4, 2)
    with BackwardGraphRecorder(str(tmp_path), model, every=2, formats=("json",), visualdl=False, verbose=0) as rec:
        for s in np.arange(1, 5):  # np.int64, as a loop over np.arange gives
            with rec.step(s, micro_batches=np.int32(1)):
                model(paddle.randn([2, 4])).mean().backward()
    assert rec.captured_steps == [1, 2, 4] and all(type(s) is int for s in rec.captured_steps)


def test_a_forward_run_outside_the_step_has_its_layers_marked_not_recorded(tmp_path):
    # the forward ran before `with rec.step()` armed the layer hooks: its ops' layers are unknown,
    # not "outside the model" (what they used to be called)
    from paddleviz_hooks.text import node_tooltip, describe_node
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with BackwardGraphRecorder(str(tmp_path), model, every=1, formats=("json",), visualdl=False, verbose=0) as rec:
        loss = model(paddle.randn([2, 4])).mean()  # outside the step
        with pytest.warns(RuntimeWarning, match="run the forward inside `with rec.step"):
            with rec.step(1):
                loss.backward()
        with rec.step(2):  # inside: layers recorded, the loss's Mean outside the model
            model(paddle.randn([2, 4])).mean().backward()
    from paddleviz_hooks import BackwardGraph
    run = tmp_path / "backward_graph"
    early, inside = (BackwardGraph.from_json((run / f"step_00000{i}.json").read_text()) for i in (1, 2))
    ops = [n for n in early.nodes if n.kind == "op"]
    assert ops and all(n.layer is None and n.layer_note == "unrecorded" for n in ops)
    assert all("layer: layer not recorded" in node_tooltip(n) for n in ops)
    assert all("outside the model" not in describe_node(n) for n in ops)
    mean = next(n for n in inside.nodes if n.op == "Mean")
    assert mean.layer is None and mean.layer_note is None and "layer: outside the model" in node_tooltip(mean)
    assert all(n.layer is not None for n in inside.nodes if n.kind == "op" and n.op != "Mean")


@pytest.mark.parametrize("shape", [[1], [1, 1]], ids=["[1]", "[1,1]"])
def test_a_loss_of_one_element_that_is_not_0d_is_captured(tmp_path, shape, recwarn):
    """Older toolkit code returns the loss as shape [1] (or sum(keepdim=True)): every selected
    step is captured, and a NaN in it is the loss's (it was 'capture failed and was skipped'
    with nothing lost, and a NaN loss was called a NaN gradient 'with a finite loss')."""
    from paddleviz_hooks import capture_backward

    paddle.seed(0)
    net = nn.Linear(4, 2)
    with capture_backward(net) as cap:
        (net(paddle.randn([3, 4])) ** 2).sum().reshape(shape).backward()
    assert cap.graph.meta["loss"] > 0 and not cap.errors
    with BackwardGraphRecorder(str(tmp_path), net, every=2, on_nonfinite=True, verbose=0,
                               formats=("json",), visualdl=False) as rec:
        for step in range(1, 5):
            with rec.step(step):
                x = paddle.randn([3, 4])
                if step == 3:
                    x = x * float("nan")
                (net(x) ** 2).sum().reshape(shape).backward()
            net.clear_gradients()
    assert rec.captured_steps == [1, 2, 3, 4] and rec.lost_steps == {}
    assert rec.triggers[3] == "nonfinite_loss", rec.triggers
    assert not [w for w in recwarn if "capture failed" in str(w.message)]


def test_a_step_whose_capture_failed_is_counted_as_lost(tmp_path, monkeypatch, capsys):
    """A selected step whose capture raised is named in lost_steps and the closing line, so the
    counts add up (it was in neither captured_steps nor lost_steps)."""
    import paddleviz_hooks.capture.session as session

    real = session.BackwardCapture._hook_all
    boom = {2}

    def hook_all(self, s):
        if rec.global_step in boom:
            raise RuntimeError("injected failure")
        return real(self, s)

    monkeypatch.setattr(session.BackwardCapture, "_hook_all", hook_all)
    net = nn.Linear(4, 2)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        with BackwardGraphRecorder(str(tmp_path), net, every=1, verbose=1, formats=("json",),
                                   visualdl=False) as rec:
            for step in range(1, 4):
                with rec.step(step):
                    net(paddle.randn([3, 4])).sum().backward()
    assert rec.captured_steps == [1, 3]
    assert list(rec.lost_steps) == [2] and "injected failure" in rec.lost_steps[2]
    assert "injected failure" in capsys.readouterr().out


def test_a_warning_names_the_users_line_not_the_librarys(tmp_path):
    """A warning about a step points at the user's line that led to it (here the backward of a
    forward run outside the step), as Python shows it (``file:line:``); it named a line of
    this package (``capture/session.py``), where the user can do nothing."""
    import warnings

    net = nn.Linear(3, 2)
    rec = BackwardGraphRecorder(str(tmp_path), net, every=1, verbose=0, formats=("json",), visualdl=False)
    loss = net(paddle.randn([2, 3])).mean()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with rec.step(1):
            loss.backward()  # the forward ran before the step was armed
        rec.close()
    ours = [w for w in got if "paddleviz_hooks:" in str(w.message)]
    assert ours and "forward ran before" in str(ours[0].message)
    assert os.path.abspath(ours[0].filename) == os.path.abspath(__file__), ours[0].filename


def test_a_log_dir_the_graphs_tab_cannot_open_is_said_at_construction(tmp_path):
    """VisualDL's Graphs tab cannot open a path with a space: said when the recorder is made,
    once (it came at the first capture, from the background thread, seen at close())."""
    import warnings

    net = nn.Linear(3, 2)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        rec = BackwardGraphRecorder(str(tmp_path / "my runs"), net, every=1, verbose=0, formats=("json",))
        made = [str(w.message) for w in got if "Graphs tab" in str(w.message)]
        with rec.step(1):
            net(paddle.randn([2, 3])).mean().backward()
        rec.close()
    assert len(made) == 1 and "my runs" in made[0]
    assert sum("Graphs tab" in str(w.message) for w in got) == 1


def test_a_run_that_recorded_nothing_leaves_no_empty_folder(tmp_path):
    """A recorder used again after close() for a step that records nothing claimed a new run
    folder (backward_graph_2) and left it empty; the first run's folder keeps its files."""
    net = nn.Linear(3, 2)
    rec = BackwardGraphRecorder(str(tmp_path), net, every=1, verbose=0, formats=("json",), visualdl=False)
    with rec.step(1):
        net(paddle.randn([2, 3])).mean().backward()
    rec.close()
    with rec.step(2):
        pass  # no backward: nothing to record
    rec.close()
    assert sorted(os.listdir(tmp_path)) == ["backward_graph"]
    assert os.listdir(tmp_path / "backward_graph") == ["step_000001.json"]
