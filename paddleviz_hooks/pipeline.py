"""The pipeline from a captured graph to files and VisualDL records.

The training thread only hands a captured graph over (:meth:`CapturePipeline.submit`);
a background thread compares it with the previous capture, draws it and
writes it. Jobs wait in a bounded queue; when it is full a new job is dropped
(with one warning) instead of blocking training. Exceptions in a job become
warnings (one per kind); a worker thread that died is restarted once.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
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
        queue_size: jobs that may wait; more are dropped.
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


class CapturePipeline:
    """Diffs, draws and writes captured graphs in a background thread.

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
        self._prev: BackwardGraph | None = None
        self.worker = BackgroundWorker(self._process, queue_size=options.queue_size, warn=warn)

    def submit(self, job: CaptureJob) -> bool:
        """Queue a capture; False when it was dropped (the queue was full)."""
        return self.worker.submit(job, what=f"the capture of step {job.step}")

    def close(self) -> None:
        """Finish queued captures, then close the VisualDL writer."""
        self.worker.close(timeout=max(60.0, 4 * self.options.render_timeout))
        sink, self._sink = self._sink, None
        if sink is not None:
            try:
                sink.close()
            except Exception as exc:
                self._warn("vdl-close", f"closing the VisualDL writer failed: {exc!r}")

    # ------------------------------------------------------- worker thread
    def _process(self, job: CaptureJob) -> None:
        opts, files = self.options, self.files
        graph, step, trigger = job.graph, job.step, job.trigger
        prev, self._prev = self._prev, graph
        diff = None
        if prev is not None:
            try:
                diff = diff_graphs(prev, graph)
            except Exception as exc:
                self._warn("diff", f"comparing with the previous capture failed: {exc!r}")
        title = f"step {step}" + ("" if trigger == "scheduled" else f" - trigger: {trigger}")
        t = opts.render_timeout
        if "json" in opts.formats:
            files.write(step, "json", graph.to_json())
        if "dot" in opts.formats:
            files.write(step, "dot", to_dot(graph, title=title))
        png = diff_png = None
        try:
            if "svg" in opts.formats:
                files.write(step, "svg", render_svg(graph, timeout=t, title=title))
            png = render_png(graph, max_px=opts.view_max_px, max_nodes=opts.view_max_nodes, timeout=t,
                             title=title)
        except (EngineNotFound, RenderTimeout) as exc:
            # JSON, DOT, text and scalars are still worth keeping
            self._warn(type(exc).__name__, f"step {step} was not drawn: {exc}")
        if diff is not None and diff.structure_changed:
            if "json" in opts.formats:
                files.write(step, "json", diff.to_json(), suffix="diff")
            if png is not None:
                try:
                    diff_png = render_diff_png(diff, graph, prev, max_px=opts.view_max_px,
                                               max_nodes=opts.view_max_nodes, timeout=t)
                except Exception as exc:
                    self._warn("diff-render", f"drawing the graph diff failed: {exc!r}")
        self._log(graph, diff, step, trigger, png, diff_png)

    def _log(self, graph: BackwardGraph, diff: GraphDiff | None, step: int, trigger: str,
             png: bytes | None, diff_png: bytes | None) -> None:
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
