"""Drawing a BackwardGraph to SVG at full detail, or to a PNG sized for viewing.

The PNG policy (``docs/graphviz.md`` has the measurements): layout is cheap
and rasterizing a huge bitmap is what costs, and VisualDL's viewer fits an
image to the window and zooms at most 3x. So a viewing PNG is laid out both
top-down and left-right (a long strip also wrapped into columns), the
arrangement that allows the larger scale wins, the resolution is chosen so the
long side stays within ``max_px`` and the aspect ratio within 16:9, and the
bitmap is never larger than the drawing at 96 dpi. A graph that would still be
drawn below the legibility floor (``LEGIBLE_DPI``) is collapsed into layer
boxes (``paddleviz_hooks.collapse``); SVG keeps full detail. See :func:`render_png`.
"""

from __future__ import annotations

import math
import os
import re
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from .._fileio import atomic_write
from ..collapse import collapse_graph, layer_depths
from ..graph import BackwardGraph
from ..text import collapse_note
from .dot import to_dot
from .engine import run_engine, run_engine_formats
from .output import output_target

__all__ = ["clear_plan_cache", "render_png", "render_views", "fit_png", "render_svg", "render_to_file", "layout_size",
           "png_size", "prepare", "LEGIBLE_DPI", "VIEW_MAX_PX"]

VIEW_MAX_PX = 2000
FULL_DPI = 96.0
_COLLAPSE_KEYS = ("depth", "by_type", "fold_repeats", "max_nodes")
_FORMATS = ("png", "svg", "dot", "json")


def prepare(graph: BackwardGraph, options: dict[str, Any]) -> BackwardGraph:
    """Apply the collapse options (popped from ``options``) to ``graph``."""
    if not isinstance(graph, BackwardGraph):
        raise TypeError(f"graph must be a BackwardGraph (e.g. cap.graph), got {type(graph).__name__}")
    collapse = {k: options.pop(k) for k in _COLLAPSE_KEYS if k in options}
    # `is` tests: depth=0 (box the whole model) is an option, though 0 == False
    if not any(v is not None and v is not False and not (isinstance(v, (tuple, list)) and not v)
               for v in collapse.values()):
        return graph
    return collapse_graph(graph, **collapse)


def layout_size(source: str, *, timeout: float | None = 60.0) -> tuple[float, float]:
    """Width and height in inches of the laid-out DOT ``source``."""
    plain = run_engine(source, "plain", timeout=timeout).decode("utf-8", "replace")
    first = plain.split("\n", 1)[0].split()
    return float(first[2]), float(first[3])


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of PNG bytes, read from the IHDR chunk."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not PNG data")
    return struct.unpack(">II", data[16:24])


def render_svg(graph: BackwardGraph, *, timeout: float | None = 120.0, **options: Any) -> bytes:
    """Full-detail SVG bytes (tooltips carry the full grad node names)."""
    g = prepare(graph, options)
    return run_engine(to_dot(g, **options), "svg", timeout=timeout)


VIEW_ASPECT = 16 / 9
#: A lower bound of the drawing area one node takes with its edge labels (square
#: inches; measured drawings of resnet50 and an encoder take 5 to 9).
_AREA_PER_NODE = 3.0
#: Below this resolution the drawing is not legible: at 48 dpi an 11 pt node
#: label is 7.3 px high and a 9 pt edge label 6 px, the smallest sizes at
#: which Graphviz's antialiased Helvetica still reads (at 40 dpi op names
#: read but gradient shapes and norms on the edges blur; at 32 dpi nothing).
LEGIBLE_DPI = 48.0
_PAD_IN = 4 / 72  # Graphviz's default pad, added on every side


@dataclass
class _Plan:
    """One way of drawing a graph: DOT source, layout size and resulting dpi."""

    source: str
    width: float
    height: float
    dpi: float
    rankdir: str
    bands: int
    area: float = 0.0  # smallest area (square inches) of the unwrapped layouts tried

    @property
    def aspect(self) -> float:
        long, short = max(self.width, self.height), max(min(self.width, self.height), 1e-3)
        return long / short


def _dpi_for(width: float, height: float, max_px: int) -> float:
    long = max(width, height) + 2 * _PAD_IN
    return min(FULL_DPI, (max_px - 1) / max(long, 1e-3))


_EDGE_LINE = re.compile(r"^(\s*)(\w+) -> (\w+) \[(.*)\]$")
_NODE_LINE = re.compile(r"^\s*(\w+) \[label=")


def _cluster_members(source: str, innermost: bool = False, boxes_split: bool = False) -> list[set[str]]:
    """Node names inside each ``subgraph cluster_*`` of DOT ``source``.

    With ``innermost``, only clusters that hold no other cluster (one
    layer's own ops, such as a Conv2D's conv, bias add and reshape); with
    ``boxes_split`` also not a frame around collapsed sublayers (``box3d``
    nodes, a model's top-level blocks), which holds sublayers, not one
    layer's own ops.
    """
    clusters: list[set[str]] = []
    has_child: list[bool] = []
    stack: list[int] = []
    for line in source.split("\n"):
        s = line.strip()
        if s.startswith("subgraph cluster_"):
            if stack:
                has_child[stack[-1]] = True
            clusters.append(set())
            has_child.append(False)
            stack.append(len(clusters) - 1)
        elif s == "}" and stack:
            stack.pop()
        else:
            m = _NODE_LINE.match(line)
            if m and stack:
                for c in stack:
                    clusters[c].add(m.group(1))
                if boxes_split and 'shape="box3d"' in line:
                    has_child[stack[-1]] = True  # a collapsed sublayer: as good as a child cluster
    if innermost:
        return [c for c, child in zip(clusters, has_child) if not child]
    return clusters


def _plain_nodes(plain: str, rankdir: str) -> dict[str, tuple[float, float]]:
    """Node name -> (distance along the rank axis from its start, position
    across it) in Graphviz ``plain`` output; the legend is left out."""
    lines = plain.split("\n")
    gh = float(lines[0].split()[3])
    pos: dict[str, tuple[float, float]] = {}
    for line in lines[1:]:
        parts = line.split()
        if len(parts) > 3 and parts[0] == "node" and parts[1] != "legend":
            x, y = float(parts[2]), float(parts[3])
            # TB: distance from the top; LR: from the left
            pos[parts[1].strip('"')] = (gh - y, x) if rankdir == "TB" else (x, gh - y)
    return pos


def _reads_in_order(plain: str, rankdir: str, band: dict[str, int]) -> bool:
    """Whether a wrapped layout reads like newspaper columns.

    The bands stand side by side in gradient order (left to right for TB,
    top to bottom for LR) without overlapping; inside a band every edge
    points down (right); every edge that crosses bands leads into the next
    band, entering it in its first quarter, above (left of) where it left
    the band before. Otherwise the wrapped drawing would scatter the blocks or
    snake edges across the page.
    """
    pos = _plain_nodes(plain, rankdir)
    k = max(band.values(), default=0) + 1
    along: list[list[float]] = [[] for _ in range(k)]
    across: list[list[float]] = [[] for _ in range(k)]
    for n, b in band.items():
        if n in pos:
            along[b].append(pos[n][0])
            across[b].append(pos[n][1])
    if any(not a for a in along):
        return False
    for b in range(k - 1):  # side by side, in order
        if max(across[b]) >= min(across[b + 1]):
            return False

    def rel(n: str) -> float:
        a = along[band[n]]
        return (pos[n][0] - min(a)) / max(max(a) - min(a), 1e-6)

    for line in plain.split("\n"):
        parts = line.split()
        if len(parts) < 3 or parts[0] != "edge":
            continue
        tail, head = parts[1].strip('"'), parts[2].strip('"')
        if tail not in band or head not in band or tail not in pos or head not in pos:
            continue
        if band[head] == band[tail]:
            if pos[head][0] <= pos[tail][0]:
                return False
        elif band[head] != band[tail] + 1 or rel(head) > 0.25 or rel(head) > rel(tail):
            return False
    return True


def _wrapped(source: str, plain: str, rankdir: str, bands: int) -> tuple[str, dict[str, int]] | None:
    """``source`` with its rank axis cut into up to ``bands`` columns (rows for LR).

    Edges that cross from one band into the next stop constraining the
    ranks, so every band starts again at the top (left): a long chain is
    drawn like newspaper columns instead of one tall strip. Cuts go between
    ranks and never through an innermost layer cluster (one layer's own
    ops) or a layer short enough to fit in one band (a block); longer
    containers such as ``Sequential`` or the model may be split, since
    otherwise a chain of containers (LeNet) can never wrap. Returns the
    wrapped source and the band of each node, or None when no such cut
    exists.
    """
    pos = {n: p[0] for n, p in _plain_nodes(plain, rankdir).items()}
    if len(pos) < 2:
        return None
    lo, hi = min(pos.values()), max(pos.values())
    extents = []
    # rows (LR) read like lines of text: a frame of collapsed blocks may continue on the next
    # row; columns (TB) keep such a frame whole (cut, it scatters its blocks over two columns)
    inner = _cluster_members(source, innermost=True, boxes_split=rankdir == "LR")
    for members in _cluster_members(source):
        ps = [pos[n] for n in members if n in pos]
        # a layer's own ops stay together (model-wide frames may be cut), and
        # so does any layer (a block) short enough to fit in one band
        limit = 0.9 if members in inner else 1.0 / bands
        if ps and max(ps) - min(ps) < limit * (hi - lo):
            extents.append((min(ps), max(ps)))
    ranks = sorted(set(round(p, 3) for p in pos.values()))
    allowed = [
        (a + b) / 2 for a, b in zip(ranks, ranks[1:])
        if not any(x0 < (a + b) / 2 < x1 for x0, x1 in extents)
    ]
    cuts: list[float] = []
    for i in range(1, bands):
        ideal = lo + (hi - lo) * i / bands
        free = [c for c in allowed if c not in cuts]
        if free:
            cuts.append(min(free, key=lambda c: abs(c - ideal)))
    cuts.sort()
    if not cuts:
        return None
    band = {n: sum(1 for c in cuts if p > c) for n, p in pos.items()}
    return _cut(source, lambda a, b: a in band and b in band and band[a] != band[b]), band


def _cut(source: str, crosses: Callable[[str, str], bool]) -> str:
    """``source`` with every edge for which ``crosses(tail, head)`` no longer constraining ranks."""
    out = []
    for line in source.split("\n"):
        m = _EDGE_LINE.match(line)
        if m and crosses(m.group(2), m.group(3)):
            rest = m.group(4)
            line = f"{m.group(1)}{m.group(2)} -> {m.group(3)} [constraint=false{', ' if rest else ''}{rest}]"
        out.append(line)
    return "\n".join(out)


def _cut_edges(source: str) -> frozenset[tuple[str, str]]:
    """The edges a wrapped source cut (to wrap the same structure again without a layout)."""
    found = set()
    for line in source.split("\n"):
        m = _EDGE_LINE.match(line)
        if m and m.group(4).startswith("constraint=false"):
            found.add((m.group(2), m.group(3)))
    return frozenset(found)


def _plan_png(
    make_source: Callable[[str], str], max_px: int, rankdir: str | None,
    timeout: float | None, wrap_only_if_legible: bool = False,
) -> _Plan:
    """The most legible way to draw ``make_source(rankdir)`` within ``max_px``.

    Tries top-down and left-right layouts and, for a long narrow strip,
    the same layout wrapped into bands. The highest dpi wins; within 15% of
    it, an unwrapped drawing wins (the edges from one band to the next are
    only worth it for legibility), then one inside the aspect window, then
    top-down. ``wrap_only_if_legible`` skips the wrapped layouts when even a
    square arrangement of the same area would be below ``LEGIBLE_DPI`` (the
    caller collapses the graph then).
    """
    plans: list[_Plan] = []
    for rd in [rankdir] if rankdir else ["TB", "LR"]:
        source = make_source(rd)
        plain = run_engine(source, "plain", timeout=timeout).decode("utf-8", "replace")
        head = plain.split("\n", 1)[0].split()
        w, h = float(head[2]), float(head[3])
        plans.append(_Plan(source, w, h, _dpi_for(w, h, max_px), rd, 1))
        rank_len, cross = (h, w) if rd in ("TB", "BT") else (w, h)
        if rd not in ("TB", "LR") or rank_len / max(cross, 1e-3) <= VIEW_ASPECT:
            continue
        if wrap_only_if_legible and (max_px - 1) / math.sqrt(max(w * h, 1e-6)) < LEGIBLE_DPI:
            continue
        if plans[-1].dpi >= FULL_DPI and plans[-1].aspect <= VIEW_ASPECT:
            continue
        ratio = rank_len / max(cross, 1e-3)
        k1 = max(2, round(math.sqrt(ratio)))
        k2 = int(math.sqrt(ratio * VIEW_ASPECT))
        # the two band counts that suit the strip, then their neighbours while those do not read
        # in order (a 12-block encoder reads in 3 or 6 rows, not in 4 or 5)
        tries = sorted({k1, k2} - {0, 1})[:2]
        first = len(tries)
        tries += [k for k in (min(tries) - 1, max(tries) + 1) if k > 1 and k not in tries]
        kept = 0
        for i, k in enumerate(tries):
            if i >= first and kept:
                break
            wrapped = _wrapped(source, plain, rd, k)
            if wrapped is None or any(wrapped[0] == p.source for p in plans):
                continue
            wsrc, band = wrapped
            try:
                wplain = run_engine(wsrc, "plain", timeout=timeout).decode("utf-8", "replace")
            except RuntimeError:  # Graphviz 2.43 can fail to route such edges
                continue
            if not _reads_in_order(wplain, rd, band):
                continue  # scattered blocks or snaking edges: better collapse further
            ww, wh = (float(v) for v in wplain.split("\n", 1)[0].split()[2:4])
            plans.append(_Plan(wsrc, ww, wh, _dpi_for(ww, wh, max_px), rd, k))
            kept += 1
    best_dpi = max(p.dpi for p in plans)
    near = [p for p in plans if p.dpi >= best_dpi / 1.15]
    # an unwrapped drawing first: wrapping costs edges between bands, paid only for legibility
    near.sort(key=lambda p: (p.bands > 1, p.aspect > VIEW_ASPECT * 1.02, p.rankdir != "TB", -p.dpi))
    near[0].area = min(p.width * p.height for p in plans if p.bands == 1)
    return near[0]


def fit_png(
    make_source: Callable[[str], str],
    *,
    max_px: int = VIEW_MAX_PX,
    rankdir: str | None = None,
    timeout: float | None = 120.0,
) -> bytes:
    """PNG of any DOT drawing with :func:`render_png`'s size policy (no collapsing).

    Args:
        make_source: returns the DOT source for a ``rankdir`` (``"TB"`` or
            ``"LR"``); called once per direction tried.
        max_px: the longest side of the bitmap, in pixels.
        rankdir: fix the direction instead of choosing it.
        timeout: seconds per engine run.

    Example:
        >>> png = fit_png(lambda rd: f"digraph {{ rankdir={rd}; a -> b -> c }}", max_px=300)
        >>> png_size(png)[0] <= 300
        True
    """
    if isinstance(max_px, bool) or not isinstance(max_px, int) or max_px < 64:
        raise ValueError(f"max_px must be an int >= 64, got {max_px!r}")
    plan = _plan_png(make_source, max_px, rankdir, timeout)
    return run_engine(plan.source, "png", args=(f"-Gdpi={plan.dpi:.3f}", *_pad_args(plan)), timeout=timeout)


def _pad_args(plan: _Plan) -> tuple[str, ...]:
    """``-Gpad`` that widens the short side so the bitmap stays in the aspect window."""
    w, h = plan.width + 2 * _PAD_IN, plan.height + 2 * _PAD_IN
    if max(w, h) / min(w, h) <= VIEW_ASPECT:
        return ()
    if h > w:
        px, py = _PAD_IN + (h / VIEW_ASPECT - w) / 2 + 0.01, _PAD_IN
    else:
        px, py = _PAD_IN, _PAD_IN + (w / VIEW_ASPECT - h) / 2 + 0.01
    return (f"-Gpad={px:.4f},{py:.4f}",)


def render_png(
    graph: BackwardGraph,
    *,
    max_px: int = VIEW_MAX_PX,
    timeout: float | None = 120.0,
    auto_collapse: bool = True,
    info: dict[str, Any] | None = None,
    min_dpi: float = LEGIBLE_DPI,
    **options: Any,
) -> bytes:
    """PNG bytes sized for viewing (VisualDL's image viewer, a browser).

    The size policy (measurements in ``docs/graphviz.md`` and
    ``docs/visualdl.md``):

    * The long side is at most ``max_px`` pixels and the resolution at most
      96 dpi (the drawing's natural size), so the bitmap is never larger
      than needed and rasterizing stays cheap.
    * Top-down and left-right layouts are both laid out (layout is cheap);
      a long narrow strip is also tried wrapped into 2-3 columns (rows).
      The arrangement allowing the highest resolution wins; among those
      within 15% of it, one whose aspect ratio is within 16:9 (either
      orientation), then top-down. If the winner is still a strip, the short
      side is padded so the image stays within 16:9.
    * Legibility floor: 48 dpi (``LEGIBLE_DPI``; an 11 pt node label 7.3 px
      high). When the best arrangement falls below it, ``auto_collapse`` is
      on, and neither ``max_nodes`` nor ``depth`` was given, the graph is
      collapsed by layer depth (deepest depth first, see
      :func:`paddleviz_hooks.collapse.collapse_graph`; ``by_type``
      and ``fold_repeats`` still apply) until it is legible, and the title
      says so. Pass ``depth=None`` to force every op, or
      ``auto_collapse=False``. :func:`render_svg` always keeps full detail.

    Args:
        graph: the graph.
        max_px: the longest side of the bitmap, in pixels.
        timeout: seconds per engine run before it is killed.
        auto_collapse: collapse an illegibly large graph (see above).
        info: a dict to fill with the decisions taken: ``nodes`` drawn,
            ``collapsed_depth`` (None when not collapsed), ``folded`` (repeated
            layers folded into one box), ``dpi``,
            ``rankdir``, ``bands`` (columns of a wrapped strip), ``padded``.
        min_dpi: the legibility floor (default ``LEGIBLE_DPI``); a viewer
            that must show node labels at least N px high asks for
            ``N * 72 / 11`` (labels are 11 pt).
        **options: collapse options (``depth``, ``by_type``, ``fold_repeats``,
            ``max_nodes``) and drawing options (``stats``, ``clusters``,
            ``legend``, ``title``; ``rankdir`` fixes the direction, otherwise
            it is chosen; ``dpi`` fixes the resolution and disables the size
            policy).

    Returns:
        The PNG file content.

    Raises:
        ValueError: ``max_px`` below 64 or invalid collapse options.
        EngineNotFound: no layout engine is installed.
        RenderTimeout: the engine ran past ``timeout``.

    Example:
        >>> import paddle
        >>> from paddleviz_hooks import capture_backward
        >>> net = paddle.nn.Linear(3, 2)
        >>> with capture_backward(net) as cap:
        ...     net(paddle.randn([2, 3])).sum().backward()
        >>> info = {}
        >>> data = render_png(cap.graph, info=info)      # legible, collapsed only if needed
        >>> info["collapsed_depth"] is None and max(png_size(data)) <= 2000
        True
        >>> data = render_png(cap.graph, max_nodes=3)    # an explicit node budget
    """
    return render_views(graph, ("png",), max_px=max_px, timeout=timeout, auto_collapse=auto_collapse, info=info,
                        min_dpi=min_dpi, **options)["png"]


def render_views(
    graph: BackwardGraph,
    formats: tuple[str, ...] = ("png",),
    *,
    max_px: int = VIEW_MAX_PX,
    timeout: float | None = 120.0,
    auto_collapse: bool = True,
    info: dict[str, Any] | None = None,
    full_detail: str | None = None,
    min_dpi: float = LEGIBLE_DPI,
    **options: Any,
) -> dict[str, bytes]:
    """The viewing picture of :func:`render_png` in each of ``formats``, from one final engine run.

    PNG and SVG come from the same layout (``dot -Tpng -Tsvg``); the SVG is
    the PNG's picture as vector graphics, at the PNG's scale. When
    ``info["full_detail"]`` is True (nothing was collapsed) that SVG has
    every node and edge of ``graph``; otherwise the full-detail SVG is a
    different graph and needs :func:`render_svg`.

    Args:
        graph, max_px, timeout, auto_collapse, min_dpi, **options: as for :func:`render_png`.
        formats: ``"png"`` and/or ``"svg"``; ``()`` only decides (fills ``info``).
        info: as for :func:`render_png`, plus ``full_detail`` and ``fold_repeats``.
        full_detail: how to see every op, said in the title of a collapsed
            drawing (default: the SVG file has every op).

    Returns:
        format -> bytes.

    Example:
        >>> import paddle
        >>> from paddleviz_hooks import capture_backward
        >>> net = paddle.nn.Linear(3, 2)
        >>> with capture_backward(net) as cap:
        ...     net(paddle.randn([2, 3])).sum().backward()
        >>> info = {}
        >>> out = render_views(cap.graph, ("png", "svg"), info=info)
        >>> sorted(out), info["full_detail"]
        (['png', 'svg'], True)
    """
    if isinstance(formats, str) or any(f not in ("png", "svg") for f in formats):
        raise ValueError(f"formats must be a tuple of 'png' and 'svg', got {formats!r}")
    if isinstance(max_px, bool) or not isinstance(max_px, int) or max_px < 64:
        raise ValueError(f"max_px must be an int >= 64, got {max_px!r}")
    explicit = "depth" in options or options.get("max_nodes") is not None
    keep = {k: options[k] for k in ("by_type", "fold_repeats") if k in options}
    g = prepare(graph, options)
    if options.get("dpi") is not None:
        if info is not None:
            info.update(full_detail=g is graph)
        return _draw(to_dot(g, **options), tuple(formats), (), timeout)
    rankdir = options.pop("rankdir", None)
    key = (_plan_key(graph, max_px, rankdir, auto_collapse, explicit, options, keep), min_dpi)
    cached = _PLANS.get(key)
    if cached is not None:  # same structure as an earlier drawing: reuse its decisions
        drawn = collapse_graph(graph, depth=cached.depth, **{**keep, "fold_repeats": cached.folded}) \
            if cached.collapsed else g
        opts = _with_note(options, drawn, graph, full_detail) if cached.collapsed else options
        source = to_dot(drawn, rankdir=cached.rankdir, **opts)
        if cached.cuts:
            source = _cut(source, lambda a, b: (a, b) in cached.cuts)
        plan = _Plan(source, cached.width, cached.height, cached.dpi, cached.rankdir, cached.bands)
    else:
        can_collapse = auto_collapse and not explicit and any(
            n.kind == "op" and n.layer is not None for n in g.nodes
        )
        if can_collapse and len(g.nodes) * _AREA_PER_NODE > 4 * ((max_px - 1) / min_dpi) ** 2:
            # far beyond legible at any arrangement: do not lay the full graph out (minutes
            # for 10,000 nodes), collapse straight away
            plan = _Plan("", 0.0, 0.0, 0.0, rankdir or "TB", 1, area=len(g.nodes) * _AREA_PER_NODE)
        else:
            plan = _plan_png(lambda rd: to_dot(g, rankdir=rd, **options), max_px, rankdir, timeout,
                             wrap_only_if_legible=can_collapse)
        drawn = g
        if plan.dpi < min_dpi and can_collapse:
            plan, drawn = _auto_collapse(graph, g, plan, max_px, options, keep, rankdir, timeout, full_detail,
                                         min_dpi)
        collapsed = drawn is not g
        used = drawn.meta.get("collapse", {}) if collapsed else {}
        _PLANS.put(key, _Decision(collapsed, used.get("depth"), bool(used.get("fold_repeats")), plan.rankdir,
                                  plan.dpi, plan.width, plan.height, plan.bands,
                                  _cut_edges(plan.source) if plan.bands > 1 else frozenset()))
    pad = _pad_args(plan)
    if info is not None:
        info.update(
            nodes=len(drawn.nodes),
            collapsed_depth=drawn.meta.get("collapse", {}).get("depth") if drawn is not graph else None,
            folded=drawn is not graph and bool(drawn.meta.get("collapse", {}).get("fold_repeats")),
            dpi=round(plan.dpi, 3), rankdir=plan.rankdir, bands=plan.bands, padded=bool(pad),
            full_detail=drawn is graph, fold_repeats=bool(drawn.meta.get("collapse", {}).get("fold_repeats")),
        )
    if not formats:
        return {}
    # -Gsize caps the bitmap at max_px even when labels of a reused plan grew a little
    cap = (max_px - 1) / plan.dpi - 2 * _PAD_IN
    return _draw(plan.source, tuple(formats), (f"-Gdpi={plan.dpi:.3f}", f"-Gsize={cap:.3f},{cap:.3f}", *pad), timeout)


_SVG_ROOT = re.compile(rb'<svg width="([\d.]+)pt" height="([\d.]+)pt"\s+viewBox="[^"]*"')


def _draw(source: str, formats: tuple[str, ...], args: tuple[str, ...], timeout: float | None) -> dict[str, bytes]:
    """One engine run writing ``formats``; the SVG's viewBox made to match its drawn size
    (see :func:`_svg_viewbox_as_drawn`)."""
    if len(formats) == 1:
        out = {formats[0]: run_engine(source, formats[0], args=args, timeout=timeout)}
    else:
        out = run_engine_formats(source, formats, args=args, timeout=timeout)
    if "svg" in out:
        out["svg"] = _svg_viewbox_as_drawn(out["svg"])
    return out


def _svg_viewbox_as_drawn(svg: bytes) -> bytes:
    """SVG whose ``viewBox`` matches its drawn size.

    With ``-Gdpi``, Graphviz 2.43 scales the drawing and its width and height
    but leaves the viewBox at the unscaled size, so viewers that honour the
    viewBox show the drawing shrunk into a corner; other engines write the
    scaled viewBox, which this leaves as it is.
    """
    return _SVG_ROOT.sub(lambda m: b'<svg width="%spt" height="%spt"\n viewBox="0.00 0.00 %s %s"'
                         % (m.group(1), m.group(2), m.group(1), m.group(2)), svg, count=1)


@dataclass(frozen=True)
class _Decision:
    """What :func:`render_png` chose for one graph structure."""

    collapsed: bool
    depth: int | None
    folded: bool
    rankdir: str
    dpi: float
    width: float
    height: float
    bands: int
    cuts: frozenset[tuple[str, str]]  # edges cut to wrap a strip into bands


class _PlanCache:
    """Size and collapse decisions by graph structure, so a capture whose structure
    equals an earlier one is laid out once instead of once per arrangement tried."""

    def __init__(self, size: int = 64) -> None:
        self._items: OrderedDict[Any, _Decision] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, key: Any) -> _Decision | None:
        with self._lock:
            d = self._items.get(key)
            if d is not None:
                self._items.move_to_end(key)
            return d

    def put(self, key: Any, decision: _Decision) -> None:
        with self._lock:
            self._items[key] = decision
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)


_PLANS = _PlanCache()


def clear_plan_cache() -> None:
    """Forget the size and collapse plans reused by :func:`render_png` (benchmarks use it
    to time a first drawing)."""
    global _PLANS
    _PLANS = _PlanCache()


def _plan_key(graph: BackwardGraph, max_px: int, rankdir: str | None, auto_collapse: bool, explicit: bool,
              options: dict[str, Any], keep: dict[str, Any]) -> Any:
    """Structure (node keys, edges, layers) plus every option but the title."""
    structure = (tuple(n.key or f"#{n.id}" for n in graph.nodes), tuple((e.src, e.dst) for e in graph.edges),
                 tuple(sorted(graph.layers.items())))
    opts = tuple(sorted((k, repr(v)) for k, v in {**options, **keep}.items() if k != "title"))
    return hash((structure, max_px, rankdir, auto_collapse, explicit, opts))


def _auto_collapse(
    graph: BackwardGraph, g: BackwardGraph, plan: _Plan, max_px: int, options: dict[str, Any],
    keep: dict[str, Any], rankdir: str | None, timeout: float | None, full_detail: str | None = None,
    min_dpi: float = LEGIBLE_DPI,
) -> tuple[_Plan, BackwardGraph]:
    """Collapse by depth, deepest first, until the drawing is legible.

    Every layer stays its own box as long as some depth is legible that way:
    the depths are tried unfolded first (deepest to 1), then with repeated
    blocks folded into "x N" boxes (deepest to 1), then the whole model as
    one box (depth 0). So six encoder blocks are six boxes whenever six
    boxes are legible, and folded only when they are not.
    """
    deepest = max(layer_depths(graph).values(), default=0)
    best, best_graph = plan, g
    # A drawing's area grows about linearly with its node count and the best
    # arrangement of an area A is a square (dpi = max_px / sqrt(A)), so a
    # depth with more nodes than this cannot reach the floor: skip its layout.
    square_dpi = (max_px - 1) / math.sqrt(max(plan.area, 1e-6))
    hopeless = len(g.nodes) * (square_dpi / min_dpi) ** 2 * 1.5
    tries = [(d, False) for d in range(deepest, 0, -1)]
    if "fold_repeats" not in keep:
        tries += [(d, True) for d in range(deepest, 0, -1)]
    tries.append((0, False))
    seen = set()
    for d, fold in tries:
        c = collapse_graph(graph, depth=d, **keep, **({"fold_repeats": True} if fold else {}))
        if len(c.nodes) >= len(g.nodes) or (len(c.nodes) > hopeless and d > 0):
            continue
        drawn = tuple((n.key, n.layer, n.count) for n in c.nodes)
        if drawn in seen:  # the same boxes as a depth already tried
            continue
        seen.add(drawn)
        opts = _with_note(options, c, graph, full_detail)
        p = _plan_png(lambda rd: to_dot(c, rankdir=rd, **opts), max_px, rankdir, timeout)
        if p.dpi > best.dpi:
            best, best_graph = p, c
        if p.dpi >= min_dpi:
            break
    return best, best_graph


def _with_note(options: dict[str, Any], collapsed: BackwardGraph, full: BackwardGraph,
               full_detail: str | None = None) -> dict[str, Any]:
    note = collapse_note(collapsed, full, full_detail) if full_detail else collapse_note(collapsed, full)
    title = options.get("title")
    return {**options, "title": f"{title} - {note}" if title else note}


def render_to_file(graph: BackwardGraph, path: str | os.PathLike, format: str | None = None, **options: Any) -> str:
    """Write ``graph`` to ``path`` as png, svg, dot or json (see ``BackwardGraph.render``)."""
    path, fmt = output_target(path, format, _FORMATS)
    if fmt == "json":
        data = graph.to_json(indent=1).encode("utf-8")
    elif fmt == "dot":
        data = to_dot(prepare(graph, options), **options).encode("utf-8")
    elif fmt == "svg":
        data = render_svg(graph, **options)
    else:
        data = render_png(graph, **options)
    atomic_write(path, data)
    return path
