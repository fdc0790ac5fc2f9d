"""Drawing yields the CPU to training: the drawing process, the layout engines it starts and the
thread that hands pictures to the sinks run niced; the training thread keeps its priority."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

import paddle
import paddle.nn as nn

from paddleviz_hooks import BackwardGraphRecorder
from paddleviz_hooks.drawproc import WORKER_MODULE
from paddleviz_hooks.drawworker import DRAWING_NICE, lower_priority

from _fitkit import children


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's")
def test_drawing_thread_and_its_engines_run_niced():
    seen = {}

    def draw():
        lower_priority(thread=True)
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


def nice_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[16])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_drawing_process_and_its_engines_run_niced_and_never_import_paddle(tmp_path, engine_run_count):
    """The worker runs at nice >= 10, so does each `dot` it starts (the shim records its nice
    value); the training thread keeps its own; the worker has not loaded paddle."""
    shim = tmp_path / "dot-shim" / "dot"
    niced = tmp_path / "dot-nice.txt"
    shim.write_text(shim.read_text().replace("exec ", f"nice >> {niced}\nexec ", 1))
    before = os.getpriority(os.PRIO_PROCESS, 0)
    net = nn.Linear(3, 2)
    with BackwardGraphRecorder(str(tmp_path / "log"), net, every=1, formats=("png",), visualdl=False,
                               verbose=0) as rec:
        with rec.step(1):
            net(paddle.randn([2, 3])).sum().backward()
        assert rec.pipeline.settle(60)
        pid = rec.pipeline.drawing.pid
        assert pid is not None and pid in children(os.getpid())
        assert WORKER_MODULE in children(os.getpid())[pid]
        assert nice_of(pid) >= DRAWING_NICE
        with open(f"/proc/{pid}/maps") as f:
            assert "/paddle/" not in f.read()  # no paddle library mapped: paddle was never imported
    assert engine_run_count() >= 1
    assert [int(v) for v in niced.read_text().split()] == [max(before, 10)] * engine_run_count()
    assert os.getpriority(os.PRIO_PROCESS, 0) == before  # the training thread's is untouched
    assert children(os.getpid()) == {}
