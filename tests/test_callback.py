"""BackwardGraphCallback with a real paddle.Model.fit, real dot and real VisualDL files."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import paddle
import pytest

from paddleviz_hooks import BackwardGraph, BackwardGraphCallback, BackwardGraphRecorder
from paddleviz_hooks.capture import dispatcher_installed
from paddleviz_hooks.render import png_size

from _fitkit import PatchProbe, Recorder


class TinyNet(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.body = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU())
        self.head = paddle.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.body(x))


class Data(paddle.io.Dataset):
    def __init__(self, n: int = 40, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((n, 8)).astype("float32")
        self.y = rng.integers(0, 3, size=(n, 1)).astype("int64")

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self) -> int:
        return len(self.x)


def fit(callbacks, *, epochs=2, batch_size=8, n=40, loss=None, amp=None, accumulate=1, net=None):
    paddle.seed(1)
    np.random.seed(1)
    model = paddle.Model(net or TinyNet())
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    model.prepare(opt, loss or paddle.nn.CrossEntropyLoss(), amp_configs=amp)
    rec = Recorder()
    model.fit(Data(n), Data(16, seed=3), epochs=epochs, batch_size=batch_size, shuffle=False, verbose=0,
              callbacks=[rec, *callbacks], accumulate_grad_batches=accumulate)
    params = {k: v.numpy().copy() for k, v in model.network.state_dict().items()}
    return rec, params, model


class ProbedNet(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.probe = PatchProbe()

    def forward(self, x):
        return self.head(self.probe(self.body(x)))


def test_unselected_steps_run_their_backward_without_the_patch(tmp_path):
    """Observed inside each step's backward (not before or after the step)."""
    net = ProbedNet()
    cb = BackwardGraphCallback(str(tmp_path), every=4, verbose=0, formats=("json",), visualdl=False)
    fit([cb], net=net)
    assert cb.captured_steps == [1, 4, 8]
    assert net.probe.seen == [s in (1, 4, 8) for s in range(1, 11)]


def read_records(run_dir):
    from visualdl import LogReader

    files = glob.glob(os.path.join(run_dir, "vdlrecords*"))
    assert len(files) == 1, files
    reader = LogReader(file_path=files[0])
    tags = reader.get_tags()
    out = {}
    for kind in ("image", "text", "scalar"):
        for tag in tags.get(kind, []):
            out[(kind, tag)] = reader.get_data(kind, tag)
    return out


def test_every_selects_exact_steps_and_changes_nothing(tmp_path):
    base, base_params, _ = fit([])
    cb = BackwardGraphCallback(str(tmp_path), every=4, verbose=0)
    rec, params, _ = fit([cb])
    # 40 samples / batch 8 = 5 steps per epoch, 2 epochs: global steps 1..10
    assert cb.captured_steps == [1, 4, 8]
    assert rec.losses == base.losses
    for k in base_params:
        assert np.array_equal(params[k], base_params[k]), k
    assert not dispatcher_installed()
    run = tmp_path / "backward_graph"
    for step in (1, 4, 8):
        for ext in ("png", "svg", "dot", "json"):
            assert (run / f"step_{step:06d}.{ext}").stat().st_size > 0
    assert sorted(p.name for p in run.glob("step_*.json") if "diff" not in p.name) == [
        "step_000001.json", "step_000004.json", "step_000008.json"]
    g = BackwardGraph.from_json((run / "step_000004.json").read_text())
    assert g.meta["step"] == 4
    assert set(g.params()) == {"body.0.weight", "body.0.bias", "head.weight", "head.bias"}
    assert g.params()["head.weight"].shape == (16, 3)
    w, h = png_size((run / "step_000004.png").read_bytes())
    assert max(w, h) <= 2000


def test_visualdl_records_read_back(tmp_path):
    cb = BackwardGraphCallback(str(tmp_path), every=2, verbose=0)
    fit([cb], epochs=1)  # steps 1..5 -> captures 1, 2, 4
    records = read_records(str(tmp_path / "backward_graph"))
    images = records[("image", "backward_graph/from_step_000001")]
    assert [r.id for r in images] == [1, 2, 4]
    run = tmp_path / "backward_graph"
    for r in images:  # the picture drawn for VisualDL's viewer: landscape, within 1280x720
        w, h = png_size(r.image.encoded_image_string)
        assert w > h and w <= 1280 and h <= 720, (r.id, w, h)
    texts = records[("text", "summary/from_step_000001")]
    assert [r.id for r in texts] == [1, 2, 4]
    assert "parameters reached" in texts[0].text.encoded_text_string
    norms = records[("scalar", "~backward_graph/global_grad_norm")]
    assert [r.id for r in norms] == [1, 2, 4]
    g = BackwardGraph.from_json((run / "step_000002.json").read_text())
    assert abs(norms[1].value - g.global_grad_norm()) <= 1e-5 * g.global_grad_norm()
    # by default only gradient norms and the NaN/Inf count, after the user's groups
    assert sorted(tag for kind, tag in records if kind == "scalar") == [
        "~backward_graph/global_grad_norm", "~backward_graph/nonfinite_grads", "~grad_norm/body.0", "~grad_norm/head"]


def test_visualdl_diagnostics_are_opt_in(tmp_path):
    cb = BackwardGraphCallback(str(tmp_path), every=2, verbose=0, formats=("json",), visualdl_diagnostics=True)
    fit([cb], epochs=1)
    records = read_records(str(tmp_path / "backward_graph"))
    nodes = records[("scalar", "~backward_graph/nodes")]
    assert [r.id for r in nodes] == [1, 2, 4]
    g = BackwardGraph.from_json((tmp_path / "backward_graph" / "step_000002.json").read_text())
    assert nodes[1].value == len(g.nodes)
    assert ("scalar", "~backward_graph/capture_ms") in records


def test_tags_page_every_ten_captures(tmp_path):
    cb = BackwardGraphCallback(str(tmp_path), every=1, verbose=0, formats=("json", "png"), queue_size=32)
    fit([cb], epochs=3, n=40)  # 15 steps, all captured
    records = read_records(str(tmp_path / "backward_graph"))
    p0 = [r.id for r in records[("image", "backward_graph/from_step_000001")]]
    p1 = [r.id for r in records[("image", "backward_graph/from_step_000011")]]
    assert p0 == list(range(1, 11)) and p1 == list(range(11, 16))


def test_steps_and_max_captures(tmp_path):
    cb = BackwardGraphCallback(str(tmp_path), steps=[2, 3, 7, 9], capture_first=False, max_captures=3,
                               verbose=0, formats=("json",))
    fit([cb])
    assert cb.captured_steps == [2, 3, 7]


def test_eval_is_never_captured(tmp_path):
    cb = BackwardGraphCallback(str(tmp_path), every=1, verbose=0, formats=("json",), visualdl=False)
    _, _, model = fit([cb], epochs=1)
    n_before = len(cb.captured_steps)
    model.evaluate(Data(16, seed=3), batch_size=8, verbose=0, callbacks=[cb])
    assert len(cb.captured_steps) == n_before == 5


class TwoLosses(paddle.nn.Layer):
    def forward(self, logits, label):
        ce = paddle.nn.functional.cross_entropy(logits, label)
        return ce, (logits * logits).mean() * 0.01


def test_several_losses_and_accumulation(tmp_path):
    base, base_params, _ = fit([], loss=TwoLosses(), accumulate=2)
    cb = BackwardGraphCallback(str(tmp_path), every=3, verbose=0, formats=("json",), visualdl=False)
    rec, params, _ = fit([cb], loss=TwoLosses(), accumulate=2)
    assert rec.losses == base.losses
    for k in base_params:
        assert np.array_equal(params[k], base_params[k]), k
    # 5 batches an epoch, accumulation 2: optimizer steps of 2, 2 and 1 batches, 6 in 2 epochs
    assert cb.captured_steps == [1, 3, 6]
    run = tmp_path / "backward_graph"
    assert sorted(p.name for p in run.glob("step_*.json")) == [
        "step_000001.json", "step_000001_b2.json", "step_000003.json", "step_000006.json"]
    roles = {p.name: BackwardGraph.from_json(p.read_text()).meta["backward"]["role"] for p in run.glob("*.json")}
    assert roles == {"step_000001.json": "micro-batch 1 of 2", "step_000001_b2.json": "micro-batch 2 of 2",
                     "step_000003.json": "micro-batch 1 of 1", "step_000006.json": "micro-batch 1 of 1"}
    g = BackwardGraph.from_json((run / "step_000003.json").read_text())
    # paddle.Model sums several losses with add_n: the root's node cannot be hooked but is drawn.
    assert "AddN" in g.count_ops()
    assert len(g.params()) == 4


def test_amp_configs_on_cpu(tmp_path):
    cb = BackwardGraphCallback(str(tmp_path), every=5, verbose=0, formats=("json",), visualdl=False)
    fit([cb], epochs=1, amp={"level": "O1"})
    assert cb.captured_steps == [1, 5]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"every": 0}, {"every": -3}, {"every": 2.5}, {"every": "10"}, {"steps": [0]}, {"steps": "1,2"},
        {"every": 5, "steps": [1]}, {"max_captures": 0}, {"formats": ("gif",)}, {"ranks": "some"},
        {"on_grad_spike": 0.5}, {"render_timeout": -1}, {"run_name": "../x"}, {"view_max_nodes": 1},
    ],
)
def test_bad_arguments_fail_at_construction(kwargs):
    with pytest.raises((ValueError, TypeError)) as info:
        BackwardGraphCallback("logs", **kwargs)
    key, value = next(iter(kwargs.items()))
    assert repr(value) in str(info.value) or key in str(info.value)


def test_static_mode_warns_once_and_records_nothing(tmp_path):
    cb = BackwardGraphCallback(str(tmp_path), every=1, verbose=0)
    paddle.enable_static()
    try:
        with pytest.warns(RuntimeWarning, match="dynamic-graph mode") as got:
            cb.on_train_begin({})
            cb.on_train_batch_begin(0, {})
            cb.on_train_batch_end(0, {})
            cb.on_train_end({})
    finally:
        paddle.disable_static()
    assert len([w for w in got if "paddleviz_hooks" in str(w.message)]) == 1
    assert cb.captured_steps == [] and not (tmp_path / "backward_graph").exists()
    assert not dispatcher_installed()


def test_viewer_px_none_logs_the_png_file(tmp_path):
    cb = BackwardGraphCallback(str(tmp_path), every=4, verbose=0, formats=("json", "png"), viewer_px=None)
    fit([cb], epochs=1)  # steps 1..5 -> captures 1, 4
    records = read_records(str(tmp_path / "backward_graph"))
    images = records[("image", "backward_graph/from_step_000001")]
    assert [r.id for r in images] == [1, 4]
    for r in images:
        assert r.image.encoded_image_string == (tmp_path / "backward_graph" / f"step_{r.id:06d}.png").read_bytes()


def test_a_model_in_the_wrong_place_is_named(tmp_path):
    """Arguments in the wrong order say which order is right (they said only 'every must be an
    int ... got Linear' and 'model must be a paddle.nn.Layer ... got str')."""
    net = paddle.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"BackwardGraphCallback takes no model .*BackwardGraphRecorder\(log_dir, model"):
        BackwardGraphCallback(str(tmp_path), net)
    with pytest.raises(TypeError, match=r"log directory comes first: BackwardGraphRecorder\(log_dir, model\)"):
        BackwardGraphRecorder(net, str(tmp_path))
