"""``make_graph``: a drop-in for the ``paddleviz`` prototype's function.

paddleviz labelled edges by scraping GLOG verbosity-6 logs from a hard-coded
file. Here the graph is walked directly and, when the parameters are known,
gradient shapes come from one observed ``paddle.grad`` call that leaves
``param.grad`` and the graph untouched (``retain_graph=True``).
"""

from __future__ import annotations

from typing import Any

import graphviz
import paddle

from .capture import BackwardCapture, has_graph, parameter_names, walk_graph
from .graph import BackwardGraph, GradMeta
from .render.dot import dot_parts
from .render.engine import find_engine

__all__ = ["make_graph", "graph_of"]


def _as_tensors(tensors: Any) -> list[Any]:
    items = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
    if not items:
        raise ValueError("make_graph needs at least one tensor, got an empty sequence")
    for t in items:
        if not isinstance(t, paddle.Tensor):
            raise TypeError(f"make_graph takes a paddle.Tensor or a tuple of them, got {type(t).__name__}")
    if not any(has_graph(t) for t in items):
        raise ValueError(
            "the tensor has no backward graph (stop_gradient=True or grad_fn is None): it was computed under "
            "paddle.no_grad(), detached, or from inputs that all have stop_gradient=True. "
            "Compute it from parameters or inputs with stop_gradient=False"
        )
    return items


def graph_of(tensors: Any, params: Any = None, *, grad_shapes: bool = True) -> BackwardGraph:
    """The :class:`BackwardGraph` of tensors that have not been backpropagated yet.

    Args:
        tensors: a ``paddle.Tensor`` or a tuple/list of them.
        params: a ``paddle.nn.Layer`` or dict name -> parameter, for names.
        grad_shapes: with ``params``, run one observed ``paddle.grad`` (graph
            retained, ``param.grad`` untouched) to put gradient shapes and
            norms on the edges.

    Raises:
        TypeError / ValueError: not tensors, or tensors without a graph.
    """
    roots = _as_tensors(tensors)
    names = parameter_names(params) if params is not None else {}
    if grad_shapes and names:
        reached = _reached_params(roots, names)
        if reached:
            cap = BackwardCapture(params=params if isinstance(params, (dict, paddle.nn.Layer)) else None)
            with cap:
                paddle.grad([t for t in roots if has_graph(t)], reached,
                            retain_graph=True, allow_unused=True)
            if cap.graphs:
                return cap.graphs[-1]
    w = walk_graph([t for t in roots if has_graph(t)], names)
    w.release()
    g = BackwardGraph(nodes=w.nodes, edges=w.edges, meta={"entry": "walk", "grad_stats": False})
    for e in g.edges:
        leaf = g.nodes[e.dst]
        if leaf.kind == "param" and e.grad is None:
            e.grad = GradMeta(shape=leaf.shape, dtype=leaf.dtype)
    g.assign_keys()
    return g


def _reached_params(roots: list[Any], names: dict[int, tuple[str, Any]]) -> list[Any]:
    w = walk_graph(roots, names)
    ptrs = [ptr for _, ptr in w.leaf_pointers()]
    w.release()
    return [names[p][1] for p in ptrs if not names[p][1].stop_gradient]


def make_graph(tensors: Any, params: Any = None, dpi: Any = None, **options: Any) -> graphviz.Digraph:
    """A ``graphviz.Digraph`` of the backward graph of ``tensors``.

    Args:
        tensors: a ``paddle.Tensor`` (e.g. the loss) or a tuple of tensors,
            before ``backward()`` is called.
        params: ``paddle.nn.Layer`` or dict name -> parameter: names the
            parameter leaves and adds gradient shapes to the edges.
        dpi: resolution of rendered bitmaps (as in paddleviz, e.g. ``"600"``).
        **options: drawing options: ``stats``, ``clusters``, ``legend``,
            ``rankdir``, ``title``.

    Returns:
        A ``graphviz.Digraph``; ``.render("viz-result.gv", format="png")``
        draws it with the system ``dot`` (or ``graphviz-pure``).

    Raises:
        TypeError / ValueError: not tensors, or tensors without a graph.

    Examples:
        >>> import paddle
        >>> net = paddle.nn.Linear(3, 2)
        >>> y = net(paddle.randn([4, 3])).mean()
        >>> dot = make_graph(y, params=net, dpi="600")
        >>> type(dot).__name__, "fc" in dot.source or "weight" in dot.source
        ('Digraph', True)

        then ``dot.render("viz-result.gv", format="png")`` draws it.
    """
    g = graph_of(tensors, params)
    options.setdefault("stats", False)
    graph_attr, body = dot_parts(g, **options)
    if dpi is not None:
        graph_attr["dpi"] = str(dpi)
    dot = graphviz.Digraph("backward", graph_attr=graph_attr)
    dot.body.extend("\t" + line + "\n" for line in body)
    _point_graphviz_at_engine()
    return dot


def _point_graphviz_at_engine() -> None:
    """Let ``Digraph.render`` use the engine ``find_engine`` picks (graphviz-pure
    when there is no system dot, or the one ``PADDLEVIZ_ENGINE`` names).

    Set every time, so an earlier call that chose graphviz-pure does not stick.
    """
    engine = find_engine()
    if engine is not None:
        graphviz.backend.dot_command.DOT_BINARY = engine.path
