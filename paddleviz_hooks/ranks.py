"""One step captured on several ranks, matched node by node (the data of the merged view).

Each rank's graph is compared with the base rank's (the lowest) by
:func:`~paddleviz_hooks.diff.diff_graphs`, so nodes match by their stable keys
(parameters by structured name) exactly as captures of two steps do. What
comes out is numbers and keys: per node, edge and parameter the gradient norm
on each rank, and the nodes and edges that are not on every rank.
:func:`paddleviz_hooks.text.rank_view_lines` words it and
:mod:`paddleviz_hooks.render.ranks` draws it. No paddle here: it works on
saved JSON files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .diff import GraphDiff, diff_graphs, edge_metas, node_norms
from .graph import BackwardGraph

__all__ = ["RankView", "compare_ranks"]


@dataclass
class RankView:
    """Several ranks' captures of one step, in the base rank's terms.

    Attributes:
        ranks: the ranks compared, the base rank (the lowest) first.
        step: ``meta["step"]`` of the base rank's graph.
        diffs: rank -> ``diff_graphs(base graph, that rank's graph)``, for
            every rank but the base.
        node_norms: base key -> rank -> norm of the gradient the node received
            (for a parameter: the applied gradient), where recorded.
        edge_norms: (src, dst) base keys -> rank -> norm of the gradient along
            that edge (under data parallel: the rank's own, local gradient).
        param_norms: parameter -> rank -> norm of the applied gradient.
        box_norms: base key of a layer box (collapsed graphs) -> rank -> norm
            of its parameters' gradients.
        local_param_norms: parameter -> rank -> norm of the rank's own
            gradient before synchronisation; empty when no rank recorded one.
        global_norms / local_global_norms: rank -> global gradient norm
            (applied / the rank's own; the latter only where recorded).
        missing: base key -> ranks on which the node is not (structure).
        only_on: rank -> keys (in that rank's graph) of nodes the base lacks.
        missing_edges: (src, dst) base keys -> ranks without that edge.
        only_edges: rank -> (src, dst) keys (that rank's) of edges the base lacks.
    """

    ranks: list[int]
    step: Any = None
    diffs: dict[int, GraphDiff] = field(default_factory=dict)
    node_norms: dict[str, dict[int, float]] = field(default_factory=dict)
    edge_norms: dict[tuple[str, str], dict[int, float]] = field(default_factory=dict)
    param_norms: dict[str, dict[int, float]] = field(default_factory=dict)
    box_norms: dict[str, dict[int, float]] = field(default_factory=dict)
    local_param_norms: dict[str, dict[int, float]] = field(default_factory=dict)
    global_norms: dict[int, float] = field(default_factory=dict)
    local_global_norms: dict[int, float] = field(default_factory=dict)
    missing: dict[str, list[int]] = field(default_factory=dict)
    only_on: dict[int, list[str]] = field(default_factory=dict)
    missing_edges: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    only_edges: dict[int, list[tuple[str, str]]] = field(default_factory=dict)

    @property
    def base(self) -> int:
        """The rank every other one is compared with."""
        return self.ranks[0]

    @property
    def structure_differs(self) -> bool:
        """Some rank has a node or edge another lacks, or reaches other parameters."""
        return any(d.structure_changed for d in self.diffs.values())

    def differing_ranks(self) -> list[int]:
        """The ranks whose graph differs in structure from the base rank's."""
        return [r for r, d in self.diffs.items() if d.structure_changed]


def _check(graphs: Any) -> dict[int, BackwardGraph]:
    if not isinstance(graphs, Mapping):
        raise TypeError(f"graphs must be a dict rank -> BackwardGraph, got {type(graphs).__name__}")
    if len(graphs) < 2:
        raise ValueError(f"graphs must hold at least 2 ranks to compare, got {len(graphs)}")
    for r, g in graphs.items():
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"ranks must be ints >= 0, got {r!r}")
        if not isinstance(g, BackwardGraph):
            raise TypeError(f"graphs[{r}] must be a BackwardGraph, got {type(g).__name__}")
    return dict(sorted(graphs.items()))


def compare_ranks(graphs: Mapping[int, BackwardGraph]) -> RankView:
    """Match the captures of one step on several ranks.

    Args:
        graphs: rank -> that rank's capture of the same step (2 or more).

    Returns:
        A :class:`RankView` in the terms of the lowest rank's graph.

    Raises:
        TypeError: ``graphs`` is not a dict of ``BackwardGraph``.
        ValueError: fewer than 2 ranks, or a rank that is not an int >= 0.

    Examples:
        >>> import paddle
        >>> from paddleviz_hooks import capture_backward
        >>> net = paddle.nn.Linear(3, 2)
        >>> with capture_backward(net) as cap:
        ...     net(paddle.ones([2, 3])).sum().backward()
        ...     net(2 * paddle.ones([2, 3])).sum().backward()
        >>> view = compare_ranks({0: cap.graphs[0], 1: cap.graphs[1]})
        >>> view.structure_differs
        False
        >>> {r: round(v, 3) for r, v in view.param_norms["weight"].items()}
        {0: 4.899, 1: 9.798}
    """
    graphs = _check(graphs)
    ranks = list(graphs)
    base = graphs[ranks[0]]
    view = RankView(ranks=ranks, step=base.meta.get("step"))
    diffs = {r: diff_graphs(base, graphs[r]) for r in ranks[1:]}
    view.diffs = diffs
    base_keys = {n.key for n in base.nodes}
    for r in ranks:
        g = graphs[r]
        to_base = {v: k for k, v in diffs[r].renamed.items()} if r in diffs else {}
        for key, norm in node_norms(g).items():
            key = to_base.get(key, key)
            if key in base_keys:
                view.node_norms.setdefault(key, {})[r] = norm
        for n in g.nodes:
            key = to_base.get(n.key, n.key)
            if n.kind == "layer" and n.norm is not None and key in base_keys:
                view.box_norms.setdefault(key, {})[r] = n.norm
        for pair, meta in edge_metas(g, to_base).items():
            if meta is not None and meta.norm is not None:
                view.edge_norms.setdefault(pair, {})[r] = meta.norm
        for name, meta in g.params().items():
            if meta is not None and meta.norm is not None:
                view.param_norms.setdefault(name, {})[r] = meta.norm
        if any(n.local_grad is not None for n in g.nodes):
            for name, meta in g.params(local=True).items():
                if meta is not None and meta.norm is not None:
                    view.local_param_norms.setdefault(name, {})[r] = meta.norm
            local = g.global_grad_norm(local=True)
            if local is not None:
                view.local_global_norms[r] = local
        total = g.global_grad_norm()
        if total is not None:
            view.global_norms[r] = total
        if r in diffs:
            d = diffs[r]
            for key in d.removed_nodes:
                view.missing.setdefault(key, []).append(r)
            for pair in d.removed_edges:
                view.missing_edges.setdefault(pair, []).append(r)
            if d.added_nodes:
                view.only_on[r] = list(d.added_nodes)
            if d.added_edges:
                view.only_edges[r] = list(d.added_edges)
    return view
