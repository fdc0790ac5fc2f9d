"""Dashboards beside VisualDL: the sink interface, ``sinks=``, and the SwanLab,
TensorBoard and W&B sinks with the real packages, offline.

One seeded ``Model.fit`` logs to all four dashboards at once; each dashboard's
records are read back with that tool's own reader (VisualDL's LogReader,
TensorBoard's EventAccumulator, SwanLab's local database and log files, W&B's
offline transaction log parsed into W&B's own protobuf records) and checked
against each other and the step files: one picture (the same pixels on every
dashboard), one summary text and the scalars per capture, at the captured steps.
"""

from __future__ import annotations

import glob
import json
import os
import sqlite3
import struct
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from paddleviz_hooks import BackwardGraph, BackwardGraphCallback, BackwardGraphRecorder, Sink
from paddleviz_hooks.sinks.base import png_to_array
from _fitkit import children, run_fit

for _pkg in ("swanlab", "tensorboardX", "tensorboard", "wandb"):
    pytest.importorskip(_pkg, reason=f"{_pkg} is installed by `make test` (the dashboards-test extra)")

REPO = Path(__file__).resolve().parents[1]
STEPS = 5  # Model.fit batches; every=2 captures steps 1, 2 and 4
CAPTURED = [1, 2, 4]
NORM = "~backward_graph/global_grad_norm"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """No sink may reach a server: W&B offline, nothing of SwanLab's cloud."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("SWANLAB_MODE", "local")


def _fit(log_dir: Path, **options):
    cb = BackwardGraphCallback(str(log_dir), every=2, verbose=0, **options)
    res = run_fit(callbacks=[cb], steps=STEPS)
    assert cb.captured_steps == CAPTURED
    return cb, res


# ---------------------------------------------------------------- readers
def vdl_records(run_dir: Path) -> dict:
    from visualdl import LogReader

    (path,) = glob.glob(str(run_dir / "vdlrecords*"))
    reader = LogReader(file_path=path)
    return {(kind, tag): reader.get_data(kind, tag)
            for kind, tags in reader.get_tags().items() if kind in ("image", "text", "scalar") for tag in tags}


def tb_records(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def swanlab_records(swanlog: Path) -> dict[str, dict]:
    """experiment name -> {key: (type, [(step, value)])} from SwanLab's local database and logs;
    an image's value is the PNG file's bytes."""
    db = sqlite3.connect(str(swanlog / "runs.swanlab"))
    try:
        out = {}
        for exp_id, run_id, name in db.execute("select id, run_id, name from experiment"):
            run = str(swanlog / run_id)
            keys = {}
            for key, folder, kind in db.execute("select name, folder, type from tag where experiment_id=?", (exp_id,)):
                rows = []
                for log in sorted(glob.glob(os.path.join(run, "logs", folder, "*.log"))):
                    for line in Path(log).read_text(encoding="utf-8").splitlines():
                        rec = json.loads(line)
                        value = rec["data"]
                        if kind == "image":
                            value = Path(run, "media", folder, value[0]).read_bytes()
                        elif kind == "text":
                            value = value[0]
                        rows.append((rec["index"], value))
                keys[key] = (kind, sorted(rows, key=lambda r: r[0]))
            out[name] = {"dir": run, "keys": keys}
        return out
    finally:
        db.close()


def wandb_history(run_dir: str, timeout: float = 60.0) -> list[dict]:
    """The history rows of an offline W&B run, from its transaction log (LevelDB-style
    32 KiB blocks of chunks behind a 7-byte file header) parsed into W&B's own records.
    W&B's writer process may still be writing after ``finish()`` returned: read until the
    run's exit record is there."""
    import time

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    deadline = time.monotonic() + timeout
    while True:
        data = Path(path).read_bytes()
        assert data[:4] == b":W&B"
        block, pos, chunk, rows, ended = 32768, 7, b"", [], False
        while pos + 7 <= len(data):
            left = block - pos % block
            if left < 7:
                pos += left
                continue
            _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
            pos += 7
            if n == 0 and kind == 0:  # zero padding up to the end of the block
                pos += left - 7
                continue
            chunk += data[pos:pos + n]
            pos += n
            if kind in (1, 4):  # FULL or LAST
                rec = pb.Record()
                rec.ParseFromString(chunk)
                chunk = b""
                which = rec.WhichOneof("record_type")
                ended = ended or which == "exit"
                if which == "history":
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        if ended or time.monotonic() > deadline:
            assert ended, f"{path} has no exit record after {timeout} s"
            return rows
        time.sleep(0.2)


def _wandb_media(rows: list[dict], key: str) -> dict[int, str]:
    """step -> media path of ``key`` in the rows."""
    return {r["backward_graph/step"]: r[f"{key}/path"] for r in rows if f"{key}/path" in r}


# ------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def all_four(tmp_path_factory):
    """One Model.fit logging to VisualDL, SwanLab, TensorBoard and W&B (own runs, offline)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    log_dir = tmp_path_factory.mktemp("sinks") / "logs"
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            cb, res = _fit(log_dir, sinks=["visualdl", "swanlab", "tensorboard", "wandb"], formats=("png", "svg", "json"))
    finally:
        mp.undo()
    return log_dir, cb, res, [str(w.message) for w in got if "paddleviz_hooks" in str(w.message)]


def test_every_dashboard_gets_one_picture_text_and_scalars_per_capture(all_four):
    log_dir, cb, res, ours = all_four
    assert ours == []
    run = log_dir / "backward_graph"
    graphs = {s: BackwardGraph.from_json((run / f"step_{s:06d}.json").read_text()) for s in CAPTURED}

    # VisualDL: the reference (its pictures are checked against the drawing in test_dashboard.py)
    vdl = vdl_records(run)
    vdl_pics = {r.id: png_to_array(r.image.encoded_image_string) for r in vdl[("image", "backward_graph/from_step_000001")]}
    vdl_text = {r.id: r.text.encoded_text_string for r in vdl[("text", "summary/from_step_000001")]}
    assert sorted(vdl_pics) == sorted(vdl_text) == CAPTURED
    scalar_names = sorted(tag for kind, tag in vdl if kind == "scalar")
    assert NORM in scalar_names and "~grad_norm/0" in scalar_names

    # TensorBoard: event files in the run folder
    tb = tb_records(run)
    tags = tb.Tags()
    assert tags["images"] == ["backward_graph"]
    images = tb.Images("backward_graph")
    assert [e.step for e in images] == CAPTURED
    for e in images:
        assert np.array_equal(png_to_array(e.encoded_image_string), vdl_pics[e.step]), e.step
    texts = {e.step: e.tensor_proto.string_val[0].decode("utf-8") for e in tb.Tensors("backward_graph/summary/text_summary")}
    assert sorted(texts) == CAPTURED
    for s, text in texts.items():  # a literal block: every line indented by four spaces
        assert "\n".join(line[4:] for line in text.splitlines()) == vdl_text[s]
    svg_notes = {e.step: e.tensor_proto.string_val[0].decode() for e in tb.Tensors("backward_graph/full_detail/text_summary")}
    assert sorted(svg_notes) == CAPTURED and str(run / "step_000004.svg") in svg_notes[4]
    assert sorted(tags["scalars"]) == scalar_names
    for e in tb.Scalars(NORM):
        assert e.value == pytest.approx(graphs[e.step].global_grad_norm(), rel=1e-6)
    assert [e.step for e in tb.Scalars(NORM)] == CAPTURED

    # SwanLab: a local run of its own under log_dir/swanlog, which copies nothing of the console
    (exp,) = swanlab_records(log_dir / "swanlog").values()
    assert not glob.glob(os.path.join(exp["dir"], "console", "*"))
    keys = exp["keys"]
    kind, pics = keys["backward_graph/graph"]
    assert kind == "image" and [s for s, _ in pics] == CAPTURED
    for s, png in pics:
        assert np.array_equal(png_to_array(png), vdl_pics[s]), s
    kind, rows = keys["backward_graph/summary"]
    assert kind == "text" and dict(rows) == vdl_text
    assert sorted(k for k, (kind, _) in keys.items() if kind == "line") == scalar_names
    assert [(s, pytest.approx(graphs[s].global_grad_norm(), rel=1e-6)) for s in CAPTURED] == keys[NORM][1]

    # W&B: an offline run of its own under the run folder, one row per capture at its step
    (wrun,) = glob.glob(str(run / "wandb" / "offline-run-*"))
    rows = wandb_history(wrun)
    assert sorted(r["backward_graph/step"] for r in rows) == CAPTURED, rows
    assert all({"backward_graph/graph/path", "backward_graph/summary/path", NORM} <= set(r) for r in rows), rows
    files = Path(wrun) / "files"
    pictures = _wandb_media(rows, "backward_graph/graph")
    assert sorted(pictures) == CAPTURED
    for s, path in pictures.items():
        assert np.array_equal(png_to_array((files / path).read_bytes()), vdl_pics[s]), s
    svgs = _wandb_media(rows, "backward_graph/svg")
    assert sorted(svgs) == CAPTURED
    for s, path in svgs.items():  # the full-detail SVG file of the step, unchanged
        assert (files / path).read_text("utf-8") == (run / f"step_{s:06d}.svg").read_text("utf-8")
    summaries = _wandb_media(rows, "backward_graph/summary")
    assert sorted(summaries) == CAPTURED
    import html

    for s, path in summaries.items():
        page = (files / path).read_text("utf-8")
        assert html.unescape(page[page.index("<pre>") + 5:page.index("</pre>")]) == vdl_text[s]
    norms = {r["backward_graph/step"]: r[NORM] for r in rows if NORM in r}
    assert norms == {s: pytest.approx(graphs[s].global_grad_norm(), rel=1e-6) for s in CAPTURED}
    logged = {k for r in rows for k in r if k.startswith("~")}
    assert sorted(logged) == scalar_names


def test_no_wandb_process_is_left_when_the_sink_ran_its_own_run(all_four):
    """The W&B sink started its own offline run (no run of the user's): when it closes, W&B's
    service process (wandb-core) goes too; it stayed for the life of the training process."""
    assert not [cmd for cmd in children(os.getpid()).values() if "wandb" in cmd]


def test_into_the_users_active_swanlab_and_wandb_runs(tmp_path):
    """The user's own runs get our records beside theirs; their steps and rows are untouched,
    and their runs stay open after training (the user finishes them)."""
    import paddle
    import swanlab
    import wandb

    swanlog = tmp_path / "swanlog_user"
    sl_run = swanlab.init(mode="local", log_dir=str(swanlog), project="mine", name="my-run")
    w_run = wandb.init(mode="offline", dir=str(tmp_path), project="mine", name="my-run")

    class UserLogger(paddle.callbacks.Callback):  # the user's own logging, one row per batch
        n = 0

        def on_train_batch_end(self, step, logs=None):
            self.n += 1
            loss = float(np.asarray(logs["loss"]).reshape(-1)[0])
            swanlab.log({"train/loss": loss}, step=self.n)
            wandb.log({"train/loss": loss})

    try:
        cb = BackwardGraphCallback(str(tmp_path / "logs"), every=2, verbose=0, sinks=["swanlab", "wandb"],
                                   formats=("png", "svg", "json"))
        run_fit(callbacks=[cb, UserLogger()], steps=STEPS)
        assert cb.captured_steps == CAPTURED
        assert swanlab.has_run() and swanlab.get_run() is sl_run and wandb.run is w_run
        assert [cmd for cmd in children(os.getpid()).values() if "wandb" in cmd]  # the user's W&B goes on
    finally:
        swanlab.finish()
        w_run.finish()
        wandb.teardown()  # the user's service process: theirs to stop, as this test does
    assert not (tmp_path / "logs" / "swanlog").exists()  # no run of our own
    assert not (tmp_path / "logs" / "backward_graph" / "wandb").exists()

    (exp,) = swanlab_records(swanlog).values()
    keys = exp["keys"]
    assert [s for s, _ in keys["train/loss"][1]] == [1, 2, 3, 4, 5]
    assert [s for s, _ in keys["backward_graph/graph"][1]] == CAPTURED
    assert [s for s, _ in keys["backward_graph/summary"][1]] == CAPTURED
    assert [s for s, _ in keys[NORM][1]] == CAPTURED

    (wrun,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    rows = wandb_history(wrun)
    losses = [r for r in rows if "train/loss" in r]
    assert [r["_step"] for r in losses] == [0, 1, 2, 3, 4]  # our records never moved the user's step
    assert sorted(_wandb_media(rows, "backward_graph/graph")) == CAPTURED
    assert sorted(r["backward_graph/step"] for r in rows if NORM in r) == CAPTURED
    ours = [r for r in rows if "backward_graph/step" in r]  # one row per capture, data and pictures together
    assert sorted(r["backward_graph/step"] for r in ours) == CAPTURED, ours
    assert all("backward_graph/graph/path" in r and NORM in r for r in ours), ours


def test_sinks_are_checked_when_the_recorder_is_made(monkeypatch):
    with pytest.raises(ValueError, match="unknown dashboard 'tensorbord'; the names are 'visualdl', 'swanlab'"):
        BackwardGraphRecorder("x", sinks=["visualdl", "tensorbord"])
    with pytest.raises(ValueError, match="'wandb' is given twice"):
        BackwardGraphCallback("x", sinks=["wandb", "wandb"])
    with pytest.raises(TypeError, match="sinks: each must be a dashboard name or an object with open, data"):
        BackwardGraphRecorder("x", sinks=[print])
    with pytest.raises(TypeError, match="sinks must be a dashboard name, a Sink object or a list"):
        BackwardGraphRecorder("x", sinks=3)
    monkeypatch.setitem(sys.modules, "swanlab", None)  # not installed
    with pytest.raises(ImportError, match=r"pip install 'paddleviz-hooks\[swanlab\]'"):
        BackwardGraphCallback("x", sinks="swanlab")
    rec = BackwardGraphRecorder("x", sinks=[Sink()], visualdl=False)
    assert len(rec.options.sinks) == 1
    assert BackwardGraphRecorder("x", visualdl=False).options.sinks == ()
    assert BackwardGraphRecorder("x").options.sinks == ("visualdl",)


class Broken(Sink):
    name = "broken"

    def __init__(self, where: str) -> None:
        self.where = where
        self.calls: list[str] = []

    def open(self, context):
        self.calls.append("open")
        if self.where == "open":
            raise OSError("no such dashboard")

    def data(self, record):
        self.calls.append(f"data {record.step}")
        if self.where == "data":
            raise RuntimeError("boom")

    def pictures(self, record):
        self.calls.append(f"pictures {record.step}")

    def close(self):
        self.calls.append("close")


@pytest.mark.parametrize("where", ["open", "data"])
def test_a_failing_sink_is_one_warning_and_the_others_go_on(tmp_path, where):
    broken, logged = Broken(where), []

    class Keeps(Sink):
        def data(self, record):
            logged.append(("data", record.step, sorted(record.paths)))

        def pictures(self, record):
            logged.append(("pictures", record.step, png_to_array(record.picture).shape[2]))

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        _fit(tmp_path, sinks=["visualdl", broken, Keeps()], formats=("png", "json"))
    msgs = [str(w.message) for w in got if "paddleviz_hooks" in str(w.message)]
    assert len(msgs) == 1, msgs
    if where == "open":
        assert "the broken sink could not start (OSError('no such dashboard'))" in msgs[0]
        assert broken.calls == ["open"]
    else:
        assert "the broken sink failed in data (step 1): RuntimeError('boom')" in msgs[0]
        assert broken.calls == ["open", "data 1", "pictures 1", "data 2", "pictures 2", "data 4", "pictures 4",
                                "close"] or sorted(broken.calls) == sorted(
            ["open", "data 1", "pictures 1", "data 2", "pictures 2", "data 4", "pictures 4", "close"])
    assert sorted(s for kind, s, _ in logged if kind == "data") == CAPTURED
    assert sorted(s for kind, s, _ in logged if kind == "pictures") == CAPTURED
    assert all(paths == ["json"] for kind, _, paths in logged if kind == "data")
    vdl = vdl_records(tmp_path / "backward_graph")
    assert [r.id for r in vdl[("image", "backward_graph/from_step_000001")]] == CAPTURED
    assert [r.id for r in vdl[("scalar", NORM)]] == CAPTURED


# ------------------------------------------------------ what a person sees
def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


class _Server:
    """A dashboard server started for one test, in a process group of its own; stopped on exit."""

    def __init__(self, argv: list[str], ready) -> None:
        import subprocess
        import tempfile
        import time

        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            self.log.seek(0)
            self.url = ready(self.log.read().decode("utf-8", "replace"))
            if self.url:
                try:
                    _get(self.url)
                    return
                except OSError:
                    pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"{argv[0]} did not start")
            time.sleep(0.25)

    def close(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except Exception:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


@pytest.mark.browser
def test_swanlab_and_tensorboard_dashboards_show_a_captured_steps_picture(all_four):
    import re

    from _browser import CHROMIUM, launch_chromium

    if not os.path.exists(CHROMIUM):
        pytest.skip("Chromium is not installed (make browser)")
    playwright = pytest.importorskip("playwright.sync_api")
    log_dir = all_four[0]
    run = log_dir / "backward_graph"
    out = REPO / "test-output"
    out.mkdir(exist_ok=True)
    bin_dir = Path(sys.executable).parent
    tb_events = tb_records(run).Images("backward_graph")
    port = _free_port()
    # swanlab watch takes another port when the one asked for is taken: read where it listens
    swan = _Server([str(bin_dir / "swanlab"), "watch", str(log_dir / "swanlog"), "-h", "127.0.0.1", "-p", str(port)],
                   lambda text: (m := re.search(r"http://127\.0\.0\.1:\d+", text)) and m.group(0))
    try:
        tb = _Server([str(bin_dir / "tensorboard"), "--logdir", str(log_dir), "--host", "127.0.0.1",
                      "--port", str(_free_port())],
                     lambda text: (m := re.search(r"http://127\.0\.0\.1:\d+", text)) and m.group(0))
        try:
            # what the servers serve: our three pictures, byte for byte as stored
            (exp,) = json.loads(_get(f"{swan.url}/api/v1/project"))["data"]["experiments"]
            listed = json.loads(_get(f"{swan.url}/api/v1/experiment/{exp['id']}/tag/backward_graph/graph"))["data"]
            assert [r["index"] for r in listed["list"]] == CAPTURED
            stored = dict(swanlab_records(log_dir / "swanlog")[exp["name"]]["keys"]["backward_graph/graph"][1])
            last = listed["list"][-1]["data"][0]
            assert _get(f"{swan.url}/api/v1/media/{last}?tag=backward_graph%2Fgraph&experiment_id={exp['id']}") == (
                stored[4])
            served = json.loads(_get(f"{tb.url}/data/plugin/images/images?run=backward_graph&tag=backward_graph"))
            assert [r["step"] for r in served] == CAPTURED
            assert _get(f"{tb.url}/data/plugin/images/individualImage?{served[-1]['query']}") == (
                tb_events[-1].encoded_image_string)

            w, h = png_to_array(stored[4]).shape[1::-1]
            with playwright.sync_playwright() as p:
                browser = launch_chromium(p)
                try:
                    page = browser.new_page(viewport={"width": 1440, "height": 900})
                    page.goto(f"{swan.url}/experiment/{exp['id']}/chart", wait_until="networkidle")
                    img = page.locator("img[src^='data:image/png']").first
                    img.wait_for(timeout=30000)
                    img.scroll_into_view_if_needed()
                    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=img.element_handle())
                    assert img.evaluate("i => [i.naturalWidth, i.naturalHeight]") == [w, h]
                    caption = page.get_by_text("step 4: ").first  # the summary under the picture
                    assert "global grad norm" in caption.inner_text()
                    page.screenshot(path=str(out / "swanlab_dashboard.png"))

                    page.goto(f"{tb.url}/#images", wait_until="networkidle")
                    page.get_by_text("Show actual image size").click()
                    img = page.locator("img[src*='individualImage']").first
                    img.wait_for(timeout=30000)
                    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=img.element_handle())
                    assert img.evaluate("i => [i.naturalWidth, i.naturalHeight]") == [w, h]
                    page.screenshot(path=str(out / "tensorboard_images.png"))
                finally:
                    browser.close()
        finally:
            tb.close()
    finally:
        swan.close()
