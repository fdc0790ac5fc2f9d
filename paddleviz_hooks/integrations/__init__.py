"""Adapters for training loops that are not yours: PaddleFormers' ``Trainer``
(:mod:`.paddleformers`) and PaddleDetection's (:mod:`.ppdet`). Each imports its
framework: import the one you use where it is installed. Any other loop takes
:func:`paddleviz_hooks.attach`.
"""

from __future__ import annotations

__all__ = ["missing_framework"]


def missing_framework(exc: ModuleNotFoundError, package: str, framework: str, module: str) -> None:
    """Turn ``exc`` into the error a person can act on, when it says ``package`` is not installed
    (returns for any other missing module: the caller re-raises it as it is). Run as a script
    (``python -m``) the error is one line, not a traceback.

    Examples:
        >>> try:
        ...     missing_framework(ModuleNotFoundError("No module named 'ppdet'", name="ppdet"),
        ...                       "ppdet", "PaddleDetection", "paddleviz_hooks.integrations.ppdet")
        ... except ModuleNotFoundError as e:
        ...     print(e)
        paddleviz_hooks.integrations.ppdet needs PaddleDetection, which is not installed: pip install 'paddleviz-hooks[ppdet]'
    """
    if (exc.name or "").partition(".")[0] != package:
        return
    name = "paddleviz_hooks.integrations." + package if module == "__main__" else module
    message = f"{name} needs {framework}, which is not installed: pip install 'paddleviz-hooks[{package}]'"
    if module == "__main__":
        raise SystemExit(f"paddleviz-hooks: error: {message}")
    raise ModuleNotFoundError(message, name=exc.name) from None
