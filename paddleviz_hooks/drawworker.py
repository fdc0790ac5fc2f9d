"""The drawing process: draws captures from their JSON, one job at a time, at low priority.

The training process never runs drawing code (planning, collapse, DOT, layout,
rasterising): its pipeline writes each capture's JSON and sends this process
one job per line on stdin (``python -m paddleviz_hooks.drawworker``); this
process draws and answers one JSON line per job on stdout. It is long-lived, so
the drawing plans it caches (``render/plan.py``) keep steady state at one
engine run per distinct drawing. It never imports paddle.

A job (JSON object): ``id``, ``step``, ``trigger``, ``suffix``, ``json`` (the
capture's JSON file), ``prev_json`` (the previous capture of the same backward,
or None), ``diff`` (draw the structure change against it), ``options``
(``formats``: the picture files to draw, of png/svg/dot; ``viewer_px``,
``view_max_px``, ``view_max_nodes``, ``color_by``, ``render_timeout``),
``engine`` (:func:`~paddleviz_hooks.render.engine.engine_choice` of the
sender), ``encoding`` (the PNG pictures written as the sender's dashboards store
them: :func:`~paddleviz_hooks.sinks.hub.encode_png`, so the training process
neither decodes nor encodes a picture) and ``out`` (where each output goes: ``dot`` and ``svg`` are the step
files, ``png``, ``viewer`` and ``diff_png`` spool files the sender hands to its
dashboards, ``vdl_graph`` the folder of a VisualDL Graphs-tab file).

The answer: ``id``, ``title``, ``written`` (output -> path), ``why`` (None
when drawn, else why not), ``warnings`` (``[key, message]`` pairs for the
sender's warn-once), ``error`` (``{"type", "message", "errno"}`` of a failure
that is no layout failure, else None).

It runs at nice ``DRAWING_NICE`` (the layout engines it starts inherit it),
ignores Ctrl-C (its sender stops it), and exits at the end of its stdin or,
on Linux, when the thread that started it ends (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, TextIO

from ._fileio import atomic_write
from .diff import diff_graphs
from .graph import BackwardGraph
from .text import every_op_elsewhere, picture_title
from .render.diff import render_diff_views
from .render.dot import to_dot
from .render.draw import render_png, render_svg, render_views
from .render.engine import EngineNotFound, RenderTimeout, die_with_parent, engines_die_with_this_process, pinned_engine
from .sinks.hub import encode_png
from .sinks.vdl_graph import write_vdl_graph

__all__ = ["DRAWING_NICE", "FULL_SVG_MAX_NODES", "VIEWER_LABEL_PX", "capture_picture_title", "draw_job",
           "lower_priority", "main", "viewer_png"]

#: Node labels (11 pt) of the VisualDL picture are at least this many pixels high
VIEWER_LABEL_PX = 8.0

#: Nice value of the drawing process, and of the layout engines it starts (they inherit it).
#: On a core training also wants it gets about a tenth (Linux CFS weights 110 vs 1024): measured
#: under 2-process data parallel on 2 cores, uncaptured steps went from 1.50x to 1.16x (median).
DRAWING_NICE = 10


#: Graphs with more nodes get no op-by-op SVG: the engine took 0.4 s for 1,082 nodes, 3.4 s
#: for 2,162, 23 s for 4,322 and over 60 s for 10,083 (encoders of 24 to 224 layers). Their SVG
#: is the viewing drawing (its title says so); the JSON keeps every op (``explore``).
FULL_SVG_MAX_NODES = 2500


def viewer_png(graph: BackwardGraph, options: Any, title: str, *, timeout: float | None = 60.0,
               info: dict[str, Any] | None = None, full_detail: str | None = None) -> bytes:
    """The picture logged to the dashboards, sized for VisualDL's image viewer.

    ``options``: the recorder's options, or anything with their ``viewer_px``,
    ``view_max_nodes`` and ``color_by``.

    The viewer fits a picture into the window (about 1300x750 CSS px of a
    1440x900 window) and never enlarges it, so the picture is drawn left to
    right (landscape) within ``options.viewer_px`` x 9/16 of that, padded to
    16:9 when it is a strip, with node labels at least ``VIEWER_LABEL_PX``
    high, collapsing layers into boxes as far as that needs. The same
    structure gets the same layout at every step (the drawing plan is
    cached), so flipping steps compares like with like. ``render/plan.py``
    plans it with the other pictures. ``full_detail``: where every op can be
    seen, said in the title when the picture is collapsed (default: the SVG).
    """
    assert options.viewer_px is not None
    width = options.viewer_px
    return render_png(graph, max_px=width, max_height_px=max(64, width * 9 // 16), max_nodes=options.view_max_nodes,
                      rankdir="LR", min_dpi=VIEWER_LABEL_PX * 72 / 11, timeout=timeout, title=title, info=info,
                      full_detail=full_detail, **_shading(options, graph))


def capture_picture_title(step: int, trigger: str, graph: BackwardGraph) -> str:
    """The title line of a capture's pictures."""
    return picture_title(graph, step, trigger)


def _shading(options: Any, graph: BackwardGraph) -> dict[str, Any]:
    """The ``color_by`` drawing option, for a graph that has what it shades by (a triggered
    capture records no saved memory: drawn unshaded, its legend then shows no shades)."""
    if options.color_by == "saved_memory" and isinstance(graph.meta.get("saved_memory"), dict):
        return {"color_by": options.color_by}
    return {}


class _Graphs:
    """The last graph read per backward (suffix): the next capture's diff is drawn against it."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[str, BackwardGraph]] = {}

    def read(self, path: str, suffix: str) -> BackwardGraph:
        last = self._last.get(suffix)
        if last is not None and last[0] == path:
            return last[1]
        with open(path, encoding="utf-8") as f:
            graph = BackwardGraph.from_json(f.read())
        self._last[suffix] = (path, graph)
        return graph

    def previous(self, path: str | None, suffix: str) -> BackwardGraph | None:
        last = self._last.get(suffix)
        if path is None:
            return None
        if last is not None and last[0] == path:
            return last[1]
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            return BackwardGraph.from_json(f.read())


def draw_job(job: dict[str, Any], graphs: _Graphs | None = None) -> dict[str, Any]:
    """Draw one job (see the module's docstring); the answer. Never raises for a failed drawing."""
    graphs = graphs or _Graphs()
    answer: dict[str, Any] = {"id": job.get("id"), "title": None, "written": {}, "why": None, "warnings": [],
                              "error": None}
    try:
        with pinned_engine(job["engine"]):
            _draw(job, graphs, answer)
    except Exception as exc:  # an unreadable JSON, a full disk...: named, the next job is drawn
        answer["error"] = {"type": type(exc).__name__, "message": str(exc), "errno": getattr(exc, "errno", None),
                           "strerror": getattr(exc, "strerror", None)}
    return answer


def _draw(job: dict[str, Any], graphs: _Graphs, answer: dict[str, Any]) -> None:
    """What the training process's drawing thread drew, from the capture's JSON."""
    opts = SimpleNamespace(**job["options"])
    out, written, warn = job["out"], answer["written"], answer["warnings"]
    encoding = job.get("encoding")
    step, trigger, suffix = job["step"], job["trigger"], job["suffix"]
    prev = graphs.previous(job.get("prev_json"), suffix) if job.get("diff") else None
    graph = graphs.read(job["json"], suffix)
    title = answer["title"] = capture_picture_title(step, trigger, graph)
    if "dot" in out:
        written["dot"] = atomic_write(out["dot"], to_dot(graph, title=title, **_shading(opts, graph)))
    if "vdl_graph" in out:  # the VisualDL sink's Graphs-tab file
        try:
            written["vdl_graph"] = write_vdl_graph(out["vdl_graph"], graph)
        except Exception as exc:
            warn.append(["vdl-graph", f"step {step} was not written for VisualDL's Graphs tab: {exc!r}"])
    if not {"png", "svg", "viewer"} & set(out):
        return
    deadline = time.monotonic() + opts.render_timeout  # bounds all drawing of this capture

    def left() -> float:  # what is left of render_timeout for the next engine run
        return round(max(0.001, deadline - time.monotonic()), 3)

    png = None
    # every op in the SVG only where the engine can lay it out in time (see FULL_SVG_MAX_NODES)
    full_svg = "svg" in out and len(graph.nodes) <= FULL_SVG_MAX_NODES
    elsewhere = None if full_svg else every_op_elsewhere()  # what a collapsed picture's title points to
    views: dict = {}
    info: dict = {}
    try:
        # one engine run draws the viewing PNG and its SVG (the full-detail one when nothing is collapsed)
        formats = ("png", "svg") if "svg" in out else ("png",)
        views = render_views(graph, formats, info=info, max_px=opts.view_max_px, max_nodes=opts.view_max_nodes,
                             timeout=left(), title=title, full_detail=elsewhere,
                             **_shading(opts, graph))
        png = views["png"]
        if "png" in out:
            written["png"] = atomic_write(out["png"], encode_png(png, encoding))
        if "svg" in out and (info["full_detail"] or not full_svg):  # no other SVG will be drawn
            written["svg"] = atomic_write(out["svg"], views["svg"])
        if "viewer" in out:
            seen: dict = {}
            viewer = viewer_png(graph, opts, title, timeout=left(), info=seen, full_detail=elsewhere)
            # a viewer picture that had to shrink the whole model into one box shows less
            # than the PNG file: the dashboards get the file's picture then (their viewers can zoom)
            if not (seen.get("collapsed_depth") == 0 and info.get("collapsed_depth") != 0):
                written["viewer"] = atomic_write(out["viewer"], encode_png(viewer, encoding))
    except (EngineNotFound, RenderTimeout) as exc:
        # JSON, DOT, text and scalars are already written
        answer["why"] = ("no layout engine is installed" if isinstance(exc, EngineNotFound)
                         else f"the layout engine ran past render_timeout={opts.render_timeout:g} s")
        warn.append([type(exc).__name__, f"step {step} was not drawn: {exc}"])
    if png is not None and prev is not None and "diff_png" in out:
        try:
            diff_png = render_diff_views(diff_graphs(prev, graph), graph, prev, ("png",), max_px=opts.view_max_px,
                                         max_nodes=opts.view_max_nodes, timeout=left())["png"]
            written["diff_png"] = atomic_write(out["diff_png"], encode_png(diff_png, encoding))
        except Exception as exc:
            warn.append(["diff-render", f"drawing the graph diff failed: {exc!r}"])
    if png is not None and "svg" in out and "svg" not in written:  # last: the largest drawing
        try:
            written["svg"] = atomic_write(out["svg"], render_svg(graph, timeout=left(), title=title,
                                                                 **_shading(opts, graph)))
        except RenderTimeout as exc:  # the pictures drawn so far stay; the viewing SVG stands in
            written["svg"] = atomic_write(out["svg"], views["svg"])
            warn.append(["svg-timeout", f"step {step}'s SVG shows the viewing drawing, not every op: {exc}"])
    if answer["why"] is None and png is None:
        answer["why"] = "the layout engine drew nothing"


def lower_priority(thread: bool = False) -> None:
    """This process, or with ``thread`` only the calling thread, at nice ``DRAWING_NICE`` (or
    lower priority still), and the processes it starts with it.

    Linux keeps a nice value per thread; elsewhere a thread id is no process
    id, so ``thread`` changes nothing there. Never raises: drawing at normal
    priority is still drawing.

    Examples:
        >>> import threading
        >>> t = threading.Thread(target=lower_priority, kwargs={"thread": True})
        >>> t.start(); t.join()  # the thread ended at nice 10 (on Linux); this one is untouched
    """
    if thread and not sys.platform.startswith("linux"):
        return
    try:
        who = threading.get_native_id() if thread else 0
        os.setpriority(os.PRIO_PROCESS, who, max(os.getpriority(os.PRIO_PROCESS, who), DRAWING_NICE))
    except (AttributeError, OSError):  # no such call, no permission: keep the normal priority
        pass


def _die_with_parent() -> None:
    """Linux: SIGTERM when the thread that started this process ends (its process killed
    included), and every engine it starts killed when it ends; stdin's end covers the rest."""
    if die_with_parent(signal.SIGTERM) and os.getppid() == 1:  # the parent was gone before the call
        raise SystemExit(0)
    engines_die_with_this_process()


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # unwinds a running engine call, which kills its engine


def serve(lines: TextIO, answers: TextIO) -> None:
    """Answer each job line of ``lines`` on ``answers`` until the input ends."""
    graphs = _Graphs()
    for line in lines:
        if not line.strip():
            continue
        try:
            job = json.loads(line)
        except ValueError as exc:
            answer = {"id": None, "error": {"type": "ValueError", "message": f"not a job: {exc}"}}
        else:
            answer = draw_job(job, graphs)
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def main() -> None:
    """Entry point of ``python -m paddleviz_hooks.drawworker``."""
    # everything inside the try: a training process gone while this one starts (before
    # _die_with_parent, or between it and the SIGTERM handler) still has its TMPDIR removed
    try:
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
        lower_priority()
        _die_with_parent()
        # the answers get the real stdout; a stray print of any library goes to stderr instead
        answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        serve(sys.stdin, answers)
    except (BrokenPipeError, KeyboardInterrupt):  # the training process is gone
        pass
    finally:  # the TMPDIR made for this worker (drawproc.TEMP_PREFIX): a killed training process cannot remove it
        temp = os.environ.get("TMPDIR", "")
        if os.path.basename(temp.rstrip(os.sep)).startswith("paddleviz-draw-"):
            shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    main()
