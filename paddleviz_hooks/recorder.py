"""BackwardGraphRecorder: capture backward graphs from any training loop.

The recorder decides *which* steps to capture (``every``, ``steps``,
triggers), arms a capture for them, and hands every captured graph to the
background pipeline that writes files and VisualDL records. A hand-written
loop drives it with ``with rec.step(): ...``; ``BackwardGraphCallback`` drives
the same recorder from ``Model.fit``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable, Iterator, Sequence

import paddle

from .capture import BackwardCapture
from .graph import BackwardGraph
from .options import FORMATS, RecorderOptions
from .pipeline import CaptureJob, CapturePipeline
from .sinks.files import StepFiles
from .text import describe_node
from .triggers import Triggers, global_grad_norm
from .warn import WarnOnce

__all__ = ["BackwardGraphRecorder"]


class BackwardGraphRecorder:
    """Capture the backward graph on selected steps of any training loop.

    For each captured step it keeps ``step_000100.png`` (sized for viewing),
    ``.svg`` (full detail), ``.dot`` and ``.json`` under ``log_dir/run_name/``,
    and logs image, text and scalar records to VisualDL in that same folder,
    its own run, so it never hides (or is hidden by) another writer of
    ``log_dir``. Drawing and writing happen in a background thread.

    Args:
        log_dir: VisualDL log directory (the one ``visualdl --logdir`` shows).
            Default ``"vdl_log"``.
        model: the ``paddle.nn.Layer`` being trained, for layer names,
            parameter names and the gradient watch of the triggers. Default
            None (op nodes then carry no layer, parameters no names).
        every: capture every N-th step (default 100 when ``steps`` is None).
        steps: explicit steps to capture instead of ``every``.
        capture_first: also capture step 1. Default True.
        max_captures: stop after this many captures. Default None (no limit).
        grad_stats: record gradient norms, min, max and NaN/Inf counts;
            False records shapes and dtypes only. Default True.
        saved_memory: on captured steps, record what the forward saves for
            backward (activation memory per grad node, layer call and op;
            see :func:`~paddleviz_hooks.capture_backward`). Observing starts
            at :meth:`begin_step` of a selected step, so run the forward
            inside the step; steps captured by a trigger are not covered.
            Default False.
        view_max_nodes: node budget of the viewing PNG (larger graphs are
            collapsed by layer depth). Default None: collapse only as far as
            legibility within ``view_max_px`` needs. The SVG keeps every op.
        view_max_px: longest side of the viewing PNG in pixels. Default 2000.
        formats: which files to keep per step, any of png, svg, dot, json.
            Default all four.
        visualdl: log records to VisualDL. Default True.
        run_name: folder (and dashboard run name) under ``log_dir``.
            Default ``"backward_graph"``.
        ranks: which ranks capture under data parallel: an int, a list of
            ints, or ``"all"`` (rank K writes to ``run_name/rank_K``).
            Default 0.
        on_nonfinite: capture a step whose loss is NaN/Inf (checked when its
            backward starts); when only gradients turn non-finite, capture
            the next step. Default False.
        on_grad_spike: capture the step after one whose global gradient norm
            exceeds this factor times the running median. Default None (off).
        on_structure_change: capture a step whose graph structure differs
            from the last capture. Default False.
        cooldown: minimum steps between two captures of one trigger. Default 100.
        queue_size: drawings that wait in memory for the background renderer;
            more wait on disk as their JSON (nothing is dropped). Default 4.
        render_timeout: seconds all drawing of one capture may take before the
            Graphviz run is killed (its data is kept). Default 60.
        close_timeout: seconds :meth:`close` spends drawing captures still
            waiting; what is left is named, with the command that draws it
            from its saved JSON. Default 120.
        verbose: 0 silent, 1 prints where the files go and trigger notices.
            Default 1.

    Raises:
        TypeError: an option of the wrong type (the message quotes it).
        ValueError: an option value out of range (the message quotes it).

    Steps are what the loop says they are (``rec.step(step)``), or counted
    from 1 when it says nothing. Unselected steps run nothing of the
    recorder's but a counter: no hook and no patch is in place (unless a
    trigger is on, which needs to see every backward).

    Example:
        A hand-written loop (``model``, ``opt``, ``loader`` are yours)::

            rec = BackwardGraphRecorder("vdl_log", model, every=100, on_nonfinite=True)
            for step, (x, y) in enumerate(loader, start=1):
                with rec.step(step):          # arms a capture only on selected steps
                    loss = loss_fn(model(x), y)
                    loss.backward()
                opt.step(); opt.clear_grad()
            rec.close()                       # or: with BackwardGraphRecorder(...) as rec:

        Options are checked when the recorder is made:

        >>> BackwardGraphRecorder("vdl_log", every=0)
        Traceback (most recent call last):
        ...
        ValueError: every must be an int >= 1 or None, got 0
    """

    def __init__(
        self,
        log_dir: str | os.PathLike = "vdl_log",
        model: paddle.nn.Layer | None = None,
        *,
        every: int | None = None,
        steps: Iterable[int] | None = None,
        capture_first: bool = True,
        max_captures: int | None = None,
        grad_stats: bool = True,
        saved_memory: bool = False,
        view_max_nodes: int | None = None,
        view_max_px: int = 2000,
        formats: Sequence[str] = FORMATS,
        visualdl: bool = True,
        run_name: str = "backward_graph",
        ranks: int | Sequence[int] | str = 0,
        on_nonfinite: bool = False,
        on_grad_spike: float | None = None,
        on_structure_change: bool = False,
        cooldown: int = 100,
        queue_size: int = 4,
        render_timeout: float = 60.0,
        close_timeout: float = 120.0,
        verbose: int = 1,
    ) -> None:
        if model is not None and not isinstance(model, paddle.nn.Layer):
            raise TypeError(f"model must be a paddle.nn.Layer or None, got {type(model).__name__}")
        self.options = RecorderOptions.check(
            log_dir, every, steps, capture_first=capture_first, max_captures=max_captures,
            grad_stats=grad_stats, saved_memory=saved_memory, view_max_nodes=view_max_nodes, view_max_px=view_max_px,
            formats=formats, visualdl=visualdl, run_name=run_name, ranks=ranks,
            on_nonfinite=on_nonfinite, on_grad_spike=on_grad_spike,
            on_structure_change=on_structure_change, cooldown=cooldown, queue_size=queue_size,
            render_timeout=render_timeout, close_timeout=close_timeout, verbose=verbose,
        )
        self.model = model
        self.global_step = 0
        #: steps whose capture was handed to the pipeline, in order
        self.captured_steps: list[int] = []
        #: steps captured but not written (only if the background thread died twice)
        self.dropped_steps: list[int] = []
        #: steps whose data is saved but whose pictures were not drawn by close()
        self.undrawn_steps: list[int] = []
        #: step -> what captured it (``"scheduled"`` or a trigger name)
        self.triggers: dict[int, str] = {}
        #: the folder this rank writes to (set when the recorder opens)
        self.run_dir: str | None = None
        self._warn = WarnOnce()
        self._open = False
        self._active = False
        self._armed: str | None = None
        self._step_capture: BackwardCapture | None = None
        self._watch: BackwardCapture | None = None
        self._pipeline: CapturePipeline | None = None
        self._triggers = Triggers(self.options, self._budget_left, self._notice)

    @property
    def pipeline(self) -> CapturePipeline | None:
        """The background pipeline while the recorder is open and writing, else None."""
        return self._pipeline

    # ------------------------------------------------------------ lifecycle
    def open(self, model: paddle.nn.Layer | None = None) -> "BackwardGraphRecorder":
        """Start recording (done by the first :meth:`begin_step` if not called).

        Args:
            model: the layer to record, when not given to the constructor.
        """
        if model is not None:
            if not isinstance(model, paddle.nn.Layer):
                raise TypeError(f"model must be a paddle.nn.Layer or None, got {type(model).__name__}")
            self.model = model
        if self._open:
            return self
        self._open = True
        opts = self.options
        rank = paddle.distributed.get_rank()
        self._active = opts.ranks == "all" or rank in opts.ranks
        if self._active and not paddle.in_dynamic_mode():
            self._active = False
            self._warn("static", "backward graphs need dynamic-graph mode (the default); "
                                 "with paddle.enable_static() there is no eager backward graph to "
                                 "capture, so nothing is recorded")
        if not self._active:
            return self
        run_dir = os.path.join(opts.log_dir, opts.run_name)
        if rank != 0:
            run_dir = os.path.join(run_dir, f"rank_{rank}")
        self.run_dir = run_dir
        try:
            files = StepFiles(run_dir)
        except OSError as exc:
            self._warn("dir", f"cannot write to {run_dir!r} ({exc.strerror or exc}); backward graphs "
                              "will not be saved or logged. Pass a writable log_dir")
        else:
            # named "<log dir>/<run_name>" in the dashboard: two experiments sharing a
            # --logdir with the default run_name stay two runs
            display = "/".join(x for x in (os.path.basename(os.path.abspath(opts.log_dir)), opts.run_name,
                                           f"rank_{rank}" if rank else "") if x)
            self._pipeline = CapturePipeline(opts, files, display, self._warn)
            if opts.verbose:
                print(f"[paddleviz-hooks] backward graphs -> {os.path.abspath(run_dir)}")
        if opts.watching:
            self._watch = self._new_capture()
            try:
                self._watch.__enter__()
            except Exception as exc:
                self._watch = None
                self._warn("watch", f"triggers are off: {exc!r}")
        return self

    def close(self) -> None:
        """Remove every hook, finish pending drawings and close the VisualDL writer.

        Calling it twice is harmless; :meth:`open` (or the next
        :meth:`begin_step`) starts recording again.
        """
        self._armed = None
        for cap in (self._step_capture, self._watch):
            if cap is not None:
                cap.__exit__(None, None, None)
        self._step_capture = self._watch = None
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            pipeline.close()
            self.undrawn_steps = pipeline.undrawn_at_close
            if self.options.verbose and self.captured_steps:
                print(f"[paddleviz-hooks] {len(pipeline.written)} steps captured, {len(pipeline.drawn)} drawn, "
                      f"{len(self.undrawn_steps)} left undrawn (data saved in {os.path.abspath(self.run_dir)})")
        self._open = self._active = False

    def __enter__(self) -> "BackwardGraphRecorder":
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------------- steps
    def begin_step(self, step: int | None = None) -> bool:
        """A training step starts; arms a capture when it is selected.

        Args:
            step: the step number (default: the previous one + 1, from 1).

        Returns:
            True when a capture is armed for this step.
        """
        if step is None:
            step = self.global_step + 1
        elif isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int or None, got {step!r}")
        self.global_step = step
        if not self._open:
            self.open()
        if not self._active:
            return False
        self._triggers.new_step()
        if self.options.scheduled(step) and self._budget_left():
            self._armed = "scheduled"
            if self._watch is None:
                self._step_capture = self._new_capture(self.options.saved_memory)
                try:
                    self._step_capture.__enter__()
                except Exception as exc:
                    self._step_capture = None
                    self._warn("arm", f"capture could not start: {exc!r}")
            elif self.options.saved_memory:
                self._watch.observe_saved(True)  # this step's forward only
            return True
        return False

    def end_step(self) -> None:
        """The training step is over: remove what :meth:`begin_step` armed."""
        self._armed = None
        cap, self._step_capture = self._step_capture, None
        if cap is not None:
            cap.__exit__(None, None, None)
        if self._watch is not None:
            self._watch.observe_saved(False)

    def disarm(self) -> None:
        """Let the rest of this step's backwards (e.g. evaluation) run uncaptured."""
        self._armed = None

    @contextlib.contextmanager
    def step(self, step: int | None = None) -> Iterator["BackwardGraphRecorder"]:
        """``with rec.step(n):`` around one training step's forward and backward.

        An exception leaving the block (Ctrl-C, an error in the model) closes
        the recorder, so no hook or patch stays behind, and propagates.
        """
        self.begin_step(step)
        try:
            yield self
        except BaseException:
            self.end_step()
            self.close()
            raise
        self.end_step()

    # --------------------------------------------------------------- helpers
    def _budget_left(self) -> bool:
        m = self.options.max_captures
        return m is None or len(self.captured_steps) < m

    def _notice(self, text: str) -> None:
        if self.options.verbose:
            print(f"[paddleviz-hooks] {text}")

    def _new_capture(self, saved_memory: bool = False) -> BackwardCapture:
        return BackwardCapture(
            self.model,
            grad_stats=self.options.grad_stats,
            on_graph=self._on_graph,
            keep_graphs=False,
            when=self._decide,
            after_backward=self._after_backward if self.options.watching else None,
            warn=self._warn,  # one warning per cause for the whole run
            saved_memory=saved_memory,
        )

    def _decide(self, roots: list[Any], walk: Any) -> str | None:
        return self._triggers.decide(self.global_step, self._armed, roots, walk)

    def _after_backward(self, ok: bool) -> None:
        if ok and self.model is not None:
            self._triggers.after_backward(self.global_step, self.model.parameters())

    def _on_graph(self, graph: BackwardGraph) -> None:
        """Training thread: a graph was captured; hand it to the pipeline."""
        step = self.global_step
        trigger = graph.meta.get("trigger") or "scheduled"
        graph.meta["step"] = step
        if self.model is not None:
            # what param.grad holds now (accumulated over this step's backwards and any
            # earlier ones not yet applied): the gradient the optimizer will apply
            try:
                graph.meta["accumulated_grad_norm"] = global_grad_norm(self.model.parameters())
            except Exception as exc:
                self._warn("accumulated", f"reading param.grad failed: {exc!r}")
        if self._triggers.note is not None:
            graph.meta["trigger_note"], self._triggers.note = self._triggers.note, None
        self.captured_steps.append(step)
        self.triggers[step] = trigger
        if trigger != "scheduled":
            sites = graph.nonfinite_sites()
            origin = f"; first non-finite gradient at {describe_node(sites[0])}" if sites else ""
            self._notice(f"captured step {step} (trigger: {trigger}){origin}")
        if self._pipeline is not None and not self._pipeline.submit(CaptureJob(graph, step, trigger)):
            # nothing of it reaches disk or VisualDL: keep captured_steps (and the
            # max_captures budget) true to what was written
            self.captured_steps.pop()
            self.triggers.pop(step, None)
            self.dropped_steps.append(step)
