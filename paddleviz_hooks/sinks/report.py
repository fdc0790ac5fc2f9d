"""One self-contained HTML page showing every captured step of a log directory.

VisualDL keeps only 10 image samples per tag (``docs/visualdl.md``);
this page shows all of them. It needs no network: CSS, JS and SVGs are inline.

What it shows, per run (a folder holding ``step_*.json`` files):

* a step slider (plus a strip of cells, one per step, marking structure
  changes and NaN/Inf) and the SVG drawing of the selected step, with pan
  (drag) and zoom (mouse wheel);
* with "highlight changes" on, the drawing of the changes since the previous
  capture (added green, removed as grey ghosts, large gradient-norm changes);
* the summary, the changes and the NaN/Inf sites of the step;
* the per-layer gradient norm over all steps as a small inline SVG chart.

Everything that comes from graphs (layer, op and parameter names) is escaped
with :func:`~paddleviz_hooks.render.quoting.html_escape`; the data block is
JSON with ``<``, ``>`` and ``&`` written as ``\\u003c`` etc., so no text can end
the script element.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .._fileio import atomic_write
from ..diff import DIFF_FORMAT, GraphDiff, diff_graphs
from ..escape import clean_svg, html_escape, json_for_script
from ..graph import BackwardGraph, parse_json
from ..render import render_diff, render_svg
from ..text import describe_node, diff_summary, fmt_num, graph_summary

__all__ = ["build_report", "find_step_files", "ReportError"]

_STEP_FILE = re.compile(r"^step_(\d+)(?:_(.+))?\.json$")
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


@dataclass
class _Run:
    name: str
    directory: str
    steps: list[_Step] = field(default_factory=list)


def find_step_files(log_dir: str) -> dict[tuple[str, str], list[tuple[int, str]]]:
    """Every ``step_*.json`` under ``log_dir``, grouped by (folder, suffix).

    ``step_000100.json`` has the suffix ``""``; ``step_000100_rank1.json``
    the suffix ``"rank1"`` (one series per suffix). Steps are sorted.
    """
    found: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for dirpath, dirnames, filenames in os.walk(log_dir):
        dirnames.sort()
        for name in filenames:
            m = _STEP_FILE.match(name)
            if m:
                found.setdefault((dirpath, m.group(2) or ""), []).append(
                    (int(m.group(1)), os.path.join(dirpath, name))
                )
    for files in found.values():
        files.sort()
    return dict(sorted(found.items()))


class _NotAGraph(Exception):
    """A file the report knows and skips silently (the callback's saved diffs)."""


def _read_graph(path: str) -> BackwardGraph:
    with open(path, "rb") as f:
        data = f.read()
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


def _load_runs(log_dir: str, timeout: float) -> tuple[list[_Run], list[tuple[str, str]]]:
    groups = find_step_files(log_dir)
    if not groups:
        raise ReportError(f"no step_*.json files under {log_dir}")
    runs: list[_Run] = []
    skipped: list[tuple[str, str]] = []
    for (directory, suffix), files in groups.items():
        rel = os.path.relpath(directory, log_dir)
        name = os.path.basename(os.path.abspath(log_dir)) if rel == "." else rel
        run = _Run(name + (f" [{suffix}]" if suffix else ""), directory)
        for number, path in files:
            try:
                g = _read_graph(path)
            except _NotAGraph:
                continue
            except (OSError, ValueError) as exc:
                skipped.append((os.path.relpath(path, log_dir), str(exc)))
                continue
            run.steps.append(_Step(_step_number(g, number), path, g))
        if run.steps:
            run.steps.sort(key=lambda s: s.number)
            runs.append(run)
    if not runs:
        first = skipped[0] if skipped else ("?", "?")
        raise ReportError(f"no readable step_*.json under {log_dir} (e.g. {first[0]}: {first[1]})")

    jobs = []
    for run in runs:
        prev = None
        for st in run.steps:
            st.svg = _existing_svg(st.json_path)
            if st.svg is None:
                jobs.append((st, "svg", render_svg, (st.graph,), {"title": f"step {st.number}"}))
            if prev is not None:
                st.diff = diff_graphs(prev.graph, st.graph)
                if st.diff.changed:
                    jobs.append((st, "diff_svg", render_diff, (st.diff, st.graph, prev.graph), {"format": "svg"}))
            prev = st
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
    return runs, skipped


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


_CHART_BOX = (360, 170, 44, 8, 10, 22)  # width, height, left, right, top, bottom margins


def _chart_x(i: int, n: int) -> float:
    W, _, L, R, _, _ = _CHART_BOX
    return round(L + (W - L - R) * (i / (n - 1) if n > 1 else 0.5), 1)


def _chart(run: _Run, ri: int) -> str:
    """Inline SVG: per-layer gradient norm over the run's steps (log scale)."""
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
    llo, lhi = math.log10(lo), math.log10(hi)
    W, H, L, R, T, B = _CHART_BOX
    n = len(graphs)

    def x(i: int) -> float:
        return _chart_x(i, n)

    def y(v: float) -> float:
        return T + (H - T - B) * (1 - (math.log10(v) - llo) / (lhi - llo))

    parts = [
        f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" aria-label="per-layer gradient norm over steps">',
        f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="#fafafa" stroke="#ddd"/>',
    ]
    for p in range(math.ceil(llo), math.floor(lhi) + 1):
        yy = y(10.0 ** p)
        parts.append(f'<line x1="{L}" x2="{W - R}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#e4e4e4"/>')
        parts.append(f'<text x="{L - 4}" y="{yy + 3:.1f}" text-anchor="end" class="tick">1e{p}</text>')
    parts.append(f'<text x="{L}" y="{H - 6}" class="tick">step {_e(run.steps[0].number)}</text>')
    parts.append(f'<text x="{W - R}" y="{H - 6}" text-anchor="end" class="tick">step {_e(run.steps[-1].number)}</text>')
    legend = []
    for k, name in enumerate(names):
        color = _PALETTE[k % len(_PALETTE)]
        d, pen_up = [], True
        marks = []
        for i, v in enumerate(series[name]):
            if v is None or v <= 0:
                pen_up = True
                continue
            if not math.isfinite(v):
                marks.append(f'<text x="{x(i):.1f}" y="{T + 9}" text-anchor="middle" class="bad">&#215;</text>')
                pen_up = True
                continue
            d.append(f"{'M' if pen_up else 'L'}{x(i):.1f},{y(v):.1f}")
            pen_up = False
        title = f"<title>{_e(name)}</title>"
        if d:
            parts.append(f'<path d="{" ".join(d)}" fill="none" stroke="{color}" stroke-width="1.6">{title}</path>')
            if len(d) == 1 or n == 1:
                cx, cy = d[0][1:].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{color}">{title}</circle>')
        parts.extend(marks)
        legend.append(f'<li><span class="swatch" style="background:{color}"></span>{_e(name)}</li>')
    parts.append(f'<line id="marker-{ri}" class="marker" x1="{x(0):.1f}" x2="{x(0):.1f}" y1="{T}" y2="{H - B}"/>')
    parts.append("</svg>")
    more = f'<li class="muted">{hidden} more layers not drawn</li>' if hidden else ""
    return "".join(parts) + f'<ul class="legend">{"".join(legend)}{more}</ul>'


def _site_list(graph: BackwardGraph) -> str:
    sites = graph.nonfinite_sites()
    if not sites:
        return ""
    items = []
    for k, n in enumerate(sites[:30]):
        info = {"kind": n.kind, "op": n.op, "layer": n.layer, "call": n.call, "param": n.param}
        badge = '<span class="badge bad">origin</span> ' if k == 0 else ""
        items.append(f"<li>{badge}{_e(describe_node(info))} <code>{_e(n.key)}</code></li>")
    if len(sites) > 30:
        items.append(f'<li class="muted">and {len(sites) - 30} more</li>')
    return (f'<h3 class="bad">NaN/Inf gradients at {len(sites)} nodes</h3>'
            f'<ol class="sites">{"".join(items)}</ol>')


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
    out.append(f"<h2>step {_e(st.number)}</h2><p>{_e('; '.join(facts))}</p>")
    out.append(_site_list(g))
    d = st.diff
    if d is not None:
        prev = run.steps[si - 1].number
        cls = "changed" if d.structure_changed else "same"
        out.append(f'<h3 class="{cls}">Changes since step {_e(prev)}</h3><ul class="facts">{_lines(diff_summary(d))}</ul>')
        if d.structure_changed:
            rows = []
            for label, keys in (("added", d.added_nodes), ("removed", d.removed_nodes)):
                for key in keys[:40]:
                    rows.append(f'<li><span class="badge {label}">{label}</span> {_e(describe_node(d.node_info[key]) if key in d.node_info else key)} <code>{_e(key)}</code></li>')
                if len(keys) > 40:
                    rows.append(f'<li class="muted">and {len(keys) - 40} more {label}</li>')
            out.append(f'<ul class="nodes">{"".join(rows)}</ul>')
    else:
        out.append('<p class="muted">First capture of this run: nothing to compare with.</p>')
    out.append(f'<h3>Summary</h3><ul class="facts">{_lines(graph_summary(g))}</ul>')
    if st.problem:
        out.append(f'<p class="bad">Drawing problem: {_e(st.problem)}</p>')
    out.append("</section>")
    return "".join(out)


def _overview(run: _Run, ri: int) -> str:
    rows = []
    for si, st in enumerate(run.steps):
        sites = st.graph.nonfinite_sites()
        if sites:
            n = sites[0]
            info = {"kind": n.kind, "op": n.op, "layer": n.layer, "call": n.call, "param": n.param}
            rows.append(
                f'<li><button class="jump" data-run="{ri}" data-step="{si}">step {_e(st.number)}</button> '
                f"{len(sites)} nodes, origin {_e(describe_node(info))}</li>"
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


_CSS = """
*{box-sizing:border-box}
html,body{margin:0;height:100%;font:14px/1.4 Helvetica,Arial,sans-serif;color:#222}
body{display:flex;flex-direction:column}
header{padding:8px 12px;border-bottom:1px solid #ddd;background:#f7f7f9}
header h1{font-size:17px;margin:0 0 6px 0}
.controls{display:flex;flex-wrap:wrap;align-items:center;gap:10px}
#step-slider{flex:1;min-width:200px}
#step-label{font-weight:bold;min-width:150px}
#strip{display:flex;gap:1px;margin-top:6px;height:12px}
#strip span{flex:1;background:#cfd8e3;cursor:pointer;min-width:2px}
#strip span.changed{background:#1a7f37}#strip span.nonfinite{background:#d00000}
#strip span.current{outline:2px solid #222;outline-offset:-1px}
main{flex:1;display:flex;min-height:0}
#viewport{flex:1;position:relative;overflow:hidden;background:#fff;cursor:grab;touch-action:none}
#viewport.dragging{cursor:grabbing}
#stage{position:absolute;left:0;top:0;transform-origin:0 0}
#stage svg{display:block}
#viewer-note{position:absolute;left:8px;bottom:6px;color:#666;font-size:12px;background:rgba(255,255,255,.85);padding:2px 6px;border-radius:3px}
#mode{position:absolute;right:8px;top:6px;font-size:12px;padding:2px 8px;border-radius:3px;background:#eee}
#mode.diff{background:#1a7f37;color:#fff}
aside{width:400px;overflow:auto;border-left:1px solid #ddd;padding:8px 12px;background:#fcfcfc}
aside h2{font-size:16px;margin:4px 0}aside h3{font-size:14px;margin:10px 0 4px 0}
ul,ol{margin:2px 0;padding-left:18px}
code{font-size:11px;color:#555;word-break:break-all}
.muted{color:#777}.bad{color:#b00000}.changed{color:#1a7f37}.same{color:#555}
.badge{display:inline-block;font-size:11px;padding:0 5px;border-radius:3px;color:#fff;background:#777}
.badge.added{background:#1a7f37}.badge.removed{background:#8a8a8a}.badge.bad{background:#b00000}
.chart{width:100%;height:auto}.chart .tick{font-size:9px;fill:#666}.chart .bad{font-size:12px;fill:#d00000}
.chart .marker{stroke:#222;stroke-dasharray:3 2}
.legend{list-style:none;padding:0;font-size:12px;columns:2}
.swatch{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
button{font:inherit;font-size:12px;padding:2px 8px}
button.jump{padding:0 6px;margin:1px}
"""

_JS = r"""
(function(){
"use strict";
var DATA = JSON.parse(document.getElementById("pvh-data").textContent);
var slider = document.getElementById("step-slider");
var label = document.getElementById("step-label");
var strip = document.getElementById("strip");
var stage = document.getElementById("stage");
var vp = document.getElementById("viewport");
var note = document.getElementById("viewer-note");
var mode = document.getElementById("mode");
var hl = document.getElementById("highlight");
var runSel = document.getElementById("run-select");
var run = 0, idx = -1, scale = 1, tx = 0, ty = 0, userView = false;

function apply(){ stage.style.transform = "translate(" + tx + "px," + ty + "px) scale(" + scale + ")"; }
function svgSize(){
  var s = stage.querySelector("svg");
  if (!s) return null;
  var vb = s.viewBox && s.viewBox.baseVal;
  var w = vb && vb.width ? vb.width : s.getBoundingClientRect().width / scale;
  var h = vb && vb.height ? vb.height : s.getBoundingClientRect().height / scale;
  return [w * 96 / 72, h * 96 / 72];
}
function place(s){
  var sz = svgSize(); if (!sz) return;
  var W = vp.clientWidth, H = vp.clientHeight;
  scale = s;
  tx = Math.max(4, (W - sz[0] * scale) / 2); ty = Math.max(4, (H - sz[1] * scale) / 2);
  apply();
}
function fit(){  // the whole drawing
  var sz = svgSize(); if (!sz) return;
  place(Math.min(vp.clientWidth / sz[0], vp.clientHeight / sz[1], 1.5) * 0.96);
}
function autoView(){  // readable: fit, but no smaller than 100% while the width allows
  var sz = svgSize(); if (!sz) return;
  var all = Math.min(vp.clientWidth / sz[0], vp.clientHeight / sz[1]);
  place(Math.min(1.5, Math.max(all, Math.min(1, vp.clientWidth / sz[0]))) * 0.96);
  var mark = stage.querySelector(".pvh-added, .pvh-removed, .pvh-ratio-up, .pvh-ratio-down");
  if (!mark) return;
  var v = vp.getBoundingClientRect(), m = mark.getBoundingClientRect();
  if (m.top >= v.top && m.bottom <= v.bottom) return;
  ty += (v.top + v.height / 2) - (m.top + m.height / 2);  // bring the first change into view
  apply();
}
function show(r, i){
  var steps = DATA.runs[r].steps;
  i = Math.max(0, Math.min(steps.length - 1, i));
  if (r !== run) { userView = false; }
  document.getElementById("panel-" + run + "-" + Math.max(idx, 0)).hidden = true;
  document.getElementById("overview-" + run).hidden = true;
  document.getElementById("chart-" + run).hidden = true;
  run = r; idx = i;
  var st = steps[i];
  slider.max = String(steps.length - 1);
  slider.value = String(i);
  label.textContent = "step " + st.step + "  (" + (i + 1) + " of " + steps.length + ")";
  var useDiff = hl.checked && st.diff !== null;
  var svg = useDiff ? DATA.svgs[st.diff] : (st.svg !== null ? DATA.svgs[st.svg] : null);
  stage.innerHTML = svg === null ? "" : svg;
  var s = stage.querySelector("svg");
  if (s) { var sz = svgSize(); s.style.width = sz[0] + "px"; s.style.height = sz[1] + "px"; }
  mode.textContent = useDiff ? "changes since step " + steps[i - 1].step : (st.svg === null ? "no drawing" : "graph");
  mode.className = useDiff ? "diff" : "";
  note.textContent = svg === null ? "No drawing for this step (see the panel)." : "wheel: zoom, drag: pan, F: fit all, 1: 100%, A: automatic view";
  document.getElementById("panel-" + r + "-" + i).hidden = false;
  document.getElementById("overview-" + r).hidden = false;
  document.getElementById("chart-" + r).hidden = false;
  var m = document.getElementById("marker-" + r);
  if (m && st.x !== undefined) { m.setAttribute("x1", st.x); m.setAttribute("x2", st.x); }
  buildStrip();
  if (!userView) { autoView(); }  // follow each step until the user zooms or pans
}
function buildStrip(){
  var steps = DATA.runs[run].steps;
  if (strip.dataset.run !== String(run)) {
    strip.innerHTML = "";
    steps.forEach(function(st, i){
      var c = document.createElement("span");
      c.className = (st.changed ? "changed " : "") + (st.nonfinite ? "nonfinite" : "");
      c.title = "step " + st.step + (st.changed ? ", structure changed" : "") + (st.nonfinite ? ", NaN/Inf" : "");
      c.addEventListener("click", function(){ show(run, i); });
      strip.appendChild(c);
    });
    strip.dataset.run = String(run);
  }
  Array.prototype.forEach.call(strip.children, function(c, i){ c.classList.toggle("current", i === idx); });
}
slider.addEventListener("input", function(){ show(run, parseInt(slider.value, 10)); });
hl.addEventListener("change", function(){ show(run, idx); });
document.getElementById("fit").addEventListener("click", function(){ userView = true; fit(); });
document.getElementById("prev").addEventListener("click", function(){ show(run, idx - 1); });
document.getElementById("next").addEventListener("click", function(){ show(run, idx + 1); });
if (runSel) runSel.addEventListener("change", function(){ show(parseInt(runSel.value, 10), 0); });
document.querySelectorAll("button.jump").forEach(function(b){
  b.addEventListener("click", function(){
    var r = parseInt(b.dataset.run, 10);
    if (runSel) runSel.value = String(r);
    show(r, parseInt(b.dataset.step, 10));
  });
});
document.addEventListener("keydown", function(e){
  var t = e.target && e.target.tagName;
  if (t === "INPUT" || t === "SELECT" || t === "TEXTAREA") return;
  if (e.key === "ArrowRight") { show(run, idx + 1); e.preventDefault(); }
  else if (e.key === "ArrowLeft") { show(run, idx - 1); e.preventDefault(); }
  else if (e.key === "f" || e.key === "F" || e.key === "0") { userView = true; fit(); }
  else if (e.key === "1") { userView = true; place(1); }
  else if (e.key === "a" || e.key === "A") { userView = false; autoView(); }
});
vp.addEventListener("wheel", function(e){
  e.preventDefault();
  var r = vp.getBoundingClientRect(), mx = e.clientX - r.left, my = e.clientY - r.top;
  var ns = Math.min(40, Math.max(0.02, scale * Math.exp(-e.deltaY * 0.0015)));
  tx = mx - (mx - tx) * ns / scale; ty = my - (my - ty) * ns / scale; scale = ns; userView = true; apply();
}, {passive: false});
var drag = null;
vp.addEventListener("pointerdown", function(e){
  if (e.button !== 0) return;
  drag = [e.clientX, e.clientY, tx, ty]; vp.setPointerCapture(e.pointerId); vp.classList.add("dragging");
});
vp.addEventListener("pointermove", function(e){
  if (!drag) return;
  tx = drag[2] + e.clientX - drag[0]; ty = drag[3] + e.clientY - drag[1]; userView = true; apply();
});
function endDrag(){ drag = null; vp.classList.remove("dragging"); }
vp.addEventListener("pointerup", endDrag);
vp.addEventListener("pointercancel", endDrag);
window.addEventListener("resize", function(){ if (!userView) autoView(); });
show(0, 0);
})();
"""


def _html(title: str, runs: list[_Run], skipped: list[tuple[str, str]]) -> str:
    svgs: list[str] = []
    data_runs = []
    for ri, run in enumerate(runs):
        n = len(run.steps)
        steps = []
        for si, st in enumerate(run.steps):
            entry = {
                "step": st.number,
                "svg": None,
                "diff": None,
                "changed": bool(st.diff is not None and st.diff.structure_changed),
                "nonfinite": bool(st.graph.nonfinite_count()),
                "x": _chart_x(si, n),
            }
            if st.svg:
                entry["svg"] = len(svgs)
                svgs.append(st.svg)
            if st.diff_svg:
                entry["diff"] = len(svgs)
                svgs.append(st.diff_svg)
            steps.append(entry)
        data_runs.append({"steps": steps})
    data = {"runs": data_runs, "svgs": svgs}

    run_select = ""
    if len(runs) > 1:
        opts = "".join(f'<option value="{ri}">{_e(r.name)} ({len(r.steps)} steps)</option>' for ri, r in enumerate(runs))
        run_select = f'<label>run <select id="run-select">{opts}</select></label>'
    total = sum(len(r.steps) for r in runs)
    panels = "".join(_step_panel(run, ri, si) for ri, run in enumerate(runs) for si in range(len(run.steps)))
    charts = "".join(
        f'<div id="chart-{ri}" hidden><h3>Gradient norm per layer{"" if len(runs) == 1 else " (" + _e(run.name) + ")"}</h3>{_chart(run, ri)}</div>'
        for ri, run in enumerate(runs)
    )
    overviews = "".join(_overview(run, ri) for ri, run in enumerate(runs))
    skipped_html = ""
    if skipped:
        items = "".join(f"<li><code>{_e(p)}</code>: {_e(why)}</li>" for p, why in skipped)
        skipped_html = f'<h3 class="bad">Skipped files</h3><ul>{items}</ul>'
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src '{_script_hash(_JS)}'; img-src data:">
<title>{_e(title)}</title>
<style>{_CSS}</style>
</head>
<body>
<header>
<h1>{_e(title)}</h1>
<div class="controls">
{run_select}
<button id="prev" title="previous step (Left arrow)">&#9664;</button>
<input type="range" id="step-slider" min="0" max="0" step="1" value="0" aria-label="captured step">
<button id="next" title="next step (Right arrow)">&#9654;</button>
<span id="step-label"></span>
<label><input type="checkbox" id="highlight" checked> highlight changes since the previous capture</label>
<button id="fit" title="show the whole drawing (F); 1: 100%; A: back to the automatic view">fit</button>
<span class="muted">{total} captured steps in {len(runs)} run{"s" if len(runs) != 1 else ""}</span>
</div>
<div id="strip" title="one cell per step: green = structure changed, red = NaN/Inf"></div>
</header>
<main>
<div id="viewport"><div id="stage"></div><div id="mode"></div><div id="viewer-note"></div></div>
<aside>
{panels}
{charts}
{overviews}
{skipped_html}
</aside>
</main>
<script type="application/json" id="pvh-data">{json_for_script(data)}</script>
<script>{_JS}</script>
</body>
</html>
"""


def build_report(log_dir: str | os.PathLike, out_path: str | os.PathLike, *, title: str | None = None,
                 timeout: float = 120.0) -> str:
    """Write one self-contained HTML file showing every captured step under ``log_dir``.

    Args:
        log_dir: searched recursively for ``step_*.json``; each folder (and
            file-name suffix) is one run, chosen with a run selector.
        out_path: the HTML file to write.
        title: page title (default: from the log directory's name).
        timeout: seconds per drawing before the layout engine is stopped.

    Returns:
        ``out_path``.

    Raises:
        ReportError: no readable ``step_*.json`` under ``log_dir``.
        NotADirectoryError: ``log_dir`` is not a directory.
        OSError: ``out_path`` cannot be written.

    Example:
        >>> build_report("vdl_log", "report.html")
        'report.html'

    Steps whose ``.svg`` is missing are drawn from the JSON (Graphviz needed);
    if no layout engine is installed the page still lists every step, without
    drawings. Unreadable files are listed on the page and skipped.
    """
    log_dir = os.fspath(log_dir)
    out_path = os.fspath(out_path)
    if not os.path.isdir(log_dir):
        raise NotADirectoryError(f"{log_dir} is not a directory")
    runs, skipped = _load_runs(log_dir, timeout)
    if title is None:
        title = f"paddleviz-hooks report: {os.path.basename(os.path.abspath(log_dir))}"
    page = _html(title, runs, skipped)
    atomic_write(out_path, page.encode("utf-8"))
    return out_path
