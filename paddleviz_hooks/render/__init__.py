"""Drawing: DOT text, the layout engine, SVG and viewing PNGs, diff drawings.

* ``dot.py``: a graph -> DOT source (styling; words from ``paddleviz_hooks.text``,
  escaping from ``paddleviz_hooks.escape``).
* ``engine.py``: the external layout program behind one function; it sees DOT
  text, never graph objects.
* ``draw.py``: SVG at full detail; the levels of detail of a viewing PNG (the
  viewing PNG and its SVG come from one engine run).
* ``plan.py``: chooses the detail, direction and rows of every sized picture
  within a few engine runs, and reuses the choice for the same structure.
* ``sizes.py``: the size model ``plan.py`` predicts layouts with.
* ``diff.py``: a :class:`~paddleviz_hooks.diff.GraphDiff` drawn over the newer graph.
* ``ranks.py``: one step captured on several ranks, merged in one drawing.
* ``output.py``: the checks of an output path and format, shared by the writers.
"""

from .diff import diff_to_dot, render_diff, render_diff_png, render_diff_views
from .dot import to_dot
from .draw import (LEGIBLE_DPI, VIEW_MAX_PX, fit_png, layout_size, png_size, render_png, render_svg, render_to_file,
                   render_views)
from .ranks import ranks_to_dot, render_ranks
from .engine import EngineNotFound, RenderTimeout, find_engine, run_engine, run_engine_formats

__all__ = [
    "EngineNotFound",
    "LEGIBLE_DPI",
    "RenderTimeout",
    "VIEW_MAX_PX",
    "diff_to_dot",
    "find_engine",
    "fit_png",
    "layout_size",
    "png_size",
    "render_diff",
    "render_diff_png",
    "render_diff_views",
    "render_png",
    "render_ranks",
    "ranks_to_dot",
    "render_svg",
    "render_to_file",
    "render_views",
    "run_engine",
    "run_engine_formats",
    "to_dot",
]
