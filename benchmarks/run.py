#!/usr/bin/env python
"""Benchmarks of paddleviz-hooks, measured in one run and printed as one table.

    .venv/bin/python benchmarks/run.py            # full run (about 5-10 minutes on 2 cores)
    .venv/bin/python benchmarks/run.py --quick    # smoke run (a few minutes)
    .venv/bin/python benchmarks/run.py --json out.json

Rows (medians over repeats, every ratio taken from numbers of this same run):

* capture-to-PNG: time from a captured graph to PNG bytes, and the PNG's
  pixel size, for a 6-layer ``TransformerEncoder`` (d_model 256) and resnet50
  (batch 2, 224x224), at full detail (``depth=None``) and as the viewing PNG
  (``render_png`` default: collapsed automatically when illegible), the first
  drawing of a structure and the same structure again (its plan reused, with
  the number of layout-engine runs that takes).
* pipeline (encoder, resnet50): the real capture pipeline with the default
  options (PNG, SVG, DOT, JSON, VisualDL) drawing captures of one structure:
  the first capture (plan search) and captures drawn per second after it,
  with layout-engine runs per capture (counted by a ``dot`` shim on PATH).
* fit:every5: ``Model.fit`` with ``BackwardGraphCallback(every=5)`` on a
  2-layer encoder: captures dropped (0 expected), drawn and left undrawn.
* 10k nodes: a 224-layer encoder (about 10,000 nodes): captured step / plain
  step, and the first viewing PNG.
* explorer: the same 10k-node graph exported for Model Explorer, and the time
  from opening the page (``explore()``, headless Chromium) to the first
  drawing of the graph, layers collapsed (skipped without the ``explorer``
  extra, playwright or /usr/bin/chromium).
* training thread: forward+backward inside ``capture_backward`` divided by the
  plain forward+backward, with and without ``grad_stats``, in wall time and
  in process CPU time (steadier on a shared machine), for the encoder,
  resnet50 and two networks of many small gradients (mobilenet_v3_small and
  shufflenet_v2_x1_0, batch 2, 224x224; section ``cnn``); for those two and
  the 10k-node encoder also each part of a capture added one at a time
  (walk and hooks, gradient statistics, layer attribution, source lines),
  in CPU time, and the floor under them (``:floor``): the same step with only
  Paddle's mechanisms a capture needs, doing nothing in them (a walk and a
  no-op post-hook on every op node, every layer call seen through
  ``Layer.__call__``, a no-op listener on every op call) plus the numpy reductions of the exact
  statistics of that step's gradients with nothing around them. No capture
  with the default parts can cost less than that on the machine measured.
* dp2: under 2-process data parallel (``paddle.distributed.launch``, gloo on
  CPU), rank 0's uncaptured and captured steps with
  ``BackwardGraphRecorder(every=10, ranks="all")`` divided by plain steps.
* saved memory: a captured step with ``saved_memory=True`` divided by a
  captured step without it (both ``grad_stats=True``), encoder and resnet50,
  with the bytes held for backward next to the allocator's growth over the
  forward, and a plain step run after them (nothing left behind).
* peer reference: the same Transformer encoder in PyTorch drawn by
  ``torchviz.make_dot`` and rendered to PNG (skipped when torch or torchviz is
  not installed: ``.venv/bin/pip install torch==2.13.0 torchviz``; they are
  not dependencies of paddleviz-hooks).
* fit:encoder / fit:resnet50 (``Model.fit``, 200+ steps; resnet50 at 64x64):
  uncaptured-step time with ``BackwardGraphCallback(every=50)`` and with each
  trigger (``on_nonfinite``, ``on_grad_spike``, ``on_structure_change``)
  divided by the step time without any callback.
* callback (``Model.fit``): uncaptured-step time with
  ``BackwardGraphCallback(every=50)`` divided by the time without it, and RSS
  at step 100 vs the last step with ``every=10`` (skipped when the callback is
  not available).

* nan: with ``on_nonfinite=True``, the uncaptured-step time of a hand-written
  loop (``BackwardGraphRecorder``) divided by the time without it, on the
  6-layer encoder and resnet50 (batch 2, 64x64); and the cost of locating a
  NaN's origin (``find_nonfinite_origin``: one forward under Paddle's
  numerics checker) and of replaying the step under capture, each divided by
  a plain step.

Results go to ``benchmarks/results/latest.json`` (git-ignored) unless
``--json`` says otherwise. Timings on shared machines are noisy: compare
ratios from one run, not absolute times across runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import paddle  # noqa: E402

from paddleviz_hooks import capture_backward  # noqa: E402
from paddleviz_hooks.render import png_size, render_png, render_svg  # noqa: E402
from paddleviz_hooks.render.draw import clear_plan_cache  # noqa: E402

DEFAULT_JSON = os.path.join(ROOT, "benchmarks", "results", "latest.json")

# Transformer encoder of the benchmark: 6 layers, d_model 256, 8 heads, FFN 1024.
TR_LAYERS, TR_D, TR_HEADS, TR_FF = 6, 256, 8, 1024
TR_BATCH, TR_SEQ = 8, 64


# --------------------------------------------------------------------------
# result table
# --------------------------------------------------------------------------
class Table:
    """Rows of (section, measurement, value text, ratio/note text) plus raw numbers."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, section: str, what: str, value: str = "", note: str = "", **raw: Any) -> None:
        self.rows.append({"section": section, "measurement": what, "value": value, "note": note, **raw})
        print(f"  {section:<10} {what:<58} {value:>12}  {note}", flush=True)

    def print(self) -> None:
        w = [max(len(str(r[k])) for r in self.rows) for k in ("section", "measurement", "value")]
        print()
        head = f"{'section':<{w[0]}}  {'measurement':<{w[1]}}  {'median':>{w[2]}}  ratio / note"
        print(head)
        print("-" * max(len(head), 100))
        last = None
        for r in self.rows:
            sec = r["section"] if r["section"] != last else ""
            last = r["section"]
            print(f"{sec:<{w[0]}}  {r['measurement']:<{w[1]}}  {r['value']:>{w[2]}}  {r['note']}")


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def fmt_s(v: float) -> str:
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


# --------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------
def paddle_transformer():
    paddle.seed(0)
    layer = paddle.nn.TransformerEncoderLayer(TR_D, TR_HEADS, TR_FF, dropout=0.0)
    model = paddle.nn.TransformerEncoder(layer, TR_LAYERS)
    x = paddle.randn([TR_BATCH, TR_SEQ, TR_D])
    return model, (lambda: model(x).mean())


def paddle_vision(name: str, batch: int = 2, size: int = 224):
    """A ``paddle.vision.models`` network (random weights) and its loss."""
    import paddle.vision.models as models

    paddle.seed(0)
    model = getattr(models, name)()
    x = paddle.randn([batch, 3, size, size])
    return model, (lambda: model(x).mean())


def paddle_resnet50():
    from paddle.vision.models import resnet50

    paddle.seed(0)
    model = resnet50()
    x = paddle.randn([2, 3, 224, 224])
    return model, (lambda: model(x).mean())


# --------------------------------------------------------------------------
# training-thread cost of a captured step
# --------------------------------------------------------------------------
def _interleaved(model, loss_fn, captures: dict[str, dict[str, Any]], repeats: int
                 ) -> tuple[dict[str, list[float]], dict[str, list[float]], Any]:
    """Plain forward+backward and one captured variant per ``captures`` entry
    (name -> capture_backward keywords), interleaved so drift hits all alike;
    returns the wall times and the process CPU times per kind (CPU time is
    steadier on a shared machine: it leaves out waiting for a core) and the
    last variant's last graph."""

    def plain():
        loss = loss_fn()
        loss.backward()
        model.clear_gradients()

    def captured(kwargs: dict[str, Any]):
        kwargs = dict(kwargs)
        layer = kwargs.pop("layer", model)  # {"layer": None}: no layer attribution

        def run():
            with capture_backward(layer, **kwargs) as cap:
                loss = loss_fn()
                loss.backward()
            model.clear_gradients()
            return cap.graph

        return run

    kinds = {"plain": plain, **{k: captured(kw) for k, kw in captures.items()}}
    last = list(kinds)[-1]
    for fn in kinds.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    graph = None
    for _ in range(repeats):
        for k, fn in kinds.items():
            gc.collect()
            c0 = time.process_time()
            dt, out = timed(fn)
            cpu[k].append(time.process_time() - c0)
            times[k].append(dt)
            if k == last:
                graph = out
    return times, cpu, graph


def bench_steps(table: Table, name: str, model, loss_fn, repeats: int) -> Any:
    """Plain vs captured forward+backward, with and without gradient statistics."""
    times, cpu, graph = _interleaved(model, loss_fn, {"shapes": {"grad_stats": False}, "stats": {"grad_stats": True}},
                                     repeats)
    base, base_cpu = med(times["plain"]), med(cpu["plain"])
    table.add(name, "plain forward+backward", fmt_s(base), f"{repeats} repeats", seconds=base)
    for k, label in (("shapes", "captured, shapes only (grad_stats=False)"), ("stats", "captured, grad_stats=True")):
        v, c = med(times[k]), med(cpu[k])
        table.add(name, label + " / plain", f"{v / base:.2f}x", f"{fmt_s(v)} per step; CPU time {c / base_cpu:.2f}x",
                  seconds=v, ratio=v / base, cpu_ratio=c / base_cpu)
    return graph


#: what a captured step does, one part added at a time (``bench_parts``)
PARTS = (("walk and hooks", {"layer": None, "grad_stats": False, "sources": False}),
         ("+ gradient statistics", {"layer": None, "sources": False}),
         ("+ layer attribution", {"sources": False}),
         ("+ source lines (all defaults)", {}))


def bench_parts(table: Table, name: str, model, loss_fn, repeats: int) -> None:
    """A captured step with one part of the capture added at a time (:data:`PARTS`), each
    divided by a plain step, and what each part adds, in CPU time (alternating runs)."""
    _, cpu, _ = _interleaved(model, loss_fn, dict(PARTS), repeats)
    base = med(cpu["plain"])
    before = base
    for label, _ in PARTS:
        c = med(cpu[label])
        table.add(name + ":parts", f"captured, {label} / plain (CPU time)", f"{c / base:.2f}x",
                  f"{fmt_s(c)} per step, this part {1000 * (c - before):+.1f} ms; plain {fmt_s(base)}; "
                  f"{repeats} repeats", cpu_ratio=c / base, part_seconds=c - before)
        before = c


# a post-hook of these would have to return holes Paddle refuses back (capture/session.py
# hooks around them); an accumulation node takes a tensor hook instead: leaving them
# out keeps the floor a floor
_UNHOOKED = ("GradNodeAccumulation", "ConcatGradNode", "StackGradNode", "AddNGradNodeFinal")


def _floor_step(model, loss_fn, *, layers: bool, ops: bool, grads: list | None = None) -> None:
    """One forward+backward with only Paddle's mechanisms a capture needs, doing nothing in
    them (:func:`bench_floor`): a walk over ``next_functions``, a no-op post-hook on every op
    node; with ``layers`` each call of a sublayer seen through ``Layer.__call__``; with ``ops``
    every op entry point wrapped (``capture/opcalls.py``) with listeners that do nothing.
    ``grads``: a list that gets a float copy of every gradient the hooks see."""
    from paddleviz_hooks.capture import opcalls
    from paddleviz_hooks.capture.gradnode import grad_fn
    from paddleviz_hooks.capture.stats import flat_tensors

    original = paddle.nn.Layer.__dict__["__call__"]
    if layers:
        known = {id(sub): path for path, sub in model.named_sublayers(include_self=True)}

        def call(layer, /, *inputs, **kwargs):
            known.get(id(layer))  # the lookup attribution.py makes: a layer of the model's?
            return original(layer, *inputs, **kwargs)

        paddle.nn.Layer.__call__ = call
    if ops:
        opcalls.listen(sources=(lambda args, kwargs: None, lambda out, args, kwargs, known, frame: None))
    try:
        loss = loss_fn()
    finally:
        if ops:
            opcalls.unlisten(sources=True)
        paddle.nn.Layer.__call__ = original
    if grads is None:
        def hook(outs, ins):
            return outs
    else:
        def hook(outs, ins):
            grads.extend(np.array(t.numpy(), dtype=np.float64 if t.dtype == paddle.float64 else np.float32)
                         for t in flat_tensors(outs))
            return outs
    seen, todo, post = set(), [grad_fn(loss)], []
    while todo:
        gn = todo.pop()
        if gn is None or gn.node_ptr() in seen:
            continue
        seen.add(gn.node_ptr())
        if gn.name() not in _UNHOOKED:
            post.append(gn._register_post_hook(hook))
        todo.extend(gn.next_functions)
    del todo, gn
    loss.backward()
    for h in post:
        h.remove()
    model.clear_gradients()


def _exact_stats_seconds(grads: list) -> float:
    """CPU time of the exact statistics of ``grads`` (numpy arrays) alone, as ``stats.py``
    takes them (float64 sums of squares, minimum, maximum), each array read right after a
    copy has put it in the cache, as a gradient is when its kernel has just written it."""
    from paddleviz_hooks.capture.stats import _VIEW_MIN, _sum_squares, segment_reductions

    total, small = 0.0, []
    for a in grads:
        if a.size < _VIEW_MIN:
            small.append(a)
            continue
        a = a.copy()
        t0 = time.process_time()
        _sum_squares(a), np.minimum.reduce(a, axis=None), np.maximum.reduce(a, axis=None)
        total += time.process_time() - t0
    if small:
        t0 = time.process_time()
        segment_reductions(small)
        total += time.process_time() - t0
    return total


def bench_floor(table: Table, name: str, model, loss_fn, repeats: int) -> None:
    """What no capture with the default parts can go below, on this machine, measured in
    Paddle alone: a walk and a no-op post-hook on every op node (seeing every gradient),
    each layer call seen and nothing done (attribution), a no-op listener on
    every op call (the call sites: source lines), and the exact statistics' numpy
    reductions of the step's gradients with nothing around them; CPU time against a plain
    step, alternating runs (``:parts`` rows show what the capture itself costs)."""

    def plain():
        loss_fn().backward()
        model.clear_gradients()

    kinds = {"plain": plain,
             "hooks": lambda: _floor_step(model, loss_fn, layers=False, ops=False),
             "layers": lambda: _floor_step(model, loss_fn, layers=True, ops=False),
             "ops": lambda: _floor_step(model, loss_fn, layers=True, ops=True)}
    for fn in kinds.values():
        fn()
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(repeats):
        for k, fn in kinds.items():
            gc.collect()
            c0 = time.process_time()
            fn()
            cpu[k].append(time.process_time() - c0)
    grads: list = []
    _floor_step(model, loss_fn, layers=False, ops=False, grads=grads)
    stats_s = med([_exact_stats_seconds(grads) for _ in range(3)])
    base = med(cpu["plain"])
    rows = (("walk + a no-op hook on every node", med(cpu["hooks"])),
            ("+ every layer call seen, nothing done", med(cpu["layers"])),
            ("+ a no-op listener on every op call", med(cpu["ops"])),
            ("+ exact statistics, numpy's reductions alone", med(cpu["ops"]) + stats_s))
    for label, c in rows:
        table.add(name + ":floor", f"floor: {label} / plain (CPU time)", f"{c / base:.2f}x",
                  f"{fmt_s(c)} per step; plain {fmt_s(base)}; {repeats} repeats"
                  + (f"; {len(grads)} gradients, {sum(a.size for a in grads) / 1e6:.1f} M elements, "
                     f"their statistics {1000 * stats_s:.1f} ms" if label.startswith("+ exact") else ""),
                  cpu_ratio=c / base)


# --------------------------------------------------------------------------
# saved memory (activations held for backward)
# --------------------------------------------------------------------------
def bench_saved(table: Table, name: str, model, loss_fn, repeats: int) -> None:
    """Captured step with and without saved_memory, interleaved with a plain step."""
    times, _, graph = _interleaved(model, loss_fn, {"captured": {}, "saved": {"saved_memory": True}}, repeats)
    base, cap, saved = med(times["plain"]), med(times["captured"]), med(times["saved"])
    section = name + ":saved"
    table.add(section, "captured, saved_memory=True / captured without", f"{saved / cap:.2f}x",
              f"{fmt_s(saved)} vs {fmt_s(cap)} per step, {repeats} repeats", ratio=saved / cap)
    table.add(section, "plain step (interleaved, after saved captures)", fmt_s(base),
              f"captured without / plain {cap / base:.2f}x", seconds=base)
    m = graph.meta["saved_memory"]
    growth = m.get("allocated_growth")
    table.add(section, "held for backward (unique storages, no params)", f"{m['total_bytes'] / 1e6:.2f} MB",
              f"allocator growth over the forward {growth / 1e6:.3f} MB, {m['saves']} saves"
              if growth is not None else f"{m['saves']} saves", bytes=m["total_bytes"], growth=growth)


# --------------------------------------------------------------------------
# forward source lines (Node.source)
# --------------------------------------------------------------------------
def bench_sources(table: Table, name: str, model, loss_fn, repeats: int) -> None:
    """Captured step with and without source lines; an uncaptured step under a recorder whose
    trigger watch is active on every step, with and without them (the flag must stay off)."""
    from paddleviz_hooks import BackwardGraphRecorder
    from paddleviz_hooks.capture import source

    times, cpu, graph = _interleaved(model, loss_fn, {"without": {"sources": False}, "sources": {}}, repeats)
    section = name + ":sources"
    w, v = med(times["without"]), med(times["sources"])
    table.add(section, "captured, sources=True / sources=False", f"{v / w:.3f}x",
              f"{fmt_s(v)} vs {fmt_s(w)} per step, CPU time {med(cpu['sources']) / med(cpu['without']):.3f}x, "
              f"{repeats} repeats", ratio=v / w, cpu_ratio=med(cpu["sources"]) / med(cpu["without"]))
    ops = [n for n in graph.nodes if n.kind == "op"]
    table.add(section, "op nodes with a source line", f"{sum(1 for n in ops if n.source)} of {len(ops)}",
              f"JSON {len(graph.to_json()) / 1e3:.0f} kB with, "
              f"{len(graph.to_json().encode()) - len(_without_sources(graph).to_json().encode()):+d} bytes for them")
    flags: list[int] = []
    arms = [0]
    real_arm = source.arm

    def counted_arm() -> bool:
        arms[0] += 1
        return real_arm()

    with tempfile.TemporaryDirectory() as tmp:
        recs = {k: BackwardGraphRecorder(os.path.join(tmp, k), model, steps=[10 ** 9], capture_first=False,
                                         on_structure_change=True, formats=("json",), visualdl=False, verbose=0,
                                         sources=(k == "sources"))
                for k in ("without", "sources")}
        t: dict[str, list[float]] = {k: [] for k in recs}
        c: dict[str, list[float]] = {k: [] for k in recs}
        source.arm = counted_arm
        try:
            for i in range(repeats + 1):
                for k, rec in recs.items():
                    gc.collect()
                    c0, t0 = time.process_time(), time.perf_counter()
                    with rec.step(i + 1):
                        loss = loss_fn()
                        flags.append(int(paddle.get_flags("FLAGS_call_stack_level")["FLAGS_call_stack_level"]))
                        loss.backward()
                    model.clear_gradients()
                    if i:  # the first is a warm-up
                        t[k].append(time.perf_counter() - t0)
                        c[k].append(time.process_time() - c0)
        finally:
            source.arm = real_arm
            for rec in recs.values():
                rec.close()
    u, uw = med(t["sources"]), med(t["without"])
    table.add(section, "uncaptured step (trigger watch on), sources=True / sources=False", f"{u / uw:.3f}x",
              f"{fmt_s(u)} vs {fmt_s(uw)}, CPU time {med(c['sources']) / med(c['without']):.3f}x (same code: "
              f"noise); flag armed {arms[0]} times, call-stack flag in those forwards: {sorted(set(flags))}",
              ratio=u / uw, arms=arms[0])


def _without_sources(graph):
    from dataclasses import replace

    return type(graph)(nodes=[replace(n, source=None, source_note=None) for n in graph.nodes], edges=graph.edges,
                       layers=graph.layers, meta=graph.meta, calls=graph.calls)


# --------------------------------------------------------------------------
# capture-to-PNG
# --------------------------------------------------------------------------
def bench_render(table: Table, name: str, graph, repeats: int) -> dict[str, float]:
    out: dict[str, float] = {}
    n = len(graph.nodes)
    cases = [
        ("full", f"PNG, full detail ({n} nodes, depth=None)", {"depth": None}),
        ("view", "PNG for viewing (render_png default)", {}),
        ("view_d1", "PNG, depth=1, fold_repeats=True", {"depth": 1, "fold_repeats": True}),
    ]
    for key, label, kw in cases:
        ts, info, data = [], {}, b""
        for _ in range(repeats):
            info = {}
            clear_plan_cache()  # a first drawing of this structure (the plan is not reused)
            dt, data = timed(lambda: render_png(graph, info=info, **kw))
            ts.append(dt)
        w, h = png_size(data)
        v = med(ts)
        out[key] = v
        how = f"{w}x{h} px, {info.get('nodes')} nodes, {info.get('dpi'):.0f} dpi"
        if info.get("collapsed_depth") is not None and key == "view":
            how += f", auto-collapsed to depth {info['collapsed_depth']}"
        if info.get("bands", 1) > 1:
            how += f", {info['bands']} rows"
        table.add(name, label, fmt_s(v), how, seconds=v, width=w, height=h, **{f"info_{k}": x for k, x in info.items()})
    # steady state: the same structure captured again reuses the plan
    first_runs = _count_engine_runs(lambda: render_png(graph))  # also primes the plan
    runs = _count_engine_runs(lambda: render_png(graph))
    ts = [timed(lambda: render_png(graph))[0] for _ in range(repeats)]
    out["view_again"] = med(ts)
    table.add(name, "PNG for viewing, same structure again (plan reused)", fmt_s(out["view_again"]),
              f"{runs} engine run(s) (first drawing: {first_runs}); first / again: "
              f"{out['view'] / out['view_again']:.1f}x", seconds=out["view_again"], engine_runs=runs,
              engine_runs_first=first_runs)
    ts = [timed(lambda: render_svg(graph))[0] for _ in range(repeats)]
    out["svg"] = med(ts)
    table.add(name, f"SVG, full detail ({n} nodes)", fmt_s(out["svg"]), "", seconds=out["svg"])
    table.add(name, "viewing PNG time / full-detail PNG time", f"{out['view'] / out['full']:.2f}x", "",
              ratio=out["view"] / out["full"])
    return out


class _EngineRuns:
    """Counts layout-engine processes, background threads included: a ``dot`` shim
    first on ``PATH`` logs each run and hands over to the real engine."""

    def __enter__(self) -> "_EngineRuns":
        from paddleviz_hooks.render import find_engine

        real = find_engine()
        self._saved = {k: os.environ.get(k) for k in ("PATH", "PADDLEVIZ_ENGINE")}
        self._tmp = tempfile.TemporaryDirectory(prefix="pvh-shim-")
        self._log = os.path.join(self._tmp.name, "runs.txt")
        if real is not None:
            shim = os.path.join(self._tmp.name, "dot")
            with open(shim, "w") as f:
                f.write(f'#!/bin/sh\necho run >> "{self._log}"\nexec "{real.path}" "$@"\n')
            os.chmod(shim, 0o755)
            os.environ["PATH"] = self._tmp.name + os.pathsep + os.environ.get("PATH", "")
            os.environ["PADDLEVIZ_ENGINE"] = "dot"
        return self

    def count(self) -> int:
        if not os.path.exists(self._log):
            return 0
        with open(self._log) as f:
            return len(f.read().splitlines())

    def __exit__(self, *exc: Any) -> None:
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._tmp.cleanup()


def _count_engine_runs(fn: Callable[[], Any]) -> int:
    """How many times ``fn`` runs the layout engine."""
    with _EngineRuns() as runs:
        fn()
        return runs.count()


# --------------------------------------------------------------------------
# the capture pipeline: drawing throughput and engine runs (default formats)
# --------------------------------------------------------------------------
def bench_drawing_rate(table: Table, name: str, graph, count: int) -> None:
    """Captures of one structure drawn per second by the real pipeline with the
    default options (PNG, SVG, DOT, JSON, VisualDL), and engine runs per capture."""
    from paddleviz_hooks.options import RecorderOptions
    from paddleviz_hooks.pipeline import CaptureJob, CapturePipeline
    from paddleviz_hooks.sinks.files import StepFiles
    from paddleviz_hooks.warn import WarnOnce

    clear_plan_cache()
    warn = WarnOnce()
    with tempfile.TemporaryDirectory(prefix="pvh-bench-") as tmp, _EngineRuns() as runs:
        pipe = CapturePipeline(RecorderOptions.check(tmp), StepFiles(os.path.join(tmp, "run")), "bench", warn)

        def draw(steps: list[int]) -> tuple[float, int]:
            before, t0 = runs.count(), time.perf_counter()
            for s in steps:
                pipe.submit(CaptureJob(graph, s, "scheduled"))
            while len(pipe.drawn) + len(warn.messages) < steps[-1] and time.perf_counter() - t0 < 900:
                time.sleep(0.005)
            return time.perf_counter() - t0, runs.count() - before

        first_t, first_runs = draw([1])
        t, n_runs = draw(list(range(2, count + 2)))
        pipe.close()
        info: dict = {}
        render_png(graph, info=info)  # planned again here (the plan cache is the drawing process's): the same view
    view = (f"view collapsed to depth {info['collapsed_depth']}" if info.get("collapsed_depth") is not None
            else "view has every node")
    problems = f"; {len(warn.messages)} problem(s): {warn.messages[0][:80]}" if warn.messages else ""
    table.add(name, "pipeline: first capture drawn (default formats)", fmt_s(first_t),
              f"{first_runs} engine runs (plan search){problems}", seconds=first_t, engine_runs=first_runs)
    table.add(name, "pipeline: captures drawn per second, same structure", f"{count / t:.2f}/s",
              f"{n_runs / count:.1f} engine runs per capture ({view}); {count} captures in {fmt_s(t)}",
              rate=count / t, engine_runs_per_capture=n_runs / count, captures=count)


def bench_fit_every5(table: Table, quick: bool) -> None:
    """``Model.fit`` at ``every=5`` on a 2-layer encoder: nothing dropped, everything drawn."""
    from paddleviz_hooks import BackwardGraphCallback

    class Encoder2(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            layer = paddle.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0)
            self.encoder = paddle.nn.TransformerEncoder(layer, 2)
            self.head = paddle.nn.Linear(64, 10)

        def forward(self, x):
            return self.head(self.encoder(x).mean(axis=1))

    steps, batch = (60 if quick else 200), 4

    def fit(callbacks: list) -> float:
        paddle.seed(0)
        net = Encoder2()
        model = paddle.Model(net)
        model.prepare(paddle.optimizer.SGD(learning_rate=1e-3, parameters=net.parameters()),
                      paddle.nn.CrossEntropyLoss())
        t0 = time.perf_counter()
        model.fit(_SeqData(steps * batch, (16, 64)), epochs=1, batch_size=batch, shuffle=False, verbose=0,
                  callbacks=callbacks)
        return time.perf_counter() - t0

    class TrainEnd(_StepClock):
        def on_train_end(self, logs=None):  # runs before the recorder's close (listed first)
            self.ended = time.perf_counter()

    fit([])  # warm-up
    rounds = 3  # plain and with the callback alternately: drift hits both alike
    bases, steps_, plains, runs = [], [], [], []
    for _ in range(rounds):
        base_clock = _StepClock()
        plains.append(fit([base_clock]))
        bases.append(med([t for s, t in base_clock.step_times().items() if s > 5]))
        with tempfile.TemporaryDirectory(prefix="pvh-bench-") as tmp:
            clock = TrainEnd()
            cb = BackwardGraphCallback(tmp, every=5, verbose=0)
            t0 = time.perf_counter()
            with_cb = fit([clock, cb])  # on_train_end closes: the backlog is drawn inside this time
            training = clock.ended - t0
            drawn = [f for f in os.listdir(cb.run_dir) if f.endswith(".png") and "_diff" not in f]
            undrawn = cb.recorder.undrawn_steps
        captured = set(cb.captured_steps)
        steps_.append(med([t for s, t in clock.step_times().items() if s > 5 and s not in captured]))
        runs.append((with_cb, training, len(drawn), len(undrawn), len(cb.dropped_steps), len(captured)))
    with_cb, training, drawn_n, undrawn_n, dropped, captured_n = sorted(runs)[rounds // 2]  # the median run
    step, base, plain = med(steps_), med(bases), med(plains)
    table.add("fit:every5", f"2-layer encoder, every=5, {steps} steps: captures dropped",
              str(dropped),
              f"{captured_n} captured, {drawn_n} drawn, {undrawn_n} undrawn at close; "
              f"training {training:.1f} s + close {with_cb - training:.1f} s vs {plain:.1f} s without the callback",
              dropped=dropped, captured=captured_n, drawn=drawn_n,
              undrawn=undrawn_n, seconds=with_cb, training_seconds=training, base_seconds=plain)
    table.add("fit:every5", "uncaptured step, every=5 / none", f"{step / base:.2f}x",
              f"{step * 1000:.1f} vs {base * 1000:.1f} ms (medians of {rounds} alternating runs each; "
              "drawing runs in a process of its own, at nice 10)",
              ratio=step / base, seconds=step, base_seconds=base,
              ratios=[round(a / b, 3) for a, b in zip(steps_, bases)])


def bench_huge(table: Table, explorer: bool = True) -> None:
    """A 224-layer encoder (about 10,000 nodes): capture, then the viewing PNG."""
    enc = paddle.nn.TransformerEncoder(paddle.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 224)
    x = paddle.randn([2, 4, 16])

    def capture():
        with capture_backward(enc) as cap:
            enc(x).mean().backward()
        return cap.graph

    def cpu(fn: Callable[[], Any]) -> float:
        t0 = time.process_time()
        fn()
        return time.process_time() - t0

    capture()  # warm-up: the first capture also reads the model's source files
    walls, cpus, plain_walls, plain_cpus = [], [], [], []
    for _ in range(3):  # alternating, medians
        plain_walls.append(timed(lambda: plain_cpus.append(cpu(lambda: enc(x).mean().backward())))[0])
        walls.append(timed(lambda: cpus.append(cpu(capture)))[0])
    dt, plain, graph = med(walls), med(plain_walls), capture()
    table.add("10k nodes", f"captured step ({len(graph.nodes)} nodes) / plain", f"{dt / plain:.2f}x",
              f"{fmt_s(dt)} vs {fmt_s(plain)}; CPU time {med(cpus) / med(plain_cpus):.2f}x",
              seconds=dt, ratio=dt / plain, cpu_ratio=med(cpus) / med(plain_cpus))
    bench_parts(table, "10k nodes", enc, lambda: enc(x).mean(), 3)
    bench_floor(table, "10k nodes", enc, lambda: enc(x).mean(), 3)
    clear_plan_cache()
    for what in ("first drawing", "same structure again"):
        info: dict = {}
        dt, _ = timed(lambda: render_png(graph, info=info))
        # the folds drawn: "layers.0-222 x223 beside layers.223" (one block of the run drawn)
        folds = "; ".join(f"{label} x{run - 1} beside {block}" for label, (block, run) in info.get("shown", {}).items())
        table.add("10k nodes", f"PNG for viewing ({what})", fmt_s(dt),
                  f"{info.get('nodes')} nodes drawn, {info.get('dpi'):.0f} dpi, engine runs: {info.get('engine_runs')}"
                  + (f", folded: {folds}" if folds else ", no fold drawn"), seconds=dt)
    if explorer:
        bench_explorer(table, graph)


_DRAWN_JS = """() => {
  const c = document.querySelector('canvas.main');
  return !!c && c.width > 0 && document.body.innerText.includes('layer count');
}"""


def bench_explorer(table: Table, graph) -> None:
    """Export for Model Explorer, then page opened -> graph drawn (collapsed) in headless Chromium."""
    from paddleviz_hooks.sinks.explorer import export_explorer

    with tempfile.TemporaryDirectory() as out:
        dt, files = timed(lambda: export_explorer(graph, out))
        size = os.path.getsize(files.graphs) + sum(os.path.getsize(p) for p in files.overlays.values())
        table.add("explorer", f"export ({len(graph.nodes)} nodes, {len(files.overlays)} overlays)", fmt_s(dt),
                  f"{size / 1e6:.1f} MB of JSON", seconds=dt)
        try:
            import model_explorer  # noqa: F401
            from playwright.sync_api import sync_playwright
        except ImportError:
            table.add("explorer", "first drawing in the browser", "n/a", "explorer extra or playwright missing")
            return
        if not os.path.exists("/usr/bin/chromium"):
            table.add("explorer", "first drawing in the browser", "n/a", "no /usr/bin/chromium")
            return
        from paddleviz_hooks.explore import explore

        with explore(graph, out_dir=out, inline=False) as handle, sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                        args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.route(lambda u: not u.startswith("http://127.0.0.1:"), lambda r: r.abort())
                t0 = time.perf_counter()
                page.goto(handle.url, timeout=120_000)
                page.wait_for_function(_DRAWN_JS, timeout=120_000, polling=50)
                dt = time.perf_counter() - t0
                page.wait_for_timeout(500)
                shot = os.path.join(ROOT, "benchmarks", "results", "explorer_10k.png")
                os.makedirs(os.path.dirname(shot), exist_ok=True)
                page.screenshot(path=shot)
            finally:
                browser.close()
        table.add("explorer", "page opened -> graph drawn, layers collapsed", fmt_s(dt),
                  "headless Chromium, software WebGL; screenshot benchmarks/results/explorer_10k.png", seconds=dt)


# --------------------------------------------------------------------------
# peer reference: torchviz
# --------------------------------------------------------------------------
def bench_torchviz(table: Table, repeats: int, ours_view: float | None) -> None:
    try:
        import torch
        from torchviz import make_dot
    except ImportError as exc:
        table.add("torchviz", "make_dot + PNG, PyTorch TransformerEncoder", "skipped",
                  f"torch/torchviz not installed ({exc.name}): .venv/bin/pip install torch==2.13.0 torchviz")
        return
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(TR_D, TR_HEADS, TR_FF, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, TR_LAYERS, enable_nested_tensor=False)
    x = torch.randn(TR_BATCH, TR_SEQ, TR_D)
    loss = model(x).mean()
    params = dict(model.named_parameters())
    build, total, data = [], [], b""
    for _ in range(repeats):
        t0 = time.perf_counter()
        dot = make_dot(loss, params=params)
        t1 = time.perf_counter()
        data = dot.pipe(format="png")
        t2 = time.perf_counter()
        build.append(t1 - t0)
        total.append(t2 - t0)
    nodes = sum(1 for line in dot.body if "->" not in line and "[" in line)
    w, h = png_size(data)
    v = med(total)
    table.add("torchviz", f"make_dot + PNG, same encoder in PyTorch ({nodes} nodes)", fmt_s(v),
              f"{w}x{h} px (aspect {max(w, h) / min(w, h):.1f}:1), make_dot alone {fmt_s(med(build))}",
              seconds=v, width=w, height=h, build_seconds=med(build), torch=torch.__version__)
    if ours_view is not None:
        table.add("torchviz", "our viewing PNG time / torchviz time", f"{ours_view / v:.2f}x", "",
                  ratio=ours_view / v)


# --------------------------------------------------------------------------
# Model.fit callback rows
# --------------------------------------------------------------------------
def _callback_class():
    try:
        from paddleviz_hooks import BackwardGraphCallback  # noqa: F401

        return BackwardGraphCallback
    except Exception:
        return None


class _Data(paddle.io.Dataset):
    def __init__(self, n: int, dim: int, classes: int) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((n, dim)).astype("float32")
        self.y = rng.integers(0, classes, (n, 1)).astype("int64")

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self) -> int:
        return len(self.x)


class _StepClock(paddle.callbacks.Callback):
    """Wall time between successive batch starts: the training thread's full step."""

    def __init__(self, rss_at: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.starts: list[float] = []
        self.rss_at = set(rss_at)
        self.rss: dict[int, int] = {}

    def on_train_batch_begin(self, step, logs=None):
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, step, logs=None):
        n = len(self.starts)  # 1-based global step
        if n in self.rss_at:
            gc.collect()
            self.rss[n] = _rss_bytes()

    def step_times(self) -> dict[int, float]:
        return {i + 1: b - a for i, (a, b) in enumerate(zip(self.starts, self.starts[1:]))}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fit(steps: int, batch: int, callbacks: list, dim: int = 256, hidden: int = 1024, classes: int = 10) -> None:
    paddle.seed(0)
    net = paddle.nn.Sequential(
        paddle.nn.Linear(dim, hidden), paddle.nn.ReLU(),
        paddle.nn.Linear(hidden, hidden), paddle.nn.ReLU(),
        paddle.nn.Linear(hidden, classes),
    )
    model = paddle.Model(net)
    model.prepare(paddle.optimizer.Adam(parameters=net.parameters()), paddle.nn.CrossEntropyLoss())
    model.fit(_Data(steps * batch, dim, classes), epochs=1, batch_size=batch, shuffle=False,
              verbose=0, callbacks=callbacks)


class _SeqData(paddle.io.Dataset):
    def __init__(self, n: int, shape: tuple[int, ...], classes: int = 10) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((n, *shape)).astype("float32")
        self.y = rng.integers(0, classes, size=(n, 1)).astype("int64")

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self) -> int:
        return len(self.x)


class _EncoderClassifier(paddle.nn.Layer):
    """The benchmark's 6-layer encoder with a mean-pool classification head."""

    def __init__(self) -> None:
        super().__init__()
        layer = paddle.nn.TransformerEncoderLayer(TR_D, TR_HEADS, TR_FF, dropout=0.0)
        self.encoder = paddle.nn.TransformerEncoder(layer, TR_LAYERS)
        self.head = paddle.nn.Linear(TR_D, 10)

    def forward(self, x):
        return self.head(self.encoder(x).mean(axis=1))


def _fit_model(name: str, steps: int, callbacks: list) -> None:
    paddle.seed(0)
    if name == "encoder":
        net, shape, batch = _EncoderClassifier(), (TR_SEQ // 2, TR_D), 4
    else:  # resnet50 at 64x64 keeps 200+ steps affordable on 2 cores; the graph is the same
        from paddle.vision.models import resnet50

        net, shape, batch = resnet50(num_classes=10), (3, 64, 64), 2
    model = paddle.Model(net)
    model.prepare(paddle.optimizer.SGD(learning_rate=1e-3, parameters=net.parameters()),
                  paddle.nn.CrossEntropyLoss())
    model.fit(_SeqData(steps * batch, shape), epochs=1, batch_size=batch, shuffle=False, verbose=0,
              callbacks=callbacks)


def model_fit_rows(table: Table, quick: bool) -> None:
    """Uncaptured-step cost of the callback and of each trigger, on real models in Model.fit.

    Runs alternate (none, every=50, each trigger) so drift hits every variant
    alike; steps that were captured are left out of the medians.
    """
    cls = _callback_class()
    steps = 60 if quick else 210
    rounds = 1 if quick else 2
    variants = [
        ("BackwardGraphCallback(every=50)", {"every": 50}),
        ("on_nonfinite=True", {"steps": [10**9], "capture_first": False, "on_nonfinite": True}),
        ("on_grad_spike=10", {"steps": [10**9], "capture_first": False, "on_grad_spike": 10}),
        ("on_structure_change=True", {"steps": [10**9], "capture_first": False, "on_structure_change": True}),
    ]
    with tempfile.TemporaryDirectory(prefix="pvh-bench-") as tmp:
        for name in ("encoder", "resnet50"):
            times: dict[str, list[float]] = {"none": []}
            captured: dict[str, list[int]] = {}
            _fit_model(name, 30, [])  # warm-up
            for r in range(rounds):
                # "none" brackets each round, so slow drift cannot favour the variants
                clock = _StepClock()
                _fit_model(name, steps // 2, [clock])
                times["none"] += [t for s, t in clock.step_times().items() if s > 5]
                for label, kwargs in variants:
                    clock = _StepClock()
                    cb = cls(log_dir=os.path.join(tmp, f"{name}{r}{len(times)}"), verbose=0, **kwargs)
                    _fit_model(name, steps, [clock, cb])
                    got = set(cb.captured_steps) | set(getattr(cb, "dropped_steps", ()))
                    captured[label] = sorted(got)
                    # the step after a capture shares the machine with the background renderer
                    skip = got | {s + 1 for s in got}
                    times.setdefault(label, []).extend(
                        t for s, t in clock.step_times().items() if s > 5 and s not in skip)
                clock = _StepClock()
                _fit_model(name, steps // 2, [clock])
                times["none"] += [t for s, t in clock.step_times().items() if s > 5]
            base = med(times["none"])
            for label, _ in variants:
                v = med(times[label])
                table.add(f"fit:{name}", f"uncaptured step, {label} / none", f"{v / base:.3f}x",
                          f"{v * 1000:.1f} vs {base * 1000:.1f} ms, {rounds} x {steps} steps, "
                          f"captured {captured[label][:6]}", ratio=v / base, seconds=v, base_seconds=base)


def nan_origin_rows(table: Table, quick: bool) -> None:
    """on_nonfinite=True: uncaptured-step ratio, and the cost of one locate and one replayed capture."""
    from paddle.vision.models import resnet50

    from paddleviz_hooks import BackwardGraphRecorder, find_nonfinite_origin
    from paddleviz_hooks.capture.nan_origin import StepInputs, replay_step
    from paddleviz_hooks.triggers import grads_nonfinite

    pairs = 12 if quick else 40
    with tempfile.TemporaryDirectory(prefix="pvh-bench-") as tmp:
        for name in ("encoder", "resnet50"):
            paddle.seed(0)
            if name == "encoder":
                layer = paddle.nn.TransformerEncoderLayer(TR_D, TR_HEADS, TR_FF, dropout=0.1)
                model = paddle.nn.TransformerEncoder(layer, TR_LAYERS)
                x = paddle.randn([TR_BATCH, TR_SEQ, TR_D])
            else:
                model = resnet50(num_classes=10)
                x = paddle.randn([2, 3, 64, 64])
            opt = paddle.optimizer.SGD(learning_rate=1e-4, parameters=model.parameters())
            rec = BackwardGraphRecorder(os.path.join(tmp, name), model, steps=[10**9], capture_first=False,
                                        on_nonfinite=True, visualdl=False, formats=("json",), verbose=0)

            def step(with_rec: bool) -> float:
                if with_rec:
                    rec.open()  # hooks and patch go in outside the timed step
                t = time.perf_counter()
                with (rec.step() if with_rec else _null()):
                    loss = model(x).mean()
                    loss.backward()
                opt.step()
                opt.clear_grad()
                dt = time.perf_counter() - t
                if with_rec:
                    rec.close()
                return dt

            for _ in range(2):
                step(False)
                step(True)
            none, ours, ratios = [], [], []
            for i in range(pairs):  # adjacent pairs, order alternating: the machine's load drifts
                first = bool(i % 2)
                a, b = step(first), step(not first)
                n, o = (b, a) if first else (a, b)
                none.append(n)
                ours.append(o)
                ratios.append(o / n)
            assert rec.captured_steps == []
            base, v = med(none), med(ours)
            table.add(f"nan:{name}", "uncaptured step, on_nonfinite=True / none", f"{med(ratios):.3f}x",
                      f"median of {pairs} adjacent pairs; {v * 1000:.1f} vs {base * 1000:.1f} ms median step, "
                      f"fastest {min(ours) * 1000:.1f} vs {min(none) * 1000:.1f} ms",
                      ratio=med(ratios), seconds=v, base_seconds=base)
            loss = model(x).mean()
            loss.backward()
            check = min(timed(lambda: grads_nonfinite(model.parameters()))[0] for _ in range(5))
            opt.clear_grad()
            table.add(f"nan:{name}", "NaN/Inf check after backward / fastest plain step",
                      f"{check / min(none):.3f}x", f"{check * 1000:.2f} ms (one sum per gradient)",
                      ratio=check / min(none), seconds=check)
            locate = [timed(lambda: find_nonfinite_origin(model, x))[0] for _ in range(2 if quick else 3)]
            table.add(f"nan:{name}", "one locate (checked forward) / plain step", f"{med(locate) / base:.2f}x",
                      f"{fmt_s(med(locate))}", ratio=med(locate) / base, seconds=med(locate))
            kept = StepInputs(model).install()
            replays = []
            for _ in range(2 if quick else 3):
                kept.reset()
                model(x).mean().backward()
                replays.append(timed(lambda: _replay_captured(model, kept, replay_step))[0])
                opt.clear_grad()
            kept.remove()
            table.add(f"nan:{name}", "replayed capture of the step / plain step", f"{med(replays) / base:.2f}x",
                      f"{fmt_s(med(replays))} (forward + backward under capture_backward)",
                      ratio=med(replays) / base, seconds=med(replays))
            if name == "resnet50":  # the check reads every gradient once: its share shrinks as the input grows
                big = paddle.randn([2, 3, 224, 224])
                full = []
                for _ in range(2 if quick else 3):
                    dt, _ = timed(lambda: model(big).mean().backward())
                    full.append(dt)
                    opt.clear_grad()
                table.add(f"nan:{name}", "NaN/Inf check / fastest plain step at 224x224", f"{check / min(full):.3f}x",
                          f"{check * 1000:.2f} vs {min(full) * 1000:.0f} ms", ratio=check / min(full))
            del model, opt


def _replay_captured(model, kept, replay_step) -> None:
    with capture_backward(model) as cap:
        replay_step(model, kept)
    assert cap.graphs


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def bench_callback(table: Table, quick: bool) -> None:
    """Run the callback rows in a fresh process, so RSS is not inflated by the models above."""
    if _callback_class() is None:
        _callback_skipped(table)
        return
    import subprocess

    with tempfile.TemporaryDirectory(prefix="pvh-bench-") as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--callback-child", out] + (["--quick"] if quick else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            table.add("callback", "Model.fit rows", "failed", tail[0][:160])
            return
        with open(out) as f:
            for row in json.load(f):
                row = dict(row)
                table.add(row.pop("section"), row.pop("measurement"), row.pop("value"), row.pop("note"), **row)


def _callback_skipped(table: Table) -> None:
    table.add("callback", "uncaptured step, BackwardGraphCallback(every=50) / none", "skipped",
              "skipped: callback not available")
    table.add("callback", "RSS late step vs step 100, every=10", "skipped", "skipped: callback not available")


def callback_rows(table: Table, quick: bool) -> None:
    """The rows that need ``paddle.Model.fit`` with ``BackwardGraphCallback``."""
    cls = _callback_class()
    if cls is None:
        _callback_skipped(table)
        return
    steps = 150 if quick else 300
    with tempfile.TemporaryDirectory(prefix="pvh-bench-") as tmp:
        _fit(50, 32, [])  # warm-up: first-fit costs would land on the first measured run
        # uncaptured-step overhead: alternate runs without and with the callback
        rounds = 2 if quick else 3
        base: list[float] = []
        withcb: list[float] = []
        captured: set[int] = set()
        for r in range(rounds):
            clock = _StepClock()
            _fit(steps, 32, [clock])
            base += [t for s, t in clock.step_times().items() if s > 5]
            clock = _StepClock()
            cb = cls(log_dir=os.path.join(tmp, f"over{r}"), every=50, verbose=0)
            _fit(steps, 32, [clock, cb])
            captured = set(getattr(cb, "captured_steps", ()))
            withcb += [t for s, t in clock.step_times().items() if s > 5 and s not in captured]
        b, c = med(base), med(withcb)
        # The callback's own work on an uncaptured step, timed in isolation:
        # a whole-step ratio cannot resolve 1% on a shared 2-core machine.
        cb = cls(log_dir=os.path.join(tmp, "calls"), steps=[10**9], capture_first=False, verbose=0)
        cb.on_train_begin({})
        n = 200_000
        t0 = time.perf_counter()
        for i in range(n):
            cb.on_train_batch_begin(i, None)
            cb.on_train_batch_end(i, None)
        per_step = (time.perf_counter() - t0) / n
        cb.on_train_end({})
        table.add("callback", "callback work per uncaptured step / step time", f"{per_step / b:.5f}x",
                  f"{per_step * 1e6:.2f} us per step (batch begin + end) vs a {b * 1000:.1f} ms step",
                  ratio=per_step / b, seconds=per_step)
        table.add("callback", "uncaptured step, BackwardGraphCallback(every=50) / none", f"{c / b:.3f}x",
                  f"{c * 1000:.2f} vs {b * 1000:.2f} ms per step (3-layer MLP), {rounds} x {steps} steps each, "
                  f"captured steps {sorted(captured)}",
                  ratio=c / b, seconds=c, base_seconds=b)
        # memory: RSS at step 100 vs the last step, without the callback (control) and
        # capturing every 10 steps
        last = 600 if quick else 2000
        clock = _StepClock(rss_at=(100, last))
        _fit(last, 16, [clock])
        c100, clast = clock.rss.get(100), clock.rss.get(last)
        if c100 and clast:
            table.add("callback", f"RSS at step {last} / step 100, no callback (control)", f"{clast / c100:.3f}x",
                      f"{c100 / 2**20:.0f} MB -> {clast / 2**20:.0f} MB ({(clast - c100) / 2**20:+.1f} MB)",
                      ratio=clast / c100, rss_100=c100, rss_last=clast, last_step=last)
        clock = _StepClock(rss_at=(100, last))
        cb = cls(log_dir=os.path.join(tmp, "rss"), every=10, verbose=0)
        t, _ = timed(lambda: _fit(last, 16, [clock, cb]))
        r100, rlast = clock.rss.get(100), clock.rss.get(last)
        if r100 and rlast:
            n = len(getattr(cb, "captured_steps", ()))
            dropped = len(getattr(cb, "dropped_steps", ()))
            table.add("callback", f"RSS at step {last} / step 100, every=10", f"{rlast / r100:.3f}x",
                      f"{r100 / 2**20:.0f} MB -> {rlast / 2**20:.0f} MB ({(rlast - r100) / 2**20:+.1f} MB), "
                      f"{n} captures ({dropped} of them dropped: renderer busy), {t:.1f} s in all",
                      ratio=rlast / r100, rss_100=r100, rss_last=rlast, last_step=last)
        else:
            table.add("callback", f"RSS at step {last} / step 100, every=10", "n/a", "RSS not recorded")


def dp_child(out: str, quick: bool) -> None:
    """One rank of the 2-process data-parallel rows (started by ``dp_rows`` through the launcher)."""
    import paddle.distributed as dist

    from paddleviz_hooks import BackwardGraphRecorder

    dist.init_parallel_env()
    rank = dist.get_rank()
    steps, rounds, every = (60, 2, 10) if quick else (150, 3, 10)
    rng = np.random.default_rng(rank)
    data = [(paddle.to_tensor(rng.standard_normal((32, 256)).astype("float32")),
             paddle.to_tensor(rng.integers(0, 10, (32, 1)).astype("int64"))) for _ in range(8)]

    def run(rec_dir: str | None, **options: Any) -> tuple[list[float], list[float]]:
        paddle.seed(0)
        net = paddle.nn.Sequential(paddle.nn.Linear(256, 1024), paddle.nn.ReLU(), paddle.nn.Linear(1024, 1024),
                                   paddle.nn.ReLU(), paddle.nn.Linear(1024, 10))
        model = paddle.DataParallel(net)
        opt = paddle.optimizer.Adam(parameters=model.parameters())
        rec = None if rec_dir is None else BackwardGraphRecorder(rec_dir, model, every=every, ranks="all", verbose=0,
                                                                    **options)
        times = []
        for step in range(1, steps + 1):
            x, y = data[step % len(data)]
            t = time.perf_counter()
            if rec is not None:
                with rec.step(step):
                    paddle.nn.functional.cross_entropy(model(x), y).backward()
            else:
                paddle.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.clear_grad()
            times.append(time.perf_counter() - t)
        captured = set()
        if rec is not None:
            rec.close()
            captured = set(rec.captured_steps)
        kept = [(s, t) for s, t in enumerate(times, start=1) if s > 5]
        return [t for s, t in kept if s not in captured], [t for s, t in kept if s in captured]

    with tempfile.TemporaryDirectory(prefix=f"pvh-dp{rank}-") as tmp:
        run(None)  # warm-up
        # default options (drawing in background threads), and JSON only (no drawing, no VisualDL)
        variants = {"": {}, ", JSON only": {"formats": ["json"], "visualdl": False}}
        base: list[float] = []
        found: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in variants}
        for r in range(rounds):
            base += run(None)[0]
            for k, options in variants.items():
                u, c = run(os.path.join(tmp, f"r{r}{len(k)}"), **options)
                found[k][0].extend(u)
                found[k][1].extend(c)
    if rank == 0:
        b = med(base)
        table = Table()
        for k, (uncaptured, captured) in found.items():
            u, c = med(uncaptured), med(captured)
            what = f"BackwardGraphRecorder(every={every}, ranks='all'{k})"
            table.add("dp2", f"uncaptured step, {what} / none", f"{u / b:.3f}x",
                      f"{u * 1000:.2f} vs {b * 1000:.2f} ms per step on rank 0 (3-layer MLP, batch 32 per rank, "
                      f"2 gloo CPU processes), {rounds} x {steps} steps", ratio=u / b, seconds=u, base_seconds=b)
            table.add("dp2", f"captured step, {what} / none", f"{c / b:.2f}x",
                      f"{c * 1000:.1f} ms, {len(captured)} captured steps, both gradients recorded",
                      ratio=c / b, seconds=c, base_seconds=b)
        with open(out, "w") as f:
            json.dump(table.rows, f)


def dp_rows(table: Table, quick: bool) -> None:
    """Step ratios under 2-process data parallel, run through ``paddle.distributed.launch``."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="pvh-bench-dp-") as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
               os.path.join(tmp, "logs"), os.path.abspath(__file__), "--dp-child", out] + (["--quick"] if quick else [])
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp)
            ok = proc.returncode == 0 and os.path.exists(out)
            why = "" if ok else ((proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"])[0]
        except subprocess.TimeoutExpired:
            ok, why = False, "timed out after 900 s"
        if not ok:
            table.add("dp2", "2-process data parallel rows", "failed", why[:160])
            return
        with open(out) as f:
            for row in json.load(f):
                row = dict(row)
                table.add(row.pop("section"), row.pop("measurement"), row.pop("value"), row.pop("note"), **row)


# --------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few repeats, shorter fit runs (a few minutes)")
    ap.add_argument("--json", metavar="PATH", default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    ap.add_argument("--skip", action="append", default=[],
                    choices=["transformer", "resnet50", "cnn", "huge", "fit5", "explorer", "torchviz", "callback", "nan", "saved",
                             "dp", "sources"],
                    help="leave out a group of rows (repeatable)")
    ap.add_argument("--callback-child", metavar="PATH", help=argparse.SUPPRESS)
    ap.add_argument("--dp-child", metavar="PATH", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    quick = args.quick
    if args.dp_child:  # one rank of the data-parallel rows
        dp_child(args.dp_child, quick)
        return 0
    if args.callback_child:  # the Model.fit rows, in their own process
        table = Table()
        callback_rows(table, quick)
        model_fit_rows(table, quick)
        with open(args.callback_child, "w") as f:
            json.dump(table.rows, f)
        return 0
    reps = {"tr_steps": 3 if quick else 7, "r50_steps": 2 if quick else 4,
            "render": 2 if quick else 5, "r50_render": 1 if quick else 3, "rate": 3 if quick else 8}
    started = time.time()
    print(f"paddleviz-hooks benchmarks ({'quick' if quick else 'full'}), paddle {paddle.__version__}, "
          f"{os.cpu_count()} CPUs, {platform.python_version()}", flush=True)
    table = Table()
    ours_view = None
    if "transformer" not in args.skip:
        model, loss_fn = paddle_transformer()
        g = bench_steps(table, "encoder", model, loss_fn, reps["tr_steps"])
        table.add("encoder", "graph captured (grad_stats=True)", f"{len(g.nodes)} nodes",
                  f"meta capture_ms {g.meta.get('capture_ms', 0):.0f} (walk + hooks + build)")
        ours_view = bench_render(table, "encoder", g, reps["render"])["view"]
        bench_drawing_rate(table, "encoder", g, reps["rate"])
        del model, g
    if "resnet50" not in args.skip:
        model, loss_fn = paddle_resnet50()
        g = bench_steps(table, "resnet50", model, loss_fn, reps["r50_steps"])
        table.add("resnet50", "graph captured (grad_stats=True)", f"{len(g.nodes)} nodes",
                  f"meta capture_ms {g.meta.get('capture_ms', 0):.0f} (walk + hooks + build)")
        bench_render(table, "resnet50", g, reps["r50_render"])
        bench_drawing_rate(table, "resnet50", g, reps["rate"])
        del model, g
    if "cnn" not in args.skip:  # many small gradients: the per-gradient cost of statistics
        for name in ("mobilenet_v3_small", "shufflenet_v2_x1_0"):
            model, loss_fn = paddle_vision(name)
            g = bench_steps(table, name, model, loss_fn, reps["tr_steps"] + 2)
            table.add(name, "graph captured (grad_stats=True)", f"{len(g.nodes)} nodes",
                      f"{sum(1 for e in g.edges if e.grad is not None and e.grad.norm is not None)} gradients measured")
            bench_parts(table, name, model, loss_fn, reps["tr_steps"] + 2)
            bench_floor(table, name, model, loss_fn, reps["tr_steps"] + 2)
            del model, g
    for group, bench in (("saved", bench_saved), ("sources", bench_sources)):  # captured step with / without
        if group in args.skip:
            continue
        for name, make, n in (("encoder", paddle_transformer, reps["tr_steps"]),
                              ("resnet50", paddle_resnet50, reps["r50_steps"])):
            model, loss_fn = make()
            bench(table, name, model, loss_fn, n)
            del model
    if "huge" not in args.skip:
        bench_huge(table, explorer="explorer" not in args.skip)
    if "fit5" not in args.skip:
        bench_fit_every5(table, quick)
    if "torchviz" not in args.skip:
        bench_torchviz(table, reps["render"], ours_view)
    if "callback" not in args.skip:
        bench_callback(table, quick)
    if "nan" not in args.skip:
        nan_origin_rows(table, quick)
    if "dp" not in args.skip:
        dp_rows(table, quick)

    table.print()
    elapsed = time.time() - started
    print(f"\n{elapsed:.0f} s in all; ratios are comparable within this run only.")
    result = {
        "quick": quick,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "seconds": round(elapsed, 1),
        "env": {"paddle": paddle.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                "machine": platform.machine()},
        "rows": table.rows,
    }
    path = os.path.abspath(args.json)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
