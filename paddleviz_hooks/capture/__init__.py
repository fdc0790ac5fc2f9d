"""Capturing Paddle's backward graph: the only package that touches autograd.

Modules, each with one job:

* ``dispatch.py``: the backward patch shared by every active capture.
* ``gradnode.py``: ``Tensor.grad_fn`` without Paddle's reference leak, and the
  walk from the roots along ``next_functions`` into plain nodes and edges.
* ``nested.py``: a backward run inside another (recompute): its PyLayer node, the stitch.
* ``stats.py``: gradient statistics.
* ``attribution.py``: forward hooks naming the layer call of each op.
* ``saved.py``: the tensors each forward saves for backward (``saved_memory``).
* ``source.py``: the line of the user's code that called each op's forward (``Node.source``).
* ``session.py``: :class:`BackwardCapture` and :func:`capture_backward`.
"""

from .dispatch import dispatcher_installed
from .gradnode import grad_fn, has_graph, parameter_names, structure_fingerprint, walk_graph
from .session import BackwardCapture, capture_backward

__all__ = [
    "BackwardCapture",
    "capture_backward",
    "dispatcher_installed",
    "grad_fn",
    "has_graph",
    "parameter_names",
    "structure_fingerprint",
    "walk_graph",
]
