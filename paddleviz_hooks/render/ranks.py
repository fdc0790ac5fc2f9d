"""Drawing one step captured on several ranks as one merged picture.

The picture is the base rank's graph (the lowest rank) drawn by
:func:`~paddleviz_hooks.render.dot.dot_parts`, with the
:class:`~paddleviz_hooks.ranks.RankView` laid on top through its hooks:

* every gradient edge is labelled with its norm on each rank
  (``|g| r0 0.41 / r1 0.52``); a parameter whose gradient was all-reduced
  shows the applied norm on each rank, a layer box (collapsed) its
  parameters' norm on each rank;
* a node or edge that is not on every rank is drawn with a thick amber frame
  and says where it is missing; nodes only on another rank are added from that
  rank's graph, amber and dashed (``only on rank 1``);
* a legend explaining the marks.

In SVG output the marked elements carry the classes ``pvh-rank-differs`` and
``pvh-rank-only``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from .._fileio import atomic_write
from ..collapse import collapse_graph
from ..escape import dot_attrs, dot_html_table, dot_label
from ..graph import BackwardGraph
from ..ranks import RankView, compare_ranks
from ..text import (RANKS_DIFFER_LEGEND, RANKS_NORM_LEGEND, RANKS_SYNC_LEGEND, box_lines, describe_node, edge_lines,
                    ghost_lines, node_lines, rank_presence, rank_values, ranks_title)
from .draw import prepare, render_png, render_svg
from .output import output_target
from .dot import to_dot

__all__ = ["RANK_STYLE", "rank_styles", "ranks_to_dot", "render_ranks"]

RANK_STYLE = {
    "differs_node": {"color": "#e67700", "penwidth": "3.5", "class": "pvh-rank-differs"},
    "only_node": {"shape": "box", "style": "dashed,rounded,filled", "fillcolor": "#fff3bf", "color": "#e67700",
                  "penwidth": "3", "class": "pvh-rank-only"},
    "differs_edge": {"color": "#e67700", "fontcolor": "#b35900", "penwidth": "2.5", "style": "dashed",
                     "class": "pvh-rank-differs"},
}
_FORMATS = ("svg", "png", "dot")


def _collapsed(graphs: dict[int, BackwardGraph], options: dict[str, Any]) -> dict[int, BackwardGraph]:
    """Collapse options (popped from ``options``) applied to every rank alike: the base rank's
    graph picks the depth (``max_nodes`` may make it shallower), the others follow it."""
    ranks = sorted(graphs)
    base = prepare(graphs[ranks[0]], options)
    if base is graphs[ranks[0]]:
        return graphs
    used = base.meta.get("collapse", {})
    return {ranks[0]: base, **{r: collapse_graph(graphs[r], depth=used.get("depth"),
                                                 by_type=used.get("by_type") or (),
                                                 fold_repeats=bool(used.get("fold_repeats")))
                               for r in ranks[1:]}}


def rank_styles(view: RankView, graphs: Mapping[int, BackwardGraph], *, stats: bool = True
                ) -> tuple[dict[str, dict[str, str]], dict[tuple[str, str], dict[str, str]], list[str]]:
    """The ``node_style``, ``edge_style`` and ``extra_body`` arguments of ``dot_parts``.

    Args:
        view: ``compare_ranks(graphs)``.
        graphs: rank -> graph; the base rank's graph is the one drawn.
        stats: whether edges and parameters show the per-rank norms.
    """
    ranks = view.ranks
    base = graphs[view.base]
    node_style: dict[str, dict[str, str]] = {}
    for n in base.nodes:
        lines: list[str] | None = None
        if n.kind == "param" and n.param is not None:
            lines = node_lines(dataclasses.replace(n, local_grad=None))  # the per-rank numbers follow
            applied, local = view.param_norms.get(n.param, {}), view.local_param_norms.get(n.param, {})
            if stats and local and any(applied.get(r) != local.get(r) for r in ranks):
                lines += rank_values(applied, ranks, "all-reduced |g|")
        elif n.kind == "layer" and stats and n.key in view.box_norms:
            lines = box_lines(dataclasses.replace(n, norm=None)) + rank_values(view.box_norms[n.key], ranks,
                                                                                "|g| params")
        missing = view.missing.get(n.key)
        if missing:
            lines = (lines or node_lines(n)) + [rank_presence(missing)]
            node_style[n.key] = dict(RANK_STYLE["differs_node"])
        if lines is not None:
            node_style.setdefault(n.key, {})["label"] = "\n".join(lines)

    edge_style: dict[tuple[str, str], dict[str, str]] = {}
    keys = {n.id: n.key for n in base.nodes}
    for e in base.edges:
        pair = (keys[e.src], keys[e.dst])
        if pair in edge_style:
            continue
        style: dict[str, str] = {}
        norms = view.edge_norms.get(pair, {})
        if stats and norms:
            style["label"] = "\n".join(edge_lines(e.grad, False) + rank_values(norms, ranks))
            style["tooltip"] = " ".join(rank_values(norms, ranks, "gradient norm", 6, per_line=len(ranks)))
        missing = view.missing_edges.get(pair)
        if missing:
            style.update(RANK_STYLE["differs_edge"])
            style["label"] = "\n".join(([style["label"]] if "label" in style else []) + [rank_presence(missing)])
        if style:
            edge_style[pair] = style

    extra: list[str] = []
    ids = {n.key: f"n{n.id}" for n in base.nodes}
    ghosts: dict[str, list[int]] = {}  # a key only on other ranks -> the ranks having it
    first: dict[str, tuple[int, Any]] = {}
    for r, found in view.only_on.items():
        by_key = {n.key: n for n in graphs[r].nodes}
        for key in found:
            ghosts.setdefault(key, []).append(r)
            first.setdefault(key, (r, by_key[key]))
    for key, having in ghosts.items():
        r, n = first[key]
        gid = ids[key] = f"r{r}n{n.id}"
        where = rank_presence(only=having[0]) if len(having) == 1 else rank_presence(
            [x for x in ranks if x not in having])
        attrs = dict(RANK_STYLE["only_node"])
        attrs["tooltip"] = f"{where}: {describe_node(n)} | {n.name} | key: {n.key}"
        extra.append(f"{gid} [label={dot_label(*ghost_lines(n)[:-1], where)}, {dot_attrs(attrs)}]")
    drawn: set[tuple[str, str]] = set()
    for r, pairs in view.only_edges.items():
        to_base = {v: k for k, v in view.diffs[r].renamed.items()}
        for src, dst in pairs:
            src, dst = to_base.get(src, src), to_base.get(dst, dst)
            if (src, dst) in drawn or src not in ids or dst not in ids:
                continue
            drawn.add((src, dst))
            attrs = dict(RANK_STYLE["differs_edge"])
            norm = view.edge_norms.get((src, dst), {})
            text = rank_values(norm, ranks) if stats and norm else []
            attrs["label"] = "\n".join(text + [rank_presence(only=r)])
            label = attrs.pop("label")
            extra.append(f"{ids[src]} -> {ids[dst]} [label={dot_label(*label.split(chr(10)))}, {dot_attrs(attrs)}]")
    extra.append(_legend(bool(view.local_param_norms) and stats, stats))
    return node_style, edge_style, extra


def _legend(synced: bool, stats: bool) -> str:
    rows = [({"BORDER": "3", "COLOR": RANK_STYLE["differs_node"]["color"]}, RANKS_DIFFER_LEGEND)]
    if stats:
        rows.append(({}, RANKS_NORM_LEGEND))
    if synced:
        rows.append(({}, RANKS_SYNC_LEGEND))
    return f'ranks_legend [shape=box, style="rounded", color="#bbbbbb", fontsize="9", label={dot_html_table("ranks", rows, spacing=2)}]'


def _options(graphs: Any, options: dict[str, Any]) -> tuple[BackwardGraph, dict[str, Any]]:
    """The graph to draw and the ``to_dot`` options of the merged drawing."""
    if not isinstance(graphs, Mapping):
        raise TypeError(f"graphs must be a dict rank -> BackwardGraph, got {type(graphs).__name__}")
    for k in ("node_style", "edge_style", "extra_body"):
        if k in options:
            raise TypeError(f"{k} is set by the merged drawing and cannot be passed")
    view = compare_ranks(graphs)  # checks the graphs
    collapsed = _collapsed(dict(graphs), options)
    if collapsed is not graphs and any(collapsed[r] is not graphs[r] for r in collapsed):
        graphs, view = collapsed, compare_ranks(collapsed)
    node_style, edge_style, extra = rank_styles(view, graphs, stats=options.get("stats", True))
    options.setdefault("title", ranks_title(view.step, view.ranks))
    options.update(node_style=node_style, edge_style=edge_style, extra_body=extra)
    return graphs[view.base], options


def ranks_to_dot(graphs: Mapping[int, BackwardGraph], **options: Any) -> str:
    """DOT source of one step's captures on several ranks, merged.

    Args:
        graphs: rank -> that rank's capture of the same step (2 or more).
        **options: drawing options as for :func:`paddleviz_hooks.render.to_dot`
            and collapse options (``depth``, ``max_nodes``, ``fold_repeats``,
            ``by_type``), applied to every rank alike.

    Raises:
        TypeError / ValueError: as for :func:`paddleviz_hooks.ranks.compare_ranks`.

    Examples:
        >>> import paddle
        >>> from paddleviz_hooks import capture_backward
        >>> net = paddle.nn.Linear(3, 2)
        >>> with capture_backward(net) as cap:
        ...     net(paddle.ones([2, 3])).sum().backward()
        ...     net(2 * paddle.ones([2, 3])).sum().backward()
        >>> "|g| r0 4.9 / r1 9.8" in ranks_to_dot({0: cap.graphs[0], 1: cap.graphs[1]})
        True
    """
    graph, opts = _options(graphs, dict(options))
    return to_dot(graph, **opts)


def render_ranks(graphs: Mapping[int, BackwardGraph], path: str | os.PathLike | None = None, *,
                 format: str | None = None, **options: Any) -> str | bytes:
    """Draw one step's captures on several ranks as one merged picture.

    Args:
        graphs: rank -> that rank's capture of the same step (2 or more).
        path: output file; its suffix picks the format when ``format`` is
            None. Without a path the bytes are returned.
        format: ``"svg"`` (full detail, the default), ``"png"`` (sized for
            viewing, as :func:`paddleviz_hooks.render.render_png`) or ``"dot"``.
        **options: as for :func:`ranks_to_dot`, plus ``timeout`` (and
            ``max_px`` for PNG).

    Returns:
        The path written, or the bytes when ``path`` is None.

    Raises:
        TypeError / ValueError: bad arguments.
        FileNotFoundError: the output directory does not exist.
        EngineNotFound / RenderTimeout: as for :func:`paddleviz_hooks.render.render_png`.

    Examples:
        >>> import paddle
        >>> from paddleviz_hooks import capture_backward
        >>> net = paddle.nn.Linear(3, 2)
        >>> with capture_backward(net) as cap:
        ...     net(paddle.ones([2, 3])).sum().backward()
        ...     net(2 * paddle.ones([2, 3])).sum().backward()
        >>> render_ranks({0: cap.graphs[0], 1: cap.graphs[1]})[:5]
        b'<?xml'
    """
    path, fmt = output_target(path, format, _FORMATS, optional=True)
    opts = dict(options)
    timeout = opts.pop("timeout", 120.0)
    max_px = opts.pop("max_px", None)
    graph, opts = _options(graphs, opts)
    if fmt == "dot":
        data = to_dot(graph, **opts).encode("utf-8")
    elif fmt == "svg":
        data = render_svg(graph, timeout=timeout, **opts)
    else:
        data = render_png(graph, timeout=timeout, auto_collapse=False,
                          **({"max_px": max_px} if max_px is not None else {}), **opts)
    if path is None:
        return data
    atomic_write(path, data)
    return path
