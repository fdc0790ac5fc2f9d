"""Large graphs as pictures: repeated blocks folded with counts, one block of each run drawn.

A 224-layer encoder's backward graph has 10,082 nodes. Its viewing PNG used to be
3 boxes (the whole stack folded into one) after 17 s of planning; now it is the
stack as one ``x223`` box beside one block drawn op by op, planned without ever
laying out the full graph, in at most 3 engine runs (counted by a ``dot`` shim),
and one per picture for a later capture of the same structure. The same fold
(``collapse_graph(..., show_one=True)``) on other architectures: a GPT-like
``layers.N`` stack, a deep ``Sequential`` MLP, ResNet stages, nested repeats
(a stage of blocks inside a repeated stage), every one checked for honesty
(no path drawn that the captured graph does not have).
"""

from __future__ import annotations

import re
import shutil

import paddle
import pytest
from paddle import nn

from paddleviz_hooks import BackwardGraph, capture_backward
from paddleviz_hooks.collapse import collapse_graph, collapse_with_map
from paddleviz_hooks.options import RecorderOptions
from paddleviz_hooks.drawworker import viewer_png
from paddleviz_hooks.render import render_views
from paddleviz_hooks.render.draw import clear_plan_cache
from test_collapse_honest import assert_honest

pytestmark = pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz dot")

_NODE = re.compile(r"^\s*n\d+ \[label=", re.M)


def _capture(model: nn.Layer, run) -> BackwardGraph:
    with capture_backward(model) as cap:
        run()
    return cap.graph


def _encoder(layers: int) -> BackwardGraph:
    paddle.seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), layers)
    x = paddle.randn([2, 4, 16])
    return _capture(enc, lambda: enc(x).mean().backward())


@pytest.fixture(scope="module")
def huge() -> BackwardGraph:
    """The benchmark's 224-layer encoder (10,082 nodes), captured once (about 1.6 s)."""
    return _encoder(224)


@pytest.fixture()
def engine_sources(monkeypatch, engine_run_count):
    """The DOT sources handed to the engine (and the shim's run count)."""
    import paddleviz_hooks.render.plan as plan

    sources: list[str] = []
    real = plan.run_engine_formats

    def spy(source, formats, **kw):
        sources.append(source)
        return real(source, formats, **kw)

    monkeypatch.setattr(plan, "run_engine_formats", spy)
    return sources, engine_run_count


def _draw_counted(engine_sources, draw) -> tuple[object, int, list[str]]:
    sources, count = engine_sources
    before, n = count(), len(sources)
    out = draw()
    return out, count() - before, sources[n:]


def test_huge_viewing_png_folds_the_stack_beside_one_block_drawn_op_by_op(huge, engine_sources):
    """10,082 nodes: the PNG shows ``layers.0-222 ... x223`` beside ``layers.223`` op by op (not
    3 boxes), with the legend line saying what "x N" means; no engine run ever gets more than a
    few hundred nodes; at most 3 runs for the first drawing, 1 for a later capture's."""
    assert len(huge.nodes) > 10_000
    clear_plan_cache()
    info: dict = {}
    _, runs, sources = _draw_counted(engine_sources, lambda: render_views(huge, ("png", "svg"), info=info))
    assert 1 <= runs <= 3, runs
    assert max(len(_NODE.findall(s)) for s in sources) < 300  # never the 10k nodes
    assert info["show_one"] and info["shown"] == {"layers.0-222": ["layers.223", 224]}, info
    drawn = collapse_graph(huge, depth=info["collapsed_depth"], fold_repeats=True, show_one=True)
    assert len(drawn.nodes) == info["nodes"]
    boxes = [n for n in drawn.nodes if n.kind == "layer"]
    assert [(b.layer, b.count, b.name) for b in boxes] == [("layers.0-222", 223, "TransformerEncoderLayer")]
    # the block drawn: its own ops, in its sublayers, as drawn in full detail
    inside = {n.layer for n in drawn.nodes if n.kind == "op" and (n.layer or "").startswith("layers.223.")}
    for sub in ("self_attn.q_proj", "self_attn.out_proj", "linear1", "linear2", "norm1", "norm2"):
        assert f"layers.223.{sub}" in inside, sorted(inside)
    full_block = [n for n in huge.nodes if n.kind == "op" and (n.layer or "").startswith("layers.223.")]
    assert len([n for n in drawn.nodes if n.kind == "op" and (n.layer or "").startswith("layers.223.")]) \
        == len(full_block)
    dot = sources[-1]
    assert "TransformerEncoderLayer x223" in dot and "each like layers.223 (drawn)" in dot
    assert "1 of 224 alike (the others: layers.0-222)" in dot  # the frame of the block drawn
    assert "x N on a box: N consecutive layers alike" in dot  # the legend says what x223 means
    assert "one of each run drawn beside them" in dot  # and the title

    # a later capture of the same structure (its JSON read back: equal keys): one engine run
    again: dict = {}
    later = BackwardGraph.from_json(huge.to_json())
    _, runs, _ = _draw_counted(engine_sources, lambda: render_views(later, ("png", "svg"), info=again))
    assert runs == 1 and again["shown"] == info["shown"] and again["nodes"] == info["nodes"]


def test_huge_viewer_picture_shows_the_fold_and_its_count(huge, engine_sources):
    """VisualDL's viewer picture (landscape, labels 8 px high) of the 10k graph: the stack as
    ``x223`` beside ``layers.223`` (one box at that size), not 3 boxes."""
    clear_plan_cache()
    info: dict = {}
    _, runs, sources = _draw_counted(engine_sources, lambda: viewer_png(huge, RecorderOptions(), "step 1", info=info))
    assert 1 <= runs <= 3, runs
    assert max(len(_NODE.findall(s)) for s in sources) < 300
    assert info["shown"] == {"layers.0-222": ["layers.223", 224]} and info["nodes"] > 3, info
    assert "TransformerEncoderLayer x223" in sources[-1] and "1 of 224 alike" in sources[-1]
    _, runs, _ = _draw_counted(engine_sources, lambda: viewer_png(huge, RecorderOptions(), "step 2"))
    assert runs == 1


# --------------------------------------------------------------------------
# other architectures
# --------------------------------------------------------------------------
class _GPTBlock(nn.Layer):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(d)
        self.self_attn = nn.MultiHeadAttention(d, 2)
        self.post_attention_layernorm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        h = self.input_layernorm(x)
        x = x + self.self_attn(h, h, h)
        return x + self.mlp(self.post_attention_layernorm(x))


class _GPT(nn.Layer):
    """A decoder stack named as PaddleFormers names it (``layers.N``)."""

    def __init__(self, n: int, d: int = 16, vocab: int = 50) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.LayerList([_GPTBlock(d) for _ in range(n)])
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class _ResBlock(nn.Layer):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.ReLU()

    def forward(self, x):
        return x + self.act(self.fc(x))


class _Stage(nn.Layer):
    def __init__(self, k: int, d: int) -> None:
        super().__init__()
        self.blocks = nn.LayerList([_ResBlock(d) for _ in range(k)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class _Nested(nn.Layer):
    """Repeated stages, each a run of repeated blocks."""

    def __init__(self, m: int, k: int, d: int = 8) -> None:
        super().__init__()
        self.stem = nn.Linear(4, d)
        self.stages = nn.LayerList([_Stage(k, d) for _ in range(m)])
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        x = self.stem(x)
        for s in self.stages:
            x = s(x)
        return self.head(x)


def _mlp(blocks: int) -> BackwardGraph:
    paddle.seed(0)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(blocks)])
    x = paddle.randn([4, 8])
    return _capture(m, lambda: m(x).mean().backward())


@pytest.fixture(scope="module")
def archs() -> dict[str, BackwardGraph]:
    paddle.seed(0)
    out = {}
    gpt, ids = _GPT(5), paddle.randint(0, 50, [2, 6])
    out["gpt"] = _capture(gpt, lambda: nn.functional.cross_entropy(
        gpt(ids).reshape([-1, 50]), ids.reshape([-1, 1])).backward())
    out["mlp"] = _mlp(5)
    nested, x = _Nested(3, 4), paddle.randn([4, 4])
    out["nested"] = _capture(nested, lambda: nested(x).mean().backward())
    res, img = paddle.vision.models.resnet50(num_classes=10), paddle.randn([1, 3, 32, 32])
    out["resnet50"] = _capture(res, lambda: nn.functional.cross_entropy(res(img), paddle.randint(0, 10, [1, 1])).backward())
    return out


def _folds(g: BackwardGraph, depth):
    small, node_of = collapse_with_map(g, depth=depth, fold_repeats=True, show_one=True)
    assert_honest(g, small, node_of)
    return small, {(n.layer, n.count) for n in small.nodes if n.kind == "layer" and n.count > 1}


@pytest.mark.parametrize("name, depth, folds, shown, drawn", [
    # the decoder stack: 4 blocks folded, the 5th drawn op by op (its attention, mlp, norms)
    ("gpt", None, {("layers.0-3", 4)}, {"layers.0-3": ["layers.4", 5]},
     ("layers.4.self_attn.q_proj", "layers.4.mlp.0", "layers.4.input_layernorm")),
    # the children of a top-level Sequential ("0" .. "4") fold too
    ("mlp", None, {("0-3", 4)}, {"0-3": ["4", 5]}, ("4.0", "4.1")),
    # nested: stages 0-1 folded beside stage 2, inside which blocks 0-2 fold beside block 3
    ("nested", None, {("stages.0-1", 2), ("stages.2.blocks.0-2", 3)},
     {"stages.0-1": ["stages.2", 3], "stages.2.blocks.0-2": ["stages.2.blocks.3", 4]},
     ("stages.2.blocks.3.fc", "stages.2.blocks.3.act")),
    # resnet50 at block depth: in each stage the blocks after the first (downsampling) one
    ("resnet50", 2, {("layer2.1-2", 2), ("layer3.1-4", 4)},
     {"layer1.1": ["layer1.2", 2], "layer2.1-2": ["layer2.3", 3], "layer3.1-4": ["layer3.5", 5],
      "layer4.1": ["layer4.2", 2]}, ()),
])
def test_show_one_folds_runs_beside_one_block_on_other_architectures(archs, name, depth, folds, shown, drawn):
    g = archs[name]
    small, got = _folds(g, depth)
    assert got == folds
    assert small.meta["collapse"]["shown"] == shown
    ops = {n.layer for n in small.nodes if n.kind == "op"}
    for layer in drawn:
        assert layer in ops, sorted(o for o in ops if o)
    for label, (block, run) in shown.items():  # the block drawn is no box of the fold, and the count adds up
        box = next(n for n in small.nodes if n.kind == "layer" and n.layer == label)
        assert box.count == run - 1
        assert not any(n.kind == "layer" and n.layer == block and n.count > 1 for n in small.nodes)


def test_deep_sequential_mlp_viewing_png_is_the_fold_beside_one_block(engine_sources):
    """300 identical Linear+ReLU blocks of a top-level Sequential: ``0-298 x299`` beside block
    299's own ops (on main: no fold at all, so the whole model as one box); a second capture
    of the model costs one engine run."""
    clear_plan_cache()
    info: dict = {}
    g = _mlp(300)
    _, runs, sources = _draw_counted(engine_sources, lambda: render_views(g, ("png",), info=info))
    assert 1 <= runs <= 3 and info["shown"] == {"0-298": ["299", 300]}, info
    assert "Sequential x299" in sources[-1]
    assert {n.layer for n in collapse_graph(g, depth=info["collapsed_depth"], fold_repeats=True,
                                            show_one=True).nodes if n.kind == "op"} >= {"299.0", "299.1"}
    again: dict = {}
    _, runs, _ = _draw_counted(engine_sources, lambda: render_views(_mlp(300), ("png",), info=again))
    assert runs == 1 and again["shown"] == info["shown"]



def test_a_capture_too_large_for_an_op_by_op_svg_is_drawn_in_time_and_says_where_every_op_is(huge, tmp_path):
    """The drawing process's job for the 10k graph with the recorder's default options: the
    engine cannot lay out 10,082 nodes op by op within render_timeout (over 60 s), so the SVG is
    the viewing drawing and every picture's title points to the explorer, not to the SVG; the
    landscape picture for VisualDL's viewer is drawn too."""
    import time

    from paddleviz_hooks.drawworker import FULL_SVG_MAX_NODES, draw_job
    from paddleviz_hooks.render.engine import engine_choice
    from paddleviz_hooks.text import every_op_elsewhere

    assert len(huge.nodes) > FULL_SVG_MAX_NODES
    path = tmp_path / "step_000001.json"
    path.write_text(huge.to_json(), encoding="utf-8")
    opts = RecorderOptions()
    out = {f: str(tmp_path / f"out.{f}") for f in ("png", "svg")}
    out["viewer"] = str(tmp_path / "viewer.png")
    job = {"step": 1, "trigger": "scheduled", "suffix": "", "json": str(path), "prev_json": None, "diff": False,
           "engine": engine_choice(), "out": out, "encoding": None,
           "options": {"viewer_px": opts.viewer_px, "view_max_px": opts.view_max_px,
                       "view_max_nodes": opts.view_max_nodes, "color_by": opts.color_by,
                       "render_timeout": opts.render_timeout}}
    t0 = time.monotonic()
    answer = draw_job(job)
    assert time.monotonic() - t0 < 30
    assert answer["error"] is None and answer["why"] is None and answer["warnings"] == [], answer
    assert sorted(answer["written"]) == ["png", "svg", "viewer"]
    svg = (tmp_path / "out.svg").read_text(encoding="utf-8")
    assert "the SVG has every op" not in svg and every_op_elsewhere().replace("-", "&#45;") in svg
    assert "layers.0&#45;222" in svg  # the fold, as in the PNG
    from PIL import Image

    with Image.open(out["viewer"]) as im:
        assert im.width > im.height  # the viewer's landscape picture, not the tall PNG


def test_the_redraw_command_draws_a_huge_capture_as_the_recorder_does(huge, tmp_path, capsys):
    """``paddleviz-hooks render step.json -o step.png`` (the command an undrawn capture's warning
    names) draws the recorder's viewing PNG: the fold beside one block, not 2,000 nodes shrunk
    into a blank bitmap."""
    from paddleviz_hooks import cli
    from paddleviz_hooks.render import render_png

    path = tmp_path / "step_000001.json"
    path.write_text(huge.to_json(), encoding="utf-8")
    assert cli.main(["render", str(path), "-o", str(tmp_path / "step_000001.png")]) == 0
    info: dict = {}
    recorders = render_png(huge, info=info)  # what the recorder draws for it
    assert info["nodes"] < 100 and info["shown"] == {"layers.0-222": ["layers.223", 224]}
    assert (tmp_path / "step_000001.png").read_bytes() == recorders  # the same drawing, byte for byte
