"""Drawing a BackwardGraph: DOT text, SVG at full detail, PNG sized for viewing.

The PNG policy (measured in ``shared/notes/graphviz.md``): layout is cheap
and rasterizing a huge bitmap is what costs, and VisualDL's viewer fits an
image to the window and zooms at most 3x. So a viewing PNG is laid out both
top-down and left-right, the direction that allows the larger scale wins, and
the resolution is chosen so the long side stays within ``max_px``; the bitmap
is never larger than the drawing at 96 dpi.
"""

from __future__ import annotations

import os
import struct
import tempfile
from typing import Any

from ..graph import BackwardGraph
from .dot import to_dot
from .engine import EngineNotFound, RenderTimeout, find_engine, run_engine

__all__ = [
    "to_dot",
    "render_png",
    "render_svg",
    "render_to_file",
    "layout_size",
    "png_size",
    "EngineNotFound",
    "RenderTimeout",
    "find_engine",
]

VIEW_MAX_PX = 2000
FULL_DPI = 96.0
_COLLAPSE_KEYS = ("depth", "by_type", "fold_repeats", "max_nodes")
_FORMATS = ("png", "svg", "dot", "json")


def prepare(graph: BackwardGraph, options: dict[str, Any]) -> BackwardGraph:
    """Apply the collapse options (popped from ``options``) to ``graph``."""
    collapse = {k: options.pop(k) for k in _COLLAPSE_KEYS if k in options}
    if not any(v not in (None, False, (), []) for v in collapse.values()):
        return graph
    from .collapse import collapse_graph

    return collapse_graph(graph, **collapse)


def layout_size(source: str, *, timeout: float | None = 60.0) -> tuple[float, float]:
    """Width and height in inches of the laid-out DOT ``source``."""
    plain = run_engine(source, "plain", timeout=timeout).decode("utf-8", "replace")
    first = plain.split("\n", 1)[0].split()
    return float(first[2]), float(first[3])


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of PNG bytes, read from the IHDR chunk."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not PNG data")
    return struct.unpack(">II", data[16:24])


def render_svg(graph: BackwardGraph, *, timeout: float | None = 120.0, **options: Any) -> bytes:
    """Full-detail SVG bytes (tooltips carry the full grad node names)."""
    g = prepare(graph, options)
    return run_engine(to_dot(g, **options), "svg", timeout=timeout)


def render_png(
    graph: BackwardGraph,
    *,
    max_px: int = VIEW_MAX_PX,
    timeout: float | None = 120.0,
    **options: Any,
) -> bytes:
    """PNG bytes sized for viewing.

    Args:
        graph: the graph.
        max_px: the longest side of the bitmap, in pixels.
        timeout: seconds per engine run before it is killed.
        **options: collapse options (``depth``, ``by_type``, ``fold_repeats``,
            ``max_nodes``) and drawing options (``stats``, ``clusters``,
            ``legend``, ``title``; ``rankdir`` fixes the direction, otherwise
            the one giving the larger scale is chosen; ``dpi`` fixes the
            resolution and disables the size policy).

    Returns:
        The PNG file content.

    Raises:
        EngineNotFound: no layout engine is installed.
        RenderTimeout: the engine ran past ``timeout``.

    Example:
        >>> data = render_png(cap.graph, max_nodes=80)
        >>> open("graph.png", "wb").write(data)
    """
    if not isinstance(max_px, int) or max_px < 64:
        raise ValueError(f"max_px must be an int >= 64, got {max_px!r}")
    g = prepare(graph, options)
    if options.get("dpi") is not None:
        return run_engine(to_dot(g, **options), "png", timeout=timeout)
    fixed = options.pop("rankdir", None)
    directions = [fixed] if fixed else ["TB", "LR"]
    best = None
    for rd in directions:
        source = to_dot(g, rankdir=rd, **options)
        w, h = layout_size(source, timeout=timeout)
        dpi = min(FULL_DPI, max_px / max(w, h, 1e-3))
        if best is None or dpi > best[0] * 1.15:  # prefer top-down unless clearly better
            best = (dpi, source)
    dpi, source = best
    return run_engine(source, "png", args=(f"-Gdpi={dpi:.3f}",), timeout=timeout)


def _atomic_write(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def render_to_file(graph: BackwardGraph, path: str | os.PathLike, format: str | None = None, **options: Any) -> str:
    """Write ``graph`` to ``path`` as png, svg, dot or json (see ``BackwardGraph.render``)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    fmt = (format or os.path.splitext(path)[1].lstrip(".")).lower()
    if fmt not in _FORMATS:
        raise ValueError(f"format must be one of {', '.join(_FORMATS)}; got {fmt!r} (from {path!r})")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"directory {directory!r} does not exist; create it first")
    if fmt == "json":
        data = graph.to_json(indent=1).encode("utf-8")
    elif fmt == "dot":
        data = to_dot(prepare(graph, options), **options).encode("utf-8")
    elif fmt == "svg":
        data = render_svg(graph, **options)
    else:
        data = render_png(graph, **options)
    _atomic_write(path, data)
    return path
