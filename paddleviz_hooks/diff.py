"""Comparing two captured backward graphs.

Nodes are matched by their stable ``key`` (see
:meth:`~paddleviz_hooks.graph.BackwardGraph.assign_keys`), edges by the pair
of their end keys. No paddle here: diffs work on saved JSON files too.

A diff holds numbers and keys; :func:`paddleviz_hooks.text.diff_summary`
words it and :mod:`paddleviz_hooks.render.diff` draws it.
"""

from __future__ import annotations

import json
import math
import weakref
from dataclasses import dataclass, field
from typing import Any

from .graph import BackwardGraph, Node, float_from_json, float_to_json, merge_grad_metas, parse_json

__all__ = ["GraphDiff", "diff_graphs", "node_norms", "norm_ratio", "DEFAULT_THRESHOLD"]

DIFF_FORMAT = "paddleviz-hooks/graph-diff"
DIFF_VERSION = 1
DEFAULT_THRESHOLD = 10.0


def _info(n: Node) -> dict[str, Any]:
    return {"kind": n.kind, "name": n.name, "op": n.op, "layer": n.layer, "call": n.call, "param": n.param}


def node_norms(graph: BackwardGraph) -> dict[str, float]:
    """Norm of the gradient each node received, by node key.

    For an op that is the gradient w.r.t. its forward output; for a parameter
    the gradient the backward added to ``param.grad``. Nodes without gradient statistics are left out.
    """
    metas: dict[int, list] = {}
    for e in graph.edges:
        if e.grad is not None:
            metas.setdefault(e.dst, []).append(e.grad)
    out: dict[str, float] = {}
    for nid, ms in metas.items():
        node = graph.nodes[nid]
        m = node.grad if node.grad is not None else merge_grad_metas(ms)
        if m is not None and m.norm is not None:
            out[node.key] = m.norm
    return out


def norm_ratio(old: float | None, new: float | None) -> float | None:
    """new/old for finite norms; 1 when both are 0, inf when only old is 0."""
    if old is None or new is None or not (math.isfinite(old) and math.isfinite(new)):
        return None
    if old == 0.0:
        return 1.0 if new == 0.0 else math.inf
    return new / old


@dataclass
class GraphDiff:
    """What changed from an older capture to a newer one.

    Attributes:
        older_step / newer_step: ``meta["step"]`` of the two graphs, if known.
        added_nodes / removed_nodes: node keys only in the newer / older graph.
        added_edges / removed_edges: ``(src key, dst key)`` pairs.
        params_started / params_stopped: parameters that the gradient reaches
            only in the newer / only in the older graph.
        node_norm_ratios: key -> newer/older norm of the gradient the node
            received, for nodes in both graphs with finite norms.
        layer_norm_ratios: layer path -> newer/older norm of its parameters'
            gradients (from :meth:`BackwardGraph.layer_grad_norms`).
        global_norm_ratio: newer/older global gradient norm.
        new_nonfinite / resolved_nonfinite: keys of NaN/Inf sites only in the
            newer / only in the older graph.
        nonfinite_origin: the origin NaN/Inf site of the newer graph
            (``{"key", "kind", "name", "op", "layer", "call", "param"}``), None when it has none.
        node_info: kind, op, layer and param of every key listed above, so
            the diff reads well without the graphs.
        threshold: ratios above ``threshold`` or below ``1/threshold`` count
            as large changes.
    """

    older_step: Any = None
    newer_step: Any = None
    added_nodes: list[str] = field(default_factory=list)
    removed_nodes: list[str] = field(default_factory=list)
    added_edges: list[tuple[str, str]] = field(default_factory=list)
    removed_edges: list[tuple[str, str]] = field(default_factory=list)
    params_started: list[str] = field(default_factory=list)
    params_stopped: list[str] = field(default_factory=list)
    node_norm_ratios: dict[str, float] = field(default_factory=dict)
    layer_norm_ratios: dict[str, float] = field(default_factory=dict)
    global_norm_ratio: float | None = None
    new_nonfinite: list[str] = field(default_factory=list)
    resolved_nonfinite: list[str] = field(default_factory=list)
    nonfinite_origin: dict[str, Any] | None = None
    node_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    threshold: float = DEFAULT_THRESHOLD

    # ------------------------------------------------------------- questions
    @property
    def structure_changed(self) -> bool:
        """Nodes or edges added or removed, or parameters started/stopped."""
        return bool(
            self.added_nodes or self.removed_nodes or self.added_edges or self.removed_edges
            or self.params_started or self.params_stopped
        )

    @property
    def nonfinite_changed(self) -> bool:
        """NaN/Inf sites appeared or went away."""
        return bool(self.new_nonfinite or self.resolved_nonfinite)

    def is_large(self, ratio: float | None) -> bool:
        """Whether a norm ratio is beyond ``threshold`` (either way)."""
        return ratio is not None and (ratio > self.threshold or ratio < 1.0 / self.threshold)

    def large_node_changes(self) -> dict[str, float]:
        """Node key -> ratio for the large changes, largest change first."""
        big = {k: r for k, r in self.node_norm_ratios.items() if self.is_large(r)}
        return dict(sorted(big.items(), key=lambda kv: -_magnitude(kv[1])))

    def large_layer_changes(self) -> dict[str, float]:
        """Layer -> ratio for the large changes, largest change first."""
        big = {k: r for k, r in self.layer_norm_ratios.items() if self.is_large(r)}
        return dict(sorted(big.items(), key=lambda kv: -_magnitude(kv[1])))

    @property
    def changed(self) -> bool:
        """Anything worth showing: structure, NaN/Inf sites or a large norm change."""
        return bool(
            self.structure_changed or self.nonfinite_changed
            or self.large_node_changes() or self.large_layer_changes()
        )

    def compared_graphs(self) -> tuple[BackwardGraph, BackwardGraph] | None:
        """The ``(older, newer)`` graphs this diff was computed from, while they are alive.

        Held weakly, so a diff never keeps captures in memory; None for a diff
        loaded from JSON or once either graph is gone.
        """
        refs = getattr(self, "_graphs", None)
        graphs = tuple(r() for r in refs) if refs else ()
        return graphs if len(graphs) == 2 and None not in graphs else None  # type: ignore[return-value]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_graphs", None)  # weak references do not pickle
        return state

    # ----------------------------------------------------------- conversions
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": DIFF_FORMAT,
            "version": DIFF_VERSION,
            "older_step": self.older_step,
            "newer_step": self.newer_step,
            "added_nodes": list(self.added_nodes),
            "removed_nodes": list(self.removed_nodes),
            "added_edges": [list(e) for e in self.added_edges],
            "removed_edges": [list(e) for e in self.removed_edges],
            "params_started": list(self.params_started),
            "params_stopped": list(self.params_stopped),
            "node_norm_ratios": {k: float_to_json(v) for k, v in self.node_norm_ratios.items()},
            "layer_norm_ratios": {k: float_to_json(v) for k, v in self.layer_norm_ratios.items()},
            "global_norm_ratio": float_to_json(self.global_norm_ratio),
            "new_nonfinite": list(self.new_nonfinite),
            "resolved_nonfinite": list(self.resolved_nonfinite),
            "nonfinite_origin": self.nonfinite_origin,
            "node_info": self.node_info,
            "threshold": self.threshold,
        }

    def to_json(self, indent: int | None = None) -> str:
        """Serialize losslessly; ``GraphDiff.from_json(d.to_json()) == d``."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GraphDiff":
        if not isinstance(d, dict) or d.get("format") != DIFF_FORMAT:
            raise ValueError(f"not a paddleviz-hooks graph diff (missing 'format': '{DIFF_FORMAT}')")
        if d.get("version", 0) > DIFF_VERSION:
            raise ValueError(
                f"graph diff format version {d.get('version')} is newer than this "
                f"paddleviz-hooks understands ({DIFF_VERSION}); upgrade paddleviz-hooks"
            )
        try:
            return cls(
                older_step=d.get("older_step"),
                newer_step=d.get("newer_step"),
                added_nodes=list(d["added_nodes"]),
                removed_nodes=list(d["removed_nodes"]),
                added_edges=[(str(s), str(t)) for s, t in d["added_edges"]],
                removed_edges=[(str(s), str(t)) for s, t in d["removed_edges"]],
                params_started=list(d["params_started"]),
                params_stopped=list(d["params_stopped"]),
                node_norm_ratios={k: float_from_json(v) for k, v in d["node_norm_ratios"].items()},
                layer_norm_ratios={k: float_from_json(v) for k, v in d["layer_norm_ratios"].items()},
                global_norm_ratio=float_from_json(d.get("global_norm_ratio")),
                new_nonfinite=list(d["new_nonfinite"]),
                resolved_nonfinite=list(d["resolved_nonfinite"]),
                nonfinite_origin=d.get("nonfinite_origin"),
                node_info={k: dict(v) for k, v in d.get("node_info", {}).items()},
                threshold=float(d.get("threshold", DEFAULT_THRESHOLD)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed graph diff JSON: {exc!r}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> "GraphDiff":
        """Load a diff written by :meth:`to_json`.

        Raises:
            ValueError: the text is not JSON of a graph diff.
        """
        return cls.from_dict(parse_json(text))

    def __repr__(self) -> str:
        return (
            f"GraphDiff(step {self.older_step} -> {self.newer_step}: "
            f"+{len(self.added_nodes)}/-{len(self.removed_nodes)} nodes, "
            f"+{len(self.added_edges)}/-{len(self.removed_edges)} edges, "
            f"{len(self.new_nonfinite)} new NaN/Inf sites)"
        )


def _magnitude(r: float) -> float:
    if r <= 0:
        return math.inf
    return abs(math.log(r)) if math.isfinite(r) else math.inf


def _edge_keys(graph: BackwardGraph) -> list[tuple[str, str]]:
    seen: dict[tuple[str, str], None] = {}
    for e in graph.edges:
        seen[(graph.nodes[e.src].key, graph.nodes[e.dst].key)] = None
    return list(seen)


def _ensure_keys(graph: BackwardGraph) -> None:
    if any(not n.key for n in graph.nodes):
        graph.assign_keys()


def diff_graphs(
    older: BackwardGraph,
    newer: BackwardGraph,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    layer_depth: int | None = None,
) -> GraphDiff:
    """Compare two captures.

    Args:
        older: the earlier graph.
        newer: the later graph.
        threshold: a gradient-norm ratio above ``threshold`` or below
            ``1/threshold`` is a large change (``GraphDiff.large_*_changes``).
        layer_depth: path components naming a layer group for
            ``layer_norm_ratios``; None groups by the full layer path (the
            layer owning each parameter).

    Returns:
        A :class:`GraphDiff`. Lists of keys are in the newer graph's
        gradient-flow order (removed ones in the older graph's order).

    Raises:
        TypeError: an argument is not a :class:`BackwardGraph`.
        ValueError: ``threshold`` is not a number above 1.

    Example:
        >>> import paddle
        >>> from paddleviz_hooks import capture_backward
        >>> net = paddle.nn.Sequential(paddle.nn.Linear(3, 3), paddle.nn.Linear(3, 1))
        >>> x = paddle.randn([2, 3])
        >>> with capture_backward(net) as cap:
        ...     net(x).sum().backward()
        ...     net[1](net[0](x).detach()).sum().backward()  # the gradient stops before layer 0
        >>> d = diff_graphs(cap.graphs[0], cap.graphs[1])
        >>> d.params_stopped
        ['0.bias', '0.weight']
    """
    for name, g in (("older", older), ("newer", newer)):
        if not isinstance(g, BackwardGraph):
            raise TypeError(f"{name} must be a BackwardGraph, got {type(g).__name__}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 1:
        raise ValueError(f"threshold must be a number above 1, got {threshold!r}")
    if layer_depth is not None and (not isinstance(layer_depth, int) or layer_depth < 1):
        raise ValueError(f"layer_depth must be a positive int or None, got {layer_depth!r}")
    _ensure_keys(older)
    _ensure_keys(newer)

    def ordered(g: BackwardGraph) -> list[Node]:
        return [g.nodes[i] for i in g.topo_order()]

    old_nodes, new_nodes = ordered(older), ordered(newer)
    old_keys = {n.key for n in old_nodes}
    new_keys = {n.key for n in new_nodes}
    added = [n for n in new_nodes if n.key not in old_keys]
    removed = [n for n in old_nodes if n.key not in new_keys]

    old_edges, new_edges = _edge_keys(older), _edge_keys(newer)
    old_edge_set, new_edge_set = set(old_edges), set(new_edges)

    old_params, new_params = older.params(), newer.params()

    old_norms, new_norms = node_norms(older), node_norms(newer)
    ratios = {}
    for n in new_nodes:
        r = norm_ratio(old_norms.get(n.key), new_norms.get(n.key))
        if r is not None:
            ratios[n.key] = r

    depth = layer_depth or 10_000
    old_layers, new_layers = older.layer_grad_norms(depth), newer.layer_grad_norms(depth)
    layer_ratios = {}
    for name in new_layers:
        r = norm_ratio(old_layers.get(name), new_layers[name])
        if r is not None:
            layer_ratios[name] = r

    old_sites, new_sites = older.nonfinite_sites(), newer.nonfinite_sites()
    old_site_keys = {n.key for n in old_sites}
    new_site_keys = {n.key for n in new_sites}
    new_bad = [n for n in new_sites if n.key not in old_site_keys]
    resolved = [n for n in old_sites if n.key not in new_site_keys]
    origin = None
    if new_sites:
        origin = {"key": new_sites[0].key, **_info(new_sites[0])}

    info: dict[str, dict[str, Any]] = {}
    for n in added + new_bad + new_sites[:1]:
        info[n.key] = _info(n)
    for n in removed + resolved:
        info.setdefault(n.key, _info(n))
    d = GraphDiff(
        older_step=older.meta.get("step"),
        newer_step=newer.meta.get("step"),
        added_nodes=[n.key for n in added],
        removed_nodes=[n.key for n in removed],
        added_edges=[e for e in new_edges if e not in old_edge_set],
        removed_edges=[e for e in old_edges if e not in new_edge_set],
        params_started=[p for p in new_params if p not in old_params],
        params_stopped=[p for p in old_params if p not in new_params],
        node_norm_ratios=ratios,
        layer_norm_ratios=layer_ratios,
        global_norm_ratio=norm_ratio(older.global_grad_norm(), newer.global_grad_norm()),
        new_nonfinite=[n.key for n in new_bad],
        resolved_nonfinite=[n.key for n in resolved],
        nonfinite_origin=origin,
        node_info=info,
        threshold=float(threshold),
    )
    by_key = {n.key: n for n in new_nodes}
    for key in d.large_node_changes():
        info.setdefault(key, _info(by_key[key]))
    d._graphs = (weakref.ref(older), weakref.ref(newer))  # for drawing it (see compared_graphs)
    return d
