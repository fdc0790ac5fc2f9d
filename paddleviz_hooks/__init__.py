"""paddleviz-hooks: see PaddlePaddle's backward (autograd) graph while you train.

Public API (every name is imported on first use, so ``import paddleviz_hooks``
is cheap and loading saved graphs, drawing and the ``paddleviz-hooks``
command work without importing paddle):

* :class:`BackwardGraphRecorder` - step selection, triggers, files and
  VisualDL records for any training loop.
* :class:`BackwardGraphCallback` - the recorder driven by ``Model.fit``.
* :func:`attach` - the recorder driven by a loop you do not edit (its model's
  forwards and its optimizer's updates); PaddleFormers' ``Trainer`` and
  PaddleDetection have adapters in ``paddleviz_hooks.integrations``.
* :func:`capture_backward` - context manager capturing every backward in a block.
* :func:`find_nonfinite_origin` - the forward op, layer and source line where
  a NaN/Inf is first produced (one checked forward of a batch).
* :func:`make_graph` / :func:`graph_of` - the graph of a tensor before backward
  (``make_graph`` is a drop-in for the ``paddleviz`` prototype).
* :class:`BackwardGraph`, :class:`GraphDiff` - the plain data model and
  comparisons (:func:`diff_graphs`); :func:`collapse_graph` - layers folded
  into boxes; :func:`summarize` - the text a person reads.
* :func:`render_to_file`, :func:`render_png`, :func:`render_svg`, :func:`render_diff`, :func:`render_ranks` -
  drawing; :func:`build_report` - the offline HTML report of a log directory.
* :func:`show` - a graph or diff drawn for a notebook cell; in Jupyter, a graph or
  diff evaluated in a cell is drawn inline (``paddleviz_hooks.notebook``).
* :func:`explore` / :func:`export_explorer` - every capture in Google's Model
  Explorer, with gradient, NaN/Inf and change overlays (``[explorer]`` extra).

How the modules fit together (data flows one way)::

    capture/ -> graph.py -> collapse.py, diff.py -> ranks.py -> text.py, render/ -> sinks/
                                                   -> pipeline.py -> recorder.py -> callbacks/, attaching.py -> integrations/
"""

import sys
from importlib import import_module
from typing import Any

from ._version import __version__

_WHERE = {
    "attach": ".attaching",
    "BackwardCapture": ".capture",
    "capture_backward": ".capture",
    "find_nonfinite_origin": ".capture.nan_origin",
    "graph_of": ".compat",
    "make_graph": ".compat",
    "BackwardGraphCallback": ".callbacks",
    "BackwardGraphRecorder": ".recorder",
    "BackwardGraph": ".graph",
    "Edge": ".graph",
    "GradMeta": ".graph",
    "Node": ".graph",
    "GraphDiff": ".diff",
    "diff_graphs": ".diff",
    "RankView": ".ranks",
    "compare_ranks": ".ranks",
    "collapse_graph": ".collapse",
    "summarize": ".text",
    "render_to_file": ".render",
    "render_png": ".render",
    "render_svg": ".render",
    "render_diff": ".render",
    "render_ranks": ".render",
    "EngineNotFound": ".render",
    "RenderTimeout": ".render",
    "build_report": ".sinks.report",
    "Sink": ".sinks.base",
    "CaptureData": ".sinks.base",
    "CapturePictures": ".sinks.base",
    "SinkContext": ".sinks.base",
    "show": ".notebook",
    "explore": ".explore",
    "export_explorer": ".sinks.explorer",
}

__all__ = sorted(_WHERE) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'paddleviz_hooks' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


def _register_notebook_display() -> None:
    """Inside an IPython kernel, graphs and diffs evaluated in a cell are drawn inline."""
    ipython = sys.modules.get("IPython")  # already loaded in a kernel; never imported here
    try:
        shell = ipython.get_ipython() if ipython is not None else None
        if shell is not None:
            from .notebook import register

            register(shell)
    except Exception as exc:  # display is a convenience: importing the package must not fail
        import warnings

        warnings.warn(f"paddleviz_hooks: graphs will not be drawn inline in this notebook: {exc!r}",
                      RuntimeWarning, stacklevel=2)


_register_notebook_display()
