"""Triggers: capture the steps where training goes wrong.

* ``nonfinite_loss``: the loss is NaN/Inf when its backward starts; that
  backward is captured.
* ``nonfinite_grad``: the loss was finite but a gradient turned NaN/Inf
  (checked after the backward, before the optimizer step); the recorder
  captures that same step by replaying it, or the next step when it cannot.
* ``grad_spike``: the global gradient norm exceeded ``on_grad_spike`` times
  the running median; the next step is captured.
* ``structure_change``: the graph differs from the last capture's (each backward of
  a step compared with the backward in the same place of earlier steps).

Each trigger respects ``cooldown`` (steps between two of its captures) and
the recorder's capture budget.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, Callable

import paddle

from .capture import structure_fingerprint
from .capture.stats import local_value, sum_of_squares
from .capture.sync import local_scalar
from .options import RecorderOptions

__all__ = ["Triggers", "global_grad_norm", "grads_nonfinite"]

# values that can be NaN/Inf
_INEXACT = (paddle.float32, paddle.float64, paddle.float16, paddle.bfloat16, paddle.complex64, paddle.complex128)


def global_grad_norm(params: Any) -> float | None:
    """L2 norm over every initialised ``p.grad`` of ``params`` (None without any).

    Read as captured gradients are (``capture/stats.py``: in place on the
    host, one transfer from a device); a complex gradient counts ``|z|**2``
    per element. Of a distributed (auto-parallel)
    gradient only this rank's shard is read: the whole would need
    communication.
    """
    grads = [local_value(p.grad) for p in params if p.grad is not None]
    grads = [g for g in grads if g is not None and g._is_initialized()]
    if not grads:
        return None
    total = sum_of_squares(grads)
    return math.sqrt(total) if not math.isnan(total) else math.nan


def _real(t: Any) -> Any:
    """A float tensor holding every value of ``t``: itself (float32, float64), its real and
    imaginary parts (complex: a NaN/Inf in either is seen), or a float32 copy."""
    if t.dtype in (paddle.float32, paddle.float64):
        return t
    return paddle.as_real(t) if t.is_complex() else t.astype("float32")


def _nonfinite(tensors: list[Any]) -> list[int]:
    """Indices of the tensors holding NaN/Inf (of a complex one, in its real or imaginary part).

    One sum per tensor, summed on the device, one host transfer; a sum that
    is not finite is confirmed per tensor, so finite values whose sum
    overflows are not taken for NaN/Inf.
    """
    ts = [_real(t) for t in tensors]
    if not ts:
        return []
    sums = [t.sum() for t in ts]
    if math.isfinite(float(paddle.add_n(sums)) if len(sums) > 1 else float(sums[0])):
        return []
    return [i for i, t in enumerate(ts) if not bool(paddle.isfinite(t).all())]


def grads_nonfinite(params: Any) -> bool | None:
    """Whether any initialised ``p.grad`` of ``params`` holds NaN/Inf (None without any);
    of a distributed gradient only this rank's shard is read."""
    grads = [local_value(p.grad) for p in params if p.grad is not None]
    grads = [g for g in grads if g is not None and g._is_initialized()]
    return bool(_nonfinite(grads)) if grads else None


def weights_nonfinite(named: Any) -> list[str]:
    """Names of the parameters whose values (not gradients) hold NaN/Inf; run on captured steps only."""
    items = [(n, p) for n, p in named if p.dtype in _INEXACT]
    return [items[i][0] for i in _nonfinite([local_value(p) for _, p in items])]


class Triggers:
    """The trigger state of one recorder.

    Args:
        options: the recorder's options.
        budget_left: whether the recorder may still capture.
        notice: prints a notice for the user.
    """

    def __init__(self, options: RecorderOptions, budget_left: Callable[[], bool],
                 notice: Callable[[str], None]) -> None:
        self.options = options
        self._budget_left = budget_left
        self._notice = notice
        self._pending: tuple[str, int] | None = None
        self._last_fired: dict[str, int] = {}
        # structure fingerprint of each backward of a step (by its place in the step: a
        # paddle.grad penalty, then backward()) at the last capture, or when first seen
        self._last_fp: dict[int, Any] = {}
        self._backward = 0  # backwards of this step so far
        self._whole_step: str | None = None  # a trigger seen at an earlier step captures all of this one
        self._norms: deque[float] = deque(maxlen=100)
        self.note: str | None = None  # why a pending trigger fired, for the capture's record
        self.captured_now = False
        self._loss_nonfinite = False
        self._fired_before: int | None = None
        self.loss: float | None = None  # the loss when this step's backward started (on_nonfinite)

    @property
    def pending(self) -> bool:
        """Whether a trigger fired earlier waits to capture the next backward."""
        return self._pending is not None

    def new_step(self) -> None:
        self.captured_now = False
        self._backward = 0
        self._whole_step = None
        self._loss_nonfinite = False
        self.loss = None

    def _can_fire(self, trigger: str, step: int) -> bool:
        last = self._last_fired.get(trigger)
        if last is not None and step - last < self.options.cooldown:
            return False
        return self._budget_left()

    def _fire(self, trigger: str, step: int) -> str | None:
        if not self._can_fire(trigger, step):
            return None
        self._last_fired[trigger] = step
        return trigger

    def decide(self, step: int, armed: str | None, roots: list[Any], walk: Callable[[], Any]) -> str | None:
        """When a backward starts: the label that captures it, or None."""
        self._backward += 1
        if self.captured_now:
            # a scheduled step records each of its backwards (micro-batches, paddle.grad), and
            # so does a step captured for what an earlier step showed (a gradient spike); a
            # trigger of this very step captures the backward it fired at
            return armed or self._whole_step
        opts = self.options
        trigger = None
        self.loss = local_scalar(roots[0]) if opts.on_nonfinite and len(roots) == 1 and roots[0].size == 1 else None
        loss_bad = self.loss is not None and not math.isfinite(self.loss)
        self._loss_nonfinite = loss_bad
        if armed:
            trigger = armed
        elif self._pending and step > self._pending[1]:  # the next step's: not a later micro-batch of this one
            kind, seen_at = self._pending
            self._pending = None
            trigger = self._whole_step = self._fire(kind, step)
            if trigger is not None:
                self.note = f"{kind} seen at step {seen_at}"
        if trigger is None and loss_bad:
            trigger = self._fire("nonfinite_loss", step)
        elif trigger is not None and loss_bad:
            # this capture already shows the NaN/Inf loss: the next NaN step
            # is not captured again until the cooldown has passed
            self._last_fired["nonfinite_loss"] = step
        if opts.on_structure_change:  # compared with the same backward of the step at the last capture
            fp = structure_fingerprint(walk())
            last = self._last_fp.get(self._backward)
            if last is None:
                self._last_fp[self._backward] = fp
            elif fp != last and trigger is None:
                trigger = self._fire("structure_change", step)
            if trigger is not None:
                self._last_fp[self._backward] = fp
        if trigger is not None:
            self.captured_now = True
        return trigger

    def defer(self, step: int) -> None:
        """The same-step capture of ``nonfinite_grad`` at ``step`` could not be made: capture the next step."""
        if self._fired_before is None:
            self._last_fired.pop("nonfinite_grad", None)
        else:
            self._last_fired["nonfinite_grad"] = self._fired_before
        if self._can_fire("nonfinite_grad", step + 1):
            self._pending = ("nonfinite_grad", step)

    def after_backward(self, step: int, params: Any, can_replay: bool = False, spike: bool = True) -> str | None:
        """After every backward: watch the gradients (non-finite, spikes).

        Args:
            step: the step.
            params: the model's parameters (their ``grad`` is read).
            can_replay: whether the caller can capture this step by replaying it.
            spike: watch for gradient spikes here (False: the loop reports the
                applied gradients' norm to :meth:`applied_norm` instead).

        Returns:
            ``"nonfinite_grad"`` when the caller is to capture this very step
            (by a replay), else None.
        """
        opts = self.options
        spike = spike and opts.on_grad_spike is not None
        if not opts.on_nonfinite and not spike:
            return None
        if not spike:
            # NaN/Inf only: a plain sum per gradient reads each once (5.7 vs 23-26 ms
            # for resnet50's 161 gradients with square().sum())
            bad = grads_nonfinite(params)
            norm = None if bad is None else (math.nan if bad else 0.0)
        else:
            norm = global_grad_norm(params)
        if norm is None:
            return None
        if not math.isfinite(norm):
            # a NaN/Inf loss is the nonfinite_loss trigger's (its gradients are
            # NaN too); notices only for a capture that will really happen
            if opts.on_nonfinite and not self.captured_now and not self._loss_nonfinite:
                self._fired_before = self._last_fired.get("nonfinite_grad")
                if can_replay and self._fire("nonfinite_grad", step):
                    self.captured_now = True
                    self._notice(f"non-finite gradients at step {step} with a finite loss; "
                                 f"capturing step {step} (replayed before the update)")
                    return "nonfinite_grad"
                if self._can_fire("nonfinite_grad", step + 1):
                    self._pending = ("nonfinite_grad", step)
                    self._notice(f"non-finite gradients at step {step} with a finite loss; "
                                 f"capturing step {step + 1}")
            return None
        if spike:
            self.applied_norm(step, norm)
        return None

    def applied_norm(self, step: int, norm: float | None) -> None:
        """The global norm of a step's gradients as its update applies them (spike watch)."""
        opts = self.options
        if opts.on_grad_spike is None or norm is None or not math.isfinite(norm):
            return
        if len(self._norms) >= 5:
            median = statistics.median(self._norms)
            if (median > 0 and norm > opts.on_grad_spike * median and not self.captured_now
                    and self._can_fire("grad_spike", step + 1)):
                self._pending = ("grad_spike", step)
                self._notice(f"gradient norm {norm:.4g} at step {step} is {norm / median:.1f}x the running "
                             f"median {median:.4g}; capturing step {step + 1}")
        self._norms.append(norm)
