"""paddleviz-hooks: see PaddlePaddle's backward (autograd) graph while you train.

Public API:

* :func:`capture_backward` - context manager capturing every backward in a block.
* :class:`BackwardGraphCallback` - a ``paddle.callbacks.Callback`` for ``Model.fit``.
* :func:`make_graph` / :func:`graph_of` - the graph of a tensor before backward
  (``make_graph`` is a drop-in for the ``paddleviz`` prototype).
* :class:`BackwardGraph`, :class:`GraphDiff` - the plain data model and comparisons.
* :func:`render_png`, :func:`render_svg`, :func:`render_diff` - drawing;
  :func:`collapse_graph` - layers folded into boxes.
* :func:`build_report` - the offline HTML report of a log directory.

The names that need paddle are imported on first use, so loading saved
graphs, drawing and the ``paddleviz-hooks`` command work without importing it.
"""

from importlib import import_module
from typing import Any

from .diff import GraphDiff, diff_graphs
from .graph import BackwardGraph, Edge, GradMeta, Node
from .render import render_png, render_svg
from .render.collapse import collapse_graph
from .render.diff import render_diff
from .render.engine import EngineNotFound, RenderTimeout
from .report import build_report

__version__ = "0.1.0"

_NEEDS_PADDLE = {
    "BackwardCapture": ".capture",
    "capture_backward": ".capture",
    "graph_of": ".compat",
    "make_graph": ".compat",
    "BackwardGraphCallback": ".callbacks",
}

__all__ = [
    "BackwardCapture",
    "BackwardGraph",
    "BackwardGraphCallback",
    "Edge",
    "EngineNotFound",
    "GradMeta",
    "GraphDiff",
    "Node",
    "RenderTimeout",
    "build_report",
    "capture_backward",
    "collapse_graph",
    "diff_graphs",
    "graph_of",
    "make_graph",
    "render_diff",
    "render_png",
    "render_svg",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _NEEDS_PADDLE.get(name)
    if module is None:
        raise AttributeError(f"module 'paddleviz_hooks' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
