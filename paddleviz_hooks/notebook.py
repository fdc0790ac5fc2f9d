"""Inline display in Jupyter: a captured graph or a diff evaluated in a cell draws itself.

Importing ``paddleviz_hooks`` inside an IPython kernel calls :func:`register`,
which adds ``image/svg+xml`` formatters for :class:`~paddleviz_hooks.graph.BackwardGraph`
and :class:`~paddleviz_hooks.diff.GraphDiff` by name, so nothing is drawn or
imported until an object is shown. The picture is the viewing drawing of
:func:`paddleviz_hooks.render.render_png` as SVG, sized for a notebook cell
(at most ``NOTEBOOK_MAX_PX`` CSS pixels wide and, for a graph,
``NOTEBOOK_MAX_HEIGHT_PX`` high: a cell scrolls down, not sideways; the
PNG's legibility floor applying as it does to a PNG) and collapsed into
layer boxes when the full graph would not be legible there; its title then says how to
see every op: :func:`show` with ``full=True``. Every SVG shown passes the
allowlist :func:`paddleviz_hooks.escape.clean_svg` first. A drawing that fails
(no Graphviz, a timeout, unfit SVG) is one warning and the plain ``repr``
stays, so a cell never errors because of a picture.
"""

from __future__ import annotations

import re
from typing import Any

from .escape import clean_svg
from .warn import WarnOnce

__all__ = ["NOTEBOOK_MAX_PX", "NOTEBOOK_MAX_HEIGHT_PX", "Drawing", "register", "show", "svg_of"]

#: Long side of a notebook drawing in CSS pixels (about a cell's width).
NOTEBOOK_MAX_PX = 960
#: Height a graph's notebook drawing may take, in CSS pixels (the cell scrolls): a chain of
#: a few dozen ops stays drawn op by op at a cell's width instead of folding into one box.
NOTEBOOK_MAX_HEIGHT_PX = 2400
#: Seconds one notebook drawing may take before the engine is stopped.
NOTEBOOK_TIMEOUT = 60.0

_warn = WarnOnce()
_TYPES = (("paddleviz_hooks.graph", "BackwardGraph"), ("paddleviz_hooks.diff", "GraphDiff"))
_SVG_SIZE = re.compile(r'^<svg width="([\d.]+)pt" height="([\d.]+)pt"')


class Drawing:
    """An SVG drawing that Jupyter displays inline (what :func:`show` returns).

    Attributes:
        svg: the sanitised ``<svg>`` element.
    """

    def __init__(self, svg: str) -> None:
        self.svg = svg

    def _repr_svg_(self) -> str:
        return self.svg

    def __repr__(self) -> str:
        return f"Drawing({len(self.svg)} characters of SVG)"


def show(obj: Any, *, full: bool = False, **options: Any) -> Drawing:
    """A drawing of a graph or diff for a notebook cell.

    Args:
        obj: a :class:`~paddleviz_hooks.graph.BackwardGraph`, or a
            :class:`~paddleviz_hooks.diff.GraphDiff` made by
            :func:`~paddleviz_hooks.diff.diff_graphs` whose two graphs are
            still alive.
        full: every op at its natural size (:func:`~paddleviz_hooks.render.render_svg`)
            instead of the drawing sized and collapsed for the cell.
        **options: drawing and collapse options of :func:`~paddleviz_hooks.render.render_png`
            (``max_px``, ``depth``, ``max_nodes``, ``stats``, ``title`` ...).

    Returns:
        A :class:`Drawing`; evaluated last in a cell, it is displayed.

    Raises:
        TypeError: ``obj`` is neither a graph nor a diff.
        ValueError: a diff whose graphs are gone (loaded from JSON): draw it
            with ``render_diff(diff, newer, older)``.
        EngineNotFound / RenderTimeout: as for :func:`~paddleviz_hooks.render.render_png`.

    Examples:
        >>> import paddle
        >>> from paddleviz_hooks import capture_backward
        >>> net = paddle.nn.Linear(3, 2)
        >>> with capture_backward(net) as cap:
        ...     net(paddle.randn([2, 3])).sum().backward()
        >>> show(cap.graph)._repr_svg_().startswith("<svg")
        True
    """
    from .diff import GraphDiff
    from .graph import BackwardGraph
    from .render import render_diff, render_svg, render_views
    from .render.diff import render_diff_views
    from .text import notebook_full_detail

    if not isinstance(full, bool):
        raise TypeError(f"full must be True or False, got {full!r}")
    if isinstance(obj, BackwardGraph):
        if full:
            data = render_svg(obj, **{"timeout": NOTEBOOK_TIMEOUT, **options})
        else:
            data = render_views(obj, ("svg",), **{"max_px": NOTEBOOK_MAX_PX, "max_height_px": NOTEBOOK_MAX_HEIGHT_PX,
                                                   "timeout": NOTEBOOK_TIMEOUT,
                                                   "full_detail": notebook_full_detail("graph"), **options})["svg"]
    elif isinstance(obj, GraphDiff):
        graphs = obj.compared_graphs()
        if graphs is None:
            raise ValueError("this diff no longer has its two graphs (it was loaded from JSON, or they were "
                             "deleted); draw it with render_diff(diff, newer, older, 'diff.svg')")
        older, newer = graphs
        if full:
            data = render_diff(obj, newer, older, format="svg", **{"timeout": NOTEBOOK_TIMEOUT, **options})
        else:
            data = render_diff_views(obj, newer, older, ("svg",), **{
                "max_px": NOTEBOOK_MAX_PX, "timeout": NOTEBOOK_TIMEOUT,
                "full_detail": notebook_full_detail("diff"), **options})["svg"]
    else:
        raise TypeError(f"show takes a BackwardGraph or a GraphDiff, got {type(obj).__name__}")
    svg = clean_svg(data.decode("utf-8", "replace"))
    if svg is None:
        raise ValueError("the layout engine's SVG has elements or links that are not safe to display inline")
    if not full:
        # the size policy counts pixels, as for a PNG: one unit of the drawing is one CSS pixel
        svg = _SVG_SIZE.sub(r'<svg width="\1px" height="\2px"', svg, count=1)
    return Drawing(svg)


def svg_of(obj: Any) -> str | None:
    """The ``image/svg+xml`` formatter: :func:`show`'s SVG, or None (and one warning) if it fails.

    A diff whose graphs are gone has no picture; its ``repr`` is shown.
    """
    try:
        if getattr(obj, "compared_graphs", None) is not None and obj.compared_graphs() is None:
            return None
        return show(obj).svg
    except Exception as exc:  # a picture must never make the cell fail
        _warn(f"notebook-{type(exc).__name__}", f"the notebook drawing failed, so only the text is shown: {exc}")
        return None


def register(shell: Any) -> bool:
    """Display graphs and diffs evaluated in ``shell``'s cells as SVG drawings.

    Args:
        shell: an IPython ``InteractiveShell`` (``get_ipython()``).

    Returns:
        True when the formatters were added; False when the shell has no
        ``image/svg+xml`` formatter.
    """
    formatters = getattr(getattr(shell, "display_formatter", None), "formatters", None) or {}
    svg = formatters.get("image/svg+xml")
    if svg is None:
        return False
    for module, name in _TYPES:
        svg.for_type_by_name(module, name, svg_of)
    return True
