"""BackwardGraphCallback: capture backward graphs during ``paddle.Model.fit``.

A thin adapter: it drives a :class:`~paddleviz_hooks.recorder.BackwardGraphRecorder`
from ``Model.fit``'s callback methods. Which steps are captured, the triggers,
the files and the VisualDL records are the recorder's.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable

import paddle

from ..argcheck import reject_unknown
from ..recorder import BackwardGraphRecorder, option_names

__all__ = ["BackwardGraphCallback"]


class BackwardGraphCallback(paddle.callbacks.Callback):
    """Capture the backward graph on selected training steps of ``Model.fit``.

    Every argument is a :class:`~paddleviz_hooks.recorder.BackwardGraphRecorder`
    argument with the same default and meaning (see there): ``log_dir``,
    ``every``, ``steps``, ``capture_first``, ``max_captures``, ``grad_stats``, ``saved_memory``, ``sources``, ``color_by``,
    ``view_max_nodes``, ``view_max_px``, ``viewer_px``, ``formats``, ``visualdl``, ``sinks``,
    ``visualdl_graphs``, ``visualdl_diagnostics``, ``scalar_depth``,
    ``run_name``, ``ranks``, ``on_nonfinite``, ``on_grad_spike``,
    ``on_structure_change``, ``cooldown``, ``queue_size``, ``render_timeout``,
    ``close_timeout``, ``verbose``. The model is ``Model.fit``'s network.

    Steps are numbered like ``paddle.callbacks.VisualDL``'s ``train/*``
    scalars: the global training batch count, starting at 1, across epochs.
    With ``fit(accumulate_grad_batches=k)`` a step is one optimizer step: the
    k batches whose gradients it applies, each recorded as "micro-batch i of
    k" (``step_000003.*``, ``step_000003_b2.*``...), with the norm of the
    accumulated ``param.grad`` the optimizer receives (``accumulated_grad_norm``;
    its own gradient clipping and weight decay come after).

    Raises:
        TypeError: an option of the wrong type (the message quotes it).
        ValueError: an option value out of range (the message quotes it).

    Examples:
        >>> cb = BackwardGraphCallback("vdl_log", every=100)
        >>> cb.recorder.options.every
        100

        then ``model.fit(train_ds, epochs=2, batch_size=32, callbacks=[cb])``
        and ``visualdl --logdir vdl_log``.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike = "vdl_log",
        every: int | None = None,
        steps: Iterable[int] | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        reject_unknown(type(self).__name__, options, option_names())  # a typo names this class, not the recorder
        #: the recorder this callback drives (public: its options and results)
        self.recorder = BackwardGraphRecorder(log_dir, every=every, steps=steps, **options)
        self._guard: _StepGuard | None = None
        self._batch: int | None = None  # the batch Model.fit announced, begun when its train_batch runs
        self._guarded = False  # this batch is begun and ended by the guard (Model.fit drives it)

    # results, as the recorder keeps them
    @property
    def captured_steps(self) -> list[int]:
        """Steps whose capture was handed to the background pipeline."""
        return self.recorder.captured_steps

    @property
    def dropped_steps(self) -> list[int]:
        """Steps captured but refused because the background writer had stopped (nothing of them
        is written)."""
        return self.recorder.dropped_steps

    @property
    def lost_steps(self) -> dict[int, str]:
        """Captured steps whose data never reached disk -> why (set by ``close()``)."""
        return self.recorder.lost_steps

    @property
    def undrawn_steps(self) -> list[int]:
        """Steps whose data is saved but whose pictures were not drawn by ``close()`` (named in a
        warning with the command that draws them)."""
        return self.recorder.undrawn_steps

    @property
    def triggers(self) -> dict[int, str]:
        """Step -> what captured it (``"scheduled"`` or a trigger name)."""
        return self.recorder.triggers

    @property
    def run_dir(self) -> str | None:
        """The folder this rank writes to."""
        return self.recorder.run_dir

    @property
    def global_step(self) -> int:
        """The last training step seen (1-based, across epochs)."""
        return self.recorder.global_step

    def _network(self) -> paddle.nn.Layer | None:
        net = getattr(getattr(self, "model", None), "network", None)
        return net if isinstance(net, paddle.nn.Layer) else None

    # ------------------------------------------------------------ Model.fit
    def on_train_begin(self, logs: dict | None = None) -> None:
        self.close()  # a previous fit that was interrupted
        self.recorder.global_step = 0
        self.recorder.open(self._network())
        self._guard = _StepGuard.attach(getattr(self, "model", None), self)

    def _accumulate(self) -> int:
        k = getattr(getattr(self, "model", None), "_accumulate", 1)
        return k if isinstance(k, int) and k > 1 else 1

    def _updates_after(self, step: int) -> bool:
        """Whether ``Model.fit`` applies the optimizer after this batch (as its ``_run_one_epoch``)."""
        k, steps = self._accumulate(), self.params.get("steps") if isinstance(self.params, dict) else None
        return (step + 1) % k == 0 or (isinstance(steps, int) and step + 1 == steps)

    def on_train_batch_begin(self, step: int, logs: dict | None = None) -> None:
        # Under Model.fit the batch is armed when its train_batch runs (the guard): an
        # exception in another callback between now and then (a Ctrl-C) would leave it
        # armed, with no callback of ours called again to disarm it. A loop of one's own
        # that calls the callback's methods (a custom trainer) is armed now.
        self._guarded = self._guard is not None and _called_by_fit()
        if self._guarded:
            self._batch = step
        else:
            self._begin_batch(step)

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        if not self._guarded:
            self._end_batch(step)

    def _batch_starts(self) -> None:
        """The guard runs the announced batch's train_batch now."""
        if self._batch is not None:
            self._begin_batch(self._batch)

    def _batch_ends(self) -> None:
        """The guard's train_batch returned (its update done, when it makes one)."""
        step, self._batch = self._batch, None
        if step is not None:
            self._end_batch(step)

    def _begin_batch(self, step: int) -> None:
        k = self._accumulate()
        if k == 1:
            self.recorder.begin_step()
        elif step % k == 0:  # the first micro-batch of an optimizer step
            steps = self.params.get("steps") if isinstance(self.params, dict) else None
            n = min(k, steps - step) if isinstance(steps, int) and steps > step else k
            self.recorder.begin_step(micro_batches=n)

    def _end_batch(self, step: int) -> None:
        if self._accumulate() == 1 or self._updates_after(step):
            self.recorder.end_step()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.recorder.end_step()  # Model.fit applies a last, shorter accumulation at an epoch's end

    def on_eval_begin(self, logs: dict | None = None) -> None:
        self.recorder.disarm()

    def on_train_end(self, logs: dict | None = None) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook, finish pending renders and close the VisualDL writer.

        Called by ``on_train_end``, and automatically when an exception
        (Ctrl-C, an error in the model or loss) leaves a training step. After
        an exception raised elsewhere (data loading, another callback,
        evaluation) ``Model.fit`` calls no callback: call it yourself, or use
        ``with BackwardGraphCallback(...) as cb: model.fit(..., callbacks=[cb])``.
        Calling it twice is harmless.
        """
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.detach(self)
        self.recorder.close()

    def __enter__(self) -> "BackwardGraphCallback":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _called_by_fit(depth: int = 8) -> bool:
    """Whether ``paddle.Model.fit``'s batch loop is among the nearest callers (it calls the
    model's ``train_batch`` next, which the guard wraps)."""
    f = sys._getframe(1)
    for _ in range(depth):
        if f is None:
            return False
        if f.f_code.co_name == "_run_one_epoch" and f.f_globals.get("__name__") == "paddle.hapi.model":
            return True
        f = f.f_back
    return False


class _StepGuard:
    """Closes callbacks when an exception leaves a training step.

    ``Model.fit`` calls no callback when an exception (Ctrl-C, an error in the
    model or loss) propagates out of it, so forward hooks and the backward
    patch of an armed capture would stay until ``close()``. While a fit runs,
    ``model.train_batch`` (looked up per batch by ``Model.fit``) is this
    wrapper, an instance attribute shared by every callback of the fit; the
    last callback to close puts the original back. Exceptions outside
    ``train_batch`` (data loading, other callbacks, evaluation) still need
    ``close()`` or ``with BackwardGraphCallback(...) as cb:``.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.had_own = "train_batch" in model.__dict__
        self.own = model.__dict__.get("train_batch")
        self.inner = model.train_batch
        self.callbacks: list[Any] = []

    @classmethod
    def attach(cls, model: Any, cb: Any) -> "_StepGuard | None":
        if model is None or not callable(getattr(model, "train_batch", None)):
            return None
        guard = model.__dict__.get("train_batch")
        if not isinstance(guard, cls):
            guard = cls(model)
            model.train_batch = guard
        guard.callbacks.append(cb)
        return guard

    def detach(self, cb: Any) -> None:
        if cb in self.callbacks:
            self.callbacks.remove(cb)
        if not self.callbacks and self.model.__dict__.get("train_batch") is self:
            if self.had_own:
                self.model.train_batch = self.own
            else:
                del self.model.train_batch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            for cb in list(self.callbacks):  # the batch's step is armed here, not in on_train_batch_begin
                cb._batch_starts()
            out = self.inner(*args, **kwargs)
            for cb in list(self.callbacks):
                cb._batch_ends()
            return out
        except BaseException:
            for cb in list(self.callbacks):
                try:
                    cb.close()
                except Exception:
                    pass
            raise
