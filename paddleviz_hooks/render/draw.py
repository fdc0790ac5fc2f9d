"""Drawing a BackwardGraph to SVG at full detail, or to a PNG sized for viewing.

The PNG policy (``docs/graphviz.md`` has the measurements): layout is cheap
and rasterizing a huge bitmap is what costs, and VisualDL's viewer fits an
image to the window and zooms at most 3x. So a viewing PNG is drawn in the
arrangement (top-down, left to right, or left to right in rows) that allows
the larger scale, within ``max_px`` and the aspect ratio 16:9, never larger
than the drawing at 96 dpi; a graph that would be drawn below the legibility
floor (``LEGIBLE_DPI``) is collapsed into layer boxes
(``paddleviz_hooks.collapse``) only as far as that needs. This module lists
the levels of detail; ``render/plan.py`` chooses among them within a few
engine runs and caches the choice by structure. SVG keeps full detail. See
:func:`render_png`.
"""

from __future__ import annotations

import os
import re
import struct
from typing import Any, Callable

from .._fileio import atomic_write
from ..collapse import collapse_graph, layer_depths
from ..graph import BackwardGraph
from ..text import collapse_note
from .dot import to_dot
from .engine import run_engine, run_engine_formats
from .output import output_target
from .plan import Candidate, Frame, clear_plan_cache, draw_planned

__all__ = ["clear_plan_cache", "render_png", "render_views", "fit_png", "render_svg", "render_to_file", "layout_size",
           "png_size", "prepare", "collapse_specs", "structure_key", "svg_viewbox_as_drawn", "LEGIBLE_DPI",
           "VIEW_MAX_PX"]

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
#: Below this resolution the drawing is not legible: at 48 dpi an 11 pt node
#: label is 7.3 px high and a 9 pt edge label 6 px, the smallest sizes at
#: which Graphviz's antialiased Helvetica still reads (at 40 dpi op names
#: read but gradient shapes and norms on the edges blur; at 32 dpi nothing).
LEGIBLE_DPI = 48.0

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

    Examples:
        >>> png = fit_png(lambda rd: f"digraph {{ rankdir={rd}; a -> b -> c }}", max_px=300)
        >>> png_size(png)[0] <= 300
        True
    """
    if isinstance(max_px, bool) or not isinstance(max_px, int) or max_px < 64:
        raise ValueError(f"max_px must be an int >= 64, got {max_px!r}")
    key = ("fit", make_source("TB"), max_px, rankdir)
    cand = Candidate(None, 0, make_source)
    return draw_planned(key, [cand], ("png",), Frame(max_px, max_px), rankdirs=(rankdir,) if rankdir else ("TB", "LR"),
                        min_dpi=LEGIBLE_DPI, timeout=timeout).outputs["png"]


def render_png(
    graph: BackwardGraph,
    *,
    max_px: int = VIEW_MAX_PX,
    timeout: float | None = 120.0,
    auto_collapse: bool = True,
    info: dict[str, Any] | None = None,
    min_dpi: float = LEGIBLE_DPI,
    max_height_px: int | None = None,
    **options: Any,
) -> bytes:
    """PNG bytes sized for viewing (VisualDL's image viewer, a browser).

    The size policy (measurements in ``docs/graphviz.md`` and
    ``docs/visualdl.md``):

    * The long side is at most ``max_px`` pixels and the resolution at most
      96 dpi (the drawing's natural size), so the bitmap is never larger
      than needed and rasterizing stays cheap.
    * Top-down and left-right arrangements are both considered, and a long
      left-to-right strip also wrapped into rows that read like lines of
      text (a top-down drawing is never wrapped: its edges would run up).
      The arrangement allowing the highest resolution wins; among those
      within 15% of it, one whose aspect ratio is within 16:9 (either
      orientation), then top-down. If the winner is still a strip, the short
      side is padded so the image stays within 16:9. The sizes are predicted
      (``render/sizes.py``) and checked by the engine runs that draw: a new
      structure costs at most ``render.plan.MAX_ATTEMPTS`` runs, a structure
      drawn before one run (``render/plan.py``).
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
            ``rankdir``, ``bands`` (rows of a wrapped strip), ``padded``,
            ``engine_runs`` (that this drawing took).
        min_dpi: the legibility floor (default ``LEGIBLE_DPI``); a viewer
            that must show node labels at least N px high asks for
            ``N * 72 / 11`` (labels are 11 pt).
        max_height_px: the bitmap's height bound (default ``max_px``): a
            viewer's frame, such as VisualDL's landscape one.
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

    Examples:
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
                        min_dpi=min_dpi, max_height_px=max_height_px, **options)["png"]


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
    max_height_px: int | None = None,
    **options: Any,
) -> dict[str, bytes]:
    """The viewing picture of :func:`render_png` in each of ``formats``, from one final engine run.

    PNG and SVG come from the same layout (``dot -Tpng -Tsvg``); the SVG is
    the PNG's picture as vector graphics, at the PNG's scale. When
    ``info["full_detail"]`` is True (nothing was collapsed) that SVG has
    every node and edge of ``graph``; otherwise the full-detail SVG is a
    different graph and needs :func:`render_svg`.

    Args:
        graph, max_px, timeout, auto_collapse, min_dpi, max_height_px, **options: as for :func:`render_png`.
        formats: ``"png"`` and/or ``"svg"``; ``()`` only decides (fills ``info``).
        info: as for :func:`render_png`, plus ``full_detail`` and ``fold_repeats``.
        full_detail: how to see every op, said in the title of a collapsed
            drawing (default: the SVG file has every op).

    Returns:
        format -> bytes.

    Examples:
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
    height = max_px if max_height_px is None else max_height_px
    can_collapse = auto_collapse and not explicit and any(n.kind == "op" and n.layer is not None for n in g.nodes)

    def build(spec: Any) -> Candidate:
        if spec is None:
            drawn, opts = g, options
        else:
            depth, fold, *one = spec
            drawn = collapse_graph(graph, depth=depth, **{**keep, "fold_repeats": fold}, show_one=bool(one))
            opts = _with_note(options, drawn, graph, full_detail)
        return Candidate(spec, len(drawn.nodes), lambda rd: to_dot(drawn, rankdir=rd, **opts), drawn)

    def candidates():
        yield build(None)
        if not can_collapse:
            return
        seen = set()
        for spec in collapse_specs(graph, keep, show_one=True):
            c = build(spec)
            shape = tuple((n.key, n.layer, n.count) for n in c.data.nodes)
            if len(c.data.nodes) >= len(g.nodes) or shape in seen:  # no fewer boxes than one tried
                continue
            seen.add(shape)
            yield c

    structure = structure_key(graph)
    key = (structure, _options_key(options, keep), max_px, height, rankdir, auto_collapse, explicit, min_dpi)
    planned = draw_planned(key, candidates(), tuple(formats), Frame(max_px, height),
                           rankdirs=(rankdir,) if rankdir else ("TB", "LR"), min_dpi=min_dpi, timeout=timeout,
                           structure=structure, build=build)
    drawn = planned.candidate.data if planned.candidate is not None else g
    d = planned.decision
    if info is not None:
        used = drawn.meta.get("collapse", {}) if drawn is not graph else {}
        info.update(
            nodes=len(drawn.nodes), collapsed_depth=used.get("depth") if drawn is not graph else None,
            folded=bool(used.get("fold_repeats")), dpi=round(d.dpi, 3), rankdir=d.rankdir, bands=d.bands,
            padded=planned.padded, full_detail=drawn is graph, fold_repeats=bool(used.get("fold_repeats")),
            engine_runs=planned.attempts, show_one=bool(used.get("show_one")), shown=dict(used.get("shown") or {}),
        )
    out = planned.outputs
    if "svg" in out:
        out["svg"] = svg_viewbox_as_drawn(out["svg"])
    return out


def collapse_specs(graph: BackwardGraph, keep: dict[str, Any], show_one: bool = False) -> list[tuple]:
    """The collapse levels a viewing picture may take, most detailed first.

    Every layer stays its own box as long as some depth is legible that way:
    the depths unfolded (deepest to 1), then with repeated blocks folded into
    "x N" boxes (deepest to 1), then the whole model as one box (depth 0). So
    six encoder blocks are six boxes whenever six boxes are legible, and
    folded only when they are not.

    With ``show_one`` (and ``fold_repeats`` not given), the levels ``(depth,
    True, True)`` come in after the unfolded depths: repeated blocks folded
    but one block of each run drawn beside its box at that depth
    (``collapse_graph``'s ``show_one``), every op of it first (depth None),
    then deeper to shallower. A fold that still shows a block's inside is
    more detail than every block folded into one box and far more than the
    whole model as one box, so it comes before those; it comes after every
    unfolded depth, because a fold hides each block's own numbers. So the 224
    blocks of a deep encoder are one "x223" box beside one block drawn op by
    op (224 boxes are not legible), not 3 boxes, while six blocks stay six
    boxes whenever that is legible.
    """
    deepest = max(layer_depths(graph).values(), default=0)
    fold = bool(keep.get("fold_repeats", False))
    specs: list[tuple] = [(d, fold) for d in range(deepest, 0, -1)]
    if "fold_repeats" not in keep:
        if show_one:
            specs += [(None, True, True)] + [(d, True, True) for d in range(deepest, 0, -1)]
        specs += [(d, True) for d in range(deepest, 0, -1)]
    return specs + [(0, fold)]


_SVG_ROOT = re.compile(rb'<svg width="([\d.]+)pt" height="([\d.]+)pt"\s+viewBox="[^"]*"')


def _draw(source: str, formats: tuple[str, ...], args: tuple[str, ...], timeout: float | None) -> dict[str, bytes]:
    """One engine run writing ``formats``; the SVG's viewBox made to match its drawn size
    (see :func:`_svg_viewbox_as_drawn`)."""
    if len(formats) == 1:
        out = {formats[0]: run_engine(source, formats[0], args=args, timeout=timeout)}
    else:
        out = run_engine_formats(source, formats, args=args, timeout=timeout)
    if "svg" in out:
        out["svg"] = svg_viewbox_as_drawn(out["svg"])
    return out


def svg_viewbox_as_drawn(svg: bytes) -> bytes:
    """SVG whose ``viewBox`` matches its drawn size.

    With ``-Gdpi``, Graphviz 2.43 scales the drawing and its width and height
    but leaves the viewBox at the unscaled size, so viewers that honour the
    viewBox show the drawing shrunk into a corner; other engines write the
    scaled viewBox, which this leaves as it is.
    """
    return _SVG_ROOT.sub(lambda m: b'<svg width="%spt" height="%spt"\n viewBox="0.00 0.00 %s %s"'
                         % (m.group(1), m.group(2), m.group(1), m.group(2)), svg, count=1)


def structure_key(graph: BackwardGraph) -> int:
    """The graph's structure (node keys, edges, layers): captures with equal keys draw alike."""
    return hash((tuple(n.key or f"#{n.id}" for n in graph.nodes), tuple((e.src, e.dst) for e in graph.edges),
                 tuple(sorted(graph.layers.items()))))


def _options_key(options: dict[str, Any], keep: dict[str, Any]) -> tuple:
    """Every drawing option but the title (which changes at every step)."""
    return tuple(sorted((k, repr(v)) for k, v in {**options, **keep}.items() if k != "title"))


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
