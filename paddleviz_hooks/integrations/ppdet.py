"""PaddleDetection's ``Trainer``: backward graphs from one of its callbacks.

::

    from paddleviz_hooks.integrations.ppdet import BackwardGraphDetCallback
    trainer = Trainer(cfg, mode="train")
    trainer.register_callbacks([BackwardGraphDetCallback(trainer, "vdl_log", every=100)])
    trainer.train()

PaddleDetection calls its callbacks' ``on_step_end`` after ``optimizer.step()``
and ``clear_grad()``, when the gradients are gone, so the steps are found as
:func:`paddleviz_hooks.attach` finds them (the model's training forwards and
the optimizer's updates), between ``on_train_begin`` and ``on_train_end``.
"""

from __future__ import annotations

import os
from typing import Any

from . import missing_framework

try:
    from ppdet.engine.callbacks import Callback
except ModuleNotFoundError as exc:
    missing_framework(exc, "ppdet", "PaddleDetection", __name__)
    raise

from ..attaching import AttachHandle, attach
from ..recorder import BackwardGraphRecorder, check_options

__all__ = ["BackwardGraphDetCallback"]


class BackwardGraphDetCallback(Callback):
    """Capture backward graphs while a PaddleDetection ``Trainer`` trains.

    Args:
        trainer: the ``ppdet.engine.Trainer`` (PaddleDetection hands each
            callback its trainer).
        log_dir: VisualDL log directory. Default ``"vdl_log"``.
        **options: any :class:`~paddleviz_hooks.recorder.BackwardGraphRecorder`
            option (``every``, ``steps``, ``on_nonfinite``...).

    Steps are optimizer updates counted from 1 over the whole training, as the
    trainer's own step count when it starts from scratch.
    """

    def __init__(self, trainer: Any, log_dir: str | os.PathLike = "vdl_log", **options: Any) -> None:
        super().__init__(trainer)
        check_options(type(self).__name__, log_dir, **options)  # wrong options fail here, not when training starts
        self._log_dir, self._options = log_dir, options
        #: what attach() installed while training runs (its ``recorder`` stays after)
        self.handle: AttachHandle | None = None

    def on_train_begin(self, status: dict) -> None:
        self.close()
        self.handle = attach(self.model.model, self.model.optimizer, self._log_dir, **self._options)

    def on_train_end(self, status: dict) -> None:
        self.close()

    @property
    def recorder(self) -> BackwardGraphRecorder | None:
        """The recorder of the last training run (None before one starts)."""
        return self.handle.recorder if self.handle is not None else None

    def close(self) -> None:
        """Put back everything attach() installed; harmless twice."""
        if self.handle is not None:
            self.handle.detach()
