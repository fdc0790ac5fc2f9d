"""BackwardGraphRecorder: capture backward graphs from any training loop.

The recorder decides *which* steps to capture (``every``, ``steps``,
triggers), arms a capture for them, and hands every captured graph to the
background pipeline that writes files and VisualDL records. A hand-written
loop drives it with ``with rec.step(): ...``; ``BackwardGraphCallback`` drives
the same recorder from ``Model.fit``.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import numbers
import os
from typing import Any, Iterable, Iterator, Sequence

import paddle

from .argcheck import reject_unknown
from .capture import BackwardCapture
from .capture.gradnode import strip_wrapper_prefix
from .capture.nan_origin import StepInputs, locate, replay_step
from .escape import visible
from .findings import nonfinite_record
from .graph import BackwardGraph, NonfiniteOrigin
from .options import FORMATS, RecorderOptions
from .pipeline import CaptureJob, CapturePipeline
from ._interrupts import as_interrupt, held_interrupts, is_wrapped_interrupt, run_all
from .sinks.files import StepFiles, claim_run_dir
from .sinks.hub import DEFAULT_SINKS
from .text import MODEL_OUTPUT, closing_line, end_line, run_folder_note, backward_role, nonfinite_lines
from .capture.stats import local_value, sum_of_squares
from .triggers import Triggers, global_grad_norm, weights_nonfinite
from .warn import WarnOnce

__all__ = ["BackwardGraphRecorder"]

#: ``begin_step(micro_batches=COUNTED)``: every backward of the step is a micro-batch, counted at its end
COUNTED = "counted"


class BackwardGraphRecorder:
    """Capture the backward graph on selected steps of any training loop.

    For each captured step it keeps ``step_000100.png`` (sized for viewing),
    ``.svg`` (every op, up to 2,500 nodes; above, the viewing drawing), ``.dot``
    and ``.json`` under ``log_dir/run_name/``,
    and logs image, text and scalar records to VisualDL in that same folder,
    its own run, so it never hides (or is hidden by) another writer of
    ``log_dir`` (or to SwanLab, TensorBoard or W&B: see ``sinks``). The data
    is written by a background thread; pictures are drawn by a low-priority
    process of their own (``drawworker.py``).

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
        sources: on captured steps, record the line of the user's code that
            called each op's forward (``Node.source``, shown in every view),
            armed the same way as ``saved_memory``. A NaN/Inf step that
            ``on_nonfinite`` replays from its inputs has its lines too; ops of
            a step captured by ``on_grad_spike`` or ``on_structure_change`` (or
            a NaN/Inf step not replayed, under data parallel) say they were not
            recorded: that forward ran before the capture was decided.
            Default True.
        color_by: ``"saved_memory"`` shades ops and layer boxes of the
            pictures by the bytes they saved for backward, with the range of
            each shade in the legend (needs ``saved_memory=True``; a capture
            without that record, such as a triggered one, is drawn unshaded).
            Default None.
        view_max_nodes: node budget of the viewing PNG (larger graphs are
            collapsed by layer depth). Default None: collapse only as far as
            legibility within ``view_max_px`` needs. The SVG keeps every op.
        view_max_px: longest side of the viewing PNG in pixels. Default 2000.
        viewer_px: width of the picture logged to VisualDL, drawn apart from
            the PNG file for VisualDL's image viewer: left to right
            (landscape), node labels at least 8 px high when the viewer fits
            it into a 1440x900 window, collapsed into layer boxes as far as
            that needs (when that is the whole model in one box, the PNG
            file's picture is logged instead). Default 1280. None logs the
            PNG file itself.
        formats: which files to keep per step, any of png, svg, dot, json.
            Default all four.
        visualdl: log records to VisualDL. Default True. False leaves
            ``"visualdl"`` out of ``sinks``.
        sinks: the dashboards that get each capture's picture, summary text
            and scalars: a name, a :class:`~paddleviz_hooks.Sink` object, or
            a list of them. Names: ``"visualdl"`` (the default), ``"swanlab"``
            (into the active SwanLab run, else a local run of its own under
            ``log_dir/swanlog``), ``"tensorboard"`` (tensorboardX event
            files in ``run_name``), ``"wandb"`` (into the active W&B run, else
            an offline run of its own under ``run_name/wandb``). Each needs its pip
            extra (``pip install 'paddleviz-hooks[swanlab]'``...), imported
            when the first capture reaches it. Default ``("visualdl",)``.
            ``"visualdl"`` named here with ``visualdl=False`` is refused
            (``ValueError``): the two contradict.
        visualdl_graphs: with ``visualdl``, also write every capture as an
            interactive graph for VisualDL's Graphs tab (collapsible layers,
            click a node for its gradient), one folder per capture under
            ``run_name/graphs/``. Default True.
        visualdl_diagnostics: also log the recorder's own scalars (node and
            edge counts, capture time, accumulated ``param.grad`` norm).
            Default False: only gradient norms and the NaN/Inf count.
        scalar_depth: the per-layer gradient norm scalars (``~grad_norm/<layer>``)
            go this many components down the dotted layer path (1: top-level
            layers, 2: ``encoder.layers``, ...; a shallower layer keeps its own
            name). Default None: the deepest level with at most about 30 scalars.
        run_name: folder (and dashboard run name) under ``log_dir``.
            Default ``"backward_graph"``.
        ranks: which ranks capture under data parallel: an int, a list of
            ints, or ``"all"`` (rank K writes to ``run_name/rank_K``).
            Default 0.
        on_nonfinite: capture a step whose loss is NaN/Inf (checked when its
            backward starts), or whose gradients are NaN/Inf with a finite
            loss (checked after the backward, before the optimizer step; that
            same step is replayed from its inputs under capture, before the
            weights change). With ``model`` given, the capture also names the
            forward op where the NaN/Inf started (its layer, file and line),
            found by replaying that step's forward once under Paddle's
            numerics checker; everything the replay touches is restored.
            Replays are single-process only: under data parallel a NaN/Inf
            loss captures its own backward and NaN/Inf gradients the next step.
            Default False.
        on_grad_spike: capture the step after one whose global gradient norm
            exceeds this factor times the running median. Default None (off).
        on_structure_change: capture a step whose graph structure differs
            from the last capture. Default False.
        cooldown: minimum steps between two captures of one trigger. Default 100.
        queue_size: kept for compatibility (an int >= 1, default 4): every drawing
            waits on disk as its JSON, which the drawing process reads, so none waits
            in memory and nothing is dropped.
        render_timeout: seconds all drawing of one capture may take before the
            Graphviz run is killed (its data is kept). Default 60.
        close_timeout: seconds :meth:`close` spends drawing captures still
            waiting; what is left is named, with the command that draws it
            from its saved JSON. Default 120.
        verbose: 0 silent, 1 prints where the files go and trigger notices.
            Default 1.

    Attributes:
        captured_steps: steps whose capture was handed to the background
            pipeline, in order.
        triggers: step -> what captured it (``"scheduled"`` or a trigger
            name: ``nonfinite_loss``, ``nonfinite_grad``, ``grad_spike``,
            ``structure_change``).
        lost_steps: captured steps whose data never reached disk -> why (set
            by :meth:`close`, for the run it closes).
        undrawn_steps: steps whose data is saved but whose pictures were not
            drawn by :meth:`close` (named in a warning, with the command that
            draws them).
        dropped_steps: steps captured but refused because the background
            writer had stopped (nothing of them is written).
        run_dir: the folder this rank writes to (set when the recorder opens).
        global_step: the last step begun.
        options: the checked options (a :class:`~paddleviz_hooks.options.RecorderOptions`).

    Raises:
        TypeError: an option of the wrong type (the message quotes it).
        ValueError: an option value out of range (the message quotes it).

    Steps are what the loop says they are (``rec.step(step)``), or counted
    from 1 when it says nothing. A step may run several backwards (gradient
    accumulation micro-batches, a ``paddle.grad`` penalty): each is its own
    graph, labelled in ``graph.meta["backward"]`` (``index``, ``of``,
    ``entry``, ``role``), the first saved as ``step_000100.*``, the i-th as
    ``step_000100_b<i>.*``; they are written when the step ends. A backward
    run inside another (reentrant recompute) is part of that one's graph.
    Unselected steps run nothing of the
    recorder's but a counter: no hook and no patch is in place (unless a
    trigger is on, which needs to see every backward).

    Examples:
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
        sources: bool = True,
        color_by: str | None = None,
        view_max_nodes: int | None = None,
        view_max_px: int = 2000,
        viewer_px: int | None = 1280,
        formats: Sequence[str] = FORMATS,
        visualdl: bool = True,
        sinks: Any = DEFAULT_SINKS,
        visualdl_graphs: bool = True,
        visualdl_diagnostics: bool = False,
        scalar_depth: int | None = None,
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
        **unknown: Any,
    ) -> None:
        if unknown:  # a typo: name this class and the closest option
            reject_unknown(type(self).__name__, unknown, option_names())
        if model is not None and not isinstance(model, paddle.nn.Layer):
            order = (" (the log directory comes first: BackwardGraphRecorder(log_dir, model))"
                     if isinstance(log_dir, paddle.nn.Layer) else "")
            raise TypeError(f"model must be a paddle.nn.Layer or None, got {type(model).__name__}{order}")
        self.options = RecorderOptions.check(
            log_dir, every, steps, capture_first=capture_first, max_captures=max_captures,
            grad_stats=grad_stats, saved_memory=saved_memory, sources=sources, color_by=color_by, view_max_nodes=view_max_nodes,
            view_max_px=view_max_px,
            viewer_px=viewer_px,
            formats=formats, visualdl=visualdl, sinks=sinks, visualdl_graphs=visualdl_graphs,
            visualdl_diagnostics=visualdl_diagnostics, scalar_depth=scalar_depth, run_name=run_name, ranks=ranks,
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
        #: captured steps whose data never reached disk -> why (set by close(), for the run it closes)
        self.lost_steps: dict[int, str] = {}
        self._failed: dict[int, str] = {}  # this run's steps chosen for capture whose capture failed
        self._capture_failures: list[str] = []  # what the captures could not capture since the last _flush
        #: step -> what captured it (``"scheduled"`` or a trigger name)
        self.triggers: dict[int, str] = {}
        #: the folder this rank writes to (set when the recorder opens)
        self.run_dir: str | None = None
        self._warn = WarnOnce()
        if self.options.visualdl and self.options.visualdl_graphs:  # said now, not at the first capture
            from .sinks.visualdl import GRAPHS_PATH_CAUSE, graphs_path_problem

            problem = graphs_path_problem(os.path.abspath(self.options.log_dir))
            if problem:
                self._warn(GRAPHS_PATH_CAUSE, problem)
        self._open = False
        self._closed = False  # close() was called (a later step warns: use after close)
        self._installed = False  # the recorder's hooks are in place (removed after an exception)
        self._in_block = False  # inside `with rec.step():`
        self._last_step = 0
        self._active = False
        self._armed: str | None = None
        self._step_capture: BackwardCapture | None = None
        self._watch: BackwardCapture | None = None
        self._kept: StepInputs | None = None  # the step's inputs, for replays (on_nonfinite)
        self._replaying = False
        self._replay_trigger: str | None = None  # a NaN loss seen when its backward started
        self._pipeline: CapturePipeline | None = None
        # this step: graphs waiting for its end, backwards seen (per entry), micro-batches announced
        self._pending: list[BackwardGraph] = []
        self._seen: list[str] = []
        self._run_from = (0, 0)  # captured_steps, dropped_steps: where the open run's entries start
        self._unwritable: str | None = None  # why the run folder could not be written (then nothing is)
        self._doomed = False  # this step was written early (NaN/Inf loss): its later graphs follow at once
        self._micro_batches: int | None = None
        self._applied_norm: float | None = None
        self._applied: dict[str, Any] | None = None  # read_applied_gradients() of this step
        self._reads_applied = False  # the loop says when its gradients are final (spike watch then)
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
        self._run_from = (len(self.captured_steps), len(self.dropped_steps))  # where this run's steps start
        self._unwritable = None
        self.lost_steps, self._failed = {}, {}
        run_dir = os.path.join(opts.log_dir, opts.run_name)
        if rank != 0:
            run_dir = os.path.join(run_dir, f"rank_{rank}")
        self.run_dir = run_dir
        opened: list = []  # lock files opened on the way: closed if anything fails (Ctrl-C included)
        try:
            claimed, lock = claim_run_dir(run_dir, opened=opened)
            files = StepFiles(claimed, lock)
            self._pipeline = CapturePipeline(opts, files, self._display_name(files.directory, rank), self._warn)
        except OSError as exc:
            run_all(*(f.close for f in opened))
            self._unwritable = f"{run_dir} could not be written ({exc.strerror or exc})"
            self._warn("dir", f"cannot write to {run_dir!r} ({exc.strerror or exc}); backward graphs "
                              "will not be saved or logged. Pass a writable log_dir")
        except BaseException:
            run_all(*(f.close for f in opened))
            raise
        else:
            self.run_dir = files.directory
            if opts.verbose:
                print(f"[paddleviz-hooks] backward graphs -> {files.directory}"
                      + run_folder_note(os.path.abspath(run_dir), files.directory))
        self._install()
        return self

    def _display_name(self, directory: str, rank: int) -> str:
        """The run's name in the dashboard: "<log dir>/<run folder>" (two experiments sharing a
        --logdir with the default run_name stay two runs)."""
        folder = os.path.basename(directory) if rank == 0 else os.path.basename(os.path.dirname(directory))
        return "/".join(x for x in (os.path.basename(os.path.abspath(self.options.log_dir)), folder,
                                    os.path.basename(directory) if rank else "") if x)

    def _install(self) -> None:
        """The hooks kept while open: the step inputs for replays and the trigger watch.
        Whatever raises (Ctrl-C included), nothing of them stays half-installed."""
        opts = self.options
        try:
            with held_interrupts():
                # a replay runs on one rank only: under data parallel its collectives (SyncBatchNorm,
                # gradient all-reduce) would wait for ranks that do not replay, so none is made there
                if opts.on_nonfinite and self.model is not None and paddle.distributed.get_world_size() == 1:
                    self._kept = StepInputs(self.model)
                    try:
                        self._kept.install()
                    except Exception as exc:
                        self._kept.remove()
                        self._kept = None
                        self._warn("keep-inputs", f"NaN/Inf origins will not be located: {exc!r}")
                if opts.watching:
                    self._watch = self._new_capture(watch=True)
                    try:
                        self._watch.__enter__()
                    except Exception as exc:
                        self._watch = None
                        self._warn("watch", f"triggers are off: {exc!r}")
                self._installed = True
        except BaseException:
            self._uninstall()
            raise

    def _uninstall(self) -> None:
        """Remove every hook and patch of the recorder (idempotent; each part whatever
        another raises). The files and VisualDL records stay open."""
        with held_interrupts():
            self._armed = None
            self._installed = False
            run_all(self._end_step_capture, self._end_watch, self._remove_kept)

    def _end_step_capture(self) -> None:
        self._end_capture("_step_capture")

    def _end_watch(self) -> None:
        self._end_capture("_watch")

    def _end_capture(self, attr: str) -> None:
        """End the capture held in ``attr``; it is forgotten only once its hooks are gone."""
        cap = getattr(self, attr)
        if cap is not None:
            cap._teardown()  # idempotent; __exit__ below numbers the step's graphs
            setattr(self, attr, None)
            cap.__exit__(None, None, None)

    def _remove_kept(self) -> None:
        kept = self._kept
        if kept is not None:
            kept.remove()
            self._kept = None

    def close(self) -> None:
        """Remove every hook, finish pending drawings and close the VisualDL writer.

        Calling it twice is harmless; :meth:`open` (or the next
        :meth:`begin_step`) starts recording again.
        """
        # every part runs whatever another raises (a Ctrl-C is raised after); each is idempotent
        run_all(self._uninstall, self._mark_closed, self._flush, self._close_pipeline)

    def _mark_closed(self) -> None:
        self._open = self._active = False
        self._closed = True
        self._last_step = 0  # opened again, it writes a new run folder: steps may start again

    def _close_pipeline(self) -> None:
        """Write and draw what is left, close VisualDL, and say what was kept."""
        pipeline = self._pipeline
        if pipeline is None:
            if self._unwritable is not None and self.lost_steps and self.options.verbose:
                print("[paddleviz-hooks] " + end_line(len(self.lost_steps), len(self.lost_steps), 0, self.lost_steps,
                                                      0, 0, self.run_dir or self.options.log_dir))
            return
        if self.options.verbose and not pipeline.idle:  # the wait may be long: say what it is for
            print("[paddleviz-hooks] " + closing_line(self.options.close_timeout), flush=True)
        pipeline.close()
        self._pipeline = None
        self.undrawn_steps = pipeline.undrawn_at_close
        written = set(pipeline.written)
        # this run's steps only: a recorder opened again writes a new run folder, and counts anew
        run_steps, dropped = self.captured_steps[self._run_from[0]:], self.dropped_steps[self._run_from[1]:]
        self.lost_steps = {**self._failed, **{s: "the background writer stopped" for s in dropped}, **pipeline.lost}
        for step in set(run_steps) - written - set(self.lost_steps):
            self.lost_steps[step] = "not written before close() gave up"
        if self.options.verbose and (run_steps or self.lost_steps):
            captured = written | set(self.lost_steps)
            graphs = len(pipeline.written) + len(pipeline.lost)  # a step may have several backwards
            print("[paddleviz-hooks] " + end_line(
                len(captured), graphs, len(written), self.lost_steps, len(set(pipeline.drawn)),
                len(self.undrawn_steps), self.run_dir))

    def __enter__(self) -> "BackwardGraphRecorder":
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------------- steps
    def begin_step(self, step: int | None = None, *, micro_batches: int | str | None = None) -> bool:
        """A training step starts; arms a capture when it is selected.

        Args:
            step: the step number (default: the previous one + 1, from 1).
            micro_batches: how many gradient-accumulation micro-batches the
                step runs, one ``backward()`` each; their graphs are labelled
                "micro-batch i of k". ``"counted"``: the loop does not say
                beforehand; every ``backward()`` of the step is a micro-batch,
                counted when the step ends. Default None: backwards are
                labelled "backward i of n".

        Returns:
            True when a capture is armed for this step.

        Raises:
            TypeError: ``step`` or ``micro_batches`` is not an int.
            ValueError: ``micro_batches`` is below 1.
        """
        if step is None:
            step = self.global_step + 1
        elif isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"step must be an int or None, got {step!r}")
        step = int(step)  # numpy integers too (a loop counter from np.arange)
        if micro_batches is not None and micro_batches != COUNTED:
            if isinstance(micro_batches, bool) or not isinstance(micro_batches, numbers.Integral):
                raise TypeError(f"micro_batches must be an int, 'counted' or None, got {micro_batches!r}")
            micro_batches = int(micro_batches)
        if isinstance(micro_batches, int) and micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1 or None, got {micro_batches!r}")
        if step < 1:
            raise ValueError(f"step must be >= 1 (steps are counted from 1, as in steps=[...]), got {step}; "
                             "pass rec.step(step + 1) for a 0-based loop counter")
        if self._in_block:
            raise RuntimeError("rec.step() blocks cannot be nested: this step's block is still open. "
                               "Put one `with rec.step(n):` around each training step, not inside another")
        if step <= self._last_step:
            raise ValueError(f"steps must increase: step {step} came after step {self._last_step}; "
                             "pass increasing step numbers (or none, to count from 1), or close() this "
                             "recorder and make a new one for a new run")
        if self._closed and not self._open:
            self._closed = False
            self._warn("after-close", "the recorder was used after close(): it records again, into a new "
                                      "run folder beside the first (call rec.open() to resume on purpose, "
                                      "or make a new BackwardGraphRecorder)")
        try:
            return self._start_step(step, micro_batches)
        except BaseException:
            run_all(self._end_step_capture)  # nothing of this step stays armed
            raise

    def _start_step(self, step: int, micro_batches: int | str | None) -> bool:
        # a step that was never ended (begin_step, then `continue`): disarmed and written; a forward
        # under way keeps its inputs (the step was begun from its own pre-hook, as attach() does)
        self._end_step(keep_call=True)
        self.global_step = self._last_step = step
        self._micro_batches = micro_batches
        if not self._open:
            self.open()
        elif self._active and not self._installed:
            self._install()  # the hooks removed after an exception left a step
        if not self._active:
            return False
        self._triggers.new_step()
        scheduled = self.options.scheduled(step) and self._budget_left()
        if scheduled:
            self._armed = "scheduled"
        # a capture of this step's own backward needs layer hooks during its forward
        if (scheduled or self._triggers.pending) and (self._watch is None or not self._watch_names_layers):
            with held_interrupts():
                cap = self._step_capture = self._new_capture(saved_memory=scheduled and self.options.saved_memory)
                try:
                    cap.__enter__()
                except Exception as exc:
                    self._step_capture = None
                    self._warn("arm", f"capture could not start: {exc!r}")
                except BaseException:
                    self._step_capture = None
                    raise
        elif scheduled and self._watch is not None:
            if self.options.saved_memory:
                self._watch.observe_saved(True)  # this step's forward only
            if self.options.sources:
                self._watch.observe_sources(True)
        return scheduled

    def end_step(self) -> None:
        """The training step is over: remove what :meth:`begin_step` armed.

        Everything is removed whatever raises where (a Ctrl-C is delivered
        after); then the step's graphs go to the writer.
        """
        self._end_step()

    def _end_step(self, keep_call: bool = False) -> None:
        # the step's graphs are written whatever the other raises
        run_all(lambda: self._disarm_step(keep_call), self._flush)

    def _disarm_step(self, keep_call: bool = False) -> None:
        with held_interrupts():
            self._armed = None
            run_all(lambda: self._reset_kept(keep_call), self._end_step_capture, self._unobserve)

    def _reset_kept(self, keep_call: bool = False) -> None:
        if self._kept is not None:  # no reference to the step's tensors outlives it
            if keep_call:
                self._kept.new_step()
            else:
                self._kept.reset()

    def _unobserve(self) -> None:
        if self._watch is not None:
            self._watch.observe_saved(False)
            self._watch.observe_sources(False)

    def read_applied_gradients(self) -> None:
        """Read ``param.grad`` now as the gradients this step's update applies.

        Call it right before the optimizer step, after the loop has done
        whatever it does to the accumulated gradients (PaddleFormers' Trainer
        divides them by the number of micro-batches, a ``GradScaler`` unscales
        them). The step's graphs then carry the norm of each applied gradient
        (``graph.meta["applied_grads"]``, by parameter name) and their global
        norm (``"applied_grad_norm"``, also ``"accumulated_grad_norm"``); the
        gradients drawn in each micro-batch's graph stay that backward's own.
        Without this call the accumulated norm is read after the step's last
        backward. ``on_grad_spike`` then watches this norm, once per step
        (else the sum in ``param.grad`` after every backward), from the first
        call on: call :meth:`expect_applied_gradients` before the first step
        to have it so from the start.
        """
        self._reads_applied = True
        if self.model is None or not self._active or not (self._pending or self.options.on_grad_spike):
            return
        try:
            total = global_grad_norm(self.model.parameters())
            self._triggers.applied_norm(self.global_step, total)
            if not self._pending:
                return
            norms: dict[str, float] = {}
            for name, p in self.model.named_parameters():
                g = local_value(p.grad) if p.grad is not None else None
                if g is not None and g._is_initialized():
                    norms[strip_wrapper_prefix(name)] = math.sqrt(sum_of_squares([g]))
        except Exception as exc:
            self._warn("applied", f"reading the applied gradients failed: {exc!r}")
            return
        self._applied = {"norms": norms, "norm": total}

    def expect_applied_gradients(self) -> None:
        """The loop will call :meth:`read_applied_gradients` on every step (adapters say so first)."""
        self._reads_applied = True

    def disarm(self) -> None:
        """Let the rest of this step's backwards (e.g. evaluation) run uncaptured."""
        self._armed = None

    @contextlib.contextmanager
    def step(self, step: int | None = None, *, micro_batches: int | None = None
             ) -> Iterator["BackwardGraphRecorder"]:
        """``with rec.step(n):`` around one training step's forward and backward(s).

        With gradient accumulation, put all of the step's micro-batches
        inside and say how many (``micro_batches``, see :meth:`begin_step`).
        An exception leaving the block (an error in the model) removes every
        hook and patch of the recorder and propagates; the next step puts
        them back and the files and VisualDL records go on in the same run.
        Ctrl-C (``KeyboardInterrupt``) and ``SystemExit`` close the recorder.

        Raises:
            ValueError: a step number below 1, or not above the previous one.
            RuntimeError: a ``rec.step()`` block inside another.
        """
        self.begin_step(step, micro_batches=micro_batches)
        self._in_block = True
        try:
            yield self
        except BaseException as exc:
            self._step_failed(exc)
            if is_wrapped_interrupt(exc):  # Paddle's OSError around a Ctrl-C: the Ctrl-C it was
                raise as_interrupt(exc) from exc
            raise
        self._step_done()

    def _step_done(self) -> None:
        run_all(self._leave_block, self.end_step)

    def _step_failed(self, exc: BaseException) -> None:
        """An exception left the step: every hook goes (each part whatever another raises);
        Ctrl-C and SystemExit also close the recorder."""
        if isinstance(exc, (KeyboardInterrupt, SystemExit)) or is_wrapped_interrupt(exc):
            run_all(self._leave_block, self.end_step, self.close)
        else:
            run_all(self._leave_block, self.end_step, self._uninstall)

    def _leave_block(self) -> None:
        self._in_block = False

    # --------------------------------------------------------------- helpers
    def _budget_left(self) -> bool:
        m = self.options.max_captures
        return m is None or len(self.captured_steps) < m

    def _notice(self, text: str) -> None:
        if self.options.verbose:
            print(f"[paddleviz-hooks] {visible(text, lines=True)}")

    @property
    def _watch_names_layers(self) -> bool:
        """Whether the trigger watch keeps layer-attribution hooks on every step.

        Only triggers that capture the real backward need them (a gradient spike
        captures the next step, a structure change the step itself). NaN/Inf
        steps are captured by replaying them, with attribution for that replay
        only, so ``on_nonfinite`` alone costs next to nothing per step.
        """
        opts = self.options
        return opts.on_grad_spike is not None or opts.on_structure_change or self._kept is None

    def _new_capture(self, watch: bool = False, saved_memory: bool = False) -> BackwardCapture:
        """The trigger watch (``watch=True``) or a scheduled step's capture."""
        names = not watch or self._watch_names_layers
        cap = BackwardCapture(
            self.model if names else None,
            params=None if names else self.model,
            grad_stats=self.options.grad_stats,
            on_graph=self._on_graph,
            keep_graphs=False,
            when=self._decide_watch if watch else self._decide,
            after_backward=self._after_backward if (watch or self._watch is None and self.options.watching)
            else None,
            warn=self._warn,  # one warning per cause for the whole run
            saved_memory=saved_memory,
            sources=self.options.sources,
        )
        # the watch is active on every step: it records sources only for the steps begin_step selects
        cap.sources_from_enter = not watch
        cap.failures = self._capture_failures  # read by _flush: a chosen step that gave no graph is lost
        return cap

    def _decide(self, roots: list[Any], walk: Any) -> str | None:
        if self._replaying:
            return None  # our own replay's backward is no backward of the step
        cap = self._watch or self._step_capture
        self._seen.append(cap.entry_now if cap is not None else "backward")
        return self._triggers.decide(self.global_step, self._armed, roots, walk)

    def _decide_watch(self, roots: list[Any], walk: Any) -> str | None:
        if self._step_capture is not None:
            return None  # this step's own capture (naming layers) decides and captures
        trigger = self._decide(roots, walk)
        kept = self._kept
        if (trigger == "nonfinite_loss" and not self._watch_names_layers and kept is not None and kept.seen
                and kept.hooked):
            self._replay_trigger = trigger  # captured by a replay when this backward is over
            return None
        return trigger

    def _after_backward(self, ok: bool) -> None:
        if self._replaying:
            return
        try:
            self._check_backward(ok)
        finally:
            self._write_if_doomed()

    def _check_backward(self, ok: bool) -> None:
        pending, self._replay_trigger = self._replay_trigger, None
        if not ok or self.model is None:
            return
        if pending is not None:
            self._capture_replayed(pending)
            return
        kept = self._kept
        can_replay = kept is not None and kept.seen and bool(kept.out_grads)
        # a spike is judged on the gradient the update applies: after the step's last announced
        # micro-batch (param.grad holds part of it before), or by the loop (read_applied_gradients)
        spike = not self._reads_applied and self._last_backward()
        if self._triggers.after_backward(self.global_step, self.model.parameters(), can_replay, spike=spike):
            self._capture_replayed("nonfinite_grad")

    def _capture_replayed(self, trigger: str) -> None:
        """Capture this step by replaying its forward and backward (param.grad untouched)."""
        cap = BackwardCapture(self.model, grad_stats=self.options.grad_stats, warn=self._warn,
                              sources=self.options.sources)
        self._replaying = True
        try:
            with cap:
                replay_step(self.model, self._kept)
        except Exception as exc:
            self._warn("replay", f"replaying step {self.global_step} to capture it failed: {exc!r}")
            return
        finally:
            self._replaying = False
        if not cap.graphs:
            self._warn("replay-empty", f"replaying step {self.global_step} gave no backward graph")
            return
        graph = cap.graphs[-1]
        if trigger == "nonfinite_grad" and not graph.nonfinite_count():
            # the forward depends on more than its inputs and the RNG (a counter...):
            # a finite replay would misrepresent the step; capture the next one instead
            self._triggers.defer(self.global_step)
            self._notice(f"the replay of step {self.global_step} did not reproduce its NaN/Inf gradients; "
                         f"capturing step {self.global_step + 1}")
            return
        graph.meta.pop("loss", None)  # its root is the model's output, not the loss
        if self._triggers.loss is not None:
            graph.meta["loss"] = self._triggers.loss  # the step's real loss
        for n in graph.nodes:
            if n.kind == "root":
                n.name = n.op = MODEL_OUTPUT
        info = graph.meta.get("backward")
        if isinstance(info, dict) and self._seen:
            info["entry"] = self._seen[-1]  # it stands for the step's latest backward, not a paddle.grad
        graph.meta.update(trigger=trigger, replayed=True)
        self._on_graph(graph)

    def _locate(self, graph: BackwardGraph, trigger: str) -> NonfiniteOrigin | None:
        """Where this step's NaN/Inf started (a replay of its forward), or None when not located."""
        kept = self._kept
        loss = graph.meta.get("loss")
        loss_bad = isinstance(loss, float) and not math.isfinite(loss)
        if kept is None or not kept.seen or not (trigger.startswith("nonfinite") or loss_bad
                                                 or graph.nonfinite_count()):
            return None
        self._replaying = True
        try:
            return locate(self.model, kept, graph, loss_nonfinite=loss_bad)
        except Exception as exc:
            self._warn("locate", f"locating where the NaN/Inf started failed: {exc!r}")
            return None
        finally:
            self._replaying = False

    def _on_graph(self, graph: BackwardGraph) -> None:
        """Training thread: a graph was captured; it waits for the end of its step."""
        step = self.global_step
        trigger = graph.meta.get("trigger") or "scheduled"
        graph.meta["step"] = step
        info = graph.meta.get("backward")
        if isinstance(info, dict) and info.get("index") is not None:
            info["index"] = len(self._seen)  # which backward of this step
            if self._micro_batches:
                info["micro_batch"] = self._seen.count("backward") + (info.get("entry") == "grad")
                info["micro_batches"] = self._micro_batches
        weights: list[str] = []
        buffers: list[str] = []
        if self.model is not None:
            # what param.grad holds now (accumulated over this step's backwards and any
            # earlier ones not yet applied); after the step's last backward it is the
            # gradient the optimizer will apply
            try:
                self._applied_norm = global_grad_norm(self.model.parameters())
            except Exception as exc:
                self._warn("accumulated", f"reading param.grad failed: {exc!r}")
            try:  # an earlier update may have written NaN/Inf into the weights themselves
                weights, buffers = self._nonfinite_values()
            except Exception as exc:
                self._warn("weights", f"checking the weights for NaN/Inf failed: {exc!r}")
        if trigger == "scheduled" and self.options.on_nonfinite:
            # a scheduled step that went NaN/Inf is that trigger's capture too (named, and filed as such)
            loss = graph.meta.get("loss")
            if isinstance(loss, float) and not math.isfinite(loss):
                trigger = "nonfinite_loss"
            elif graph.nonfinite_count():
                trigger = "nonfinite_grad"
            if trigger != "scheduled":
                graph.meta["trigger"] = trigger
        # the NaN/Inf story of the capture, computed once here; every view reads it (a capture
        # with nothing non-finite keeps none in its JSON: findings.record_of gives it empty)
        record = nonfinite_record(graph, self._locate(graph, trigger), weights, buffers)
        graph.nonfinite = record if record.any else None
        if self._triggers.note is not None:
            graph.meta["trigger_note"], self._triggers.note = self._triggers.note, None
        if trigger != "scheduled":
            story = " ".join(nonfinite_lines(record)).rstrip(";")
            # several backwards of a step each say which one they are (their total is known later)
            role = backward_role(dict(info, of=None, micro_batches=None if info.get("micro_batches") == COUNTED
                                      else info.get("micro_batches"))) if isinstance(info, dict) else ""
            self._notice(f"captured step {step} (" + (f"{role}; " if role else "") + f"trigger: {trigger})"
                         + (f"; {story}" if story else ""))
        if any(n.layer_note == "unrecorded" for n in graph.nodes):
            self._warn("forward-outside", f"step {step}'s forward ran before its capture was armed, so the layers "
                                          "(and source lines) of its ops are not recorded; run the forward inside "
                                          "`with rec.step(n):` (or between begin_step() and end_step())")
        self._pending.append(graph)
        self._write_if_doomed()

    def _write_if_doomed(self) -> None:
        """After the step's last backward, a step with a NaN/Inf loss is written at once; so is
        every graph of it delivered after that (one capture may deliver after another's check)."""
        if not self._pending:
            return
        if self._doomed or (any(self._nonfinite_loss(g) for g in self._pending) and self._last_backward()):
            self._doomed = True
            self._write_now()

    @staticmethod
    def _nonfinite_loss(graph: BackwardGraph) -> bool:
        loss = graph.meta.get("loss")
        return isinstance(loss, float) and not math.isfinite(loss)

    def _last_backward(self) -> bool:
        """Whether the step has run every backward it announced (unknown: yes)."""
        k = self._micro_batches
        return not isinstance(k, int) or self._seen.count("backward") >= k

    def _write_now(self) -> None:
        """Write this step's graphs and wait until their files and records are out.

        Loops commonly raise on a NaN/Inf loss right after the step's last
        backward (PaddleFormers' Trainer does), so neither :meth:`end_step` nor
        :meth:`close` may follow; the capture must not wait for them.
        """
        self._flush(final=False)
        if self._pipeline is not None:
            self._pipeline.settle(self.options.close_timeout)

    def _nonfinite_values(self) -> tuple[list[str], list[str]]:
        """Trainable parameters, and non-trainable tensors (buffers, BatchNorm running statistics:
        the forward writes them, no update does), whose values hold NaN/Inf."""
        named = list(self.model.named_parameters())
        trainable = {name for name, p in named if not p.stop_gradient}
        bad = weights_nonfinite(named)
        weights = [strip_wrapper_prefix(n) for n in bad if n in trainable]
        buffers = [strip_wrapper_prefix(n) for n in bad if n not in trainable]
        buffers += [strip_wrapper_prefix(n) for n in weights_nonfinite(
            (name, b) for name, b in self.model.named_buffers() if b is not None and b._is_initialized())]
        return weights, buffers

    def _flush(self, final: bool = True) -> None:
        """Label the step's graphs and write them.

        Args:
            final: the step is over (its number of backwards is known). False: a
                step written before its end (:meth:`_write_now`): the backwards
                seen so far stay counted, so a later one of the step gets the
                next number (and a file of its own); the total is left unknown
                unless the loop announced it.
        """
        pending, self._pending = self._pending, []
        seen_entries = self._seen
        if final:
            self._seen, self._doomed = [], False
        seen = len(seen_entries) if final or isinstance(self._micro_batches, int) else None
        applied, self._applied_norm = self._applied_norm, None
        read, self._applied = self._applied, None
        if read is not None and read["norm"] is not None:
            applied = read["norm"]
        failed, self._capture_failures[:] = list(self._capture_failures), []
        if failed and not pending and self.global_step not in self.captured_steps:
            self._failed.setdefault(self.global_step, failed[0])  # chosen, but no graph came of it
            self.lost_steps.setdefault(self.global_step, failed[0])
        if not pending:
            return
        step = pending[0].meta["step"]
        written = False
        for graph in pending:
            info = graph.meta.get("backward")
            if isinstance(info, dict):
                if info.get("index") is not None:
                    info["of"] = seen
                if info.get("micro_batches") == COUNTED:
                    info["micro_batches"] = seen_entries.count("backward") if final else None
                info["role"] = backward_role(info)
            if applied is not None:
                graph.meta["accumulated_grad_norm"] = applied
            if read is not None:
                graph.meta["applied_grad_norm"] = read["norm"]
                graph.meta["applied_grads"] = dict(read["norms"])
            trigger = graph.meta.get("trigger") or "scheduled"
            index = info.get("index") if isinstance(info, dict) else None
            suffix = f"b{index}" if isinstance(index, int) and index > 1 else (
                "" if isinstance(index, int) else f"nested{pending.index(graph)}")
            if self._pipeline is None:  # the run folder could not be written: lost, and said so at close
                self.lost_steps.setdefault(step, self._unwritable or "no run folder to write to")
            elif self._pipeline.submit(CaptureJob(graph, step, trigger, suffix)):
                written = True
            else:
                # nothing of it reaches disk or VisualDL
                if step not in self.dropped_steps:
                    self.dropped_steps.append(step)
            if trigger != "scheduled" or step not in self.triggers:
                self.triggers[step] = trigger
        # captured_steps (and the max_captures budget) stay true to what was written; a step
        # written in parts (early, then at its end) is counted once
        if written:
            if not self.captured_steps or self.captured_steps[-1] != step:
                self.captured_steps.append(step)
        elif not self.captured_steps or self.captured_steps[-1] != step:  # nothing of the step written
            self.triggers.pop(step, None)


def check_options(called: str, log_dir: Any, **options: Any) -> None:
    """Raise now what ``BackwardGraphRecorder(log_dir, **options)`` would raise, an unknown keyword
    named after ``called`` (the adapter the user made), for adapters that make their recorder later.

    Examples:
        >>> check_options("MyCallback", "vdl_log", evry=5)
        Traceback (most recent call last):
        ...
        TypeError: MyCallback() got an unexpected keyword argument 'evry'; did you mean 'every'?
    """
    reject_unknown(called, options, option_names())
    BackwardGraphRecorder(log_dir, **options)


def option_names() -> tuple[str, ...]:
    """The keyword arguments :class:`BackwardGraphRecorder` takes (for "did you mean" errors)."""
    params = inspect.signature(BackwardGraphRecorder.__init__).parameters.values()
    return tuple(p.name for p in params if p.name != "self" and p.kind is not p.VAR_KEYWORD)
