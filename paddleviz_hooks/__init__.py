"""paddleviz-hooks: see PaddlePaddle's backward (autograd) graph while you train.

Public API:

* :func:`capture_backward` - context manager capturing every backward in a block.
* :class:`BackwardGraphCallback` - a ``paddle.callbacks.Callback`` for ``Model.fit``.
* :func:`make_graph` - drop-in for the ``paddleviz`` prototype.
* :class:`BackwardGraph`, :class:`GraphDiff` - the plain data model.
* :func:`render_png` / :func:`render_svg` - drawing.
"""

from .graph import BackwardGraph, Edge, GradMeta, Node
from .capture import BackwardCapture, capture_backward
from .compat import graph_of, make_graph
from .render import render_png, render_svg
from .render.engine import EngineNotFound, RenderTimeout
from .callbacks import BackwardGraphCallback

__version__ = "0.1.0"

__all__ = [
    "BackwardCapture",
    "BackwardGraph",
    "BackwardGraphCallback",
    "Edge",
    "EngineNotFound",
    "GradMeta",
    "Node",
    "RenderTimeout",
    "capture_backward",
    "graph_of",
    "make_graph",
    "render_png",
    "render_svg",
    "__version__",
]
