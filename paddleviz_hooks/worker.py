"""A background thread that does the slow work off the training thread.

Jobs wait in a bounded queue; when it is full a new job is dropped (with one
warning) instead of blocking training. Exceptions in a job become warnings
(one per kind); a worker thread that died is restarted once.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from typing import Any, Callable

__all__ = ["BackgroundWorker"]

_STOP = object()


class BackgroundWorker:
    """Runs ``handler(job)`` for submitted jobs in a daemon thread.

    Args:
        handler: called with each job, in submission order.
        queue_size: jobs that may wait; more are dropped.
        name: thread name (shows in stack dumps).
        warn: how to report problems (default: ``warnings.warn`` once per cause).

    Example:
        >>> w = BackgroundWorker(print, queue_size=2)
        >>> w.submit("hello"); w.close()
    """

    def __init__(
        self,
        handler: Callable[[Any], None],
        *,
        queue_size: int = 4,
        name: str = "paddleviz-hooks-worker",
        warn: Callable[[str, str], None] | None = None,
    ) -> None:
        self._handler = handler
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._name = name
        self._warn = warn or _warn_once_factory()
        self._thread: threading.Thread | None = None
        self._restarted = False
        self.dropped = 0
        self.done = 0
        self.failed = 0

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Any, what: str = "job") -> bool:
        """Queue a job; returns False (and warns once) when it was dropped."""
        if not self.alive:
            if self._thread is not None:
                if self._restarted:
                    self.dropped += 1
                    self._warn("worker-dead", f"the background renderer stopped twice; {what} dropped")
                    return False
                self._warn("worker-restart", "the background renderer had stopped; it was restarted")
                self._restarted = True
            self._start()
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            self.dropped += 1
            self._warn(
                "queue-full",
                f"{what} dropped: the background renderer is still busy with earlier captures "
                "(capture less often, lower max_nodes, or raise queue_size)",
            )
            return False

    def close(self, timeout: float | None = 300.0) -> bool:
        """Finish queued jobs (waiting at most ``timeout`` s) and stop the thread.

        Returns:
            True when every queued job was handled in time.
        """
        if not self.alive:
            return self._queue.empty()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            self._warn("close-timeout", "the background renderer did not finish in time; pending captures dropped")
            return False
        assert self._thread is not None
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._warn("close-timeout", "the background renderer did not finish in time; pending captures dropped")
            return False
        return True

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            try:
                self._handler(job)
                self.done += 1
            except Exception as exc:  # keep serving later jobs
                self.failed += 1
                self._warn(f"job-{type(exc).__name__}", f"a capture could not be written: {exc}")


def _warn_once_factory() -> Callable[[str, str], None]:
    seen: set[str] = set()
    lock = threading.Lock()

    def warn(cause: str, message: str) -> None:
        with lock:
            if cause in seen:
                return
            seen.add(cause)
        warnings.warn(f"paddleviz_hooks: {message}", RuntimeWarning, stacklevel=2)

    return warn
