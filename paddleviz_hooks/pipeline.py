"""The pipeline from a captured graph to files and dashboard sinks (VisualDL by default).

The training thread only hands a captured graph over (:meth:`CapturePipeline.submit`).
A data thread writes every capture's JSON, diff JSON, summary text and scalars
at once (handing them to the sinks), never waiting behind drawing, and queues
the drawing. Drawing happens in a process of its own (``drawworker.py``,
driven by :class:`~paddleviz_hooks.drawproc.DrawingProcess`), so no drawing
code shares this process's interpreter lock with training: a thread here sends
it the backlog, triggered captures first, one capture's JSON path at a time,
and hands the pictures it draws to the sinks (VisualDL shows only the newest
records file of a folder: its records must all come from this process's one
writer). A waiting drawing keeps only the path of its JSON, so memory stays
bounded however far drawing lags. ``close()`` draws the backlog within
``close_timeout`` and names what is left, with the command that draws it later.
Exceptions in a job become warnings (one per kind); a worker thread that died
is restarted once, a drawing process that died or hung is started again.
"""

from __future__ import annotations

import errno
import heapq
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .diff import GraphDiff, diff_graphs
from .drawproc import DrawingProcess
from .graph import BackwardGraph
from .options import RecorderOptions
from .render.engine import engine_choice
from .drawworker import lower_priority
from .sinks.base import CaptureData, CapturePictures, SinkContext, capture_scalars, suffixed
from .sinks.files import StepFiles
from .sinks.hub import SinkSet
from .text import capture_title, diff_summary, graph_summary, redraw_command, undrawn_line
from ._interrupts import run_all
from .warn import WarnOnce

__all__ = ["BackgroundWorker", "CaptureJob", "CapturePipeline"]


_STOP = object()


class BackgroundWorker:
    """Runs ``handler(job)`` for submitted jobs in a daemon thread.

    Args:
        handler: called with each job, in submission order.
        queue_size: jobs that may wait; more are dropped (0: no limit).
        name: thread name (shows in stack dumps).
        warn: how to report problems (default: ``warnings.warn`` once per cause).

    Examples:
        >>> w = BackgroundWorker(print, queue_size=2)
        >>> w.submit("hello")
        True
        >>> w.close()
        hello
        True
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
        self._warn = warn or WarnOnce()
        self._thread: threading.Thread | None = None
        self._restarted = False
        self.dropped = 0
        self.done = 0
        self.failed = 0

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Jobs waiting in the queue."""
        return self._queue.qsize()

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

    def wait(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until every job handed over so far is handled."""
        q = self._queue
        deadline = time.monotonic() + timeout
        with q.all_tasks_done:
            while q.unfinished_tasks and self.alive:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                q.all_tasks_done.wait(min(left, 0.5))
        return not q.unfinished_tasks

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
                self._queue.task_done()
                return
            try:
                self._handler(job)
                self.done += 1
            except Exception as exc:  # keep serving later jobs
                self.failed += 1
                self._warn(f"job-{type(exc).__name__}", f"a capture could not be written: {exc}")
            finally:
                self._queue.task_done()


@dataclass
class CaptureJob:
    """One captured graph on its way to disk and VisualDL.

    ``suffix`` tells a step's backwards apart (``"b2"`` for its second one):
    in file names, VisualDL tags, and which earlier capture it is diffed with.
    """

    graph: BackwardGraph
    step: int
    trigger: str
    suffix: str = ""


@dataclass(order=True)
class _Drawing:
    """A capture waiting to be drawn (its JSON on disk); triggered captures sort first."""

    priority: int
    step: int
    trigger: str = field(compare=False)
    path: str = field(compare=False)  # the capture's JSON
    prev_path: str | None = field(compare=False)  # the previous capture of the same backward
    diff: bool = field(compare=False)  # the structure changed since it: draw the change
    suffix: str = field(default="", compare=False)
    sink_files: dict[str, str] = field(default_factory=dict, compare=False)  # written for the sinks


class CapturePipeline:
    """Writes each capture's data at once and draws it when there is time.

    Args:
        options: the recorder's options (formats, sizes, timeouts, sinks).
        files: where the per-step files go; its folder is also the dashboards' run folder.
        display_name: the run's name in the dashboard.
        warn: the recorder's warn-once function.
    """

    def __init__(self, options: RecorderOptions, files: StepFiles, display_name: str,
                 warn: Callable[[str, str], None]) -> None:
        self.options = options
        self.files = files
        self.display_name = display_name
        self._warn = warn
        #: the dashboards, each created when the first capture reaches it
        self.sinks = SinkSet(options.sinks, SinkContext(files.directory, options.log_dir, display_name,
                                                         graphs=options.visualdl_graphs, warn=warn))
        self._prev: dict[str, tuple[BackwardGraph, str]] = {}  # suffix -> last capture and its JSON
        self._backlog: list[_Drawing] = []
        self._lock = threading.Lock()
        #: steps whose data (JSON, text, scalars) was written
        self.written: list[int] = []
        #: steps whose pictures were drawn
        self.drawn: list[int] = []
        #: steps still undrawn when close() gave up
        self.undrawn_at_close: list[int] = []
        #: steps whose data could not be written -> why (nothing of them is on disk)
        self.lost: dict[int, str] = {}
        #: steps written but not drawn -> why (by close(): every written step is drawn or here)
        self.not_drawn: dict[int, str] = {}
        self.worker = BackgroundWorker(self._process, queue_size=0, warn=warn)
        self._wake = threading.Condition(self._lock)
        self._closing_at: float | None = None  # set by close(): draw until then, then stop
        self._drawer: threading.Thread | None = None
        self._drawing = 0  # drawings under way (0 or 1)
        #: the process that draws (started at the first drawing)
        self.drawing = DrawingProcess(warn, log_path=os.path.join(self._spool_dir(), "drawing.log"))
        self._sink_lock = threading.Lock()  # the data thread and the drawing thread both log
        self._prev_logged: dict[str, BackwardGraph] = {}  # suffix -> the last capture summarised

    def submit(self, job: CaptureJob) -> bool:
        """Hand a capture over; False only when the background thread is gone for good."""
        return self.worker.submit(job, what=f"the capture of step {job.step}")

    @property
    def idle(self) -> bool:
        """No drawing waiting or under way, and no capture waiting to be written."""
        with self._lock:
            return not self._backlog and not self._drawing and self.worker.pending == 0

    def settle(self, timeout: float) -> bool:
        """Wait until every capture handed over is written and drawn (at most ``timeout``
        s; the sinks flush after each record); True when nothing was left waiting."""
        deadline = time.monotonic() + timeout
        done = self.worker.wait(timeout)
        while not self.idle and time.monotonic() < deadline:
            time.sleep(0.02)
        return done and self.idle

    @property
    def undrawn(self) -> list[int]:
        """Captured steps whose pictures are still waiting."""
        with self._lock:
            return sorted(d.step for d in self._backlog)

    def close(self) -> None:
        """Write what is queued, draw the backlog within ``close_timeout``, close the sinks."""
        deadline = time.monotonic() + self.options.close_timeout
        self.worker.close(timeout=max(60.0, self.options.close_timeout))  # data is never cut short
        with self._lock:
            self._closing_at = deadline
            self._wake.notify_all()
        if self._drawer is not None:
            # the drawing under way may run up to render_timeout past the deadline
            self._drawer.join(max(0.0, deadline - time.monotonic()) + self.options.render_timeout + 5)
        self.drawing.close()  # a drawing still under way is cut short: its step is named undrawn
        if self._drawer is not None:
            self._drawer.join(10)
        with self._lock:
            for step in sorted(d.step for d in self._backlog):
                self.not_drawn.setdefault(step, f"not drawn within close_timeout={self.options.close_timeout:g} s")
            self._backlog.clear()
        for step in self.drawn:  # a step with several backwards: drawn when any picture of it is
            self.not_drawn.pop(step, None)
        left = self.undrawn_at_close = sorted(self.not_drawn)
        if left:
            formats = [f for f in ("png", "svg") if f in self.options.formats]
            json_path = self.files.path(left[0], "json") if "json" in self.options.formats else None
            self._warn("undrawn", undrawn_line(dict(self.not_drawn), redraw_command(
                json_path, self.files.path(left[0], formats[0] if formats else "png"),
                self.options.view_max_px, self.options.view_max_nodes)))
        shutil.rmtree(self._spool_dir(), ignore_errors=True)
        run_all(self._close_sinks, self.files.close)  # both, whatever the other raises

    def _close_sinks(self) -> None:
        with self._sink_lock:
            self.sinks.close()

    # ------------------------------------------------------- worker thread
    def _spool_dir(self) -> str:
        return os.path.join(self.files.directory, ".pending")

    def _json_path(self, graph: BackwardGraph, step: int, suffix: str = "") -> str:
        """Where the graph's JSON is: the step file, or a spool file when json is not kept."""
        if "json" in self.options.formats:
            return self.files.write(step, "json", graph.to_json(), suffix=suffix)
        os.makedirs(self._spool_dir(), exist_ok=True)
        path = os.path.join(self._spool_dir(), f"step_{int(step):06d}{'_' + suffix if suffix else ''}.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(graph.to_json())
        return path

    def _process(self, job: CaptureJob) -> None:
        """Data first: JSON, DOT, diff JSON, summary text and scalars; then queue the drawing."""
        opts, files = self.options, self.files
        graph, step, trigger, suffix = job.graph, job.step, job.trigger, job.suffix
        prev = self._prev.get(suffix)  # the same backward of an earlier step
        # a replayed step (rooted at the model output) is compared too: diff_graphs leaves the
        # loss ops of the other graph out (GraphDiff.replayed)
        diff = None
        if prev is not None:
            try:
                diff = diff_graphs(prev[0], graph)
            except Exception as exc:
                self._warn("diff", f"comparing with the previous capture failed: {exc!r}")
        try:
            path = self._json_path(graph, step, suffix)
        except OSError as exc:  # nothing of this capture reaches disk: named, with why
            why = self._why(exc)
            self.lost[step] = why
            self._warn("lost", f"step {step} could not be written ({why}); later steps are tried again")
            return
        paths = {"json": path} if "json" in opts.formats else {}
        self._prev[suffix] = (graph, path)
        self.written.append(step)  # its data (the JSON) is on disk; the rest is extra
        try:
            if diff is not None and diff.structure_changed and "json" in opts.formats:
                paths["diff.json"] = files.write(step, "json", diff.to_json(), suffix=suffixed(suffix, "diff"))
        except OSError as exc:
            self._warn("lost", f"step {step}'s data is saved but not all its records ({self._why(exc)})")
        sink_files = self._log_data(graph, diff, step, trigger, suffix, paths)
        if not {"png", "svg", "dot"} & set(opts.formats) and not self.sinks:
            return
        drawing = _Drawing(0 if trigger != "scheduled" else 1, step, trigger, path,
                           prev[1] if prev is not None else None,
                           diff is not None and diff.structure_changed, suffix, sink_files)
        with self._lock:
            heapq.heappush(self._backlog, drawing)
            self._wake.notify()
            if self._drawer is None or not self._drawer.is_alive():
                self._drawer = threading.Thread(target=self._draw_loop, name="paddleviz-hooks-drawing",
                                                daemon=True)
                self._drawer.start()

    def _draw_loop(self) -> None:
        """The thread that hands the backlog to the drawing process, triggered captures first, and
        its pictures to the sinks, until close() says stop."""
        lower_priority(thread=True)  # pictures may lag; the training steps must not
        while True:
            with self._lock:
                while not self._backlog and self._closing_at is None:
                    self._wake.wait()
                if not self._backlog or (self._closing_at is not None and time.monotonic() >= self._closing_at):
                    return
                d = heapq.heappop(self._backlog)
                self._drawing += 1
            try:
                self._draw_one(d)
            finally:
                with self._lock:
                    self._drawing -= 1

    def _draw_one(self, d: _Drawing) -> None:
        try:
            why = self._draw(d)
        except Exception as exc:  # keep drawing the others
            why = self._why(exc)
            self._warn(f"draw-{type(exc).__name__}", f"step {d.step} could not be drawn: {exc}")
        # drawn: a picture of it is on disk (or, with no picture file asked, drawn for the dashboards)
        pictures = [f for f in ("png", "svg") if f in self.options.formats]
        if not pictures and not self.sinks:
            return  # only its DOT file was asked for
        if any(os.path.exists(self.files.path(d.step, f, d.suffix)) for f in pictures) or (
                not pictures and why is None):
            self.drawn.append(d.step)
        else:
            self.not_drawn.setdefault(d.step, why or "no picture was written")

    def _why(self, exc: BaseException) -> str:
        """Why a file could not be written, in a few words."""
        if isinstance(exc, OSError):
            if not os.path.isdir(self.files.directory):
                return "the run folder was deleted"
            if exc.errno == errno.ENOSPC:
                return "no space left on device"
            return exc.strerror or str(exc)
        return f"{type(exc).__name__}: {exc}"

    def _job(self, d: _Drawing) -> dict[str, Any]:
        """What the drawing process draws of ``d``, and where it writes it (``drawworker.py``)."""
        opts, files = self.options, self.files
        spool = os.path.join(self._spool_dir(), f"{os.path.basename(files.path(d.step, '', d.suffix))}draw")
        out = {f: files.path(d.step, f, d.suffix) for f in ("dot", "svg") if f in opts.formats}
        if "png" in opts.formats or self.sinks:
            out["png"] = spool + ".png"
            if d.diff and d.prev_path is not None:
                out["diff_png"] = spool + ".diff.png"
        if self.sinks and opts.viewer_px is not None:
            out["viewer"] = spool + ".viewer.png"
        out.update(d.sink_files)
        with self._sink_lock:
            encoding = self.sinks.png_encoding() if self.sinks else None
        return {"step": d.step, "trigger": d.trigger, "suffix": d.suffix, "json": d.path, "prev_json": d.prev_path,
                "diff": d.diff, "engine": engine_choice(), "out": out, "encoding": encoding,
                "options": {"viewer_px": opts.viewer_px, "view_max_px": opts.view_max_px,
                            "view_max_nodes": opts.view_max_nodes, "color_by": opts.color_by,
                            "render_timeout": opts.render_timeout}}

    def _draw(self, d: _Drawing) -> str | None:
        """Have one capture drawn; None when it was drawn, else why not."""
        job = self._job(d)
        if os.path.isdir(self.files.directory):  # (a deleted run folder is not made again)
            os.makedirs(self._spool_dir(), exist_ok=True)
        answer = self.drawing.draw(job)
        for key, message in answer.get("warnings") or ():
            self._warn(key, message)
        why, error, written = answer.get("why"), answer.get("error"), answer.get("written") or {}
        if error:  # not a layout failure: an unreadable JSON, a full disk...
            why = (self._why(OSError(error["errno"], error.get("strerror") or error["message"]))
                   if error.get("errno") is not None else f"{error['type']}: {error['message']}")
            self._warn(f"draw-{error['type']}", f"step {d.step} could not be drawn: {error['message']}")
        pictures = {k: _take(written.get(k)) for k in ("png", "viewer", "diff_png")}
        svg = written.get("svg") if self.sinks else None
        self._log_pictures(d, pictures, svg, written, answer.get("title") or capture_title(d.step, d.trigger),
                           job["encoding"])
        if why is None and pictures["png"] is None:
            why = "the layout engine drew nothing"
        return why

    def _log_pictures(self, d: _Drawing, pictures: dict[str, bytes | None], svg_path: str | None,
                      written: dict[str, str], title: str, encoding: str | None) -> None:
        with self._sink_lock:
            self._log_pictures_locked(d, pictures, svg_path, written, title, encoding)

    def _log_pictures_locked(self, d: _Drawing, pictures: dict[str, bytes | None], svg_path: str | None,
                             written: dict[str, str], title: str, encoding: str | None) -> None:
        """The PNG files, as their dashboard serves them (encoded by the drawing process when it
        knows how), and the pictures handed to the sinks."""
        step, suffix = d.step, d.suffix
        files, formats = self.files, self.options.formats
        png, diff_png = pictures["png"], pictures["diff_png"]
        as_served = (lambda b: b) if encoding is not None else self.sinks.file_png
        paths = {k: written[k] for k in ("dot", "svg") if k in written}
        if "png" in formats and png is not None:
            paths["png"] = files.write(step, "png", as_served(png), suffix=suffix)
        if "png" in formats and diff_png is not None:
            paths["diff.png"] = files.write(step, "png", as_served(diff_png), suffix=suffixed(suffix, "diff"))
        if not self.sinks:
            return  # (a capture not drawn still reaches the sinks: what they keep for it is let go)
        svg = None
        if svg_path is not None:
            with open(svg_path, encoding="utf-8") as f:
                svg = f.read()
        viewer = pictures["viewer"]
        self.sinks.pictures(CapturePictures(step, d.trigger, suffix, title, viewer if viewer is not None else png,
                                            diff_png, svg, paths, encoding))

    def _log_data(self, graph: BackwardGraph, diff: GraphDiff | None, step: int, trigger: str,
                  suffix: str, paths: dict[str, str]) -> dict[str, str]:
        """The capture's data to the sinks; the files the drawing process is to write for them."""
        with self._sink_lock:
            return self._log_data_locked(graph, diff, step, trigger, suffix, paths)

    def _log_data_locked(self, graph: BackwardGraph, diff: GraphDiff | None, step: int, trigger: str,
                         suffix: str, paths: dict[str, str]) -> dict[str, str]:
        if not self.sinks:
            return {}
        text = graph_summary(graph, previous=self._prev_logged.get(suffix))
        self._prev_logged[suffix] = graph
        if trigger != "scheduled":
            note = graph.meta.get("trigger_note")
            text = f"trigger: {trigger}" + (f" ({note})" if note else "") + ";\n" + text
        if diff is not None:
            text += "\n" + diff_summary(diff)  # starts "step B vs step A:"
        scalars = capture_scalars(graph, suffix, diagnostics=self.options.visualdl_diagnostics,
                                  depth=self.options.scalar_depth)
        changed = diff if (diff is not None and diff.structure_changed) else None
        record = CaptureData(step, trigger, suffix, graph, changed, text, scalars, paths)
        self.sinks.data(record)
        return self.sinks.drawn_files(record)


def _take(path: str | None) -> bytes | None:
    """The bytes of a picture the drawing process left in the spool folder, which it leaves."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
