"""PaddleFormers' ``Trainer``: backward graphs from a callback, or one word in ``report_to``.

In Python::

    from paddleviz_hooks.integrations.paddleformers import BackwardGraphTrainerCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[BackwardGraphTrainerCallback(every=100, on_nonfinite=True)])

From a YAML config (``report_to: [visualdl, paddleviz]``): call :func:`register`
in the process that builds the ``Trainer`` (see :func:`main` for
``paddleformers-cli``, which starts that process itself).

Steps are the Trainer's ``state.global_step`` (optimizer steps, the step
numbers of its own scalars) and the run lies in its ``logging_dir``, beside
those scalars. Each micro-batch of gradient accumulation is its own graph,
with that backward's own gradients; the gradients the optimizer applies
(after the Trainer divides the accumulated sum by the number of
micro-batches) are read in ``on_optimizer_begin``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from . import missing_framework

try:
    from paddleformers.trainer import TrainerCallback
    from paddleformers.trainer import integrations as _pf_integrations
except ModuleNotFoundError as exc:
    missing_framework(exc, "paddleformers", "PaddleFormers", __name__)
    raise

from ..recorder import BackwardGraphRecorder, check_options

__all__ = ["BackwardGraphTrainerCallback", "register", "ENV_OPTIONS", "REPORT_NAME", "main"]

#: the name :func:`register` adds to PaddleFormers' ``report_to`` table
REPORT_NAME = "paddleviz"
#: environment variable holding recorder options as JSON, read when ``report_to`` makes the callback
ENV_OPTIONS = "PADDLEVIZ_HOOKS_OPTIONS"

_registered_options: dict[str, Any] = {}


def _env_options() -> dict[str, Any]:
    text = os.environ.get(ENV_OPTIONS, "").strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{ENV_OPTIONS} must hold recorder options as a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{ENV_OPTIONS} must hold a JSON object such as '{{\"every\": 50}}', got {text!r}")
    return value


class BackwardGraphTrainerCallback(TrainerCallback):
    """Capture backward graphs during ``paddleformers.trainer.Trainer.train()``.

    Args:
        log_dir: VisualDL log directory. Default None: the Trainer's
            ``args.logging_dir``, so the run sits beside its scalars.
        **options: any :class:`~paddleviz_hooks.recorder.BackwardGraphRecorder`
            option (``every``, ``steps``, ``on_nonfinite``...). Made without
            arguments (as ``report_to`` makes it), the options are those given
            to :func:`register`, updated by the JSON object in the
            ``PADDLEVIZ_HOOKS_OPTIONS`` environment variable.

    Raises:
        TypeError, ValueError: a wrong option (checked here, before training).

    When the loss goes NaN/Inf the Trainer raises ``ValueError`` out of
    ``train()`` after the step's last backward and calls no further callback;
    a capture of that step is written (files, origin, pictures, records)
    before the exception leaves the backward, and the hooks come off when the
    Trainer is next used or at :meth:`close`.
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, **options: Any) -> None:
        if not options and log_dir is None:
            options = {**_registered_options, **_env_options()}
            log_dir = options.pop("log_dir", None)
        self._log_dir = log_dir
        self._options = options
        # checked now (a typo fails at construction, not after the first step)
        check_options(type(self).__name__, log_dir or "vdl_log", **options)
        #: the recorder (made by ``on_train_begin``, in the Trainer's logging_dir)
        self.recorder: BackwardGraphRecorder | None = None

    # ---------------------------------------------------------------- events
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.close()  # a previous train(), perhaps one that raised
        log_dir = self._log_dir or getattr(args, "logging_dir", None) or "vdl_log"
        self.recorder = BackwardGraphRecorder(log_dir, model, **self._options)
        self.recorder.expect_applied_gradients()
        self.recorder.open()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            k = getattr(args, "gradient_accumulation_steps", 1)
            self.recorder.begin_step(state.global_step + 1, micro_batches=k if isinstance(k, int) and k > 0 else None)

    def on_optimizer_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rec = self.recorder
        if rec is not None:
            rec.read_applied_gradients()  # after the Trainer's division by the micro-batch count
            rec.end_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    # --------------------------------------------------------------- results
    @property
    def captured_steps(self) -> list[int]:
        """Optimizer steps whose capture was handed to the writer."""
        return self.recorder.captured_steps if self.recorder is not None else []

    @property
    def run_dir(self) -> str | None:
        """The folder the graphs go to (set when training starts)."""
        return self.recorder.run_dir if self.recorder is not None else None

    def close(self) -> None:
        """Remove every hook and finish writing; called by ``on_train_end``. Harmless twice."""
        if self.recorder is not None:
            self.recorder.close()


def register(name: str = REPORT_NAME, **options: Any) -> None:
    """Make ``report_to: [..., "paddleviz"]`` add :class:`BackwardGraphTrainerCallback`.

    PaddleFormers builds the ``report_to`` callbacks from its table
    ``paddleformers.trainer.integrations.INTEGRATION_TO_CALLBACK`` with no
    arguments; ``options`` become their recorder options (the
    ``PADDLEVIZ_HOOKS_OPTIONS`` environment variable, a JSON object, adds to
    them when the Trainer is made). Call it before the ``Trainer`` is made,
    in the process that makes it.

    Raises:
        TypeError, ValueError: a wrong option.
    """
    check_options("register", options.get("log_dir") or "vdl_log",
                  **{k: v for k, v in options.items() if k != "log_dir"})
    _registered_options.clear()
    _registered_options.update(options)
    _pf_integrations.INTEGRATION_TO_CALLBACK[name] = BackwardGraphTrainerCallback


def main(argv: list[str] | None = None) -> None:
    """``python -m paddleviz_hooks.integrations.paddleformers train config.yaml``.

    What ``paddleformers-cli train config.yaml`` runs in its training process
    (``paddleformers.cli.train.tuner.run_tuner``), with :func:`register` done
    first, so the YAML's ``report_to`` may name ``paddleviz``. One process;
    for several devices give this file to ``paddle.distributed.launch`` as its
    training script (the CLI itself starts that launcher, whose processes
    never see a registration made in the CLI's own process).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "train":
        raise SystemExit("usage: python -m paddleviz_hooks.integrations.paddleformers train CONFIG.yaml [key=value ...]")
    register()
    from paddleformers.cli.train.tuner import run_tuner

    sys.argv = [sys.argv[0], *argv]
    run_tuner()


if __name__ == "__main__":
    main()
