"""Drawing happens in a process of its own; whatever happens to it, training does not notice.

The real worker (``python -m paddleviz_hooks.drawworker``) with the real ``dot`` is killed
(SIGKILL) and hung (SIGSTOP) by this test while a hand-written training loop runs with the real
recorder: the loop's gradients stay bit-identical to a run without the recorder, every capture's
JSON is on disk, the step the worker hung on twice is named undrawn with the command that draws
it, and no process is left behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
import paddle
import paddle.nn as nn
import pytest

from paddleviz_hooks import BackwardGraphRecorder

from _fitkit import children, ours, recorded_warnings, step_files

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

STEPS = 7
KILLED, HUNG = 3, 5  # the worker is killed while drawing step 3, hung (twice) while drawing step 5


def train(make_recorder=None, between=None) -> list[list[np.ndarray]]:
    """A seeded loop, recorded by ``make_recorder(net)``; every step's parameter gradients (float64)."""
    paddle.seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    rec = make_recorder(net) if make_recorder is not None else None
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=net.parameters())
    rng = np.random.RandomState(0)
    grads = []
    for step in range(1, STEPS + 1):
        x = paddle.to_tensor(rng.randn(4, 8).astype("float32"))
        y = paddle.to_tensor(rng.randint(0, 3, (4, 1)).astype("int64"))
        if rec is not None:
            with rec.step(step):
                nn.functional.cross_entropy(net(x), y).backward()
        else:
            nn.functional.cross_entropy(net(x), y).backward()
        grads.append([p.grad.numpy().astype("float64") for p in net.parameters()])
        opt.step()
        opt.clear_grad()
        if between is not None:
            between(step)
    return grads


def test_a_killed_and_a_hung_drawing_process_cost_training_nothing(tmp_path):
    plain = train()
    rec = None

    def recorder(net):
        nonlocal rec
        rec = BackwardGraphRecorder(str(tmp_path / "log"), net, every=1, verbose=0, visualdl=False,
                                    formats=("json", "png"), render_timeout=1)
        return rec

    pipe = None
    stopped: list[int] = []
    done = threading.Event()

    def saboteur():
        """Kills the worker drawing step 3; stops (hangs) each of the first two drawing step 5."""
        killed = False
        while not done.is_set():
            proc = pipe.drawing if pipe is not None else None
            pid = proc.pid if proc is not None else None
            if pid is not None and proc.in_flight == KILLED and not killed:
                os.kill(pid, signal.SIGKILL)
                killed = True
            elif pid is not None and proc.in_flight == HUNG and pid not in stopped and len(stopped) < 2:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            time.sleep(0.002)

    def between(step):
        nonlocal pipe
        pipe = rec.pipeline
        pipe.drawing.margin = 2.0  # a hang is given up on after render_timeout + 2 s: 3 s
        deadline = time.monotonic() + 60
        while step not in pipe.drawn and step not in pipe.not_drawn and time.monotonic() < deadline:
            time.sleep(0.01)  # mid-run: each step's drawing is over before the next step

    watcher = threading.Thread(target=saboteur, daemon=True)
    watcher.start()
    try:
        with recorded_warnings() as got:
            grads = train(recorder, between)
            rec.close()
    finally:
        done.set()
        watcher.join(5)
        for pid in stopped:  # (already killed by the recorder; never left stopped whatever failed)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for a, b in zip(grads, plain):
        for ga, gb in zip(a, b):
            assert np.array_equal(ga, gb)
    run_dir = tmp_path / "log" / "backward_graph"
    assert step_files(run_dir, "json") == list(range(1, STEPS + 1))
    assert step_files(run_dir, "png") == [s for s in range(1, STEPS + 1) if s != HUNG]
    assert len(stopped) == 2 and rec.undrawn_steps == [HUNG]
    msgs = ours(got)
    died = [m for m in msgs if "drawing process was killed by signal SIGKILL" in m]
    hung = [m for m in msgs if "did not answer within 3 s while drawing step 5" in m]
    undrawn = [m for m in msgs if "not drawn (" in m]
    assert len(died) == 1 and len(hung) == 1 and len(undrawn) == 1 and len(msgs) == 3, msgs
    assert "started again" in died[0] and "started again" in hung[0]
    assert "step 5: the drawing process did not answer within 3 s twice on it" in undrawn[0], undrawn
    assert f"paddleviz-hooks render {run_dir / 'step_000005.json'}" in undrawn[0], undrawn
    assert children(os.getpid()) == {}  # no worker, no engine left



def _state(pid: int) -> str | None:
    """The process's state letter (None: gone); a zombie has ended."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except OSError:
        return None


@pytest.mark.parametrize("how", ["exits without close", "is killed"])
def test_no_drawing_process_outlives_the_training_process(tmp_path, how):
    """The training process ends without closing the recorder (interpreter exit), or is killed
    (SIGKILL: no Python code runs): its drawing process ends too."""
    import subprocess

    end = "os.kill(os.getpid(), signal.SIGKILL)" if how == "is killed" else "sys.exit(0)"
    script = f"""
import os, signal, sys, time, paddle
from paddleviz_hooks import BackwardGraphRecorder
net = paddle.nn.Linear(3, 2)
rec = BackwardGraphRecorder({str(tmp_path)!r}, net, every=1, formats=("png",), visualdl=False, verbose=0)
for step in (1, 2, 3):
    with rec.step(step):
        net(paddle.randn([2, 3])).sum().backward()
deadline = time.monotonic() + 60
while rec.pipeline.drawing.pid is None and time.monotonic() < deadline:
    time.sleep(0.01)
print(os.getpid(), rec.pipeline.drawing.pid, flush=True)
{end}
"""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__import__("paddleviz_hooks").__file__))),
         os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == (-9 if how == "is killed" else 0), r.stderr[-2000:]
    trainer, pid = map(int, r.stdout.split()[-2:])
    deadline = time.monotonic() + 10
    while _state(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _state(pid) in (None, "Z")
    if how == "is killed":
        # no code of the killed process ran to remove its drawing folder; its worker removes it
        # when it can, and one left by a worker killed outright too (made here, as it would be
        # left) is removed by the next training process that draws (they stayed in /tmp for good)
        left = temp / f"paddleviz-draw-{trainer}-left"
        left.mkdir(exist_ok=True)
        r = subprocess.run([sys.executable, "-c", script.replace(end, "rec.close()")], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
    assert [d for d in os.listdir(temp) if d.startswith("paddleviz-draw-")] == []


def test_an_engine_run_ends_with_its_killed_drawing_process(tmp_path, dot_shim):
    """SIGKILL of the drawing process mid-layout: its engine run ends too (it would be orphaned
    and run on for minutes on a large graph), and its temporary files are removed."""
    dot_shim("exec sleep 30\n")  # an engine run that takes long
    net = nn.Linear(3, 2)
    rec = BackwardGraphRecorder(str(tmp_path / "log"), net, every=1, formats=("json", "png"), visualdl=False,
                                verbose=0, render_timeout=4, close_timeout=0)
    try:
        with rec.step(1):
            net(paddle.randn([2, 3])).sum().backward()
        deadline, engine = time.monotonic() + 60, None
        while engine is None and time.monotonic() < deadline:
            engine = next((p for p, cmd in children(os.getpid()).items() if cmd.startswith("sleep 30")), None)
            time.sleep(0.02)
        worker = rec.pipeline.drawing.pid
        assert engine is not None and worker is not None
        with open(f"/proc/{worker}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        temp = env.get(b"TMPDIR", b"").decode()
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _state(engine) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _state(engine) in (None, "Z")  # not left running on its own
        with recorded_warnings():
            rec.close()
        assert temp and not os.path.exists(temp)
        assert children(os.getpid()) == {}
    finally:
        rec.close()
