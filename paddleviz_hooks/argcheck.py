"""Checks of arguments shared by every public entry point (no other module of the package is imported).

The package's one rule: a value of the wrong *type* raises ``TypeError``, a
value of the right type that is out of range raises ``ValueError``; both
name the argument and quote the value received.
"""

from __future__ import annotations

import difflib
import os
from typing import Any, Iterable

__all__ = ["check_path", "reject_unknown"]


def check_path(name: str, value: Any, allow_none: bool = False) -> str | None:
    """A file or folder path option: ``str`` or ``os.PathLike`` (TypeError), not empty, no NUL byte (ValueError).

    Examples:
        >>> check_path("log_dir", "")
        Traceback (most recent call last):
        ...
        ValueError: log_dir must be a non-empty path without NUL bytes, got ''
    """
    if value is None and allow_none:
        return None
    text = f"{name} must be a non-empty path (str or os.PathLike){' or None' if allow_none else ''}"
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{text}, got {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str):  # a PathLike of bytes
        raise TypeError(f"{text}, got {value!r}")
    if not path or "\0" in path:
        raise ValueError(f"{name} must be a non-empty path without NUL bytes, got {value!r}")
    return path


#: Options of the drawing functions that a recorder or callback does not take
DRAWING_OPTIONS = frozenset({"fold_repeats", "depth", "max_nodes", "by_type", "auto_collapse", "rankdir"})


def reject_unknown(called: str, given: Iterable[str], known: Iterable[str]) -> None:
    """``TypeError`` naming ``called`` (the class or function the user called) and the closest valid name.

    Examples:
        >>> reject_unknown("BackwardGraphCallback", ["evry"], ["every", "steps"])
        Traceback (most recent call last):
        ...
        TypeError: BackwardGraphCallback() got an unexpected keyword argument 'evry'; did you mean 'every'?
        >>> reject_unknown("BackwardGraphRecorder", ["fold_repeats"], ["formats", "every"])
        Traceback (most recent call last):
        ...
        TypeError: BackwardGraphRecorder() got an unexpected keyword argument 'fold_repeats'; 'fold_repeats' is an option of the drawing functions (render_png, render_svg, paddleviz-hooks render); pictures taken while training are collapsed and folded as far as legibility needs
    """
    known = sorted(known)
    for name in sorted(given):
        if name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        if name in DRAWING_OPTIONS:  # a drawing function's option: no near name is what was meant
            hint = (f"{name!r} is an option of the drawing functions (render_png, render_svg, "
                    "paddleviz-hooks render); pictures taken while training are collapsed and folded "
                    "as far as legibility needs")
        else:
            hint = f"did you mean {close[0]!r}?" if close else f"the options are: {', '.join(known)}"
        raise TypeError(f"{called}() got an unexpected keyword argument {name!r}; {hint}")
