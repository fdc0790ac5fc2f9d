"""The pipeline from a captured graph to files and dashboard sinks (VisualDL by default).

The training thread only hands a captured graph over (:meth:`CapturePipeline.submit`).
Two background threads do the rest. The data thread writes every capture's
JSON, DOT, diff JSON, summary text and scalars at once (handing them to the
sinks), never waiting behind drawing, and queues the drawing. The drawing thread works through that
backlog, triggered captures first, and hands the pictures to the sinks;
beyond ``queue_size`` a waiting drawing keeps only the path of its JSON, so
memory stays bounded however far drawing lags. ``close()`` draws the backlog
within ``close_timeout`` and names what is left, with the command that draws
it later. Exceptions in a job become warnings (one per kind); a worker thread
that died is restarted once.
"""

from __future__ import annotations

import errno
import heapq
import os
import queue
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .diff import GraphDiff, diff_graphs
from .findings import record_of
from .graph import BackwardGraph
from .options import RecorderOptions
from .render import (EngineNotFound, RenderTimeout, render_diff_views, render_png, render_svg,
                     render_views, to_dot)
from .sinks.base import CaptureData, CapturePictures, SinkContext, capture_scalars, suffixed
from .sinks.files import StepFiles
from .sinks.hub import SinkSet
from .text import backward_role, capture_title, diff_summary, graph_summary, redraw_command, undrawn_line
from ._interrupts import run_all
from .warn import WarnOnce

__all__ = ["BackgroundWorker", "CaptureJob", "CapturePipeline", "VIEWER_LABEL_PX", "viewer_png"]

#: Node labels (11 pt) of the VisualDL picture are at least this many pixels high
VIEWER_LABEL_PX = 8.0

#: Nice value of the drawing thread, and of the layout engines it starts (they inherit it).
#: On a core training also wants it gets about a tenth (Linux CFS weights 110 vs 1024): measured
#: under 2-process data parallel on 2 cores, uncaptured steps went from 1.50x to 1.16x (median).
DRAWING_NICE = 10


def lower_thread_priority(nice: int = DRAWING_NICE) -> None:
    """Give the calling thread (and the processes it starts) a lower CPU priority.

    Linux keeps a nice value per thread; elsewhere a thread id is no process
    id, so nothing is changed. Never raises: drawing at normal priority is
    still drawing.

    Example:
        >>> import threading
        >>> t = threading.Thread(target=lower_thread_priority)
        >>> t.start(); t.join()  # the thread ended at nice 10 (on Linux); this one is untouched
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except (AttributeError, OSError):  # no permission, no such call: keep the normal priority
        pass


def viewer_png(graph: BackwardGraph, options: RecorderOptions, title: str, *, timeout: float | None = 60.0,
               info: dict[str, Any] | None = None) -> bytes:
    """The picture logged to the dashboards, sized for VisualDL's image viewer.

    The viewer fits a picture into the window (about 1300x750 CSS px of a
    1440x900 window) and never enlarges it, so the picture is drawn left to
    right (landscape) within ``options.viewer_px`` x 9/16 of that, padded to
    16:9 when it is a strip, with node labels at least ``VIEWER_LABEL_PX``
    high, collapsing layers into boxes as far as that needs. The same
    structure gets the same layout at every step (the drawing plan is
    cached), so flipping steps compares like with like. ``render/plan.py``
    plans it with the other pictures.
    """
    assert options.viewer_px is not None
    width = options.viewer_px
    return render_png(graph, max_px=width, max_height_px=max(64, width * 9 // 16), max_nodes=options.view_max_nodes,
                      rankdir="LR", min_dpi=VIEWER_LABEL_PX * 72 / 11, timeout=timeout, title=title, info=info,
                      **_shading(options, graph))


_STOP = object()


class BackgroundWorker:
    """Runs ``handler(job)`` for submitted jobs in a daemon thread.

    Args:
        handler: called with each job, in submission order.
        queue_size: jobs that may wait; more are dropped (0: no limit).
        name: thread name (shows in stack dumps).
        warn: how to report problems (default: ``warnings.warn`` once per cause).

    Example:
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
    """A capture waiting to be drawn; triggered captures sort first."""

    priority: int
    step: int
    trigger: str = field(compare=False)
    graph: BackwardGraph | None = field(compare=False)  # None: reload from `path`
    path: str = field(compare=False)
    prev: BackwardGraph | None = field(compare=False)
    prev_path: str | None = field(compare=False)
    diff: GraphDiff | None = field(compare=False)
    suffix: str = field(default="", compare=False)
    viewer: bytes | None = field(compare=False, default=None)  # the dashboards' picture, once drawn
    svg: str | None = field(compare=False, default=None)  # the full-detail SVG, once drawn


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
                json_path, self.files.path(left[0], formats[0] if formats else "png"))))
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
            if "dot" in opts.formats:
                paths["dot"] = files.write(step, "dot", to_dot(graph, title=_title(step, trigger, graph),
                                                               **_shading(opts, graph)), suffix=suffix)
            if diff is not None and diff.structure_changed and "json" in opts.formats:
                paths["diff.json"] = files.write(step, "json", diff.to_json(), suffix=suffixed(suffix, "diff"))
        except OSError as exc:
            self._warn("lost", f"step {step}'s data is saved but not all its records ({self._why(exc)})")
        self._log_data(graph, diff, step, trigger, suffix, paths)
        if not {"png", "svg"} & set(opts.formats) and not self.sinks:
            return
        keep = len(self._backlog) < opts.queue_size  # beyond: wait on disk as the JSON
        drawing = _Drawing(0 if trigger != "scheduled" else 1, step, trigger,
                           graph if keep else None, path,
                           prev[0] if (keep and prev is not None) else None,
                           prev[1] if prev is not None else None,
                           diff if (diff is not None and diff.structure_changed) else None, suffix)
        with self._lock:
            heapq.heappush(self._backlog, drawing)
            self._wake.notify()
            if self._drawer is None or not self._drawer.is_alive():
                self._drawer = threading.Thread(target=self._draw_loop, name="paddleviz-hooks-drawing",
                                                daemon=True)
                self._drawer.start()

    def _draw_loop(self) -> None:
        """The drawing thread: triggered captures first, until close() says stop."""
        lower_thread_priority()  # pictures may lag; the training steps must not
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
            if d.graph is not None:
                graph = d.graph
            else:
                with open(d.path, encoding="utf-8") as f:
                    graph = BackwardGraph.from_json(f.read())
            why = self._draw(d, graph)
        except Exception as exc:  # keep drawing the others
            why = self._why(exc)
            self._warn(f"draw-{type(exc).__name__}", f"step {d.step} could not be drawn: {exc}")
        # drawn: a picture of it is on disk (or, with no picture file asked, drawn for the dashboards)
        pictures = [f for f in ("png", "svg") if f in self.options.formats]
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

    def _draw(self, d: _Drawing, graph: BackwardGraph) -> str | None:
        """Draw one capture; None when it was drawn, else why not."""
        opts, files = self.options, self.files
        why = None
        step, trigger, suffix = d.step, d.trigger, d.suffix
        title = _title(step, trigger, graph)
        deadline = time.monotonic() + opts.render_timeout  # bounds all drawing of this capture

        def left() -> float:  # what is left of render_timeout for the next engine run
            return round(max(0.001, deadline - time.monotonic()), 3)

        png = diff_png = None
        try:
            # one engine run draws the viewing PNG and, when it has every node, the full-detail SVG
            info: dict = {}
            formats = ("png", "svg") if "svg" in opts.formats else ("png",)
            views = render_views(graph, formats, info=info, max_px=opts.view_max_px,
                                 max_nodes=opts.view_max_nodes, timeout=left(), title=title,
                                 **_shading(opts, graph))
            png = views["png"]
            if "svg" in opts.formats:
                svg = views["svg"] if info["full_detail"] else render_svg(
                    graph, timeout=left(), title=title, **_shading(opts, graph))
                files.write(step, "svg", svg, suffix=suffix)
                d.svg = svg if isinstance(svg, str) else svg.decode("utf-8")
            if self.sinks and opts.viewer_px is not None:
                seen: dict = {}
                viewer = viewer_png(graph, opts, title, timeout=left(), info=seen)
                # a viewer picture that had to shrink the whole model into one box shows less
                # than the PNG file: the dashboards get the file's picture then (their viewers can zoom)
                if not (seen.get("collapsed_depth") == 0 and info.get("collapsed_depth") != 0):
                    d.viewer = viewer
        except (EngineNotFound, RenderTimeout) as exc:
            # JSON, DOT, text and scalars are already written
            why = ("no layout engine is installed" if isinstance(exc, EngineNotFound)
                   else f"the layout engine ran past render_timeout={opts.render_timeout:g} s")
            self._warn(type(exc).__name__, f"step {step} was not drawn: {exc}")
        if png is not None and d.diff is not None:
            prev = d.prev
            if prev is None and d.prev_path is not None and os.path.exists(d.prev_path):
                with open(d.prev_path, encoding="utf-8") as f:
                    prev = BackwardGraph.from_json(f.read())
            if prev is not None:
                try:
                    diff_png = render_diff_views(d.diff, graph, prev, ("png",), max_px=opts.view_max_px,
                                                 max_nodes=opts.view_max_nodes, timeout=left())["png"]
                except Exception as exc:
                    self._warn("diff-render", f"drawing the graph diff failed: {exc!r}")
        self._log_pictures(d, png, diff_png, title)
        if why is None and png is None:
            why = "the layout engine drew nothing"
        return why

    def _log_pictures(self, d: _Drawing, png: bytes | None, diff_png: bytes | None, title: str) -> None:
        with self._sink_lock:
            self._log_pictures_locked(d, png, diff_png, title)

    def _log_pictures_locked(self, d: _Drawing, png: bytes | None, diff_png: bytes | None, title: str) -> None:
        step, suffix = d.step, d.suffix
        files, formats = self.files, self.options.formats
        paths: dict[str, str] = {}
        if "png" in formats and png is not None:
            paths["png"] = files.write(step, "png", self.sinks.file_png(png), suffix=suffix)
        if "png" in formats and diff_png is not None:
            paths["diff.png"] = files.write(step, "png", self.sinks.file_png(diff_png), suffix=suffixed(suffix, "diff"))
        if "svg" in formats and d.svg is not None:
            paths["svg"] = files.path(step, "svg", suffix=suffix)
        viewer, svg, d.viewer, d.svg = d.viewer, d.svg, None, None
        if not self.sinks:
            return  # (a capture not drawn still reaches the sinks: what they keep for it is let go)
        self.sinks.pictures(CapturePictures(step, d.trigger, suffix, title, viewer if viewer is not None else png,
                                            diff_png, svg, paths))

    def _log_data(self, graph: BackwardGraph, diff: GraphDiff | None, step: int, trigger: str,
                  suffix: str, paths: dict[str, str]) -> None:
        with self._sink_lock:
            self._log_data_locked(graph, diff, step, trigger, suffix, paths)

    def _log_data_locked(self, graph: BackwardGraph, diff: GraphDiff | None, step: int, trigger: str,
                         suffix: str, paths: dict[str, str]) -> None:
        if not self.sinks:
            return
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
        self.sinks.data(CaptureData(step, trigger, suffix, graph, changed, text, scalars, paths))


def _shading(options: RecorderOptions, graph: BackwardGraph) -> dict[str, Any]:
    """The ``color_by`` drawing option, for a graph that has what it shades by (a triggered
    capture records no saved memory: drawn unshaded, its legend then shows no shades)."""
    if options.color_by == "saved_memory" and isinstance(graph.meta.get("saved_memory"), dict):
        return {"color_by": options.color_by}
    return {}


def _title(step: int, trigger: str, graph: BackwardGraph) -> str:
    meta = graph.meta
    return capture_title(step, trigger, backward_role(meta.get("backward")), origin=record_of(graph).origin)
