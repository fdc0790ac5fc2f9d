"""The NaN/Inf story of a capture, computed once and kept in ``graph.nonfinite``.

Two facts with two names, never mixed up:

* the **origin**: where the NaN/Inf was first made, found by replaying the
  step's forward (``paddleviz_hooks.capture.nan_origin.locate``); the op may
  have no grad node in the graph (it worked on data that needs no gradient,
  or inside a compiled program); then the **entry** is the node where its
  output enters the graph;
* the **first non-finite gradient**: the first node that received finite
  gradients and passed a non-finite one on
  (:meth:`~paddleviz_hooks.graph.BackwardGraph.nonfinite_sites`).

:func:`record_of` gives a graph's record (computing it the first time, for
graphs captured by hand or saved by older versions); :func:`marks` finds the
nodes a view marks, in the full graph or in a collapsed one (the deepest
layer box holding the node). Views word the record with
``paddleviz_hooks.text`` and compute nothing of their own.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple

from .graph import BackwardGraph, Node, NonfiniteOrigin, NonfiniteRecord, NonfiniteSite

__all__ = ["Marks", "entry_node", "marks", "nonfinite_record", "record_of"]


def entry_node(graph: BackwardGraph, origin: NonfiniteOrigin) -> Node | None:
    """Where the output of an origin op without a grad node enters ``graph``: the node the replay
    of the step saw first take that output (``graph.meta["nonfinite_entry"]``, see
    ``paddleviz_hooks.capture.nan_origin``); None when it was not found (a drawing leaves the
    origin's node unlinked rather than guess)."""
    key = graph.meta.get("nonfinite_entry")
    return graph.node_by_key().get(key) if isinstance(key, str) else None


def nonfinite_record(graph: BackwardGraph, origin: NonfiniteOrigin | None = None,
                     weights: Iterable[str] = (), buffers: Iterable[str] = ()) -> NonfiniteRecord:
    """Compute the record of a full (not collapsed) graph.

    Args:
        graph: the captured graph.
        origin: what the replay of the step found, if it ran.
        weights: trainable parameters whose values hold NaN/Inf.
        buffers: non-trainable tensors (running statistics) whose values hold NaN/Inf.
    """
    sites = graph.nonfinite_sites()
    entry = None
    if origin is not None and origin.kind == "forward":
        by_key = graph.node_by_key()
        node = by_key.get(origin.key) if origin.key else None
        if node is not None:
            origin.call = node.call
        else:
            origin.key = None
            found = entry_node(graph, origin)
            entry = NonfiniteSite.of(found) if found is not None else None
    return NonfiniteRecord(origin=origin, first_gradient=NonfiniteSite.of(sites[0]) if sites else None,
                           gradient_sites=len(sites), entry=entry, weights=tuple(weights),
                           buffers=tuple(buffers))


def record_of(graph: BackwardGraph) -> NonfiniteRecord:
    """The graph's record; computed (from its gradients, and the origin a graph saved by an
    older version kept in ``meta["nonfinite_origin"]``) and kept the first time it is asked for."""
    if graph.nonfinite is None:
        legacy = graph.meta.get("nonfinite_origin")
        origin = NonfiniteOrigin.from_dict(legacy) if isinstance(legacy, dict) and legacy.get("kind") else None
        weights = graph.meta.get("nonfinite_weights")
        graph.nonfinite = nonfinite_record(graph, origin, weights if isinstance(weights, list) else ())
    return graph.nonfinite


class Marks(NamedTuple):
    """Node ids a view marks (None: not in this graph)."""

    origin: int | None  #: the origin op's node (or the box holding it)
    entry: int | None  #: where an origin without a node enters the graph (or the box holding it)
    first_gradient: int | None  #: the first non-finite gradient's node (or the box holding it)


def _find(graph: BackwardGraph, site: Any) -> int | None:
    """The node of ``site`` (by key), else the deepest layer box holding its layer call."""
    key = getattr(site, "key", None)
    if key:
        for n in graph.nodes:
            if n.key == key:
                return n.id
    layer = getattr(site, "layer", None)
    if layer is None:
        return None
    best = None
    for n in graph.nodes:
        if n.kind == "layer" and n.layer is not None and (
                n.layer == layer or n.layer == "" or layer.startswith(n.layer + ".")):
            if best is None or len(n.layer) > len(best.layer):
                best = n
    return best.id if best is not None else None


def marks(graph: BackwardGraph) -> Marks:
    """The nodes of ``graph`` (full or collapsed) that carry the record's facts."""
    rec = record_of(graph)
    o = rec.origin
    origin = _find(graph, o) if o is not None and o.kind == "forward" and o.key else None
    entry = _find(graph, rec.entry) if rec.entry is not None else None
    first = _find(graph, rec.first_gradient) if rec.first_gradient is not None else None
    return Marks(origin, entry, first)
