"""The capture pipeline: data first, drawings in priority order, nothing lost."""

from __future__ import annotations

import threading

import numpy as np
import paddle
import paddle.nn as nn
import pytest

from paddleviz_hooks import BackwardGraph, BackwardGraphCallback, BackwardGraphRecorder
from paddleviz_hooks.pipeline import CapturePipeline

from _fitkit import (
    Recorder,
    assert_same_run,
    mlp,
    ours,
    recorded_warnings,
    run_fit,
    step_files,
    text_records,
    vdl_records,
)

STEPS = 40


class Branch(nn.Layer):
    """An MLP that switches a branch on at step 25 (a structure change)."""

    def __init__(self):
        super().__init__()
        self.body, self.extra, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = paddle.tanh(self.body(x))
        if self.calls >= 25:
            h = h + self.extra(h)
        return self.head(h)


def test_every_step_fast_model_tiny_queue_loses_nothing(tmp_path, monkeypatch):
    """every=2 for 40 steps, queue_size=1, drawing slower than training, a trigger mid-run:
    every step's JSON, summary and scalars are written, the triggered step is drawn
    before the scheduled backlog, and after close() every step has its picture."""
    base = run_fit(Branch, [], steps=STEPS)
    order = []
    gate = threading.Event()
    real = CapturePipeline._draw

    def slow(self, d):
        gate.wait(30)
        order.append(d.step)
        return real(self, d)

    monkeypatch.setattr(CapturePipeline, "_draw", slow)
    cb = BackwardGraphCallback(str(tmp_path), every=2, queue_size=1, on_structure_change=True, cooldown=0,
                               verbose=0, view_max_px=300, formats=("json", "png"))
    with recorded_warnings() as got:
        res = run_fit(Branch, [cb], steps=STEPS,
                      recorder=Recorder(on_step=lambda s: gate.set() if s == STEPS else None))
    assert_same_run(res, base)
    assert ours(got) == []
    assert cb.captured_steps == sorted([1, 25, *range(2, STEPS + 1, 2)]) and cb.dropped_steps == []
    assert cb.triggers[25] == "structure_change"
    run_dir = tmp_path / "backward_graph"
    assert step_files(run_dir, "json") == cb.captured_steps
    assert step_files(run_dir, "png") == cb.captured_steps
    assert (run_dir / "step_000025_diff.json").exists() and (run_dir / "step_000025_diff.png").exists()
    reader = vdl_records(run_dir)
    assert sorted(text_records(reader, "summary")) == cb.captured_steps
    assert [r.id for r in reader.get_data("scalar", "~backward_graph/nonfinite_grads")] == cb.captured_steps
    # the first drawing had started before the gate opened; then the trigger jumps the queue
    assert order[:2] == [1, 25], order[:4]
    assert not (run_dir / ".pending").exists()


def test_close_timeout_names_what_is_left_with_the_command(tmp_path, monkeypatch, capsys):
    gate = threading.Event()
    real = CapturePipeline._draw

    def blocked(self, d):
        gate.wait(5)
        return real(self, d)

    monkeypatch.setattr(CapturePipeline, "_draw", blocked)
    net = mlp()
    x, y = paddle.randn([4, 8]), paddle.randint(0, 3, [4, 1])
    rec = BackwardGraphRecorder(str(tmp_path), net, every=1, close_timeout=0, render_timeout=5, verbose=1,
                                visualdl=False, formats=("json", "png"))
    with recorded_warnings() as got:
        for step in range(1, 6):
            with rec.step(step):
                nn.functional.cross_entropy(net(x), y).backward()
        rec.close()
    gate.set()
    msgs = ours(got)
    assert len(msgs) == 1 and "not drawn within close_timeout=0 s" in msgs[0], msgs
    assert "paddleviz-hooks render" in msgs[0] and "step_000002.json" in msgs[0]
    assert rec.undrawn_steps and set(rec.undrawn_steps) <= {2, 3, 4, 5}
    assert step_files(tmp_path / "backward_graph", "json") == [1, 2, 3, 4, 5]
    out = capsys.readouterr().out
    assert "5 steps captured" in out and f"{len(rec.undrawn_steps)} left undrawn" in out


def test_formats_decide_every_file(tmp_path):
    """formats=("json",): no PNG, not even of a diff; the diff JSON is written."""
    cb = BackwardGraphCallback(str(tmp_path), steps=[1, 30], verbose=0, visualdl=False, formats=("json",))
    run_fit(Branch, [cb], steps=STEPS)
    names = sorted(p.name for p in (tmp_path / "backward_graph").iterdir())
    assert names == ["step_000001.json", "step_000030.json", "step_000030_diff.json"]
    assert np.isfinite(cb.captured_steps).all()


@pytest.mark.parametrize("formats, view_max_px, act, steady, visualdl", [
    (("json", "png"), 2000, nn.Tanh, 1, False),
    (("png", "svg", "dot", "json"), 2000, nn.Sigmoid, 1, False),  # the SVG comes from the PNG's run
    (("png", "svg", "dot", "json"), 160, nn.Softsign, 2, False),  # a collapsed view: the full SVG is another graph
    (("png", "svg", "dot", "json"), 2000, nn.Hardtanh, 2, True),  # the defaults: + the picture for VisualDL's viewer
])
def test_engine_runs_once_per_capture_in_steady_state(tmp_path, engine_run_count, formats, view_max_px, act, steady,
                                                      visualdl):
    """A `dot` shim first on PATH counts layout-engine runs: with the structure unchanged,
    each capture's viewing PNG costs one run (its size and collapse plan is reused), and
    the full-detail SVG comes from that same run unless the viewing picture is collapsed."""
    import re

    runs = engine_run_count
    per_capture = []
    net = nn.Sequential(nn.Linear(8, 23), act(), nn.Linear(23, 3))  # a structure no other test draws
    x, y = paddle.randn([4, 8]), paddle.randint(0, 3, [4, 1])
    with BackwardGraphRecorder(str(tmp_path / "log"), net, every=1, verbose=0, visualdl=visualdl,
                               visualdl_graphs=False, formats=formats, view_max_px=view_max_px) as rec:
        for step in range(1, 7):
            before = runs()
            with rec.step(step):
                nn.functional.cross_entropy(net(x), y).backward()
            while not rec.pipeline.idle or len(rec.pipeline.drawn) < step:
                threading.Event().wait(0.01)
            per_capture.append(runs() - before)
    print(f"\nengine runs per capture, formats={formats}, view_max_px={view_max_px}: {per_capture}")
    assert 1 <= per_capture[0] <= 3 * steady, per_capture  # a new structure: at most 3 runs per picture
    assert per_capture[1:] == [steady] * 5, per_capture
    run_dir = tmp_path / "log" / "backward_graph"
    assert step_files(run_dir, "png") == list(range(1, 7))
    if "svg" in formats:
        graph = BackwardGraph.from_json((run_dir / "step_000006.json").read_text())
        svg = (run_dir / "step_000006.svg").read_text()
        assert len(re.findall(r'<g id="node\d+" class="node', svg)) == len(graph.nodes) + 1  # + the legend
        assert ("collapsed to layer depth" in svg) is False  # the SVG always has every op


def test_a_10000_node_graph_is_captured_and_drawn_legibly(tmp_path):
    """224 encoder layers: about 10,000 nodes. The full graph is never laid out (minutes);
    the viewing PNG folds the identical blocks into one 'x223' box beside the one block it draws
    (tests/test_fold_view.py looks at that picture) and stays legible."""
    import time

    from paddleviz_hooks.render import LEGIBLE_DPI, render_png

    paddle.seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 224)
    rec = BackwardGraphRecorder(str(tmp_path), enc, every=1, verbose=0, visualdl=False,
                                formats=("json", "png"))
    t0 = time.perf_counter()
    with rec:
        with rec.step(1):
            enc(paddle.randn([2, 4, 16])).mean().backward()
        step_seconds = time.perf_counter() - t0
    from paddleviz_hooks import BackwardGraph

    graph = BackwardGraph.from_json((tmp_path / "backward_graph" / "step_000001.json").read_text())
    assert len(graph.nodes) > 10_000
    assert step_files(tmp_path / "backward_graph", "png") == [1]
    info = {}
    t0 = time.perf_counter()
    render_png(graph, info=info)
    assert time.perf_counter() - t0 < 30
    assert info["dpi"] >= LEGIBLE_DPI and info["nodes"] < 100 and info["shown"], info
    print(f"\n10k-node graph: captured step {step_seconds:.1f} s, viewing PNG {info}")


def test_visualdl_never_gets_a_one_box_picture_of_a_real_model(tmp_path):
    """resnet18's picture for VisualDL's viewer (1280x720, labels >= 8 px) wraps its top-level
    blocks into rows instead of shrinking the model into a single box; were it one box, the PNG
    file's picture would be logged instead."""
    from _fitkit import vdl_records
    from paddleviz_hooks.options import RecorderOptions
    from paddleviz_hooks.drawworker import viewer_png
    from paddleviz_hooks.render import png_size
    from paddleviz_hooks.sinks.visualdl import encode_like_visualdl, png_to_array
    from paddleviz_hooks.text import every_op_elsewhere, graph_title

    paddle.seed(0)
    net = paddle.vision.models.resnet18(num_classes=4)
    x = paddle.randn([2, 3, 32, 32])
    with BackwardGraphRecorder(str(tmp_path), net, every=1, verbose=0, formats=("json", "png"),
                               visualdl_graphs=False) as rec:
        with rec.step(1):
            net(x).mean().backward()
    run = tmp_path / "backward_graph"
    image = vdl_records(str(run)).get_data("image", "backward_graph/from_step_000001")[0]
    graph = BackwardGraph.from_json((run / "step_000001.json").read_text())
    seen: dict = {}
    # formats without svg: the collapsed picture's title points to the explorer for every op
    viewer = viewer_png(graph, RecorderOptions.check(), graph_title(graph), info=seen,
                        full_detail=every_op_elsewhere())
    assert seen["collapsed_depth"] != 0 and seen["nodes"] > 5, seen  # the blocks, not one box
    w, h = png_size(viewer)
    assert w <= 1280 and h <= 720
    assert image.image.encoded_image_string == encode_like_visualdl(png_to_array(viewer))


@pytest.mark.parametrize("blocks", [6, 12])
def test_viewer_shows_each_encoder_block_when_legible(blocks):
    """A 6- or 12-layer TransformerEncoder drawn for VisualDL's viewer shows every block as its
    own box (legible in rows at depth 1) instead of folding them into one ``layers.0-5 x6`` box
    of a deeper depth; folding is only for blocks that are illegible unfolded. (12 blocks read
    in order in 3 or 6 rows, not in the 4 or 5 the strip's shape suggests.)"""
    from paddleviz_hooks import capture_backward
    from paddleviz_hooks.collapse import collapse_graph
    from paddleviz_hooks.options import RecorderOptions
    from paddleviz_hooks.drawworker import viewer_png
    from paddleviz_hooks.render import png_size

    paddle.seed(0)
    net = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0), blocks)
    with capture_backward(net) as cap:
        net(paddle.randn([2, 5, 32])).mean().backward()
    seen: dict = {}
    viewer = viewer_png(cap.graph, RecorderOptions.check(), "step 1", info=seen)
    assert seen["collapsed_depth"] == 1 and not seen["folded"], seen
    w, h = png_size(viewer)
    assert w <= 1280 and h <= 720
    drawn = collapse_graph(cap.graph, depth=seen["collapsed_depth"], fold_repeats=seen["folded"])
    boxes = [n for n in drawn.nodes if n.kind == "layer"]
    assert sorted(n.layer for n in boxes) == sorted(f"layers.{i}" for i in range(blocks))
    assert all(n.count == 1 for n in boxes)
