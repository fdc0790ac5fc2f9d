"""Where a drawing goes: the output path and format checks shared by every ``render_*`` writer."""

from __future__ import annotations

import os
from typing import Any

from ..argcheck import check_path

__all__ = ["DRAW_MAX_NODES", "output_target"]

#: Graphs with more nodes are drawn collapsed to this many by the command line and
#: the report: the layout engine needs minutes, or crashes, on tens of thousands.
DRAW_MAX_NODES = 2000


def output_target(path: Any, format: str | None, formats: tuple[str, ...], *, optional: bool = False,
                  default: str = "svg") -> tuple[str | None, str]:
    """Check a drawing's destination before anything is drawn.

    Args:
        path: the output file (``str`` or ``os.PathLike``); None returns the
            bytes instead, when ``optional``.
        format: the format asked for; None takes the path's suffix (or
            ``default`` without a path).
        formats: the formats this writer can produce.
        optional: whether ``path`` may be None.
        default: the format without a path or a format.

    Returns:
        ``(path as str or None, format)``.

    Raises:
        TypeError: ``path`` of the wrong type.
        ValueError: an empty path or one with a NUL byte; a format the writer cannot produce.
        FileNotFoundError: the output directory does not exist.

    Examples:
        >>> output_target("out.svg", None, ("svg", "png"))
        ('out.svg', 'svg')
        >>> output_target(None, None, ("svg", "png"), optional=True)
        (None, 'svg')
        >>> output_target("out.gif", None, ("svg", "png"))
        Traceback (most recent call last):
        ...
        ValueError: format must be one of svg, png; got 'gif' (from 'out.gif')
    """
    if not isinstance(path, (str, os.PathLike)) and not (optional and path is None):
        allowed = "str, os.PathLike or None" if optional else "str or os.PathLike"
        raise TypeError(f"path must be a {allowed}, got {type(path).__name__}")
    path = check_path("path", path, allow_none=optional)  # not empty, no NUL byte
    fmt = (format or (os.path.splitext(path)[1].lstrip(".") if path else default)).lower()
    if fmt not in formats:
        raise ValueError(f"format must be one of {', '.join(formats)}; got {fmt!r}" + (f" (from {path!r})" if path else ""))
    if path is not None:
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"directory {directory!r} does not exist; create it first")
    return path, fmt
