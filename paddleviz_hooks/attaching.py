"""attach(): capture backward graphs from a training loop without editing it.

One line before a loop that is not yours (a toolkit's ``tools/train.py``)::

    handle = paddleviz_hooks.attach(model, optimizer, log_dir="vdl_log", every=100)

Steps are found from what the loop does to the model and the optimizer:

* the first *training* forward of ``model`` after an update (``model.training``
  and gradients enabled) opens a step;
* every ``backward()`` until the next update is a micro-batch of that step;
* the update closes it: ``optimizer.step()`` or ``optimizer.minimize()``, also
  when a ``GradScaler`` calls them (``scaler.minimize(opt, loss)``,
  ``scaler.step(opt)``: they unscale first, so the gradients read at the update
  are the applied ones). Pass ``scaler=`` too and an update the scaler skips
  (NaN/Inf gradients under AMP) still closes its step.

A forward with no backward before the next update (evaluation in training
mode) opens nothing new and captures nothing. Updates with no training forward
of ``model`` before them (the loop calls other layers: ``model.G`` and
``model.D`` of a GAN) capture nothing either, and are warned about once. ``handle.detach()``, or leaving
``with attach(...):``, puts every method and hook back, on exceptions too.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Sequence

import paddle

from .argcheck import reject_unknown
from .recorder import COUNTED, BackwardGraphRecorder, option_names
from .warn import WarnOnce

__all__ = ["attach", "AttachHandle"]

UPDATE_METHODS = ("step", "minimize")  # what an optimizer, or a GradScaler, updates by

# id(model) -> the handle attached to it, until its detach(). Weak: the model's own forward
# hook holds the handle, so an entry goes with its model and never keeps one alive.
_ATTACHED: "weakref.WeakValueDictionary[int, AttachHandle]" = weakref.WeakValueDictionary()


class AttachHandle:
    """What :func:`attach` installed: the recorder, and how to take it all off again.

    Attributes:
        recorder: the :class:`~paddleviz_hooks.recorder.BackwardGraphRecorder`
            driven by the loop (its ``captured_steps``, ``run_dir``...).
        updates: updates seen so far (the step numbers: the n-th update closes step n).
    """

    def __init__(self, model: paddle.nn.Layer, updaters: Sequence[tuple[Any, bool]], recorder: BackwardGraphRecorder) -> None:
        self.recorder = recorder
        self.model = model
        self.updates = 0
        self._in_step = False
        self._depth = 0  # nested update calls (scaler.minimize -> optimizer.minimize)
        self._read = False  # this step's applied gradients were read
        self._blind = 0  # updates in a row with no training forward of the model before them
        self._warn = WarnOnce()
        self._patched: list[tuple[Any, str, bool, Any]] = []  # (object, method, had own, own value)
        self._hook = None
        try:
            _ATTACHED[id(model)] = self
            self._hook = model.register_forward_pre_hook(self._on_forward)
            for obj, reads in updaters:
                for name in UPDATE_METHODS:
                    if callable(getattr(obj, name, None)):
                        self._patch(obj, name, reads)
        except BaseException:
            self.detach()
            raise

    # ------------------------------------------------------------- patches
    def _patch(self, obj: Any, name: str, reads: bool) -> None:
        own = obj.__dict__.get(name, _MISSING)
        inner = getattr(obj, name)
        self._patched.append((obj, name, own is not _MISSING, own))
        setattr(obj, name, self._wrap(inner, reads))

    def _wrap(self, inner: Callable[..., Any], reads: bool) -> Callable[..., Any]:
        """An update method: an optimizer's reads the gradients it applies (a scaler has
        unscaled them by then); the outermost update call closes the step."""
        def update(*args: Any, **kwargs: Any) -> Any:
            outer = self._depth == 0
            self._depth += 1
            try:
                if reads and self._in_step and not self._read:
                    self._read = True
                    self._safely(self.recorder.read_applied_gradients)
                return inner(*args, **kwargs)
            finally:
                self._depth -= 1
                if outer:
                    self._blind = 0 if self._in_step else self._blind + 1
                    if self._blind == 2:
                        self._warn_blind()
                    self._close_step()
        update.__wrapped__ = inner  # type: ignore[attr-defined]
        return update

    def _on_forward(self, layer: Any, inputs: Any) -> None:
        if self._in_step or self._depth or not layer.training or not paddle.is_grad_enabled():
            return None
        self._in_step, self._read = True, False
        self._safely(lambda: self.recorder.begin_step(self.updates + 1, micro_batches=COUNTED))
        return None

    def _close_step(self) -> None:
        if self._in_step:
            self.updates += 1
            self._in_step = False
            self._safely(self.recorder.end_step)

    def _warn_blind(self) -> None:
        self._warn("attach-blind", f"attach(): {self._blind} optimizer updates ran with no training forward of "
                                   f"the attached {type(self.model).__name__} before them, so nothing is captured: "
                                   "a step opens when the loop calls that layer in training mode with gradients "
                                   "enabled. Attach the layer the loop calls (for a GAN's model.G and model.D, "
                                   "drive BackwardGraphRecorder with rec.step() instead), or check that it is "
                                   "not left in eval() mode.")

    def _safely(self, fn: Callable[[], Any]) -> None:
        """The recorder's work never breaks the training it watches."""
        try:
            fn()
        except Exception as exc:
            self._warn(f"attach-{type(exc).__name__}", f"a backward graph step could not be recorded: {exc!r}")

    # ------------------------------------------------------------- removal
    def detach(self) -> None:
        """Put back every patched method and hook, end an open step and close the recorder.

        Calling it twice is harmless.
        """
        if _ATTACHED.get(id(self.model)) is self:
            del _ATTACHED[id(self.model)]
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()
        patched, self._patched = self._patched, []
        for obj, name, had_own, own in reversed(patched):
            if had_own:
                setattr(obj, name, own)
            else:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
        if self._in_step:
            self._in_step = False
            self._safely(self.recorder.end_step)
        elif self._blind == 1 and not self.updates:  # one update, and it was blind
            self._warn_blind()
        self.recorder.close()

    def __enter__(self) -> "AttachHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()


_MISSING = object()


def attach(model: paddle.nn.Layer, optimizer: Any, log_dir: str | os.PathLike = "vdl_log", *,
           scaler: Any = None, **options: Any) -> AttachHandle:
    """Capture backward graphs from a loop you do not edit (see the module docstring).

    Args:
        model: the ``paddle.nn.Layer`` the loop calls for its training forward.
        optimizer: the optimizer, or a list of them (PaddleClas keeps a list);
            the first update of a step closes it.
        log_dir: VisualDL log directory, as for the recorder.
        scaler: the loop's ``paddle.amp.GradScaler``, if any (optional: its
            ``minimize``/``step`` call the optimizer's; passing it also closes
            steps whose update it skips).
        **options: any :class:`~paddleviz_hooks.recorder.BackwardGraphRecorder`
            option (``every``, ``steps``, ``on_nonfinite``...).

    Returns:
        An :class:`AttachHandle`; ``handle.detach()`` or ``with attach(...):``
        removes everything.

    Raises:
        RuntimeError: ``model`` is already attached (a notebook cell run again):
            call the first handle's ``detach()`` before attaching again.
        TypeError: an unknown option (the message names ``attach()``).

    Examples:
        >>> import paddle, paddleviz_hooks, tempfile
        >>> net = paddle.nn.Linear(2, 1)
        >>> opt = paddle.optimizer.SGD(parameters=net.parameters())
        >>> with paddleviz_hooks.attach(net, opt, tempfile.mkdtemp(), verbose=0, formats=("json",),
        ...                             visualdl=False) as h:
        ...     net(paddle.ones([1, 2])).sum().backward(); opt.step(); opt.clear_grad()
        >>> h.recorder.captured_steps
        [1]
        >>> "step" in opt.__dict__
        False
    """
    if not isinstance(model, paddle.nn.Layer):
        raise TypeError(f"model must be a paddle.nn.Layer, got {type(model).__name__}")
    reject_unknown("attach", options, set(option_names()) - {"log_dir", "model"})
    if id(model) in _ATTACHED:
        raise RuntimeError(f"attach(): this {type(model).__name__} is already attached (attach() was called "
                           "twice on it, e.g. a notebook cell run again); call handle.detach() on the first "
                           "handle before attaching again, or reuse that handle")
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not optimizers or not all(any(callable(getattr(o, m, None)) for m in UPDATE_METHODS) for o in optimizers):
        raise TypeError("optimizer must be an optimizer (with step() or minimize()) or a list of them, "
                        f"got {optimizer!r}")
    recorder = BackwardGraphRecorder(log_dir, model, **options)
    recorder.expect_applied_gradients()
    recorder.open()
    updaters = [*([(scaler, False)] if scaler is not None else []), *((o, True) for o in optimizers)]
    return AttachHandle(model, updaters, recorder)
