"""The fault matrix: whatever goes wrong around the callback, training does not notice.

Every row runs a real, seeded ``paddle.Model.fit`` with ``BackwardGraphCallback``
while one fault is injected (through the environment, never by mocking Paddle,
Graphviz or VisualDL) and checks:

* the fit completes, with per-step losses and final parameters bit-identical
  to the same seeded fit without our callback;
* exactly one ``paddleviz_hooks`` warning, naming the cause;
* what could still be saved was saved, and nothing half-written remains.
"""

from __future__ import annotations

import gc

import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import paddle
import paddle.nn as nn
import pytest

import paddleviz_hooks.capture.stats as stats_mod
from paddleviz_hooks import BackwardGraph, BackwardGraphCallback, EngineNotFound, capture_backward
from paddleviz_hooks.capture import dispatcher_installed
from paddleviz_hooks.render.engine import find_engine

from paddleviz_hooks import render_to_file
from paddleviz_hooks.pipeline import CapturePipeline
from _fitkit import (
    children,
    Recorder,
    assert_same_run,
    files_under,
    mlp,
    no_leftover_hooks,
    ours,
    recorded_warnings,
    run_fit,
    step_files,
    vdl_records,
    image_steps,
    without_engine,
)

STEPS = 12
EVERY = 4
CAPTURED = [1, 4, 8, 12]
_BASELINES: dict = {}


def baseline(steps: int = STEPS, make_net=mlp, key: str = "mlp", **kw):
    """The seeded fit without our callback (computed once per configuration)."""
    k = (key, steps, tuple(sorted(kw.items())))
    if k not in _BASELINES:
        _BASELINES[k] = run_fit(make_net, steps=steps, **kw)
    return _BASELINES[k]


def cb_for(tmp_path, **kw) -> BackwardGraphCallback:
    if "steps" not in kw:
        kw.setdefault("every", EVERY)
    kw.setdefault("verbose", 0)
    kw.setdefault("view_max_px", 400)
    kw.setdefault("queue_size", 16)  # every capture is written (the backlog row tests drops)
    return BackwardGraphCallback(str(tmp_path / "vdl"), **kw)


def no_tmp_leftovers(root) -> None:
    left = [f for f in files_under(root) if ".tmp-" in f or ".probe-" in f]
    assert not left, left


@pytest.fixture(autouse=True)
def _clean_state():
    yield
    # every row must leave the process as it found it
    assert not dispatcher_installed()
    assert paddle.is_grad_enabled()
    assert not any(t.name == "paddleviz-hooks-worker" for t in threading.enumerate())
    if sys.platform.startswith("linux"):
        assert children(os.getpid()) == {}  # no drawing process, no layout engine


# --------------------------------------------------------------------------
# the control row: no fault at all
# --------------------------------------------------------------------------
def test_control_no_fault_is_bit_identical_and_silent(tmp_path):
    cb = cb_for(tmp_path)
    with recorded_warnings() as got:
        res = run_fit(callbacks=[cb], steps=STEPS)
    assert_same_run(res, baseline())
    assert ours(got) == []
    assert cb.captured_steps == CAPTURED
    run_dir = tmp_path / "vdl" / "backward_graph"
    for ext in ("png", "svg", "dot", "json"):
        assert step_files(run_dir, ext) == CAPTURED, ext
    assert image_steps(vdl_records(run_dir), "backward_graph") == CAPTURED
    no_tmp_leftovers(tmp_path)


# --------------------------------------------------------------------------
# no layout engine
# --------------------------------------------------------------------------
def test_no_layout_engine(tmp_path, monkeypatch):
    without_engine(tmp_path, monkeypatch)

    cb = cb_for(tmp_path)
    with recorded_warnings() as got:
        res = run_fit(callbacks=[cb], steps=STEPS)
    assert_same_run(res, baseline())
    msgs = ours(got)
    assert len(msgs) == 2, msgs
    assert "Graphviz" in msgs[0] and "apt-get install" in msgs[0] and "graphviz-pure" in msgs[0]
    # then every undrawn step, named, with the command that draws it from its JSON
    assert "steps 1, 4, 8, 12: no layout engine is installed" in msgs[1] and "paddleviz-hooks render" in msgs[1]
    assert cb.recorder.undrawn_steps == CAPTURED

    # what needs no engine is still written, for every captured step
    run_dir = tmp_path / "vdl" / "backward_graph"
    assert cb.captured_steps == CAPTURED
    assert step_files(run_dir, "json") == CAPTURED
    assert step_files(run_dir, "dot") == CAPTURED
    assert step_files(run_dir, "png") == [] and step_files(run_dir, "svg") == []
    # the user asking for a drawing gets the same clear error
    g = BackwardGraph.from_json((run_dir / "step_000004.json").read_text())
    with pytest.raises(EngineNotFound, match="apt-get install -y graphviz"):
        render_to_file(g, str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()
    no_tmp_leftovers(tmp_path)


def test_engine_env_names_missing_engine(tmp_path, monkeypatch):
    """PADDLEVIZ_ENGINE naming an engine that is not there: no silent fallback."""
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    monkeypatch.setattr(sys, "executable", str(empty_bin / "python"))
    monkeypatch.setenv("PADDLEVIZ_ENGINE", "graphviz-pure")
    assert find_engine() is None
    monkeypatch.setenv("PADDLEVIZ_ENGINE", "neato")
    with pytest.raises(ValueError, match="'neato'"):
        find_engine()


# --------------------------------------------------------------------------
# VisualDL not importable
# --------------------------------------------------------------------------
def test_visualdl_not_importable(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "visualdl", None)
    cb = cb_for(tmp_path)
    with recorded_warnings() as got:
        res = run_fit(callbacks=[cb], steps=STEPS)
    assert_same_run(res, baseline())
    msgs = ours(got)
    assert len(msgs) == 1, msgs
    assert "VisualDL is not importable" in msgs[0] and "pip install visualdl" in msgs[0]
    run_dir = tmp_path / "vdl" / "backward_graph"
    for ext in ("png", "svg", "dot", "json"):
        assert step_files(run_dir, ext) == CAPTURED, ext
    assert not [f for f in os.listdir(run_dir) if f.startswith("vdlrecords")]
    no_tmp_leftovers(tmp_path)


# --------------------------------------------------------------------------
# log dir unwritable
# --------------------------------------------------------------------------
def _unwritable_log_dir(tmp_path, how: str) -> str:
    if how == "enotdir":
        f = tmp_path / "file.txt"
        f.write_text("a regular file, not a directory")
        return str(f / "sub")
    d = tmp_path / "ro"
    d.mkdir()
    os.chmod(d, 0o500)
    probe = d / "probe"
    try:
        probe.write_text("x")
    except OSError:
        return str(d)
    probe.unlink()
    os.chmod(d, 0o700)
    pytest.skip("running as root (or with CAP_DAC_OVERRIDE): chmod does not stop writes; "
                "the ENOTDIR row covers this case")


@pytest.mark.parametrize("how", ["enotdir", "chmod"])
def test_log_dir_unwritable(tmp_path, how):
    log_dir = _unwritable_log_dir(tmp_path, how)
    cb = BackwardGraphCallback(log_dir, every=EVERY, verbose=0)
    try:
        with recorded_warnings() as got:
            res = run_fit(callbacks=[cb], steps=STEPS)
    finally:
        os.chmod(tmp_path, 0o700)
        if how == "chmod":
            os.chmod(log_dir, 0o700)
    assert_same_run(res, baseline())
    msgs = ours(got)
    assert len(msgs) == 1, msgs
    assert "cannot write to" in msgs[0] and "log_dir" in msgs[0]
    assert repr(os.path.join(log_dir, "backward_graph")) in msgs[0]
    # the graphs were still captured, but nothing could be saved: each step is lost, with why
    # (captured = written + lost), and none is listed as captured
    assert cb.captured_steps == []
    assert sorted(cb.recorder.lost_steps) == CAPTURED
    assert all("could not be written" in why for why in cb.recorder.lost_steps.values())
    if how == "chmod":
        assert os.listdir(log_dir) == []


# --------------------------------------------------------------------------
# disk full
# --------------------------------------------------------------------------
_DISK_FULL_CHILD = textwrap.dedent(
    """
    import json, os, resource, signal, sys, warnings
    sys.path.insert(0, {tests!r})
    from _fitkit import run_fit, assert_same_run, ours, recorded_warnings, files_under
    from paddleviz_hooks import BackwardGraphCallback

    base = run_fit(steps={steps})
    log_dir = sys.argv[1]
    os.makedirs(log_dir)
    # the "disk" holds 2 KiB per file from now on; writes beyond fail with EFBIG
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    cb = BackwardGraphCallback(log_dir, every={every}, verbose=0, view_max_px=400)
    with recorded_warnings() as got:
        res = run_fit(callbacks=[cb], steps={steps})
    assert_same_run(res, base)
    print(json.dumps({{"warnings": ours(got), "captured": cb.captured_steps,
                      "files": files_under(log_dir)}}))
    """
)


def test_disk_full_file_size_limit(tmp_path):
    """RLIMIT_FSIZE in a child process: every write past 2 KiB fails with EFBIG."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = _DISK_FULL_CHILD.format(tests=here, steps=STEPS, every=EVERY)
    log_dir = tmp_path / "vdl"
    proc = subprocess.run([sys.executable, "-c", code, str(log_dir)], capture_output=True, text=True,
                          timeout=240, cwd=os.path.dirname(here))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "File too large" in out["warnings"][0] or "No space" in out["warnings"][0]
    assert out["captured"] == CAPTURED
    # atomic writes: no temporary or truncated file is left behind
    assert not [f for f in out["files"] if ".tmp-" in f], out["files"]
    for rel in out["files"]:
        p = log_dir / rel
        if rel.endswith(".json"):
            BackwardGraph.from_json(p.read_text())
        if rel.endswith(".png"):
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _try_mount_tmpfs(path, size: str) -> bool:
    path.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def test_disk_full_tmpfs(tmp_path):
    """A real ENOSPC: a tiny tmpfs (needs permission to mount; skipped otherwise)."""
    mnt = tmp_path / "small"
    if not _try_mount_tmpfs(mnt, "256k"):
        pytest.skip("mounting a tmpfs is not permitted here; the RLIMIT_FSIZE row covers disk full")
    try:
        # fill the file system, leaving about 8 KiB (room for the first small files)
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        os.truncate(mnt / "filler", os.path.getsize(mnt / "filler") - 8192)
        cb = BackwardGraphCallback(str(mnt / "vdl"), every=EVERY, verbose=0, view_max_px=400)
        with recorded_warnings() as got:
            res = run_fit(callbacks=[cb], steps=STEPS)
        assert_same_run(res, baseline())
        msgs = ours(got)
        assert msgs and all("no space left on device" in m.lower() for m in msgs), msgs
        assert cb.captured_steps == CAPTURED
        # counts that add up: every captured step written or lost (with why), drawn or named undrawn
        rec = cb.recorder
        written = sorted(set(CAPTURED) - set(rec.lost_steps))
        assert set(rec.lost_steps.values()) <= {"no space left on device"}
        assert set(rec.undrawn_steps) <= set(written)
        no_tmp_leftovers(mnt)
        run_dir = mnt / "vdl" / "backward_graph"
        for n in os.listdir(run_dir):
            if n.endswith(".json"):
                BackwardGraph.from_json((run_dir / n).read_text())
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=20)


# --------------------------------------------------------------------------
# rendering past its timeout
# --------------------------------------------------------------------------
def test_render_timeout(tmp_path):
    cb = cb_for(tmp_path, render_timeout=0.001)
    with recorded_warnings() as got:
        res = run_fit(callbacks=[cb], steps=STEPS)
    assert_same_run(res, baseline())
    msgs = ours(got)
    assert len(msgs) == 2, msgs
    assert "did not finish" in msgs[0] and "0.001 s" in msgs[0] and "timeout" in msgs[0]
    assert "the layout engine ran past render_timeout=0.001 s" in msgs[1] and "paddleviz-hooks render" in msgs[1]
    assert cb.recorder.undrawn_steps == CAPTURED
    run_dir = tmp_path / "vdl" / "backward_graph"
    assert cb.captured_steps == CAPTURED
    # the drawing was dropped; the engine-free records are kept
    assert step_files(run_dir, "svg") == [] and step_files(run_dir, "png") == []
    assert step_files(run_dir, "json") == CAPTURED
    no_tmp_leftovers(tmp_path)
    # no stray engine process is left running
    ps = subprocess.run(["ps", "-o", "pid=,ppid=,comm=", "--ppid", str(os.getpid())],
                        capture_output=True, text=True).stdout
    assert " dot" not in ps and "graphviz" not in ps, ps


# --------------------------------------------------------------------------
# an exception inside a gradient hook
# --------------------------------------------------------------------------
def test_exception_inside_gradient_hook(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected failure in a gradient hook")

    monkeypatch.setattr(stats_mod, "grad_meta", broken)
    cb = cb_for(tmp_path)
    with recorded_warnings() as got:
        res = run_fit(callbacks=[cb], steps=STEPS)
    assert paddle.is_grad_enabled()
    assert_same_run(res, baseline())
    msgs = ours(got)
    assert len(msgs) == 1, msgs
    assert "gradient recording failed" in msgs[0] and "injected failure" in msgs[0]
    # the structure is still captured, with no gradient data on the edges
    assert cb.captured_steps == CAPTURED
    g = BackwardGraph.from_json((tmp_path / "vdl" / "backward_graph" / "step_000004.json").read_text())
    assert g.count_ops().get("Matmul") == 2


def test_exception_inside_gradient_hook_manual_backward(monkeypatch):
    """Same fault with capture_backward: backward succeeds, gradients identical."""
    paddle.seed(1)
    net = mlp()
    x = paddle.randn([4, 8])

    def grads():
        net.clear_gradients()
        net(x).square().mean().backward()
        return [p.grad.numpy().copy() for p in net.parameters()]

    want = grads()
    monkeypatch.setattr(stats_mod, "grad_meta", lambda *a, **k: 1 / 0)
    net.clear_gradients()
    with recorded_warnings() as got:
        with capture_backward(net) as cap:
            net(x).square().mean().backward()
    assert paddle.is_grad_enabled()
    got_grads = [p.grad.numpy() for p in net.parameters()]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(want, got_grads))
    msgs = ours(got)
    assert len(msgs) == 1 and "ZeroDivisionError" in msgs[0], msgs
    assert len(cap.graphs) == 1


# --------------------------------------------------------------------------
# NaN / Inf gradients
# --------------------------------------------------------------------------
class _Blowup(nn.Layer):
    """An MLP whose first layer's output is multiplied by inf from step 6 on."""

    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        scale = float("inf") if self.calls >= 6 else 1.0
        return self.body(x * scale)


def test_nan_inf_gradients(tmp_path):
    cb = cb_for(tmp_path, every=2)
    with recorded_warnings() as got:
        res = run_fit(_Blowup, callbacks=[cb], steps=STEPS)
    assert_same_run(res, baseline(make_net=_Blowup, key="blowup"))
    # Linear on inf inputs gives NaN, ReLU turns NaN into 0: finite losses, NaN weight gradients
    assert np.isnan(res.params["body.0.weight"]).all()
    # NaN/Inf are data, not a fault: no warning, every capture written
    assert ours(got) == []
    run_dir = tmp_path / "vdl" / "backward_graph"
    want = [1, 2, 4, 6, 8, 10, 12]
    assert cb.captured_steps == want
    for ext in ("png", "svg", "dot", "json"):
        assert step_files(run_dir, ext) == want, ext
    g = BackwardGraph.from_json((run_dir / "step_000006.json").read_text())
    assert g.nonfinite_count() > 0 and g.nonfinite_sites()
    assert image_steps(vdl_records(run_dir), "backward_graph") == want


# --------------------------------------------------------------------------
# KeyboardInterrupt in the middle of a captured step
# --------------------------------------------------------------------------
class _InterruptingLoss(nn.Layer):
    def __init__(self, at_call: int):
        super().__init__()
        self.ce = nn.CrossEntropyLoss()
        self.at_call = at_call
        self.calls = 0

    def forward(self, logits, label):
        self.calls += 1
        if self.calls == self.at_call:
            raise KeyboardInterrupt
        return self.ce(logits, label)


def _assert_clean(net):
    assert not dispatcher_installed()
    assert no_leftover_hooks(net)
    assert paddle.is_grad_enabled()
    assert gc.isenabled()  # collections held off during the captured backward are back


@pytest.mark.parametrize("where", ["loss", "forward_hook", "gradient_hook"])
@pytest.mark.parametrize("triggers", [False, True], ids=["plain", "triggers"])
def test_keyboard_interrupt_in_captured_step(tmp_path, monkeypatch, where, triggers):
    """Ctrl-C on captured step 4: hooks and the backward patch go away by themselves.

    ``Model.fit`` calls no callback when an exception leaves it; the callback
    wraps ``Model.train_batch`` during the fit so an exception raised inside a
    step (forward, loss, backward, optimizer) closes it before propagating.
    ``cb.close()`` (or ``with BackwardGraphCallback(...) as cb:``) is still
    the documented way, and it is harmless to call twice.
    """
    cb = cb_for(tmp_path, on_nonfinite=triggers)
    loss = None
    make_net = mlp
    if where == "loss":
        loss = _InterruptingLoss(at_call=4)
    elif where == "forward_hook":
        def make_net():
            net = mlp()
            calls = [0]

            def hook(layer, inputs):
                calls[0] += 1
                if calls[0] == 4:
                    raise KeyboardInterrupt

            net[2].register_forward_pre_hook(hook)
            return net
    else:
        # Ctrl-C arriving while our hook runs inside Paddle's backward: the
        # user must get a KeyboardInterrupt, not Paddle's OSError wrapper.
        real = stats_mod.grad_meta
        calls = [0]

        def interrupting(*args, **kwargs):
            calls[0] += 1
            if cb.global_step == 4:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(stats_mod, "grad_meta", interrupting)

    with recorded_warnings() as got:
        res = run_fit(make_net, callbacks=[cb], steps=STEPS, loss=loss, catch=(KeyboardInterrupt,))
    assert isinstance(res.error, KeyboardInterrupt), res.error
    assert ours(got) == []
    assert len(res.losses) == 3  # steps 1-3 finished
    assert res.losses.tobytes() == baseline().losses[:3].tobytes()
    net = res.net
    if where == "forward_hook":  # the user's own hook stays, ours are gone
        assert len(net[2]._forward_pre_hooks) == 1
        net[2]._forward_pre_hooks.clear()
    # cleaned up automatically, before close()
    _assert_clean(net)
    assert cb.recorder.pipeline is None
    cb.close()  # still fine to call
    _assert_clean(net)
    assert cb.captured_steps == [1]
    # and the process trains as before: a new fit is bit-identical to the baseline
    monkeypatch.undo()
    assert_same_run(run_fit(steps=STEPS), baseline())


def test_keyboard_interrupt_outside_a_step_needs_close(tmp_path):
    """An exception between steps (here: in another callback, after our
    on_train_batch_end) skips our callback: with triggers on, the watch hooks
    stay until close() or the end of the ``with`` block."""

    def interrupt(step):
        if step == 6:
            raise KeyboardInterrupt

    with BackwardGraphCallback(str(tmp_path / "vdl"), every=EVERY, verbose=0, on_nonfinite=True) as cb:
        res = run_fit(callbacks=[cb], recorder=Recorder(on_step=interrupt), catch=(KeyboardInterrupt,))
        assert isinstance(res.error, KeyboardInterrupt)
        assert dispatcher_installed()  # the trigger watch is still on ...
        assert not no_leftover_hooks(res.net)
    _assert_clean(res.net)  # ... until the with block (or close()) ends it
    assert "train_batch" not in res.model.__dict__
    assert cb.captured_steps == [1, 4]



class _InterruptAtBatchBegin(paddle.callbacks.Callback):
    """Another callback, after ours in the list, whose on_train_batch_begin raises a Ctrl-C."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def on_train_batch_begin(self, step, logs=None):
        if step + 1 == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("triggers", [False, True], ids=["plain", "triggers"])
def test_keyboard_interrupt_in_another_callbacks_batch_begin_leaves_nothing_armed(tmp_path, triggers):
    """A selected step is armed when its train_batch runs, not in on_train_batch_begin: a Ctrl-C in
    a later callback's on_train_batch_begin (before train_batch) left the step armed (forward hooks,
    the backward patch, the call-stack flag) and every later backward() of the process was captured."""
    flag = paddle.get_flags("FLAGS_call_stack_level")["FLAGS_call_stack_level"]
    cb = cb_for(tmp_path, on_nonfinite=triggers)
    res = run_fit(callbacks=[cb, _InterruptAtBatchBegin(at=EVERY)], catch=(KeyboardInterrupt,))
    assert isinstance(res.error, KeyboardInterrupt)
    assert paddle.get_flags("FLAGS_call_stack_level")["FLAGS_call_stack_level"] == flag
    if not triggers:  # nothing of ours is armed: plain backwards run unpatched
        _assert_clean(res.net)
    captured = list(cb.captured_steps)
    res.net(paddle.randn([4, 8])).mean().backward()  # the user's code after the failed fit
    assert cb.captured_steps == captured == [1]
    cb.close()
    _assert_clean(res.net)

def test_keyboard_interrupt_inside_capture_backward_block():
    net = mlp()
    x = paddle.randn([4, 8])
    with pytest.raises(KeyboardInterrupt):
        with capture_backward(net):
            net(x).mean()
            assert dispatcher_installed()
            raise KeyboardInterrupt
    _assert_clean(net)


def test_keyboard_interrupt_inside_hook_of_capture_backward(monkeypatch):
    paddle.seed(3)
    net = mlp()
    x = paddle.randn([4, 8])
    net(x).mean().backward()
    want = [p.grad.numpy().copy() for p in net.parameters()]

    def interrupting(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(stats_mod, "grad_meta", interrupting)
    net.clear_gradients()
    with pytest.raises(KeyboardInterrupt):
        with capture_backward(net) as cap:
            net(x).mean().backward()
    _assert_clean(net)
    assert cap.graphs == []
    # the backward itself finished before the interrupt was delivered
    assert all(a.tobytes() == p.grad.numpy().tobytes() for a, p in zip(want, net.parameters()))


# --------------------------------------------------------------------------
# the background worker dying
# --------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_background_worker_dies_and_restarts_once(tmp_path, monkeypatch):
    cb = cb_for(tmp_path, steps=[2, 6, 10], capture_first=False)
    real = CapturePipeline._process
    dead = threading.Event()

    def dying(self, job):
        if job.step == 2:
            dead.set()
            raise SystemExit  # ends the worker thread
        return real(self, job)

    monkeypatch.setattr(CapturePipeline, "_process", dying)

    def between(step):
        if step == 4:  # let the thread finish dying before the next capture
            assert dead.wait(30)
            worker = cb.recorder.pipeline.worker
            worker._thread.join(30)
            assert not worker.alive

    with recorded_warnings() as got:
        res = run_fit(callbacks=[cb], steps=STEPS, recorder=Recorder(on_step=between))
    assert_same_run(res, baseline())
    msgs = ours(got)
    assert len(msgs) == 1, msgs
    assert "background renderer had stopped" in msgs[0] and "restarted" in msgs[0]
    assert cb.captured_steps == [2, 6, 10]
    run_dir = tmp_path / "vdl" / "backward_graph"
    assert step_files(run_dir, "png") == [6, 10]  # the job that killed it is lost, later ones are not


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_background_worker_dies_twice(tmp_path, monkeypatch):
    cb = cb_for(tmp_path, steps=[2, 6, 10], capture_first=False)

    def always_dying(self, job):
        raise SystemExit

    monkeypatch.setattr(CapturePipeline, "_process", always_dying)

    def between(step):
        if step in (4, 8):
            cb.recorder.pipeline.worker._thread.join(30)

    with recorded_warnings() as got:
        res = run_fit(callbacks=[cb], steps=STEPS, recorder=Recorder(on_step=between))
    assert_same_run(res, baseline())
    msgs = ours(got)
    assert len(msgs) == 2, msgs  # one restart, then one "stopped twice"
    assert "restarted" in msgs[0] and "stopped twice" in msgs[1]


def test_renderer_backlog_loses_nothing(tmp_path, monkeypatch):
    """Captures faster than the renderer: training never waits, nothing is dropped; the
    data of every step is written first and every picture arrives by close()."""
    cb = cb_for(tmp_path, every=1, queue_size=1)
    real = CapturePipeline._draw
    release = threading.Event()
    written_while_blocked = []

    def slow(self, d):
        release.wait(30)
        return real(self, d)

    monkeypatch.setattr(CapturePipeline, "_draw", slow)
    def at_step(step):
        if step == STEPS:  # the data thread has had the whole run to catch up
            deadline = time.monotonic() + 30
            while len(cb.recorder.pipeline.written) < STEPS and time.monotonic() < deadline:
                time.sleep(0.01)
            written_while_blocked.append(len(cb.recorder.pipeline.written))
            assert cb.recorder.pipeline.drawn == []
            release.set()

    with recorded_warnings() as got:
        res = run_fit(callbacks=[cb], steps=STEPS, recorder=Recorder(on_step=at_step))
    assert_same_run(res, baseline())
    assert ours(got) == []
    assert cb.captured_steps == list(range(1, STEPS + 1)) and cb.dropped_steps == []
    run_dir = tmp_path / "vdl" / "backward_graph"
    assert step_files(run_dir, "json") == cb.captured_steps
    assert step_files(run_dir, "png") == cb.captured_steps
    assert cb.recorder.undrawn_steps == []
    # while drawing was blocked, the data of later captures kept being written
    assert written_while_blocked == [STEPS]


def test_write_errors_name_the_file_asked_for(tmp_path):
    """atomic_write and the run folder's write probe go through temporary files; a failure names
    the destination (and the reason), of the same error class, and leaves no temporary file."""
    from paddleviz_hooks._fileio import atomic_write
    from paddleviz_hooks.sinks.files import StepFiles

    target = tmp_path / "adir"  # the rename onto a folder that holds a file fails
    target.mkdir()
    (target / "keep").write_text("x")
    with pytest.raises(OSError) as info:
        atomic_write(str(target), "data")
    assert info.value.filename == str(target) and ".tmp-" not in str(info.value), info.value
    assert info.value.strerror and info.value.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST)
    assert sorted(os.listdir(tmp_path)) == ["adir"]

    missing = tmp_path / "gone" / "r.html"
    with pytest.raises(FileNotFoundError) as info:
        atomic_write(str(missing), "data")
    assert info.value.filename == str(missing) and ".tmp-" not in str(info.value)
    assert str(tmp_path / "gone") in info.value.strerror  # the folder the new file was refused in

    if os.path.isdir("/proc/self"):  # a folder that exists and refuses new files, for root too
        with pytest.raises(OSError) as info:
            atomic_write("/proc/self/x.html", "data")
        assert info.value.filename == "/proc/self/x.html" and ".tmp-" not in str(info.value)
        with pytest.raises(OSError) as info:
            StepFiles("/proc/self")
        assert info.value.filename == "/proc/self" and ".probe-" not in str(info.value)
