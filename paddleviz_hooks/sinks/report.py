"""One self-contained HTML page showing every captured step of a log directory.

VisualDL keeps only 10 image samples per tag (``docs/visualdl.md``);
this page shows all of them. It needs no network: CSS, JS and SVGs are inline.
The page template, its CSS and its JavaScript are asset files in
``report_assets/``; this module only builds the data and the escaped HTML
fragments that go into the template.

What it shows, per run (a folder holding ``step_*.json`` files):

* a step slider (plus a strip of cells, one per step, marking structure
  changes and NaN/Inf) and the SVG drawing of the selected step, with pan
  (drag) and zoom (mouse wheel);
* with "highlight changes" on, the drawing of the changes since the previous
  capture (added green, removed as grey ghosts, large gradient-norm changes);
* the summary, the changes and the NaN/Inf sites of the step;
* the per-layer gradient norm over all steps as a small inline SVG chart.

Everything that comes from graphs (layer, op and parameter names) is escaped
with :func:`~paddleviz_hooks.escape.html_escape`; the data block is
JSON with ``<``, ``>`` and ``&`` written as ``\\u003c`` etc., so no text can end
the script element.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from string import Template
from typing import Any

from .._fileio import MAX_INPUT_BYTES, atomic_write, read_input
from ..argcheck import check_path
from ..diff import DIFF_FORMAT, GraphDiff, diff_graphs
from ..escape import clean_svg, html_escape, json_for_script
from ..findings import record_of
from ..graph import BackwardGraph, parse_json
from ..render import render_diff, render_ranks, render_svg
from ..render.output import DRAW_MAX_NODES
from ..text import (FIRST_GRADIENT, backward_role, call_name, capture_title, chart_point_text, describe_first_gradient,
                    describe_node, describe_origin, diff_summary, fmt_bytes, fmt_num, graph_summary, origin_badge,
                    plural, rank_comparison_lines)
from .report_ranks import MergedRun, merged_chart, merged_overview, merged_panel, merged_run

__all__ = ["build_report", "capture_order", "find_step_files", "ReportError"]

_STEP_FILE = re.compile(r"^step_(\d+)(?:_(.+))?\.json$")
#: The suffix of a step's second (third...) backward, or of a backward run inside another:
#: one more capture of the same step, in the same run.
BACKWARD_SUFFIX = re.compile(r"^(b|nested)(\d+)$")


def backward_order(suffix: str) -> int:
    """Which backward of its step a capture is, from its file suffix: 1 for the first (no
    suffix), 2 for ``b2``...; a backward run inside another (``nestedN``) after all of them.

    Examples:
        >>> [backward_order(s) for s in ("", "b2", "b10")], backward_order("nested1") > backward_order("b99")
        ([1, 2, 10], True)
    """
    m = BACKWARD_SUFFIX.match(suffix)
    if m is None:
        return 1
    return int(m.group(2)) + (0 if m.group(1) == "b" else 1_000_000)


def run_suffix(suffix: str) -> str:
    """The suffix of the run a capture belongs to: a step's further backwards (``b2``,
    ``nested1``) belong to the run of its first; another suffix (``rank1``) is a run of its own.

    Examples:
        >>> run_suffix("b2"), run_suffix("nested1"), run_suffix("rank1")
        ('', '', 'rank1')
    """
    return "" if BACKWARD_SUFFIX.match(suffix) else suffix


def capture_order(step: int, suffix: str = "") -> tuple[int, int]:
    """The order of the captures of one run, in every view that lists them or picks the first
    NaN/Inf (the report, the explorer's graph list and the capture it opens at): by training
    step, then by which backward of the step it was (:func:`backward_order`).

    Examples:
        >>> sorted([(7, ""), (6, "b3"), (6, ""), (6, "b10"), (6, "b2")], key=lambda c: capture_order(*c))
        [(6, ''), (6, 'b2'), (6, 'b3'), (6, 'b10'), (7, '')]
    """
    return step, backward_order(suffix)


_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
MAX_CHART_LINES = 8


class ReportError(Exception):
    """The log directory holds nothing a report can be built from."""


@dataclass
class _Step:
    number: int
    json_path: str
    graph: BackwardGraph | None = None
    svg: str | None = None
    diff: GraphDiff | None = None
    diff_svg: str | None = None
    problem: str | None = None
    rank: int | None = None  # in a rank_K folder: K
    rank_base: BackwardGraph | None = None  # rank 0's capture of the same step
    rank_diff: GraphDiff | None = None
    suffix: str = ""  # which backward of the step: "" (the first), "b2", ...
    role: str = ""  # the same, in words (text.backward_role): "micro-batch 2 of 2"
    older: "_Step | None" = None  # the capture diffed against: the same backward of an earlier step

    @property
    def order(self) -> tuple[int, int]:
        """Where this capture comes in its run (:func:`capture_order`)."""
        return capture_order(self.number, self.suffix)

    @property
    def title(self) -> str:
        """``step 3``, ``step 3 - micro-batch 2 of 2``."""
        return capture_title(self.number, role=self.role)


@dataclass
class _Run:
    name: str
    directory: str
    steps: list[_Step] = field(default_factory=list)
    suffix: str = ""


def find_step_files(log_dir: str,
                    skipped: list[tuple[str, str]] | None = None) -> dict[tuple[str, str], list[tuple[int, str]]]:
    """Every ``step_*.json`` under ``log_dir``, grouped by (folder, suffix).

    ``step_000100.json`` has the suffix ``""``; ``step_000100_rank1.json``
    the suffix ``"rank1"`` (one series per suffix). Steps are sorted. Links to
    folders are not followed, and a link to a file outside ``log_dir`` is
    left out: it goes on ``skipped`` (its path relative to ``log_dir``, why)
    and is warned about, as an unreadable file is.
    """
    found: dict[tuple[str, str], list[tuple[int, str]]] = {}
    root = os.path.realpath(log_dir)
    for dirpath, dirnames, filenames in os.walk(log_dir):
        dirnames.sort()
        for name in filenames:
            m = _STEP_FILE.match(name)
            if m:
                path = os.path.join(dirpath, name)
                if os.path.islink(path) and os.path.commonpath([root, os.path.realpath(path)]) != root:
                    reason = skip_file(path, "a link to a file outside the log directory (not read)")
                    if skipped is not None:
                        skipped.append((os.path.relpath(path, log_dir), reason))
                    continue
                found.setdefault((dirpath, m.group(2) or ""), []).append(
                    (int(m.group(1)), os.path.join(dirpath, name))
                )
    for files in found.values():
        files.sort()
    return dict(sorted(found.items()))


def no_steps_error(log_dir: str, skipped: list[tuple[str, str]] | None = None) -> "ReportError":
    """What ``report`` and ``explore`` say when ``log_dir`` holds no capture they can read.

    Examples:
        >>> print(no_steps_error("logs"))
        no step_*.json files under logs (a recorder or callback writes them to LOG_DIR/backward_graph: pass its log_dir, or a folder above it)
        >>> print(no_steps_error("logs", [("backward_graph/step_000001.json", "not JSON")]))
        no readable step_*.json under logs (e.g. backward_graph/step_000001.json: not JSON)
    """
    if skipped:
        return ReportError(f"no readable step_*.json under {log_dir} (e.g. {skipped[0][0]}: {skipped[0][1]})")
    return ReportError(f"no step_*.json files under {log_dir} (a recorder or callback writes them to "
                       "LOG_DIR/backward_graph: pass its log_dir, or a folder above it)")


def skip_file(path: str, why: Exception | str) -> str:
    """Warn that the capture file ``path`` is skipped, and why (returned, as people read it)."""
    reason = why if isinstance(why, str) else (
        why.strerror if isinstance(why, OSError) and why.strerror else str(why))
    warnings.warn(f"skipped {path}: {reason}", RuntimeWarning, stacklevel=3)
    return reason


class _NotAGraph(Exception):
    """A file the report knows and skips silently (the callback's saved diffs)."""


def _read_graph(path: str, max_bytes: int = MAX_INPUT_BYTES) -> BackwardGraph:
    data = read_input(path, max_bytes)  # a regular file of a bounded size
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    d = parse_json(text)
    if isinstance(d, dict) and d.get("format") == DIFF_FORMAT:
        raise _NotAGraph(path)  # step_000100_diff.json: the report makes its own diffs
    g = BackwardGraph.from_dict(d)
    if any(not n.key for n in g.nodes):
        g.assign_keys()
    return g


def _existing_svg(json_path: str) -> str | None:
    svg_path = json_path[: -len(".json")] + ".svg"
    try:
        with open(svg_path, "r", encoding="utf-8") as f:
            return clean_svg(f.read())
    except (OSError, UnicodeDecodeError):
        return None


def _render(fn, *args, **kwargs) -> tuple[str | None, str | None]:
    try:
        data = fn(*args, **kwargs)
        svg = clean_svg(data.decode("utf-8", "replace"))
        return (svg, None) if svg else (None, "the drawing was not usable SVG")
    except Exception as exc:  # no engine, timeout, engine failure: report it on the page
        return None, f"{type(exc).__name__}: {exc}"


def _step_number(graph: BackwardGraph, file_number: int) -> int:
    s = graph.meta.get("step")
    return s if isinstance(s, int) and not isinstance(s, bool) else file_number


def _load_runs(log_dir: str, timeout: float,
               max_bytes: int = MAX_INPUT_BYTES) -> tuple[list[_Run], list[tuple[str, str]], list[MergedRun]]:
    skipped: list[tuple[str, str]] = []
    groups = find_step_files(log_dir, skipped)
    if not groups:
        raise no_steps_error(log_dir)
    by_key: dict[tuple[str, str], _Run] = {}
    for (directory, suffix), files in groups.items():
        # a step's further backwards (step_N_b2.json...) belong to the run of its first
        own = run_suffix(suffix)
        rel = os.path.relpath(directory, log_dir)
        name = os.path.basename(os.path.abspath(log_dir)) if rel == "." else rel
        run = by_key.get((directory, own)) or by_key.setdefault(
            (directory, own), _Run(name + (f" [{own}]" if own else ""), directory, suffix=own))
        for number, path in files:
            try:
                g = _read_graph(path, max_bytes)
            except _NotAGraph:
                continue
            except (OSError, ValueError) as exc:
                skipped.append((os.path.relpath(path, log_dir), skip_file(path, exc)))
                continue
            role = backward_role(g.meta.get("backward")) if suffix != own else ""
            run.steps.append(_Step(_step_number(g, number), path, g, suffix=suffix if suffix != own else "",
                                   role=role))
    runs = [run for run in by_key.values() if run.steps]
    for run in runs:
        run.steps.sort(key=lambda s: s.order)
        if any(st.suffix for st in run.steps):  # the first backward of a step with several is named too
            for st in run.steps:
                if not st.suffix:
                    st.role = backward_role(st.graph.meta.get("backward"))
    if not runs:
        raise no_steps_error(log_dir, skipped or [("?", "?")])

    merged = _pair_ranks(runs)
    jobs = [(st, "svg", render_ranks, (st.graphs,), {}) for m in merged for st in m.steps]
    for run in runs:
        prevs: dict[str, _Step] = {}  # each backward is compared with the same backward earlier
        for st in run.steps:
            prev = prevs.get(st.suffix)
            st.svg = _existing_svg(st.json_path)
            big = {"max_nodes": DRAW_MAX_NODES} if len(st.graph.nodes) > DRAW_MAX_NODES else {}
            if st.svg is None:
                jobs.append((st, "svg", render_svg, (st.graph,), {"title": f"step {st.number}", **big}))
            # a replayed step (rooted at the model output) is compared too: diff_graphs aligns it
            if prev is not None:
                st.older = prev
                st.diff = diff_graphs(prev.graph, st.graph)
                if st.diff.changed:
                    jobs.append((st, "diff_svg", render_diff, (st.diff, st.graph, prev.graph), {"format": "svg", **big}))
            prevs[st.suffix] = st
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [
            (st, attr, pool.submit(_render, fn, *args, timeout=timeout, **kwargs))
            for st, attr, fn, args, kwargs in jobs
        ]
        for st, attr, fut in futures:
            svg, problem = fut.result()
            setattr(st, attr, svg)
            if problem and st.problem is None:
                st.problem = problem
    return runs, skipped, merged


_RANK_DIR = re.compile(r"rank_(\d+)")


def _pair_ranks(runs: list[_Run]) -> list[MergedRun]:
    """A run in ``X/rank_K`` (the recorder's folder for rank K) is compared, step by step,
    with the run in ``X`` (rank 0): structure by :func:`diff_graphs`, norms side by side.

    Returns:
        The merged view of each run that has ranks (see ``report_ranks``).
    """
    by_dir = {(os.path.abspath(r.directory), r.suffix): r for r in runs}
    groups: dict[int, tuple[_Run, dict[int, dict[int, BackwardGraph]]]] = {}
    for run in runs:
        m = _RANK_DIR.fullmatch(os.path.basename(run.directory))
        base = by_dir.get((os.path.dirname(os.path.abspath(run.directory)), run.suffix))
        if m is None or base is None:
            continue
        base_steps = {(st.number, st.suffix): st for st in base.steps}
        # the merged drawing matches each step's first backward across the ranks
        by_rank = groups.setdefault(id(base), (base, {0: {st.number: st.graph for st in base.steps if not st.suffix}}))[1]
        by_rank[int(m.group(1))] = {st.number: st.graph for st in run.steps if not st.suffix}
        for st in run.steps:
            other = base_steps.get((st.number, st.suffix))
            if other is not None:
                st.rank, st.rank_base = int(m.group(1)), other.graph
                st.rank_diff = diff_graphs(other.graph, st.graph)
    found = (merged_run(base.name, by_rank) for base, by_rank in groups.values())
    return [m for m in found if m is not None]


# ---------------------------------------------------------------- HTML parts
def _e(text: Any) -> str:
    return html_escape(text)


def _fmt(v: float | None) -> str:
    return fmt_num(v, digits=4)


def _chart_depth(graphs: list[BackwardGraph]) -> int:
    max_depth = 1
    for g in graphs:
        for name in g.params():
            max_depth = max(max_depth, len(name.split(".")) - 1)
    best = 1
    for d in range(1, max_depth + 1):
        groups = set()
        for g in graphs:
            groups.update(g.layer_grad_norms(d))
        if len(groups) <= MAX_CHART_LINES:
            best = d
        else:
            break
    return best


_CHART_BOX = (360, 196, 44, 8, 10, 36)  # width, height, left, right, top, bottom margins
#: The y axis of the gradient-norm chart, in words.
CHART_Y_TITLE = "gradient L2 norm, log scale"
CHART_X_TITLE = "training step"
_CHART_X_LABELS = 7  # step numbers written under the x axis, at most


def _chart_x(i: int, n: int) -> float:
    W, _, L, R, _, _ = _CHART_BOX
    return round(L + (W - L - R) * (i / (n - 1) if n > 1 else 0.5), 1)


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Where a log axis from ``lo`` to ``hi`` gets a labelled tick: at each power of ten, and
    at 2 and 5 times (then more multiples) when fewer than two powers of ten fall inside.

    Examples:
        >>> _log_ticks(0.003, 40)
        [0.01, 0.1, 1.0, 10.0]
        >>> _log_ticks(0.7, 3.5)
        [1.0, 2.0]
        >>> _log_ticks(1.1, 1.9)
        [1.2, 1.4, 1.6, 1.8]
    """
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    decades = [float(10.0 ** p) for p in range(first, last + 1) if lo <= 10.0 ** p <= hi]
    if len(decades) >= 2:
        return decades
    ticks: list[float] = decades
    for mults in ((1, 2, 5), (1, 2, 3, 5, 7), range(1, 10), [m / 10 for m in range(10, 100, 2)]):
        ticks = sorted({float(f"{m * 10.0 ** p:.6g}") for p in range(first - 1, last + 1) for m in mults
                        if lo <= m * 10.0 ** p <= hi})
        if len(ticks) >= 2:
            return ticks
    return ticks


def _tick_text(v: float) -> str:
    """``0.01``, ``500``, ``1e-05``: short, exact for the round values ticks sit at."""
    return f"{v:g}"


def _chart(run: _Run, ri: int) -> str:
    """Inline SVG: per-layer gradient norm over the run's captures (log scale). Each capture is
    one x position; the x axis names the training steps (a step with several backwards,
    micro-batches, has several positions). Every point is marked and says, on hover, its layer,
    step (and which backward of the step) and value."""
    graphs = [s.graph for s in run.steps]
    depth = _chart_depth(graphs)
    series: dict[str, list[float | None]] = {}
    per_step = [g.layer_grad_norms(depth) for g in graphs]
    for i, norms in enumerate(per_step):
        for name, v in norms.items():
            series.setdefault(name, [None] * len(graphs))[i] = v
    if not series:
        return '<p class="muted">No gradient statistics were recorded (grad_stats off).</p>'

    def peak(vals):
        finite = [v for v in vals if v is not None and math.isfinite(v)]
        return max(finite) if finite else 0.0

    names = sorted(series, key=lambda n: -peak(series[n]))[:MAX_CHART_LINES]
    hidden = len(series) - len(names)
    positive = [v for n in names for v in series[n] if v is not None and math.isfinite(v) and v > 0]
    lo, hi = (min(positive), max(positive)) if positive else (1e-3, 1.0)
    if hi / lo < 10:
        mid = math.sqrt(hi * lo)
        lo, hi = mid / math.sqrt(10), mid * math.sqrt(10)
    pad = (math.log10(hi) - math.log10(lo)) * 0.04  # no point drawn on the frame
    llo, lhi = math.log10(lo) - pad, math.log10(hi) + pad
    W, H, L, R, T, B = _CHART_BOX
    n = len(graphs)

    def x(i: int) -> float:
        return _chart_x(i, n)

    def y(v: float) -> float:
        return T + (H - T - B) * (1 - (math.log10(v) - llo) / (lhi - llo))

    parts = [
        f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" aria-label="per-layer {CHART_Y_TITLE}, over training steps">',
        f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="#fafafa" stroke="#ddd"/>',
    ]
    for v in _log_ticks(10.0 ** llo, 10.0 ** lhi):
        yy = y(v)
        parts.append(f'<line x1="{L}" x2="{W - R}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#e4e4e4"/>')
        parts.append(f'<text x="{L - 4}" y="{yy + 3:.1f}" text-anchor="end" class="tick y">{_tick_text(v)}</text>')
    mid_y = T + (H - T - B) / 2
    parts.append(f'<text transform="rotate(-90)" x="{-mid_y:.1f}" y="9" text-anchor="middle" class="axis">'
                 f'{_e(CHART_Y_TITLE)}</text>')
    # the x axis: true training steps, each under the middle of its captures
    where: dict[int, list[float]] = {}
    for i, st in enumerate(run.steps):
        where.setdefault(st.number, []).append(x(i))
    numbers = list(where)
    if len(numbers) > _CHART_X_LABELS:
        picks = sorted({round(k * (len(numbers) - 1) / (_CHART_X_LABELS - 1)) for k in range(_CHART_X_LABELS)})
        numbers = [numbers[k] for k in picks]
    for k, number in enumerate(numbers):
        xs = where[number]
        xx = (min(xs) + max(xs)) / 2
        anchor = "start" if xx <= L + 4 and len(numbers) > 1 else "end" if xx >= W - R - 4 and len(numbers) > 1 else "middle"
        parts.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{H - B}" y2="{H - B + 3}" stroke="#999"/>')
        parts.append(f'<text x="{xx:.1f}" y="{H - B + 12}" text-anchor="{anchor}" class="tick x">{_e(number)}</text>')
    parts.append(f'<text x="{L + (W - L - R) / 2:.1f}" y="{H - 4}" text-anchor="middle" class="axis">'
                 f'{_e(CHART_X_TITLE)}</text>')
    legend = []
    for k, name in enumerate(names):
        color = _PALETTE[k % len(_PALETTE)]
        d, pen_up = [], True
        marks = []
        for i, v in enumerate(series[name]):
            if v is None or v <= 0:
                pen_up = True
                continue
            tip = f"<title>{_e(chart_point_text(name, run.steps[i].number, run.steps[i].role, v))}</title>"
            if not math.isfinite(v):
                marks.append(f'<text x="{x(i):.1f}" y="{T + 9}" text-anchor="middle" class="bad">&#215;{tip}</text>')
                pen_up = True
                continue
            d.append(f"{'M' if pen_up else 'L'}{x(i):.1f},{y(v):.1f}")
            # a point: its marker, with a wider invisible ring that takes the hover
            marks.append(f'<circle class="point" cx="{x(i):.1f}" cy="{y(v):.1f}" r="2.4" fill="{color}" '
                         f'stroke="transparent" stroke-width="6">{tip}</circle>')
            pen_up = False
        if d:
            parts.append(f'<path d="{" ".join(d)}" fill="none" stroke="{color}" stroke-width="1.6">'
                         f'<title>{_e(name)}</title></path>')
        parts.extend(marks)
        legend.append(f'<li><span class="swatch" style="background:{color}"></span>{_e(name)}</li>')
    parts.append(f'<line id="marker-{ri}" class="marker" x1="{x(0):.1f}" x2="{x(0):.1f}" y1="{T}" y2="{H - B}"/>')
    parts.append("</svg>")
    more = f'<li class="muted">{hidden} more layers not drawn</li>' if hidden else ""
    return "".join(parts) + f'<ul class="legend">{"".join(legend)}{more}</ul>'


def _site_list(graph: BackwardGraph) -> str:
    rec = record_of(graph)
    sites = graph.nonfinite_sites() if rec.first_gradient is not None else []
    head = (f'<p class="bad origin"><span class="badge bad">{_e(origin_badge(rec.origin))}</span> '
            f'{_e(describe_origin(rec.origin))}</p>' if rec.origin is not None else "")
    if not sites:
        return head
    items = []
    for n in sites[:30]:
        badge = (f'<span class="badge first">{_e(FIRST_GRADIENT)}</span> '
                 if n.key == rec.first_gradient.key else "")
        items.append(f"<li>{badge}{_e(describe_node(n))} <code>{_e(n.key)}</code></li>")
    if len(sites) > 30:
        items.append(f'<li class="muted">and {len(sites) - 30} more</li>')
    return (f'{head}<h3 class="bad">NaN/Inf gradients at {len(sites)} nodes</h3>'
            f'<ol class="sites">{"".join(items)}</ol>')


def _saved_table(graph: BackwardGraph, shown: int = 30) -> str:
    """Layer calls by bytes held for backward (sublayers included), with a bar,
    the inputs a recomputed call keeps and what recomputing it would free;
    empty when not recorded.

    A click on a column header sorts the rows (``report.js``: numbers
    descending by the ``data-v`` of their cells, names ascending); the first
    ``shown`` rows of the current order are visible.
    """
    m = graph.meta.get("saved_memory")
    table = m.get("recompute") if isinstance(m, dict) else None
    if not table:
        return ""
    rows = sorted(table.items(), key=lambda kv: (-kv[1].get("held", 0), kv[0]))
    top = max(v.get("held", 0) for _, v in rows) or 1

    def num(v: Any, bar: str = "") -> str:
        value = v if isinstance(v, int) else -1
        return f'<td class="num" data-v="{_e(value)}">{bar}<span>{_e(fmt_bytes(v))}</span></td>'

    def bar(v: dict) -> str:  # behind the bytes held: as long as they are, relative to the most
        return f'<span class="bar" style="width:{100 * v.get("held", 0) / top:.1f}%"></span>'

    body = "".join(
        f'<tr{" hidden" if i >= shown else ""}><td>{_e(call_name(k, inclusive=True))}</td>'
        f'{num(v.get("held"), bar(v))}{num(v.get("inputs"))}{num(v.get("frees"))}</tr>'
        for i, (k, v) in enumerate(rows))
    more = (f'<p class="muted">{shown} of {len(table)} layer calls shown; a click on a column sorts them all</p>'
            if len(table) > shown else "")
    columns = (("layer call", "text", "the layer and which of its calls"),
               ("held", "num", "bytes saved for backward inside this call, its sublayers included"),
               ("inputs", "num", "bytes of the call's inputs, which a recomputed call keeps"),
               ("recompute frees", "num", "bytes that recomputing this call in backward would free"))
    sorted_by = ' aria-sort="descending"'  # the rows come sorted by bytes held
    head = "".join(f'<th{sorted_by if col == 1 else ""}><button class="sort" data-col="{col}" data-kind="{kind}" '
                   f'title="{_e(tip)}; click to sort">{_e(name)}</button></th>'
                   for col, (name, kind, tip) in enumerate(columns))
    return (f'<h3>Held for backward, by layer call</h3><table class="saved" data-shown="{shown}"><thead><tr>{head}'
            f'</tr></thead><tbody>{body}</tbody></table>{more}')


def _lines(text: str, skip_heading: bool = True) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    if skip_heading and lines and lines[0].endswith(":"):  # "step 60:" repeats the panel's heading
        lines = lines[1:]
    return "".join(f"<li>{_e(line)}</li>" for line in lines)


def _step_panel(run: _Run, ri: int, si: int) -> str:
    st = run.steps[si]
    g = st.graph
    ops = sum(1 for n in g.nodes if n.kind == "op")
    facts = [f"{len(g.nodes)} nodes ({ops} ops), {len(g.edges)} edges"]
    if "loss" in g.meta and isinstance(g.meta["loss"], (int, float)):
        facts.append(f"loss {_fmt(float(g.meta['loss']))}")
    out = [f'<section class="step-panel" id="panel-{ri}-{si}" hidden>']
    out.append(f"<h2>{_e(st.title)}</h2><p>{_e('; '.join(facts))}</p>")
    out.append(_site_list(g))
    d = st.diff
    if d is not None:
        cls = "changed" if d.structure_changed else "same"
        out.append(f'<h3 class="{cls}">Changes since {_e(st.older.title)}</h3>'
                   f'<ul class="facts">{_lines(diff_summary(d))}</ul>')
        if d.structure_changed:
            rows = []
            for label, keys in (("added", d.added_nodes), ("removed", d.removed_nodes)):
                for key in keys[:40]:
                    rows.append(f'<li><span class="badge {label}">{label}</span> {_e(describe_node(d.node_info[key]) if key in d.node_info else key)} <code>{_e(key)}</code></li>')
                if len(keys) > 40:
                    rows.append(f'<li class="muted">and {len(keys) - 40} more {label}</li>')
            out.append(f'<ul class="nodes">{"".join(rows)}</ul>')
    else:
        what = f"{st.role} in this run" if st.role else "this run"
        out.append(f'<p class="muted">First capture of {_e(what)}: nothing to compare with.</p>')
    if st.rank_diff is not None:
        cls = "bad" if st.rank_diff.structure_changed else "same"
        lines = rank_comparison_lines(g, st.rank_base, st.rank_diff, st.rank)
        out.append(f'<h3 class="{cls} ranks">Compared with rank 0 at step {_e(st.number)}</h3>'
                   f'<ul class="facts ranks">{"".join(f"<li>{_e(x)}</li>" for x in lines)}</ul>')
    out.append(f'<h3>Summary</h3><ul class="facts">{_lines(graph_summary(g))}</ul>')
    out.append(_saved_table(g))
    if st.problem:
        out.append(f'<p class="bad">Drawing problem: {_e(st.problem)}</p>')
    out.append("</section>")
    return "".join(out)


def _overview(run: _Run, ri: int) -> str:
    rows = []
    for si, st in enumerate(run.steps):
        rec = record_of(st.graph)
        if rec.origin is not None or rec.first_gradient is not None:
            where = (describe_origin(rec.origin) if rec.origin is not None
                     else describe_first_gradient(rec.first_gradient))
            rows.append(
                f'<li><button class="jump" data-run="{ri}" data-step="{si}">{_e(st.title)}</button> '
                f"{rec.gradient_sites} nodes, {_e(where)}</li>"
            )
    changed = [
        f'<button class="jump" data-run="{ri}" data-step="{si}">{_e(st.number)}</button>'
        for si, st in enumerate(run.steps) if st.diff is not None and st.diff.structure_changed
    ]
    out = [f'<div class="overview" id="overview-{ri}" hidden>']
    out.append("<h3>NaN/Inf sites</h3>")
    out.append(f'<ul class="sites">{"".join(rows)}</ul>' if rows else '<p class="muted">No NaN/Inf gradients in any step.</p>')
    out.append("<h3>Structure changed at steps</h3>")
    out.append(f'<p>{" ".join(changed)}</p>' if changed else '<p class="muted">Same structure in every step.</p>')
    out.append("</div>")
    return "".join(out)


def _script_hash(js: str) -> str:
    """CSP source allowing exactly our inline script (inline event handlers stay blocked)."""
    return "sha256-" + base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode("ascii")


def _asset(name: str) -> str:
    """A file of ``report_assets/`` (page template, CSS, JS), shipped as package data."""
    return resources.files("paddleviz_hooks.sinks").joinpath("report_assets", name).read_text("utf-8")



def _html(title: str, runs: list[_Run], skipped: list[tuple[str, str]], merged: list[MergedRun] = ()) -> str:
    svgs: list[str] = []
    svg_of: dict[int, int] = {}  # id(graph) -> its drawing's index (each rank's own, for the side-by-side view)
    data_runs = []
    for ri, run in enumerate(runs):
        n = len(run.steps)
        steps = []
        for si, st in enumerate(run.steps):
            entry = {
                "step": st.number,
                "role": st.role,
                "since": None if st.older is None else st.older.title,
                "svg": None,
                "diff": None,
                "changed": bool(st.diff is not None and st.diff.structure_changed),
                "nonfinite": bool(st.graph.nonfinite_count()),
                "x": _chart_x(si, n),
            }
            if st.svg:
                entry["svg"] = svg_of[id(st.graph)] = len(svgs)
                svgs.append(st.svg)
            if st.diff_svg:
                entry["diff"] = len(svgs)
                svgs.append(st.diff_svg)
            steps.append(entry)
        data_runs.append({"steps": steps})
    for m in merged:  # after the runs: run indices len(runs)...
        steps = []
        for st in m.steps:
            steps.append({"step": st.number, "svg": len(svgs) if st.svg else None, "diff": None,
                          "changed": st.view.structure_differs,
                          "nonfinite": any(g.nonfinite_count() for g in st.graphs.values()),
                          "ranks": [[r, svg_of.get(id(g))] for r, g in st.graphs.items()]})
            if st.svg:
                svgs.append(st.svg)
        data_runs.append({"steps": steps, "merged": True})
    data = {"runs": data_runs, "svgs": svgs}
    first = len(runs)

    run_select = ""
    if len(runs) > 1:
        opts = "".join(f'<option value="{ri}">{_e(r.name)} ({len(r.steps)} steps)</option>'
                       for ri, r in enumerate([*runs, *merged]))
        run_select = f'<label>run <select id="run-select">{opts}</select></label>'
    captures = sum(len(r.steps) for r in runs)
    steps = sum(len({st.number for st in r.steps}) for r in runs)
    total = plural(steps, "captured step") + (f" ({captures} backwards)" if captures > steps else "")
    panels = "".join(_step_panel(run, ri, si) for ri, run in enumerate(runs) for si in range(len(run.steps)))
    panels += "".join(merged_panel(m, first + k, si) for k, m in enumerate(merged) for si in range(len(m.steps)))
    charts = "".join(
        f'<div id="chart-{ri}" hidden><h3>Gradient norm per layer{"" if len(runs) == 1 else " (" + _e(run.name) + ")"}</h3>{_chart(run, ri)}</div>'
        for ri, run in enumerate(runs)
    ) + "".join(merged_chart(m, first + k) for k, m in enumerate(merged))
    overviews = "".join(_overview(run, ri) for ri, run in enumerate(runs))
    overviews += "".join(merged_overview(m, first + k) for k, m in enumerate(merged))
    skipped_html = ""
    if skipped:
        items = "".join(f"<li><code>{_e(p)}</code>: {_e(why)}</li>" for p, why in skipped)
        skipped_html = f'<h3 class="bad">Skipped files</h3><ul>{items}</ul>'
    script = _asset("report.js")
    return Template(_asset("report.html")).substitute(
        script_hash=_script_hash(script),
        title=_e(title),
        css=_asset("report.css"),
        run_select=run_select,
        total=total,
        runs_text=f"{len(runs)} run{'s' if len(runs) != 1 else ''}",
        panels=panels,
        charts=charts,
        overviews=overviews,
        skipped=skipped_html,
        data=json_for_script(data),
        script=script,
    )


def build_report(log_dir: str | os.PathLike, out_path: str | os.PathLike, *, title: str | None = None,
                 timeout: float = 120.0, max_input_bytes: int = MAX_INPUT_BYTES) -> str:
    """Write one self-contained HTML file showing every captured step under ``log_dir``.

    Args:
        log_dir: searched recursively for ``step_*.json``; each folder (and
            file-name suffix) is one run, chosen with a run selector.
        out_path: the HTML file to write.
        title: page title (default: from the log directory's name).
        timeout: seconds per drawing before the layout engine is stopped.
        max_input_bytes: a larger ``step_*.json`` is skipped unread (with a
            warning, like any malformed one), so the report stays within a
            known time and memory.

    Returns:
        ``out_path``.

    Raises:
        ReportError: no readable ``step_*.json`` under ``log_dir``.
        TypeError / ValueError: a path that is not a str or os.PathLike, empty or with a NUL byte.
        NotADirectoryError: ``log_dir`` is not a directory.
        OSError: ``out_path`` cannot be written.

    Examples:
        >>> import os, tempfile, paddle
        >>> from paddleviz_hooks import capture_backward
        >>> log = tempfile.mkdtemp()
        >>> net = paddle.nn.Linear(3, 2)
        >>> with capture_backward(net) as cap:
        ...     net(paddle.randn([2, 3])).sum().backward()
        >>> with open(os.path.join(log, "step_000001.json"), "w") as f:
        ...     _ = f.write(cap.graph.to_json())
        >>> out = build_report(log, os.path.join(log, "report.html"))
        >>> out.endswith("report.html")
        True

    Steps whose ``.svg`` is missing are drawn from the JSON (Graphviz needed);
    if no layout engine is installed the page still lists every step, without
    drawings. Unreadable files are listed on the page and skipped.
    """
    log_dir = check_path("log_dir", log_dir)
    out_path = check_path("out_path", out_path)
    if not os.path.isdir(log_dir):
        raise NotADirectoryError(f"{log_dir} is not a directory")
    runs, skipped, merged = _load_runs(log_dir, timeout, max_input_bytes)
    if title is None:
        title = f"paddleviz-hooks report: {os.path.basename(os.path.abspath(log_dir))}"
    page = _html(title, runs, skipped, merged)
    atomic_write(out_path, page.encode("utf-8"))
    return out_path
