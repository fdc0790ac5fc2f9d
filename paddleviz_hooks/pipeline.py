"""The pipeline from a captured graph to files and VisualDL records.

The training thread only hands a captured graph over (:meth:`CapturePipeline.submit`).
Two background threads do the rest. The data thread writes every capture's
JSON, DOT, diff JSON, summary text and scalars at once, never waiting behind
drawing, and queues the drawing. The drawing thread works through that
backlog, triggered captures first;
beyond ``queue_size`` a waiting drawing keeps only the path of its JSON, so
memory stays bounded however far drawing lags. ``close()`` draws the backlog
within ``close_timeout`` and names what is left, with the command that draws
it later. Exceptions in a job become warnings (one per kind); a worker thread
that died is restarted once.
"""

from __future__ import annotations

import heapq
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .diff import GraphDiff, diff_graphs
from .graph import BackwardGraph
from .options import RecorderOptions
from .render import EngineNotFound, RenderTimeout, render_diff_png, render_png, render_svg, to_dot
from .sinks.files import StepFiles
from .sinks.visualdl import VisualDLSink, encode_like_visualdl, png_to_array
from .text import diff_summary, graph_summary
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


@dataclass
class CaptureJob:
    """One captured graph on its way to disk and VisualDL."""

    graph: BackwardGraph
    step: int
    trigger: str


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


class CapturePipeline:
    """Writes each capture's data at once and draws it when there is time.

    Args:
        options: the recorder's options (formats, sizes, timeouts, VisualDL).
        files: where the per-step files go; its folder is also the VisualDL run.
        display_name: the run's name in the dashboard.
        warn: the recorder's warn-once function.
    """

    def __init__(self, options: RecorderOptions, files: StepFiles, display_name: str,
                 warn: Callable[[str, str], None]) -> None:
        self.options = options
        self.files = files
        self.display_name = display_name
        self._warn = warn
        self._use_visualdl = options.visualdl
        self._sink = None
        self._prev: tuple[BackwardGraph, str] | None = None
        self._backlog: list[_Drawing] = []
        self._lock = threading.Lock()
        #: steps whose data (JSON, text, scalars) was written
        self.written: list[int] = []
        #: steps whose pictures were drawn
        self.drawn: list[int] = []
        #: steps still undrawn when close() gave up
        self.undrawn_at_close: list[int] = []
        self.worker = BackgroundWorker(self._process, queue_size=0, warn=warn)
        self._wake = threading.Condition(self._lock)
        self._closing_at: float | None = None  # set by close(): draw until then, then stop
        self._drawer: threading.Thread | None = None
        self._drawing = 0  # drawings under way (0 or 1)
        self._sink_lock = threading.Lock()  # the data thread and the drawing thread both log

    def submit(self, job: CaptureJob) -> bool:
        """Hand a capture over; False only when the background thread is gone for good."""
        return self.worker.submit(job, what=f"the capture of step {job.step}")

    @property
    def idle(self) -> bool:
        """No drawing waiting or under way, and no capture waiting to be written."""
        with self._lock:
            return not self._backlog and not self._drawing and self.worker.pending == 0

    @property
    def undrawn(self) -> list[int]:
        """Captured steps whose pictures are still waiting."""
        with self._lock:
            return sorted(d.step for d in self._backlog)

    def close(self) -> None:
        """Write what is queued, draw the backlog within ``close_timeout``, close VisualDL."""
        deadline = time.monotonic() + self.options.close_timeout
        self.worker.close(timeout=max(60.0, self.options.close_timeout))  # data is never cut short
        with self._lock:
            self._closing_at = deadline
            self._wake.notify_all()
        if self._drawer is not None:
            # the drawing under way may run up to render_timeout past the deadline
            self._drawer.join(max(0.0, deadline - time.monotonic()) + self.options.render_timeout + 5)
        left = self.undrawn_at_close = self.undrawn
        if left:
            formats = [f for f in ("png", "svg") if f in self.options.formats]
            self._warn("undrawn", (
                f"{len(left)} captured step(s) were not drawn within close_timeout="
                f"{self.options.close_timeout:g} s: {', '.join(map(str, left[:10]))}"
                f"{' ...' if len(left) > 10 else ''}; their data is saved. Draw one later with "
                f"`paddleviz-hooks render {self.files.path(left[0], 'json')} -o "
                f"{self.files.path(left[0], formats[0] if formats else 'png')}`"))
        with self._lock:
            self._backlog.clear()
        shutil.rmtree(self._spool_dir(), ignore_errors=True)
        with self._sink_lock:
            sink, self._sink = self._sink, None
        if sink is not None:
            try:
                sink.close()
            except Exception as exc:
                self._warn("vdl-close", f"closing the VisualDL writer failed: {exc!r}")

    # ------------------------------------------------------- worker thread
    def _spool_dir(self) -> str:
        return os.path.join(self.files.directory, ".pending")

    def _json_path(self, graph: BackwardGraph, step: int) -> str:
        """Where the graph's JSON is: the step file, or a spool file when json is not kept."""
        if "json" in self.options.formats:
            return self.files.write(step, "json", graph.to_json())
        os.makedirs(self._spool_dir(), exist_ok=True)
        path = os.path.join(self._spool_dir(), f"step_{int(step):06d}.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(graph.to_json())
        return path

    def _process(self, job: CaptureJob) -> None:
        """Data first: JSON, DOT, diff JSON, summary text and scalars; then queue the drawing."""
        opts, files = self.options, self.files
        graph, step, trigger = job.graph, job.step, job.trigger
        prev = self._prev
        diff = None
        if prev is not None:
            try:
                diff = diff_graphs(prev[0], graph)
            except Exception as exc:
                self._warn("diff", f"comparing with the previous capture failed: {exc!r}")
        path = self._json_path(graph, step)
        self._prev = (graph, path)
        if "dot" in opts.formats:
            files.write(step, "dot", to_dot(graph, title=_title(step, trigger)))
        if diff is not None and diff.structure_changed and "json" in opts.formats:
            files.write(step, "json", diff.to_json(), suffix="diff")
        self._log_data(graph, diff, step, trigger)
        self.written.append(step)
        if not {"png", "svg"} & set(opts.formats) and not opts.visualdl:
            return
        keep = len(self._backlog) < opts.queue_size  # beyond: wait on disk as the JSON
        drawing = _Drawing(0 if trigger != "scheduled" else 1, step, trigger,
                           graph if keep else None, path,
                           prev[0] if (keep and prev is not None) else None,
                           prev[1] if prev is not None else None,
                           diff if (diff is not None and diff.structure_changed) else None)
        with self._lock:
            heapq.heappush(self._backlog, drawing)
            self._wake.notify()
            if self._drawer is None or not self._drawer.is_alive():
                self._drawer = threading.Thread(target=self._draw_loop, name="paddleviz-hooks-drawing",
                                                daemon=True)
                self._drawer.start()

    def _draw_loop(self) -> None:
        """The drawing thread: triggered captures first, until close() says stop."""
        while True:
            with self._lock:
                while not self._backlog and self._closing_at is None:
                    self._wake.wait()
                if not self._backlog or (self._closing_at is not None and time.monotonic() >= self._closing_at):
                    return
                d = heapq.heappop(self._backlog)
                self._drawing += 1
            try:
                graph = d.graph or BackwardGraph.from_json(open(d.path, encoding="utf-8").read())
                self._draw(d, graph)
                self.drawn.append(d.step)
            except Exception as exc:  # keep drawing the others
                self._warn(f"draw-{type(exc).__name__}", f"step {d.step} could not be drawn: {exc}")
            finally:
                with self._lock:
                    self._drawing -= 1

    def _draw(self, d: _Drawing, graph: BackwardGraph) -> None:
        opts, files = self.options, self.files
        step, trigger = d.step, d.trigger
        title = _title(step, trigger)
        deadline = time.monotonic() + opts.render_timeout  # bounds all drawing of this capture

        def left() -> float:  # what is left of render_timeout for the next engine run
            return round(max(0.001, deadline - time.monotonic()), 3)

        png = diff_png = None
        try:
            if "svg" in opts.formats:
                files.write(step, "svg", render_svg(graph, timeout=left(), title=title))
            png = render_png(graph, max_px=opts.view_max_px, max_nodes=opts.view_max_nodes, timeout=left(),
                             title=title)
        except (EngineNotFound, RenderTimeout) as exc:
            # JSON, DOT, text and scalars are already written
            self._warn(type(exc).__name__, f"step {step} was not drawn: {exc}")
        if png is not None and d.diff is not None:
            prev = d.prev
            if prev is None and d.prev_path is not None and os.path.exists(d.prev_path):
                prev = BackwardGraph.from_json(open(d.prev_path, encoding="utf-8").read())
            if prev is not None:
                try:
                    diff_png = render_diff_png(d.diff, graph, prev, max_px=opts.view_max_px,
                                               max_nodes=opts.view_max_nodes, timeout=left())
                except Exception as exc:
                    self._warn("diff-render", f"drawing the graph diff failed: {exc!r}")
        self._log_pictures(step, trigger, png, diff_png)

    def _log_pictures(self, step: int, trigger: str, png: bytes | None, diff_png: bytes | None) -> None:
        with self._sink_lock:
            self._log_pictures_locked(step, trigger, png, diff_png)

    def _log_pictures_locked(self, step: int, trigger: str, png: bytes | None, diff_png: bytes | None) -> None:
        files, formats = self.files, self.options.formats
        sink = self._visualdl()
        if sink is None:
            if "png" in formats and png is not None:
                files.write(step, "png", png)
            if "png" in formats and diff_png is not None:
                files.write(step, "png", diff_png, suffix="diff")
            return
        if png is not None:
            array = png_to_array(png)
            if "png" in formats:
                # the same encoder VisualDL uses, so the dashboard serves these exact bytes
                files.write(step, "png", encode_like_visualdl(array))
            sink.image("backward_graph", array, step)
            if trigger != "scheduled":
                sink.image(f"trigger_{trigger}", array, step)
        if diff_png is not None:
            diff_array = png_to_array(diff_png)
            if "png" in formats:
                files.write(step, "png", encode_like_visualdl(diff_array), suffix="diff")
            sink.image("structure_change", diff_array, step)
        sink.flush()

    def _log_data(self, graph: BackwardGraph, diff: GraphDiff | None, step: int, trigger: str) -> None:
        with self._sink_lock:
            self._log_data_locked(graph, diff, step, trigger)

    def _log_data_locked(self, graph: BackwardGraph, diff: GraphDiff | None, step: int, trigger: str) -> None:
        sink = self._visualdl()
        if sink is None:
            return
        text = graph_summary(graph)
        if trigger != "scheduled":
            note = graph.meta.get("trigger_note")
            text = f"trigger: {trigger}" + (f" ({note})" if note else "") + ";\n" + text
        if diff is not None:
            text += "\nsince the previous capture: " + diff_summary(diff)
        sink.text("summary", text, step)
        scalars = {
            "backward_graph/nodes": len(graph.nodes),
            "backward_graph/edges": len(graph.edges),
            "backward_graph/global_grad_norm": graph.global_grad_norm(),
            "backward_graph/accumulated_grad_norm": graph.meta.get("accumulated_grad_norm"),
            "backward_graph/nonfinite_grads": graph.nonfinite_count(),
            "backward_graph/capture_ms": graph.meta.get("capture_ms"),
        }
        for layer, norm in graph.layer_grad_norms().items():
            scalars[f"grad_norm/{layer}"] = norm
        saved = graph.meta.get("saved_memory")
        if isinstance(saved, dict):  # in MB
            scalars["saved_memory/total"] = saved.get("total_bytes", 0) / 1e6
            for layer, nbytes in graph.saved_bytes_by_layer().items():
                scalars[f"saved_memory/{layer}"] = nbytes / 1e6
        sink.scalars(scalars, step)
        sink.flush()

    def _visualdl(self):
        """The VisualDL sink, created on first use; None when VisualDL is off or missing."""
        if self._sink is None and self._use_visualdl:
            try:
                self._sink = VisualDLSink(self.files.directory, display_name=self.display_name)
            except ImportError as exc:
                self._use_visualdl = False
                self._warn("vdl", f"VisualDL is not importable ({exc}); images are kept on disk only. "
                                  "pip install visualdl")
        return self._sink


def _title(step: int, trigger: str) -> str:
    return f"step {step}" + ("" if trigger == "scheduled" else f" - trigger: {trigger}")
