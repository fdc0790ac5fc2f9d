"""Drawing a :class:`~paddleviz_hooks.diff.GraphDiff`.

The picture is the newer graph drawn by :func:`~paddleviz_hooks.render.dot.dot_parts`
(same styling as a plain drawing) with the diff laid on top through its hooks:

* added nodes and edges: green, bold (``node_style`` / ``edge_style``);
* removed nodes and edges: dashed grey ghosts taken from the older graph
  (``extra_body``), labelled with their op and layer;
* a gradient whose norm changed more than ``diff.threshold`` times: the edge
  is coloured (orange up, blue down) and labelled ``x12.3``;
* a second legend explaining the marks.

In SVG output the marked elements carry the classes ``pvh-added``,
``pvh-removed``, ``pvh-ratio-up`` and ``pvh-ratio-down``.
"""

from __future__ import annotations

import os
from typing import Any

from .._fileio import atomic_write
from ..collapse import collapse_alike, collapse_graph
from ..diff import GraphDiff, diff_graphs, edge_metas, norm_ratio
from ..escape import dot_attrs, dot_html_table, dot_label
from ..graph import BackwardGraph
from ..text import collapse_note, describe_node, diff_side, edge_lines, fmt_num, fmt_ratio, ghost_lines
from .dot import to_dot
from .output import output_target
from .draw import (LEGIBLE_DPI, VIEW_MAX_PX, collapse_specs, render_svg, render_views, structure_key,
                   svg_viewbox_as_drawn)
from .plan import Candidate, Frame, draw_planned

__all__ = ["diff_to_dot", "render_diff", "render_diff_png", "render_diff_views", "diff_styles", "DIFF_STYLE"]

DIFF_STYLE = {
    "added_node": {"color": "#1a7f37", "penwidth": "3", "class": "pvh-added"},
    "added_edge": {"color": "#1a7f37", "fontcolor": "#1a7f37", "penwidth": "2.5", "class": "pvh-added"},
    "removed_node": {
        "shape": "box", "style": "dashed,rounded", "color": "#9a9a9a", "fontcolor": "#8a8a8a",
        "class": "pvh-removed",
    },
    "removed_edge": {"style": "dashed", "color": "#b0b0b0", "arrowhead": "empty", "class": "pvh-removed"},
    "ratio_up": {"color": "#d9480f", "fontcolor": "#d9480f", "penwidth": "2.5", "class": "pvh-ratio-up"},
    "ratio_down": {"color": "#1c7ed6", "fontcolor": "#1c7ed6", "penwidth": "2.5", "class": "pvh-ratio-down"},
}
_COLLAPSE_KEYS = ("depth", "by_type", "fold_repeats", "max_nodes")
_FORMATS = ("png", "svg", "dot", "json")


def _check(diff: Any, newer: Any, older: Any) -> None:
    if not isinstance(diff, GraphDiff):
        raise TypeError(f"diff must be a GraphDiff, got {type(diff).__name__}")
    for name, g in (("newer", newer), ("older", older)):
        if not isinstance(g, BackwardGraph):
            raise TypeError(f"{name} must be a BackwardGraph, got {type(g).__name__}")


def diff_styles(
    diff: GraphDiff, newer: BackwardGraph, older: BackwardGraph, *, stats: bool = True, legend: bool = True
) -> tuple[dict[str, dict[str, str]], dict[tuple[str, str], dict[str, str]], list[str]]:
    """The ``node_style``, ``edge_style`` and ``extra_body`` arguments of ``dot_parts``.

    Args:
        diff: the diff of ``older`` -> ``newer``.
        newer: the graph that is drawn.
        older: where removed nodes and edges come from.
        stats: whether edge labels show gradient norms (as in ``dot_parts``).
        legend: whether to add the legend of the marks that are drawn.
    """
    _check(diff, newer, older)
    node_style: dict[str, dict[str, str]] = {}
    for key in diff.added_nodes:
        node_style[key] = dict(DIFF_STYLE["added_node"])

    edge_style: dict[tuple[str, str], dict[str, str]] = {}
    for pair in diff.added_edges:
        edge_style[pair] = dict(DIFF_STYLE["added_edge"])

    old_metas, new_metas = edge_metas(older, diff.renamed), edge_metas(newer)
    added_edges = set(diff.added_edges)
    for pair, new in new_metas.items():
        old = old_metas.get(pair)
        if pair in added_edges or old is None or new is None:
            continue
        r = norm_ratio(old.norm, new.norm)
        if not diff.is_large(r):
            continue
        style = dict(DIFF_STYLE["ratio_up" if r > 1 else "ratio_down"])
        # dot_parts takes a label from edge_style as the whole label: keep its text.
        style["label"] = "\n".join(edge_lines(new, stats) + [fmt_ratio(r)])
        style["tooltip"] = f"gradient norm {fmt_ratio(r)} ({fmt_num(old.norm)} -> {fmt_num(new.norm)})"
        edge_style[pair] = style

    extra: list[str] = []
    new_ids = {n.key: f"n{n.id}" for n in newer.nodes}
    old_by_key = {n.key: n for n in older.nodes}
    ghost_ids: dict[str, str] = {}
    for key in diff.removed_nodes:
        n = old_by_key.get(key)
        if n is None:
            continue
        gid = f"ghost{n.id}"
        ghost_ids[key] = gid
        attrs = dict(DIFF_STYLE["removed_node"])
        attrs["tooltip"] = f"removed: {describe_node(n)} | {n.name} | key: {n.key}"
        extra.append(f"{gid} [label={dot_label(*ghost_lines(n))}, {dot_attrs(attrs)}]")
    for src, dst in diff.removed_edges:
        src, dst = diff.renamed.get(src, src), diff.renamed.get(dst, dst)
        a = new_ids.get(src) or ghost_ids.get(src)
        b = new_ids.get(dst) or ghost_ids.get(dst)
        if a is None or b is None:
            continue
        attrs = dict(DIFF_STYLE["removed_edge"])
        if src in new_ids and dst in new_ids:
            attrs["constraint"] = "false"  # a rewired edge must not pull the layout about
        extra.append(f"{a} -> {b} [{dot_attrs(attrs)}]")
    if legend:
        marks = {style.get("class") for style in (*node_style.values(), *edge_style.values())}
        if extra:  # ghosts and removed edges
            marks.add("pvh-removed")
        extra.extend(_legend(diff, marks))
    return node_style, edge_style, extra


def _legend(diff: GraphDiff, marks: set[str | None]) -> list[str]:
    """Legend nodes for the ``marks`` (SVG classes) that are drawn: structure changes in one,
    gradient-norm colours in another (class ``pvh-norm-legend``, so a viewer that turns
    norm colouring off can hide it with the colours)."""
    since = "" if diff.older_step is None else f" since step {diff.older_step}"
    rows = [
        ("pvh-added", {"BORDER": "3", "COLOR": "#1a7f37"}, f"added{since}"),
        ("pvh-removed", {"BORDER": "1", "STYLE": "dashed", "COLOR": "#9a9a9a"}, f"removed{since} (ghost)"),
        ("pvh-ratio-up", {"BGCOLOR": "#d9480f"}, f"grad norm up over {diff.threshold:g}x"),
        ("pvh-ratio-down", {"BGCOLOR": "#1c7ed6"}, f"grad norm down below {1 / diff.threshold:g}x"),
    ]
    out = []
    for name, title, kinds, extra in (
        ("diff_legend", "changes", ("pvh-added", "pvh-removed"), ""),
        ("diff_legend_norms", "gradient norm", ("pvh-ratio-up", "pvh-ratio-down"), ', class="pvh-norm-legend"'),
    ):
        shown = [(swatch, text) for mark, swatch, text in rows if mark in kinds and mark in marks]
        if shown:
            table = dot_html_table(title, shown, spacing=2)
            out.append(f'{name} [shape=box, style="rounded", color="#bbbbbb", fontsize="9"{extra}, label={table}]')
    return out


def _given(v: Any) -> bool:
    return v is not None and v is not False and v not in ((), [], "")


def _collapsed(
    diff: GraphDiff, newer: BackwardGraph, older: BackwardGraph, options: dict[str, Any]
) -> tuple[GraphDiff, BackwardGraph, BackwardGraph]:
    """Apply collapse options (popped from ``options``) to both graphs alike.

    The newer graph picks the depth (``max_nodes`` may make it shallower);
    both are collapsed to that depth by ``collapse_alike`` (a box opened in
    one to keep it honest is opened in the other too), so layer boxes match,
    a layer that appeared is one green box and an unchanged layer is never
    marked. The diff is recomputed on the collapsed pair; steps and
    threshold are kept.
    """
    collapse = {k: options.pop(k) for k in _COLLAPSE_KEYS if k in options}
    if not any(_given(v) for v in collapse.values()):
        return diff, newer, older
    depth = collapse.get("depth")
    if collapse.get("max_nodes") is not None:
        depth = collapse_graph(newer, **collapse).meta["collapse"]["depth"]
    new_c, old_c = collapse_alike([newer, older], depth=depth, by_type=collapse.get("by_type", ()),
                                  fold_repeats=collapse.get("fold_repeats", False))
    d = diff_graphs(old_c, new_c, threshold=diff.threshold)
    d.older_step, d.newer_step = diff.older_step, diff.newer_step
    d.older_role, d.newer_role = diff.older_role, diff.newer_role
    return d, new_c, old_c


def _diff_options(diff: GraphDiff, newer: BackwardGraph, older: BackwardGraph, options: dict[str, Any]) -> dict[str, Any]:
    for k in ("node_style", "edge_style", "extra_body"):
        if k in options:
            raise TypeError(f"{k} is set by the diff drawing and cannot be passed")
    node_style, edge_style, extra = diff_styles(diff, newer, older, stats=options.get("stats", True),
                                                legend=options.get("legend", True))
    if "title" not in options:
        if diff.older_step is None or diff.newer_step is None:
            options["title"] = "changes since the older capture"
        else:
            options["title"] = f"changes from {diff_side(diff.older_step, diff.older_role)} to " \
                               f"{diff_side(diff.newer_step, diff.newer_role)}"
    options.update(node_style=node_style, edge_style=edge_style, extra_body=extra)
    return options


def diff_to_dot(diff: GraphDiff, newer: BackwardGraph, older: BackwardGraph, **options: Any) -> str:
    """DOT source of the newer graph with the changes since ``older`` marked.

    Args:
        diff: ``diff_graphs(older, newer)``.
        newer: the graph that is drawn.
        older: the graph removed nodes and edges are taken from.
        **options: drawing options as for :func:`paddleviz_hooks.render.to_dot`
            (``stats``, ``clusters``, ``legend``, ``rankdir``, ``title``,
            ``dpi``) and collapse options (``depth``, ``max_nodes``,
            ``fold_repeats``, ``by_type``): both graphs are collapsed alike
            and compared again, so a new layer shows as one green box.

    Raises:
        TypeError: wrong argument types.
        ValueError: bad option values.

    Examples:
        >>> import paddle, tempfile, os
        >>> from paddleviz_hooks import capture_backward, diff_graphs
        >>> net = paddle.nn.Sequential(paddle.nn.Linear(3, 3), paddle.nn.Linear(3, 1))
        >>> x = paddle.randn([2, 3])
        >>> with capture_backward(net) as cap:
        ...     net(x).sum().backward()
        ...     net[1](net[0](x).detach()).sum().backward()
        >>> old, new = cap.graphs
        >>> src = diff_to_dot(diff_graphs(old, new), new, old)
        >>> "removed since step" in src or "(removed)" in src
        True
    """
    _check(diff, newer, older)
    options = dict(options)
    diff, newer, older = _collapsed(diff, newer, older, options)
    return to_dot(newer, **_diff_options(diff, newer, older, options))


def render_diff(
    diff: GraphDiff,
    newer: BackwardGraph,
    older: BackwardGraph,
    path: str | os.PathLike | None = None,
    *,
    format: str | None = None,
    **options: Any,
) -> str | bytes:
    """Draw a diff to a file, or return the drawing's bytes.

    Args:
        diff: ``diff_graphs(older, newer)``.
        newer: the later graph.
        older: the earlier graph.
        path: output file; its suffix picks the format when ``format`` is
            None. Without a path the bytes are returned.
        format: ``"png"``, ``"svg"``, ``"dot"`` or ``"json"`` (the diff
            itself); ``"svg"`` when neither path nor format says.
        **options: drawing and collapse options as for :func:`diff_to_dot`,
            plus ``max_px`` (PNG) and ``timeout``.

    Returns:
        The path written, or the bytes when ``path`` is None.

    Raises:
        ValueError: unknown format or bad option values.
        FileNotFoundError: the output directory does not exist.
        EngineNotFound / RenderTimeout: as for :func:`render_png`.

    Examples:
        >>> import paddle, tempfile, os
        >>> from paddleviz_hooks import capture_backward, diff_graphs
        >>> net = paddle.nn.Sequential(paddle.nn.Linear(3, 3), paddle.nn.Linear(3, 1))
        >>> x = paddle.randn([2, 3])
        >>> with capture_backward(net) as cap:
        ...     net(x).sum().backward()
        ...     net[1](net[0](x).detach()).sum().backward()
        >>> old, new = cap.graphs
        >>> out = os.path.join(tempfile.mkdtemp(), "diff.svg")
        >>> render_diff(diff_graphs(old, new), new, old, out) == out
        True
    """
    _check(diff, newer, older)
    path, fmt = output_target(path, format, _FORMATS, optional=True)
    if fmt == "json":
        data = diff.to_json(indent=1).encode("utf-8")
    elif fmt == "png":
        data = render_diff_views(diff, newer, older, ("png",), **options)["png"]
    else:
        opts = dict(options)
        diff, newer, older = _collapsed(diff, newer, older, opts)
        opts = _diff_options(diff, newer, older, opts)
        opts.pop("max_px", None)
        if fmt == "dot":
            opts.pop("timeout", None)
            data = to_dot(newer, **opts).encode("utf-8")
        else:
            data = render_svg(newer, **opts)
    if path is None:
        return data
    atomic_write(path, data)
    return path


def render_diff_png(
    diff: GraphDiff, newer: BackwardGraph, older: BackwardGraph, **options: Any
) -> bytes:
    """PNG bytes of the diff drawing, sized for viewing like :func:`render_png`.

    Args:
        diff / newer / older: as for :func:`render_diff`.
        **options: ``max_px``, ``timeout``, collapse options (``max_nodes``
            ...) and drawing options; ``info``: a dict filled as
            :func:`render_png` fills it, where ``collapsed_depth`` and
            ``folded`` say how both graphs were collapsed.

    Examples:
        >>> import paddle, tempfile, os
        >>> from paddleviz_hooks import capture_backward, diff_graphs
        >>> net = paddle.nn.Sequential(paddle.nn.Linear(3, 3), paddle.nn.Linear(3, 1))
        >>> x = paddle.randn([2, 3])
        >>> with capture_backward(net) as cap:
        ...     net(x).sum().backward()
        ...     net[1](net[0](x).detach()).sum().backward()
        >>> old, new = cap.graphs
        >>> data = render_diff_png(diff_graphs(old, new), new, old, max_px=800, max_nodes=80)
        >>> data[:4]
        b'\\x89PNG'
    """
    return render_diff(diff, newer, older, None, format="png", **options)


def render_diff_views(
    diff: GraphDiff, newer: BackwardGraph, older: BackwardGraph, formats: tuple[str, ...] = ("png",), *,
    auto_collapse: bool = True, full_detail: str | None = None, info: dict[str, Any] | None = None,
    **options: Any,
) -> dict[str, bytes]:
    """The diff drawing sized for viewing, in each of ``formats`` from one engine run.

    When the drawing with its ghosts of removed nodes would be illegible
    (below ``LEGIBLE_DPI``), both graphs are collapsed alike, starting at the
    depth the newer graph's own viewing picture needs, and compared again:
    removed layers are ghost boxes of the same depth, and the title says so.

    Args:
        diff / newer / older: as for :func:`render_diff`.
        formats: ``"png"`` and/or ``"svg"``.
        auto_collapse: collapse when the newer graph's view needs it (as
            :func:`paddleviz_hooks.render.render_png` decides).
        full_detail: how to see every op, said in the title of a collapsed drawing.
        info: a dict filled as :func:`paddleviz_hooks.render.render_png` fills
            it, where ``collapsed_depth`` and ``folded`` say how both graphs
            were collapsed (None: not collapsed).
        **options: as for :func:`paddleviz_hooks.render.draw.render_views`.

    Returns:
        format -> bytes.

    Examples:
        >>> import paddle
        >>> from paddleviz_hooks import capture_backward, diff_graphs
        >>> net = paddle.nn.Sequential(paddle.nn.Linear(3, 3), paddle.nn.Linear(3, 1))
        >>> x = paddle.randn([2, 3])
        >>> with capture_backward(net) as cap:
        ...     net(x).sum().backward()
        ...     net[1](net[0](x).detach()).sum().backward()
        >>> old, new = cap.graphs
        >>> sorted(render_diff_views(diff_graphs(old, new), new, old, ("png", "svg")))
        ['png', 'svg']
    """
    _check(diff, newer, older)
    opts = dict(options)
    if opts.get("dpi") is not None:  # a fixed resolution: no size policy to plan
        diff, n2, o2 = _collapsed(diff, newer, older, opts)
        return render_views(n2, tuple(formats), auto_collapse=False, info=info, **_diff_options(diff, n2, o2, opts))
    max_px = opts.pop("max_px", VIEW_MAX_PX)
    timeout = opts.pop("timeout", 120.0)
    min_dpi = opts.pop("min_dpi", LEGIBLE_DPI)
    rankdir = opts.pop("rankdir", None)
    explicit = "depth" in opts or opts.get("max_nodes") is not None
    titled = "title" in opts  # a title given by the caller is kept as it is

    def build(spec: Any) -> Candidate:
        trial = dict(opts) if spec is None else {**opts, "depth": spec[0], "fold_repeats": spec[1]}
        d2, n2, o2 = _collapsed(diff, newer, older, trial)
        trial = _diff_options(d2, n2, o2, trial)
        if n2 is not newer and not titled:
            note = collapse_note(n2, newer, full_detail) if full_detail else collapse_note(n2, newer)
            trial["title"] = f"{trial['title']} - {note}"
        return Candidate(spec, len(n2.nodes), lambda rd: to_dot(n2, rankdir=rd, **trial), n2)

    def candidates():
        yield build(None)
        if not auto_collapse or explicit:
            return
        seen = set()
        for spec in collapse_specs(newer, {k: opts[k] for k in ("by_type", "fold_repeats") if k in opts}):
            c = build(spec)
            shape = tuple((n.key, n.layer, n.count) for n in c.data.nodes)
            if len(c.data.nodes) >= len(newer.nodes) or shape in seen:
                continue
            seen.add(shape)
            yield c

    styles = ("node_style", "edge_style", "extra_body", "title")
    key = ("diff", structure_key(newer), structure_key(older), tuple(sorted(
        (k, repr(v)) for k, v in opts.items() if k not in styles)), max_px, rankdir, auto_collapse, min_dpi)
    planned = draw_planned(key, candidates(), tuple(formats), Frame(max_px, max_px),
                           rankdirs=(rankdir,) if rankdir else ("TB", "LR"), min_dpi=min_dpi, timeout=timeout,
                           structure=key[1], build=build)
    newer_drawn = planned.candidate.data if planned.candidate is not None else newer
    out = planned.outputs
    if "svg" in out:
        out["svg"] = svg_viewbox_as_drawn(out["svg"])
    d = planned.decision
    full, newer = newer, newer_drawn
    if info is not None:
        info.update(nodes=len(newer.nodes), dpi=round(d.dpi, 3), rankdir=d.rankdir, bands=d.bands,
                    padded=planned.padded, full_detail=newer is full, engine_runs=planned.attempts)
    if info is not None:
        used = newer.meta.get("collapse", {}) if newer is not full else {}
        info.update(collapsed_depth=used.get("depth"), folded=bool(used.get("fold_repeats")))
    return out
