"""The drawing thread yields the CPU to training: it and the layout engines it starts run niced."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from paddleviz_hooks.pipeline import DRAWING_NICE, lower_thread_priority


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's")
def test_drawing_thread_and_its_engines_run_niced():
    seen = {}

    def draw():
        lower_thread_priority()
        seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        # what a `dot` started from this thread inherits
        seen["child"] = int(subprocess.run(["sh", "-c", "nice"], capture_output=True, text=True).stdout)

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=draw)
    t.start()
    t.join()
    assert DRAWING_NICE == 10
    assert seen == {"thread": max(before, 10), "child": max(before, 10)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # training's thread untouched
    assert int(subprocess.run(["sh", "-c", "nice"], capture_output=True, text=True).stdout) == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's")
def test_the_recorders_drawing_thread_runs_niced(tmp_path):
    import time

    import paddle

    from paddleviz_hooks import BackwardGraphRecorder

    net = paddle.nn.Linear(3, 2)
    rec = BackwardGraphRecorder(str(tmp_path), net, every=1, formats=["png"], visualdl=False, verbose=0)
    try:
        with rec.step(1):
            net(paddle.randn([2, 3])).sum().backward()
        deadline = time.monotonic() + 30
        while not list(tmp_path.rglob("step_000001.png")) and time.monotonic() < deadline:
            time.sleep(0.05)  # drawn: the thread has started and lowered itself
        drawer = next(t for t in threading.enumerate() if t.name == "paddleviz-hooks-drawing")
        assert os.getpriority(os.PRIO_PROCESS, drawer.native_id) >= DRAWING_NICE
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < DRAWING_NICE  # training's thread
    finally:
        rec.close()
    assert list(tmp_path.rglob("step_000001.png"))  # the picture arrived
