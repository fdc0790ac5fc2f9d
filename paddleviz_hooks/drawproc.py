"""The training process's side of the drawing process (``drawworker.py``).

:class:`DrawingProcess` starts the worker at the first drawing, sends it one
job at a time and waits for its answer, at most the job's ``render_timeout``
plus :data:`ANSWER_MARGIN`. Whatever the worker does, training goes on: a
worker that died is started again (one warning per kind of failure), one that
does not answer is killed and started again, and a job that two workers in a
row did not answer is not drawn, with the reason. Nothing outlives the
training process: :meth:`DrawingProcess.close` (and, failing that, a
finalizer at interpreter exit) stops the worker, which also exits when its
stdin ends or (Linux) when the thread that started it ends.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Callable

__all__ = ["ANSWER_MARGIN", "DrawingProcess", "TEMP_PREFIX", "WORKER_MODULE"]

WORKER_MODULE = "paddleviz_hooks.drawworker"
#: How the worker's own temporary folder (its TMPDIR, removed when it ends) is named
TEMP_PREFIX = "paddleviz-draw-"

#: Seconds a job's answer may take past its render_timeout (which bounds only the layout engine's
#: runs): the worker's start (its imports) and its Python work of planning a large graph.
ANSWER_MARGIN = 30.0

#: The interpreter running this process, as it was when the package was imported.
_PYTHON = sys.executable
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Failed(Exception):
    """The worker did not answer a job: ``kind`` is ``"died"`` or ``"hung"``."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind, self.why = kind, why


class DrawingProcess:
    """Sends drawing jobs to one worker process; contains whatever goes wrong with it.

    Args:
        warn: the recorder's warn-once function ``warn(key, message)``.
        log_path: the worker's stderr goes there (its last line is named when it dies).
        margin: seconds an answer may take past the job's ``render_timeout``.

    Examples:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> proc = DrawingProcess(print, log_path=os.path.join(d, "worker.log"))
        >>> proc.pid is None  # started at the first drawing
        True
        >>> proc.close()
    """

    def __init__(self, warn: Callable[[str, str], None], *, log_path: str | None = None,
                 margin: float = ANSWER_MARGIN) -> None:
        self._warn = warn
        self._log_path = log_path
        self.margin = margin
        self._proc: subprocess.Popen | None = None
        self._answers: queue.Queue = queue.Queue()  # the running worker's answer lines (None: its end)
        self._lock = threading.Lock()  # guards _proc between draw() and close()
        self._finalizers: dict[int, weakref.finalize] = {}  # pid -> what ends it if close() is never called
        self._closed = False
        self._next_id = 0
        #: workers started so far
        self.starts = 0
        #: the step whose drawing the worker is on (None: none)
        self.in_flight: int | None = None

    @property
    def pid(self) -> int | None:
        """The running worker's process id, or None."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def draw(self, job: dict[str, Any]) -> dict[str, Any]:
        """Send ``job`` (see ``drawworker.py``) and return the answer. Never raises: a job
        not drawn comes back with ``why`` said, and ``"error"`` None."""
        timeout = float(job["options"]["render_timeout"]) + self.margin
        failures: list[_Failed] = []
        while len(failures) < 2:
            try:
                proc = self._ensure()
            except OSError as exc:
                self._warn("drawing-start", f"the drawing process could not be started ({exc}); "
                                            "captures are saved but not drawn")
                return _not_drawn(job, f"the drawing process could not be started: {exc}")
            if proc is None:
                return _not_drawn(job, "the recorder was closing")
            try:
                self.in_flight = job["step"]
                return self._ask(proc, job, timeout)
            except _Failed as failed:
                failures.append(failed)
                self._stop(proc)
                if self._closed:
                    return _not_drawn(job, "the recorder was closing")
                self._warn(f"drawing-{failed.kind}", f"the drawing process {failed.why} while drawing step "
                                                     f"{job['step']}; it was started again")
            finally:
                self.in_flight = None
        why = failures[-1].why if failures[0].kind == failures[1].kind else f"{failures[0].why}, then {failures[1].why}"
        return _not_drawn(job, f"the drawing process {why} twice on it")

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker: it ends at the end of its input (within ``timeout``), or is killed."""
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
        if proc is not None:
            self._end(proc, timeout)

    # --------------------------------------------------------------- inside
    def _ensure(self) -> subprocess.Popen | None:
        with self._lock:
            if self._closed:
                return None
            old = self._proc
            if old is not None and old.poll() is None:
                return old
            self._proc = None
        if old is not None:  # it died between two drawings
            self._warn("drawing-died", f"the drawing process {self._ended(old)} between two drawings; "
                                       "it was started again")
            self._end(old, 0.0)
        with self._lock:
            if self._closed:
                return None
            self._proc = self._start()
            return self._proc

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        if not _PYTHON:
            raise OSError("no Python interpreter is known (sys.executable is empty)")
        # the worker's (and its engines') temporary files, removed when it ends however it ends;
        # named by this process, so a later one removes them if this one is killed first
        _remove_stale_folders()
        temp_dir = env["TMPDIR"] = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-")
        log: Any = subprocess.DEVNULL
        try:
            if self._log_path and os.path.isdir(os.path.dirname(self._log_path)):
                log = open(self._log_path, "ab")
            proc = subprocess.Popen([_PYTHON, "-m", WORKER_MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=log, env=env, close_fds=True)
        except BaseException:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        proc.temp_dir = temp_dir  # type: ignore[attr-defined]
        self._answers = queue.Queue()
        threading.Thread(target=_read_lines, args=(proc.stdout, self._answers), daemon=True,
                         name="paddleviz-hooks-drawing-answers").start()
        self.starts += 1
        # interpreter exit, or this object let go without close(); detached once the worker is ended
        self._finalizers[proc.pid] = weakref.finalize(self, _reap, proc, 1.0)
        return proc

    def _ask(self, proc: subprocess.Popen, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        self._next_id += 1
        job = {**job, "id": self._next_id}
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write((json.dumps(job) + "\n").encode("utf-8"))
            proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise _Failed("died", self._ended(proc)) from None
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise _Failed("hung", f"did not answer within {timeout:g} s") from None
            if line is None:
                raise _Failed("died", self._ended(proc))
            try:
                answer = json.loads(line)
            except ValueError:
                raise _Failed("died", "answered garbage") from None
            if answer.get("id") == job["id"]:
                return answer  # (else the answer to a job given up on)

    def _ended(self, proc: subprocess.Popen) -> str:
        """How the worker ended, in a few words (with the last line it wrote to its log)."""
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        how = (f"was killed by signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
               else f"exited with status {code}")
        last = _last_line(self._log_path)
        return f"{how} ({last})" if last else how

    def _end(self, proc: subprocess.Popen, timeout: float) -> None:
        _reap(proc, timeout)
        finalizer = self._finalizers.pop(proc.pid, None)
        if finalizer is not None:
            finalizer.detach()

    def _stop(self, proc: subprocess.Popen) -> None:
        with self._lock:
            if self._proc is proc:
                self._proc = None
        self._end(proc, 0.0)


_STALE = re.compile(re.escape(TEMP_PREFIX) + r"(\d+)-")


def _remove_stale_folders() -> None:
    """Remove the drawing folders of training processes that are gone (killed, or crashed,
    before they could remove their own), in the temporary folder this process uses."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        m = _STALE.match(name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # alive (or another user's: PermissionError below)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except (OSError, OverflowError, ValueError):
            continue


def _read_lines(stream: Any, answers: queue.Queue) -> None:
    """Each line the worker answers, then None when its output ends (it exited, or was stopped)."""
    try:
        for line in iter(stream.readline, b""):
            answers.put(line)
    except (OSError, ValueError):  # closed by close()
        pass
    answers.put(None)


def _not_drawn(job: dict[str, Any], why: str) -> dict[str, Any]:
    return {"id": job.get("id"), "title": None, "written": {}, "why": why, "warnings": [], "error": None}


def _reap(proc: subprocess.Popen, timeout: float) -> None:
    """End the worker: its input closed, then (after ``timeout``) SIGTERM, then SIGKILL; with
    ``timeout`` 0 (a worker given up on) SIGKILL at once. Never raises."""
    try:
        if proc.poll() is None:
            try:
                proc.stdin.close()  # the worker ends at the end of its input
            except (OSError, ValueError, AttributeError):
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                engines = _children(proc.pid)  # a killed worker cannot stop its engine run
                if timeout > 0:  # asked to end: a moment to end its engine run itself
                    proc.terminate()
                    try:
                        proc.wait(1.0)
                    except subprocess.TimeoutExpired:
                        pass
                if proc.poll() is None:  # (given up on, or a stopped worker: SIGKILL needs no waiting)
                    proc.kill()
                    proc.wait(5.0)
                for pid in engines:  # each engine runs in a process group of its own
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        pass
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                try:
                    f.close()
                except (OSError, ValueError):
                    pass
        if proc.poll() is not None:  # its temporary files go with it, whatever ended it
            shutil.rmtree(getattr(proc, "temp_dir", None) or "", ignore_errors=True)
    except Exception:  # noqa: BLE001 - stopping must never fail training's exit
        pass
    except BaseException:  # Ctrl-C while stopping it: it is killed all the same
        try:
            proc.kill()
        except OSError:
            pass
        raise


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux; elsewhere none)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if len(fields) > 1 and int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _last_line(path: str | None) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 2000))
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""
