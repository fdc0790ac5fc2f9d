"""Start a 2-process CPU data-parallel job for a test, bounded by a timeout.

``python -m paddle.distributed.launch --nproc_per_node 2`` on 127.0.0.1 (gloo):
the launcher picks the backend and the master address itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def launch(work: Path, script_text: str, *args: str, timeout: float = 300) -> tuple[int, float, str]:
    """Run ``script_text`` on 2 ranks in ``work``; return (exit code, seconds, a report of the logs)."""
    script = work / "worker.py"
    script.write_text(script_text)
    logs = work / "launch_logs"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
           "--log_dir", str(logs), str(script), *args]
    t0 = time.perf_counter()
    # its own session, so a hung job is ended with its workers (and only them)
    with open(work / "launch.out", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_launch(proc)
    seconds = time.perf_counter() - t0
    report = (f"rc={proc.returncode} after {seconds:.1f} s\n--- launch output:\n{tail(work / 'launch.out')}"
              f"\n--- worker 0:\n{tail(logs / 'workerlog.0')}\n--- worker 1:\n{tail(logs / 'workerlog.1')}")
    return proc.returncode, seconds, report


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError as exc:
        return f"<{exc}>"


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return kids


def _stop_launch(proc: subprocess.Popen) -> None:
    """End a hung launch and its workers (launch puts each worker in its own session)."""
    workers = [(pid, _cmdline(pid)) for pid in _children(proc.pid)]
    proc.terminate()  # launch stops its workers on SIGTERM
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
    for pid, cmdline in workers:
        if cmdline and _cmdline(pid) == cmdline:  # still that worker, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


