"""saved_memory=True: what each step holds for backward, checked against Paddle's own allocator."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import numpy as np
import paddle
import paddle.nn as nn
import pytest
from paddle.base import core
from paddle.distributed.fleet.utils import recompute

from paddleviz_hooks import BackwardGraph, BackwardGraphRecorder, build_report, capture_backward, summarize
from paddleviz_hooks.capture.saved import _op_sites

from _fitkit import text_records, vdl_records
from _browser import CHROMIUM, launch_chromium


def allocated() -> int:
    return int(core.host_memory_stat_current_value("Allocated", 0))


def nbytes(t) -> int:
    return int(np.prod(t.shape)) * paddle.to_tensor([], dtype=t.dtype).element_size()


def encoder(layers=6, dropout=0.1):
    paddle.seed(3)
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=dropout), layers)


def measured_step(model, make_input, saved_memory=True, seed=5):
    """One captured step; returns (graph, Allocated growth from forward start to backward start, grads)."""
    paddle.seed(seed)
    model.clear_gradients()
    gc.collect()
    with capture_backward(model, saved_memory=saved_memory) as cap:
        a0 = allocated()
        x = make_input()
        loss = (model(x) ** 2).mean()
        a1 = allocated()
        loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return cap.graph, a1 - a0, grads


def untouched(model, make_input, seed=5):
    paddle.seed(seed)
    model.clear_gradients()
    x = make_input()
    (model(x) ** 2).mean().backward()
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a, b):
    assert a.keys() == b.keys() and a
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def assert_nothing_left():
    """Every wrapper, patch and hook pair of ours is gone."""
    assert type(paddle._C_ops.matmul).__name__ == "builtin_function_or_method"
    assert paddle.tensor.linalg.matmul is paddle._C_ops.matmul  # a copy imported by name
    assert all(type(getattr(o, n)).__name__ == "builtin_function_or_method" for o, n in _op_sites())
    assert type(paddle.Tensor.__dict__["__mul__"]).__name__ == "method_descriptor"
    assert "apply" not in paddle.autograd.PyLayer.__dict__
    assert core.eager.register_saved_tensors_hooks.__module__ != "paddleviz_hooks.capture.saved"
    assert getattr(core.eager.reset_saved_tensors_hooks, "__self__", None) is None or \
        type(core.eager.reset_saved_tensors_hooks.__self__).__name__ != "SavedMemory"
    with paddle.autograd.saved_tensors_hooks(lambda t: t, lambda t: t):  # no pair left registered
        pass


# --------------------------------------------------------------------------
# the truth: the allocator's own counter
# --------------------------------------------------------------------------
def test_encoder_total_matches_allocator_and_gradients_are_bit_identical():
    model = encoder()
    make = lambda: paddle.randn([2, 16, 32])
    g, growth, grads = measured_step(model, make)
    m = g.meta["saved_memory"]
    assert abs(m["total_bytes"] - growth) <= 0.01 * growth, (m["total_bytes"], growth)
    assert m["allocated_growth"] - m["total_bytes"] == 4  # the float32 loss, the one output not saved
    assert sum(n.saved_bytes for n in g.nodes) == m["total_bytes"] == sum(m["by_layer"].values())
    assert m["no_node_bytes"] == 0 and m["unobserved"] == []
    # every layer holds the same; parameters are listed apart, every one of them saved once
    per_block = [sum(v for k, v in m["by_layer"].items() if k.startswith(f"layers.{i}.") or k == f"layers.{i}#0")
                 for i in range(6)]
    assert len(set(per_block[1:])) == 1 and per_block[0] >= per_block[1] > 0
    weights = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    assert m["params_bytes"] >= sum(nbytes(p) for p in weights)
    assert {"Matmul", "Softmax", "LayerNorm", "Dropout", "Relu"} <= set(m["by_op"])
    assert "Add" not in m["by_op"]  # linear's bias add saves nothing; its saves are Matmul's
    assert_same_grads(grads, untouched(model, make))
    assert_nothing_left()


def test_resnet18_total_matches_allocator_and_shared_storage_counted_once():
    paddle.seed(1)
    model = paddle.vision.models.resnet18(num_classes=10)
    g, growth, grads = measured_step(model, lambda: paddle.randn([2, 3, 32, 32]))
    m = g.meta["saved_memory"]
    assert abs(m["total_bytes"] - growth) <= 0.01 * growth, (m["total_bytes"], growth)
    assert m["saves"] == 224  # 223 in the model, 1 in the loss
    # every BatchNorm's running mean/variance is a parameter here, not an activation
    bn_stats = sum(nbytes(b) for n, b in model.named_parameters() if n.endswith(("_mean", "_variance")))
    assert m["params_bytes"] >= bn_stats > 0
    assert set(m["by_op"]) == {"BatchNorm", "Relu", "Pool2d", "Conv2d", "Pow"}


def test_relu_output_feeding_a_conv_is_counted_once_and_bn_statistics_not_at_all():
    paddle.seed(2)
    model = nn.Sequential(nn.Conv2D(3, 4, 3), nn.BatchNorm2D(4), nn.ReLU(), nn.Conv2D(4, 5, 3))
    g, growth, _ = measured_step(model, lambda: paddle.randn([2, 3, 10, 10]))
    m = g.meta["saved_memory"]
    x, conv1, relu = 2 * 3 * 10 * 10 * 4, 2 * 4 * 8 * 8 * 4, 2 * 4 * 8 * 8 * 4
    saved_stats = 2 * 4 * 4  # BatchNorm's batch mean and inverse std of this step
    out = 2 * 5 * 6 * 6 * 4  # the model output: squared by the loss, which saves it
    assert m["total_bytes"] == x + conv1 + saved_stats + relu + out
    assert m["by_op"]["Relu"] == relu and m["by_op"]["Conv2d"] == x  # conv 2 saved relu's output: not again
    # the weights (not the biases) and BN's scale, shift, running mean and variance
    params = sum(nbytes(p) for n, p in model.named_parameters() if not n.endswith("bias") or n.startswith("1."))
    assert m["params_bytes"] == params
    assert m["allocated_growth"] == growth
    by_node = {n.op: n.saved_bytes for n in g.nodes if n.saved_bytes}
    assert by_node["Relu"] == relu and by_node["BatchNorm"] == conv1 + saved_stats


def test_lstm_buffers_are_attributed_to_its_rnn_node():
    paddle.seed(4)

    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(8, 16)
            self.head = nn.Linear(16, 2)

        def forward(self, x):
            return self.head(self.lstm(x)[0])

    model, make = Net(), lambda: paddle.randn([2, 5, 8])
    untouched(model, make)  # the first forward also allocates the LSTM's caches (324 B), never saved
    g, growth, _ = measured_step(model, make)
    m = g.meta["saved_memory"]
    rnn = [n for n in g.nodes if n.op == "Rnn"]
    assert len(rnn) == 1 and rnn[0].layer == "lstm"
    output = 2 * 5 * 16 * 4
    assert rnn[0].saved_bytes == m["by_op"]["Rnn"] == m["by_layer"]["lstm#0"] > 2 * output  # reserve, state...
    # not saved: the input (the LSTM saves a transposed copy) and the loss
    assert growth - m["total_bytes"] == 2 * 5 * 8 * 4 + 4


# --------------------------------------------------------------------------
# recompute and the user's own hooks
# --------------------------------------------------------------------------
class Recomputed(nn.Layer):
    def __init__(self, reentrant: bool | None, blocks=3):
        super().__init__()
        paddle.seed(6)
        self.blocks = nn.LayerList([nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh())
                                    for _ in range(blocks)])
        self.reentrant = reentrant

    def forward(self, x):
        for b in self.blocks:
            x = b(x) if self.reentrant is None else recompute(b, x, use_reentrant=self.reentrant)
        return x


def needs_grad(x):
    x.stop_gradient = False  # reentrant recompute skips blocks whose inputs need no gradient
    return x


def test_reentrant_recompute_holds_only_block_inputs():
    make = lambda: needs_grad(paddle.randn([4, 16]))
    plain, _, _ = measured_step(Recomputed(None), make)
    g, growth, grads = measured_step(Recomputed(True), make)
    m = g.meta["saved_memory"]
    block_input = 4 * 16 * 4
    assert m["by_op"] == {"PyLayer:RecomputeFunction": 3 * block_input, "Pow": block_input}
    assert abs(m["total_bytes"] - growth) <= 0.01 * growth
    # without recompute each block holds its Linear input, ReLU output and Tanh output
    assert plain.meta["saved_memory"]["total_bytes"] == block_input + 3 * (4 * 32 * 4 + block_input)
    # the table says so beforehand: recomputing a block frees its ReLU output (its input stays,
    # its Tanh output is the next block's input); recomputing the ReLU alone would cost its input
    table = plain.meta["saved_memory"]["recompute"]
    relu = 4 * 32 * 4
    for i in range(3):
        assert table[f"blocks.{i}#0"] == {"held": 2 * block_input + relu, "inputs": block_input, "frees": relu}
        assert table[f"blocks.{i}.1#0"] == {"held": relu, "inputs": relu, "frees": -relu}
    assert "recomputing would free most: blocks.0 512 B (keeping 256 B of inputs)" in summarize(plain)
    # the blocks' forwards re-run inside the backward are not this step's: nothing is armed there
    model = Recomputed(True)
    with capture_backward(model, saved_memory=True) as cap:
        (model(make()) ** 2).mean().backward()
    # ... and the recomputed blocks' backwards are stitched into the step's one graph, every parameter in it
    assert len(cap.graphs) == 1 and "saved_memory" in cap.graph.meta and "nested" in cap.graph.meta
    assert set(cap.graph.params()) == {n for n, p in model.named_parameters() if not p.stop_gradient}
    assert m["total_bytes"] == 4 * block_input
    assert_same_grads(grads, untouched(Recomputed(True), make))


def test_non_reentrant_recompute_runs_unchanged_and_is_named_unobserved():
    make = lambda: paddle.randn([4, 16])
    g, _, grads = measured_step(Recomputed(False), make)
    assert_same_grads(grads, untouched(Recomputed(False), make))
    assert_same_grads(grads, untouched(Recomputed(None), make))
    un = g.meta["saved_memory"]["unobserved"]
    assert len(un) == 1 and "non-reentrant recompute" in un[0]["what"] and un[0]["count"] == 3
    assert un[0]["bytes"] > 0
    assert g.meta["saved_memory"]["by_op"] == {"Pow": 4 * 16 * 4}  # the loss, after the blocks: seen again
    assert "not observed: non-reentrant recompute" in summarize(g)
    assert_nothing_left()


def test_users_own_saved_tensors_hooks_keep_working():
    """A user's pair (here: to numpy and back, as for CPU offload) runs exactly as without us."""
    packed = []

    class Offload(nn.Layer):
        def __init__(self):
            super().__init__()
            paddle.seed(8)
            self.a, self.b = nn.Linear(6, 12), nn.Linear(12, 3)

        def forward(self, x):
            def pack(t):
                packed.append(t.shape)
                return t.numpy()

            with paddle.autograd.saved_tensors_hooks(pack, lambda a: paddle.to_tensor(a)):
                h = paddle.tanh(self.a(x))
            return self.b(h)

    model, make = Offload(), lambda: paddle.randn([2, 6])
    g, _, grads = measured_step(model, make)
    seen = len(packed)
    assert_same_grads(grads, untouched(model, make))
    assert seen == len(packed) // 2 == 3  # linear: x and W, tanh: its output
    un = g.meta["saved_memory"]["unobserved"]
    assert [u["what"] for u in un] == ["your own saved_tensors_hooks (test_users_own_saved_tensors_hooks_keep_working.<locals>.Offload.forward.<locals>.pack)"]
    assert g.meta["saved_memory"]["by_layer"] == {"b#0": 2 * 12 * 4, "?": 2 * 3 * 4}  # ours came back after it
    assert_nothing_left()


def test_a_pylayer_is_named_for_what_it_may_keep_unseen():
    class Cube(paddle.autograd.PyLayer):
        @staticmethod
        def forward(ctx, x):
            ctx.x = x  # kept as a plain attribute: the pack hook never sees it
            return x ** 3

        @staticmethod
        def backward(ctx, dy):
            return 3 * ctx.x ** 2 * dy

    model = nn.Linear(4, 4)
    with capture_backward(model, saved_memory=True) as cap:
        (Cube.apply(model(paddle.randn([2, 4]))) ** 2).mean().backward()
    un = cap.graph.meta["saved_memory"]["unobserved"]
    assert [u["what"] for u in un] == [
        "PyLayer:Cube: what it keeps as plain ctx attributes (only ctx.save_for_backward is seen)"]


def test_hooks_removed_when_the_forward_raises_and_json_round_trip():
    model = encoder(layers=1)
    with pytest.raises(ZeroDivisionError):
        with capture_backward(model, saved_memory=True):
            model(paddle.randn([2, 4, 32]))
            1 / 0
    assert_nothing_left()
    g, _, _ = measured_step(model, lambda: paddle.randn([2, 4, 32]))
    back = BackwardGraph.from_json(g.to_json())
    assert back == g and back.meta["saved_memory"]["total_bytes"] > 0
    assert any(n.saved_bytes for n in back.nodes)


def test_every_forward_of_a_block_is_observed_and_a_pair_active_before_it_is_named():
    from paddleviz_hooks.text import node_tooltip

    model = encoder(layers=1)
    with capture_backward(model, saved_memory=True) as cap:
        for _ in range(2):
            (model(paddle.randn([2, 4, 32])) ** 2).mean().backward()
    a, b = (g.meta["saved_memory"] for g in cap.graphs)
    assert a["total_bytes"] == b["total_bytes"] > 0 and a["saves"] == b["saves"]
    relu = next(n for n in cap.graph.nodes if n.op == "Relu")
    assert "saved for backward: 2.05 kB" in node_tooltip(relu)  # 2 x 4 x 64 float32 (4 bytes each)
    with paddle.autograd.saved_tensors_hooks(lambda t: t, lambda t: t):
        with capture_backward(model, saved_memory=True) as cap:
            loss = (model(paddle.randn([2, 4, 32])) ** 2).mean()
            loss.backward()
    m = cap.graph.meta["saved_memory"]
    assert m["total_bytes"] == 0 and m["unobserved"][0]["what"] == "saved_tensors_hooks active when the forward began"
    assert_nothing_left()


def test_drawings_show_what_ops_and_layer_boxes_saved():
    from paddleviz_hooks import collapse_graph
    from paddleviz_hooks.render import to_dot
    from paddleviz_hooks.text import fmt_bytes

    model = encoder(layers=2)
    g, _, _ = measured_step(model, lambda: paddle.randn([2, 4, 32]))
    boxes = collapse_graph(g, depth=1)
    layer0 = next(n for n in boxes.nodes if n.kind == "layer" and n.layer == "layers.0")
    ops0 = [n for n in g.nodes if n.kind == "op" and n.layer is not None and
            (n.layer == "layers.0" or n.layer.startswith("layers.0."))]
    assert layer0.saved_bytes == sum(n.saved_bytes for n in ops0) > 0
    assert f"saved for backward {fmt_bytes(layer0.saved_bytes)}" in to_dot(boxes)
    assert "saved 2.05 kB" in to_dot(g)  # each ReLU: 2 x 4 x 64 float32


def _dot_node(source: str, nid: int) -> str:
    return next(line for line in source.split("\n") if line.strip().startswith(f"n{nid} [label="))


@pytest.mark.parametrize("arch", ["encoder", "resnet18"])
def test_color_by_saved_memory_shades_nodes_and_boxes_by_bytes(arch):
    from paddleviz_hooks import collapse_graph
    from paddleviz_hooks.render import render_png, to_dot
    from paddleviz_hooks.render.dot import SAVED_SHADES
    from paddleviz_hooks.text import SAVED_SHADE_TITLE, fmt_bytes

    if arch == "encoder":
        model, make = encoder(layers=2), (lambda: paddle.randn([2, 4, 32]))
    else:
        paddle.seed(1)
        model, make = paddle.vision.models.resnet18(num_classes=10), (lambda: paddle.randn([2, 3, 32, 32]))
    g, _, _ = measured_step(model, make)
    for graph in (g, collapse_graph(g, depth=1)):
        src = to_dot(graph, color_by="saved_memory")
        held = [n for n in graph.nodes if n.saved_bytes]
        top = max(held, key=lambda n: n.saved_bytes)
        assert f'fillcolor="{SAVED_SHADES[0]}"' in _dot_node(src, top.id)
        assert 'fontcolor="white"' in _dot_node(src, top.id)
        # the darkest shade stands for (top/4, top]; the legend gives its nodes' range
        darkest = [n.saved_bytes for n in held if 4 * n.saved_bytes > top.saved_bytes]
        low = min(darkest)
        size = fmt_bytes(top.saved_bytes) if low == top.saved_bytes else f"{fmt_bytes(low)} to {fmt_bytes(top.saved_bytes)}"
        assert f'BGCOLOR="{SAVED_SHADES[0]}" WIDTH="14"></TD><TD ALIGN="LEFT">{size} ({len(darkest)} node' in src
        assert SAVED_SHADE_TITLE in src
        for n in graph.nodes:  # every node with bytes is shaded, every op or box without is white
            line = _dot_node(src, n.id)
            if n.saved_bytes:
                assert any(f'fillcolor="{c}"' in line for c in SAVED_SHADES), line
            elif n.kind in ("op", "layer"):
                assert 'fillcolor="white"' in line, line
            if n.saved_bytes and 16 * n.saved_bytes <= top.saved_bytes:
                assert f'fillcolor="{SAVED_SHADES[0]}"' not in line and f'fillcolor="{SAVED_SHADES[1]}"' not in line
        if graph is not g:  # a box sums its ops' bytes, each storage once: the boxes add up to the total
            assert sum(n.saved_bytes for n in graph.nodes) == g.meta["saved_memory"]["total_bytes"]
    assert "fillcolor" in to_dot(g) and SAVED_SHADES[0] not in to_dot(g)  # not asked: not shaded
    png = render_png(collapse_graph(g, depth=2), color_by="saved_memory", title=f"{arch} by saved memory")
    out = Path(__file__).resolve().parents[1] / "test-output"  # to look at
    out.mkdir(exist_ok=True)
    (out / f"saved_memory_shaded_{arch}.png").write_bytes(png)


def test_color_by_needs_saved_memory_and_a_known_value():
    from paddleviz_hooks.render import render_png, to_dot

    model = encoder(layers=1)
    g, _, _ = measured_step(model, lambda: paddle.randn([2, 4, 32]), saved_memory=False)
    with pytest.raises(ValueError, match=r"color_by='saved_memory' needs a graph captured with saved_memory=True"):
        to_dot(g, color_by="saved_memory")
    with pytest.raises(ValueError, match=r"needs a graph captured with saved_memory=True"):
        render_png(g, color_by="saved_memory")
    with pytest.raises(ValueError, match=r"color_by must be None or one of \('saved_memory',\), got 'bytes'"):
        to_dot(g, color_by="bytes")
    with pytest.raises(TypeError, match=r"color_by must be None or one of .*, got True"):
        to_dot(g, color_by=True)
    with pytest.raises(ValueError, match=r"color_by='saved_memory' needs saved_memory=True .*got saved_memory=False"):
        BackwardGraphRecorder("unused", color_by="saved_memory")
    with pytest.raises(ValueError, match=r"got 'memory'"):
        BackwardGraphRecorder("unused", saved_memory=True, color_by="memory")


def test_recorder_color_by_shades_its_drawings(tmp_path):
    from paddleviz_hooks.render.dot import SAVED_SHADES

    model = encoder(layers=1)
    with BackwardGraphRecorder(str(tmp_path), model, steps=[1], formats=("dot", "json"), visualdl=False,
                               verbose=0, saved_memory=True, color_by="saved_memory") as rec:
        with rec.step(1):
            (model(paddle.randn([2, 4, 32])) ** 2).mean().backward()
    run = tmp_path / "backward_graph"
    g = BackwardGraph.from_json((run / "step_000001.json").read_text())
    top = max(g.nodes, key=lambda n: n.saved_bytes)
    assert f'fillcolor="{SAVED_SHADES[0]}"' in _dot_node((run / "step_000001.dot").read_text(), top.id)




@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's Chromium at /usr/bin/chromium")
def test_report_memory_table_sorts_by_a_clicked_column(tmp_path):
    from playwright.sync_api import sync_playwright

    model = encoder(layers=3)  # 46 layer calls: more than the 30 rows shown
    g, _, _ = measured_step(model, lambda: paddle.randn([2, 4, 32]))
    table = g.meta["saved_memory"]["recompute"]
    assert len(table) > 30
    log = tmp_path / "log"
    log.mkdir()
    (log / "step_000001.json").write_text(g.to_json())
    out = tmp_path / "report.html"
    build_report(str(log), str(out))
    by = {col: sorted(table.values(), key=lambda v: -v[col]) for col in ("held", "frees")}
    visible = "t => Array.from(t.tBodies[0].rows).filter(r => !r.hidden).map(r => r.cells[%d].dataset.v ?? r.cells[0].textContent)"
    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(out.as_uri())
            t = page.locator("table.saved")
            t.scroll_into_view_if_needed()
            assert [int(v) for v in t.evaluate(visible % 1)] == [v["held"] for v in by["held"][:30]]
            # the top row holds everything, its sublayers included: the whole model, not its own forward
            assert t.locator("tbody tr").first.locator("td").first.inner_text() == "the whole model"
            # behind each row's bytes held, a bar as long as they are relative to the most
            bars = t.evaluate("t => Array.from(t.querySelectorAll('tr:not([hidden]) .bar'))"
                              ".map(b => b.getBoundingClientRect().width / b.parentNode.clientWidth)")
            top = by["held"][0]["held"]
            assert bars == pytest.approx([v["held"] / top for v in by["held"][:30]], abs=0.01) and bars[-1] > 0
            t.locator("button.sort", has_text="recompute frees").click()
            frees = [int(v) for v in t.evaluate(visible % 3)]
            assert frees == [v["frees"] for v in by["frees"][:30]]  # the 30 that free most, of all 46
            assert frees != [v["frees"] for v in by["held"][:30]]  # the order changed
            assert t.locator("th[aria-sort=descending]").inner_text().startswith("recompute frees")
            shot = Path(__file__).resolve().parents[1] / "test-output"
            shot.mkdir(exist_ok=True)
            page.locator("aside").screenshot(path=str(shot / "report_saved_sorted.png"))
            t.locator("button.sort", has_text="layer call").click()
            names = t.evaluate(visible % 0)
            assert names == sorted(names, key=str.lower)[:30] or names == sorted(names)[:30]
            t.locator("button.sort", has_text="held").click()
            assert [int(v) for v in t.evaluate(visible % 1)] == [v["held"] for v in by["held"][:30]]
        finally:
            browser.close()
    assert errors == []


def test_off_by_default_and_bad_value():
    model = encoder(layers=1)
    g, _, _ = measured_step(model, lambda: paddle.randn([2, 4, 32]), saved_memory=False)
    assert "saved_memory" not in g.meta and not any(n.saved_bytes for n in g.nodes)
    with pytest.raises(TypeError, match="saved_memory must be True or False, got 'yes'"):
        capture_backward(model, saved_memory="yes")
    with pytest.raises(TypeError, match="saved_memory must be True or False, got 1"):
        BackwardGraphRecorder("unused", saved_memory=1)


# --------------------------------------------------------------------------
# the recorder: only selected steps are observed; memory stays flat
# --------------------------------------------------------------------------
@pytest.mark.parametrize("watch", [False, True])
def test_recorder_observes_selected_steps_only(tmp_path, watch):
    model = encoder(layers=1)
    armed_at_forward = []

    def probe(layer, inputs):
        armed_at_forward.append(type(paddle._C_ops.matmul).__name__ != "builtin_function_or_method")

    h = model.register_forward_pre_hook(probe)
    rec = BackwardGraphRecorder(str(tmp_path), model, steps=[2], capture_first=False, formats=("json",),
                                visualdl=False, verbose=0, saved_memory=True, on_nonfinite=watch)
    graphs = []
    rec._on_graph = graphs.append
    try:
        for step in range(1, 4):
            with rec.step(step):
                (model(paddle.randn([2, 4, 32])) ** 2).mean().backward()
    finally:
        rec.close()
        h.remove()
    assert armed_at_forward == [False, True, False]
    assert len(graphs) == 1 and graphs[0].meta["saved_memory"]["total_bytes"] > 0
    assert_nothing_left()


def test_recorder_writes_saved_memory_to_json_text_and_visualdl(tmp_path):
    model = encoder(layers=1)
    with BackwardGraphRecorder(str(tmp_path), model, every=2, formats=("json",), verbose=0,
                               saved_memory=True) as rec:
        for step in range(1, 3):
            with rec.step(step):
                (model(paddle.randn([2, 4, 32])) ** 2).mean().backward()
    run = tmp_path / "backward_graph"
    totals = {s: json.loads((run / f"step_{s:06d}.json").read_text())["meta"]["saved_memory"]["total_bytes"]
              for s in (1, 2)}
    assert totals[1] == totals[2] > 0
    reader = vdl_records(run)
    tags = reader.get_tags()["scalar"]
    total_tag = [t for t in tags if t.endswith("saved_memory/total")]
    assert len(total_tag) == 1
    assert [r.value for r in reader.get_data("scalar", total_tag[0])] == pytest.approx([totals[1] / 1e6] * 2)
    assert any(t.endswith("saved_memory/layers") for t in tags)
    texts = text_records(reader, "summary")
    assert sorted(texts) == [1, 2] and all("held for backward: " in t for t in texts.values())
    build_report(str(tmp_path), str(tmp_path / "report.html"))
    html = (tmp_path / "report.html").read_text()
    assert html.count("<table class=\"saved\" ") == 2  # one per step
    assert "<td>layers.0.self_attn</td>" in html and "recompute frees" in html


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _soak(steps: int, saved_memory: bool = True) -> tuple[list[int], list[int]]:
    """Allocated and RSS every 10 captured steps of a 2-layer encoder."""
    model = encoder(layers=2)
    allocs, rss = [], []
    with capture_backward(model, saved_memory=saved_memory, grad_stats=False) as cap:
        cap.keep_graphs = False
        for i in range(steps):
            loss = (model(paddle.randn([2, 8, 32])) ** 2).mean()
            loss.backward()
            model.clear_gradients()
            del loss
            if i % 10 == 9:
                gc.collect()
                allocs.append(allocated())
                rss.append(_rss())
    return allocs, rss


def test_soak_allocated_stays_flat():
    allocs, _ = _soak(40)
    assert allocs[-1] - allocs[0] <= 4096, allocs


@pytest.mark.slow
def test_soak_1000_steps_allocated_and_rss_flat_against_control():
    control_alloc, control_rss = _soak(1000, saved_memory=False)
    allocs, rss = _soak(1000)
    assert max(allocs[5:]) - min(allocs[5:]) <= 4096, allocs[::10]
    grew, control_grew = rss[-1] - rss[10], control_rss[-1] - control_rss[10]
    print(f"RSS growth over steps 110-1000: {grew / 1e6:.1f} MB with saved_memory, "
          f"{control_grew / 1e6:.1f} MB without; Allocated {allocs[5]} -> {allocs[-1]} B")
    assert grew <= control_grew + 8e6, (grew, control_grew)


def test_model_fit_callback_records_saved_memory_and_leaves_training_unchanged(tmp_path):
    from _fitkit import assert_same_run, run_fit

    from paddleviz_hooks import BackwardGraphCallback

    cb = BackwardGraphCallback(str(tmp_path), every=5, formats=("json",), visualdl=False, verbose=0,
                               saved_memory=True)
    with_saved = run_fit(callbacks=[cb], steps=6)
    assert_same_run(with_saved, run_fit(steps=6))
    assert cb.captured_steps == [1, 5]
    for step in cb.captured_steps:
        meta = json.loads((tmp_path / "backward_graph" / f"step_{step:06d}.json").read_text())["meta"]
        m = meta["saved_memory"]
        # batch 4: the input (saved by the first Linear), ReLU's output (the second Linear's input:
        # not again), and the loss's labels and softmax (outside the model)
        assert m["by_layer"] == {"1#0": 4 * 16 * 4, "0#0": 4 * 8 * 4, "?": 4 * 8 + 4 * 3 * 4}
        assert m["by_op"] == {"Relu": 256, "Matmul": 128, "CrossEntropyWithSoftmax": 80}
    assert_nothing_left()


def test_failures_of_ours_never_reach_training(monkeypatch):
    """A save that cannot be read is named; a failing summary costs only the saved-memory data."""
    from paddleviz_hooks.capture import saved

    model, make = encoder(layers=1), lambda: paddle.randn([2, 4, 32])
    reference = untouched(model, make)

    def unreadable(t):
        raise RuntimeError("unreadable")

    monkeypatch.setattr(saved, "storage_key", unreadable)
    g, _, grads = measured_step(model, make)
    assert_same_grads(grads, reference)
    m = g.meta["saved_memory"]
    assert m["total_bytes"] == 0 and m["unobserved"][-1]["what"].endswith("saves that could not be read")
    monkeypatch.undo()

    def broken(self, *args):
        raise RuntimeError("broken")

    monkeypatch.setattr(saved.SavedMemory, "collect", broken)
    with pytest.warns(RuntimeWarning, match="saved-tensor memory is not observed: RuntimeError"):
        g, _, grads = measured_step(model, make)
    assert_same_grads(grads, reference)
    assert "saved_memory" not in g.meta and len(g.nodes) > 10
    assert_nothing_left()
