"""End to end: ``Model.fit`` with BackwardGraphCallback, then the real VisualDL server.

A tiny LeNet-like model trains for 8 steps with ``BackwardGraphCallback`` and
``paddle.callbacks.VisualDL`` writing into the same log directory; the real
``visualdl`` server is started on that directory and checked through its HTTP
API (both runs visible, every capture listed, served images byte-identical to
the PNG files on disk, text and scalar records present) and, when Debian's
Chromium is installed, through the dashboard itself in headless Chromium
(``@pytest.mark.browser``; screenshots also land in ``test-output/``).

Facts this relies on are in ``docs/visualdl.md``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import paddle
import pytest

from paddleviz_hooks import BackwardGraph, BackwardGraphCallback
from paddleviz_hooks.text import graph_title
from paddleviz_hooks.options import RecorderOptions
from paddleviz_hooks.drawworker import VIEWER_LABEL_PX, viewer_png
from paddleviz_hooks.sinks.visualdl import encode_like_visualdl, png_to_array
from _browser import CHROMIUM, launch_chromium

REPO = Path(__file__).resolve().parents[1]
TEST_OUTPUT = REPO / "test-output"
RUN = "backward_graph"  # our run's folder under the log dir (the callback's run_name)
SHOWN = "vdl_log/backward_graph"  # its name in the dashboard: "<log dir>/<run_name>"
PAGE_TAG = re.compile(r"^backward_graph/from_step_(\d{6})$")
SUMMARY_TAG = re.compile(r"^summary/from_step_(\d{6})$")


# --------------------------------------------------------------------------
# a small LeNet-like model and a synthetic dataset
# --------------------------------------------------------------------------
class SmallLeNet(paddle.nn.Layer):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = paddle.nn.Sequential(
            paddle.nn.Conv2D(1, 4, 3, padding=1),
            paddle.nn.ReLU(),
            paddle.nn.MaxPool2D(2, 2),
            paddle.nn.Conv2D(4, 8, 3),
            paddle.nn.ReLU(),
            paddle.nn.MaxPool2D(2, 2),
        )
        self.fc = paddle.nn.Sequential(
            paddle.nn.Linear(8 * 3 * 3, 32),
            paddle.nn.ReLU(),
            paddle.nn.Linear(32, num_classes),
        )

    def forward(self, x):
        x = self.features(x)
        x = paddle.flatten(x, 1)
        return self.fc(x)


class TinyDigits(paddle.io.Dataset):
    """16x16 random images whose label shifts their brightness."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.labels = rng.integers(0, 10, size=n).astype("int64")
        noise = rng.standard_normal((n, 1, 16, 16)) * 0.3
        self.images = (noise + self.labels[:, None, None, None] / 10).astype("float32")

    def __getitem__(self, i):
        return self.images[i], self.labels[i : i + 1]

    def __len__(self) -> int:
        return len(self.labels)


def train(log_dir: Path, *, every: int, epochs: int, with_paddle_visualdl: bool = True,
          queue_size: int = 4) -> BackwardGraphCallback:
    """64 samples, batch 16: 4 steps per epoch."""
    paddle.seed(0)
    model = paddle.Model(SmallLeNet())
    model.prepare(
        paddle.optimizer.Adam(learning_rate=1e-3, parameters=model.parameters()),
        paddle.nn.CrossEntropyLoss(),
        paddle.metric.Accuracy(),
    )
    cb = BackwardGraphCallback(str(log_dir), every=every, queue_size=queue_size, verbose=0)
    callbacks = [cb]
    if with_paddle_visualdl:
        callbacks.append(paddle.callbacks.VisualDL(log_dir=str(log_dir)))
    model.fit(TinyDigits(64), epochs=epochs, batch_size=16, callbacks=callbacks, verbose=0, shuffle=False)
    return cb


def step_file(run_dir: Path, step: int, ext: str) -> Path:
    return run_dir / f"step_{step:06d}.{ext}"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


# --------------------------------------------------------------------------
# the VisualDL server and its HTTP API (urllib only)
# --------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_until(fn, timeout: float, what: str, interval: float = 0.25):
    """Poll ``fn`` until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except (OSError, ValueError) as exc:  # connection refused, not JSON yet
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last_exc!r})")


class VisualDLServer:
    """``visualdl --logdir DIR`` on a free port; always stopped on exit."""

    def __init__(self, logdir: Path, log_file: Path) -> None:
        self.logdir = logdir
        self.log_file = log_file
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "VisualDLServer":
        exe = Path(sys.executable).with_name("visualdl")
        cmd = [str(exe), "--logdir", str(self.logdir), "--host", "127.0.0.1", "--port", str(self.port),
               "--disable-telemetry", "--cache-timeout", "1"]
        self._log = open(self.log_file, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def alive():
                if self.proc.poll() is not None:
                    raise AssertionError(f"visualdl exited with {self.proc.returncode}:\n{self.log()}")
                return http_get(self.url + "/alive", timeout=2)[0] == 204

            wait_until(alive, 60, "GET /alive == 204")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: only what we started
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    def raw(self, path: str, **params) -> bytes:
        url = f"{self.url}/app/api/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        status, body = http_get(url)
        assert status == 200, f"GET {url} -> {status}: {body[:300]!r}"
        return body

    def api(self, path: str, **params):
        reply = json.loads(self.raw(path, **params))
        assert reply.get("status") == 0, f"{path} {params}: {reply}"
        return reply["data"]

    def tags(self, kind: str) -> dict[str, list[str]]:
        """run -> tags of one kind (image, text, scalar)."""
        data = self.api(f"{kind}/tags")
        return dict(zip(data["runs"], data["tags"]))


def our_pages(tags: list[str], pattern: re.Pattern) -> list[str]:
    """Paged tags of one base name (each named by the step it starts at), in step order."""
    pages = sorted((int(m.group(1)), t) for t in tags if (m := pattern.match(t)))
    return [t for _, t in pages]


def served_steps(server: VisualDLServer, kind: str, tags: list[str]) -> list[int]:
    steps = []
    for tag in tags:
        steps += [rec["step"] for rec in server.api(f"{kind}/list", run=SHOWN, tag=tag)]
    return steps


# --------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """8 steps (64 samples, batch 16, 2 epochs), capture every 2nd step and step 1."""
    log_dir = tmp_path_factory.mktemp("m") / "vdl_log"
    t0 = time.perf_counter()
    cb = train(log_dir, every=2, epochs=2)
    print(f"fit with capture: {time.perf_counter() - t0:.1f} s, captured {cb.captured_steps}")
    return log_dir, cb


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory):
    log_dir, _ = trained
    with VisualDLServer(log_dir, tmp_path_factory.mktemp("server") / "visualdl.log") as srv:
        # the server scans the log dir lazily: wait until both runs are listed
        wait_until(lambda: len(srv.api("runs")) >= 2, 30, "both runs in /app/api/runs")
        yield srv


# --------------------------------------------------------------------------
# the HTTP API
# --------------------------------------------------------------------------
def test_files_on_disk(trained):
    log_dir, cb = trained
    assert cb.captured_steps == [1, 2, 4, 6, 8], (cb.captured_steps, cb.dropped_steps)
    run_dir = log_dir / RUN
    assert sorted(p.name for p in run_dir.glob("step_*.png")) == [f"step_{s:06d}.png" for s in cb.captured_steps]
    for step in cb.captured_steps:
        for ext in ("png", "svg", "dot", "json"):
            assert step_file(run_dir, step, ext).is_file(), f"missing {step_file(run_dir, step, ext)}"
    # our records live in their own directory, paddle's VisualDL writes to log_dir
    assert list(run_dir.glob("vdlrecords*")), "no VisualDL records in the run folder"
    assert list(log_dir.glob("vdlrecords*")), "paddle.callbacks.VisualDL wrote nothing"


def test_both_runs_listed(server, trained):
    runs = server.api("runs")
    assert SHOWN in runs, runs
    others = [r for r in runs if r != SHOWN]
    assert len(others) == 1, f"expected our run and paddle's VisualDL run, got {runs}"
    scalars = server.tags("scalar")
    assert {"train/loss", "train/acc"} <= set(scalars[others[0]]), scalars
    assert "~backward_graph/global_grad_norm" in scalars[SHOWN], scalars[SHOWN]
    # VisualDL orders tag groups by their upper-cased names: ours come after the user's
    groups = sorted({t.split("/")[0] for tags in scalars.values() for t in tags}, key=str.upper)
    assert groups[-2:] == ["~backward_graph", "~grad_norm"] and "train" in groups, groups
    # our steps are numbered like paddle's train/* scalars
    _, cb = trained
    loss_steps = [s for _, s, _ in server.api("scalar/list", run=others[0], tag="train/loss")]
    assert loss_steps == list(range(1, 9))
    assert set(cb.captured_steps) <= set(loss_steps)


def expected_viewer_png(run_dir: Path, step: int, info: dict | None = None) -> bytes:
    """The picture the dashboard should serve for a scheduled capture: the viewer picture
    drawn again from the step's saved JSON, encoded as VisualDL stores it."""
    graph = BackwardGraph.from_json(step_file(run_dir, step, "json").read_text())
    png = viewer_png(graph, RecorderOptions.check(), graph_title(graph), info=info)  # the recorder's title
    return encode_like_visualdl(png_to_array(png))


def test_images_served_byte_identical(server, trained):
    log_dir, cb = trained
    image_tags = server.tags("image")
    assert list(image_tags) == [SHOWN], f"only our run logs images: {image_tags}"
    pages = our_pages(image_tags[SHOWN], PAGE_TAG)
    assert pages == ["backward_graph/from_step_000001"], image_tags[SHOWN]
    listed = server.api("image/list", run=SHOWN, tag=pages[0])
    assert [rec["step"] for rec in listed] == cb.captured_steps
    for index, rec in enumerate(listed):
        served = server.raw("image/image", run=SHOWN, tag=pages[0], index=index)
        info: dict = {}
        expected = expected_viewer_png(log_dir / RUN, rec["step"], info)
        assert served == expected, f"step {rec['step']}: served {len(served)} bytes differ from the viewer picture"
        w, h = png_size(served)
        assert w > h and w <= 1280 and h <= 720, (rec["step"], w, h)  # landscape, fits the viewer unscaled
        assert info["dpi"] * 11 / 72 >= VIEWER_LABEL_PX, info  # 11 pt node labels, in image pixels


def test_text_and_scalars(server, trained):
    log_dir, cb = trained
    text_tags = server.tags("text")
    pages = our_pages(text_tags[SHOWN], SUMMARY_TAG)
    assert pages == ["summary/from_step_000001"], text_tags
    listed = server.api("text/list", run=SHOWN, tag=pages[0])
    assert [rec["step"] for rec in listed] == cb.captured_steps
    texts = []
    for index, rec in enumerate(listed):
        text = server.raw("text/text", run=SHOWN, tag=pages[0], index=index).decode("utf-8")
        texts.append(text)
        graph = json.loads(step_file(log_dir / RUN, rec["step"], "json").read_text())
        assert f"step {rec['step']}" in text, text
        assert f"{len(graph['nodes'])} nodes" in text, text
        assert "op:" not in text and "#0" not in text, f"node keys are for machines: {text}"
        assert all(len(line) <= 100 for line in text.splitlines()), text
    # the op that gives no gradient data is named once, not in every record
    # the AddN root takes no hook, but the gradients it passes on are seen by their receivers:
    # nothing is reported as not observed, at any step
    assert not any("not observed" in t for t in texts), texts
    assert f"step {cb.captured_steps[1]} vs step {cb.captured_steps[0]}:\nsame graph structure;" in texts[1]
    norms = server.api("scalar/list", run=SHOWN, tag="~backward_graph/global_grad_norm")
    assert [s for _, s, _ in norms] == cb.captured_steps
    for _, step, value in norms:
        graph = BackwardGraph.from_json(step_file(log_dir / RUN, step, "json").read_text())
        assert math.isclose(value, graph.global_grad_norm(), rel_tol=1e-5), (step, value)


def test_paged_tags_keep_every_capture(tmp_path):
    """VisualDL keeps 10 samples per tag: 12 captures must span two pages, none lost."""
    log_dir = tmp_path / "vdl_log"  # shown as SHOWN
    cb = train(log_dir, every=1, epochs=3, with_paddle_visualdl=False)
    assert cb.captured_steps == list(range(1, 13)), (cb.captured_steps, cb.dropped_steps)
    with VisualDLServer(log_dir, tmp_path / "visualdl.log") as srv:
        image_tags = wait_until(lambda: srv.tags("image").get(SHOWN), 30, "our image tags")
        pages = our_pages(image_tags, PAGE_TAG)
        assert pages == ["backward_graph/from_step_000001", "backward_graph/from_step_000011"], image_tags
        assert served_steps(srv, "image", pages) == cb.captured_steps
        text_pages = our_pages(srv.tags("text")[SHOWN], SUMMARY_TAG)
        assert served_steps(srv, "text", text_pages) == cb.captured_steps
        last = srv.raw("image/image", run=SHOWN, tag=pages[1], index=1)
        assert last == expected_viewer_png(log_dir / RUN, 12)


# --------------------------------------------------------------------------
# the dashboard in headless Chromium
# --------------------------------------------------------------------------
# The full-screen viewer: its header holds `.step-slider` (a "Step" label, a
# [role=slider] and the shown step number); the viewer's <img> is a blob: URL
# in the nearest ancestor of that header holding an image.
VIEWER_JS = """() => {
  const header = document.querySelector('.step-slider');
  if (!header) return null;
  let box = header;
  while (box && !box.querySelector("img[src^='blob:']")) box = box.parentElement;
  if (!box) return null;
  const img = box.querySelector("img[src^='blob:']");
  const nums = Array.from(header.querySelectorAll(':scope > span'))
                    .map(s => s.textContent.trim()).filter(t => /^\\d+$/.test(t));
  const r = img.getBoundingClientRect();
  return {src: img.src, complete: img.complete, w: img.naturalWidth, h: img.naturalHeight,
          shown_w: r.width, shown_h: r.height, step: nums.length ? parseInt(nums[nums.length - 1]) : null};
}"""
def open_image_tab(browser, url: str):
    """A 1440x900 page on the dashboard's image tab and the first card's image (a blob: URL)."""
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.set_default_timeout(30_000)
    page.goto(url + "/app/sample/image", timeout=60_000)
    card_img = page.locator("img[src^='blob:']").first  # our card: its title is the tag
    card_img.wait_for(state="visible", timeout=60_000)
    return page, card_img


def viewer_state(page, not_src: str | None = None) -> dict | None:
    """What the open image viewer shows (``VIEWER_JS``), once its image is decoded and laid
    out on screen (and, with ``not_src``, is another image than that one); else None."""
    v = page.evaluate(VIEWER_JS)
    if (v and v["complete"] and v["w"] > 0 and v.get("shown_w", 0) > 0 and v["step"] is not None
            and v["src"] != not_src):
        return v
    return None


BLOB_BYTES_JS = """async (src) => {
  const b = new Uint8Array(await (await fetch(src)).arrayBuffer());
  let s = ''; for (let i = 0; i < b.length; i += 0x8000) s += String.fromCharCode.apply(null, b.subarray(i, i + 0x8000));
  return btoa(s);
}"""


@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Debian's Chromium at {CHROMIUM}")
def test_dashboard_viewer_in_chromium(server, trained, tmp_path):
    import base64

    sync_api = pytest.importorskip("playwright.sync_api")
    log_dir, cb = trained
    run_dir = log_dir / RUN
    shots: list[Path] = []

    def shoot(page, name: str) -> None:
        path = tmp_path / name
        page.screenshot(path=str(path))
        shots.append(path)

    viewer_ready = viewer_state

    label_px = {}

    def check_shown(page, v) -> None:
        assert v["step"] in cb.captured_steps, f"viewer shows step {v['step']}, captured {cb.captured_steps}"
        info: dict = {}
        expected = expected_viewer_png(run_dir, v["step"], info)
        assert (v["w"], v["h"]) == png_size(expected), f"step {v['step']}: {v} vs {png_size(expected)}"
        shown = base64.b64decode(page.evaluate(BLOB_BYTES_JS, v["src"]))
        assert shown == expected, f"the viewer's image is not step {v['step']}'s picture"
        # node labels as displayed: 11 pt at the drawing's dpi, times the viewer's scale
        label_px[v["step"]] = 11 * info["dpi"] / 72 * v["shown_w"] / v["w"]
        assert label_px[v["step"]] >= VIEWER_LABEL_PX, (v, info, label_px)

    with sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page, card_img = open_image_tab(browser, server.url)
            page.wait_for_function(
                "() => { const i = document.querySelector(\"img[src^='blob:']\"); return i && i.complete && i.naturalWidth > 0; }",
                timeout=30_000,
            )
            assert page.get_by_text("backward_graph/from_step_000001", exact=True).count() >= 1
            shoot(page, "dashboard_image_tab.png")

            card_img.click()
            page.locator(".step-slider [role=slider]").wait_for(state="visible")
            first = wait_until(lambda: viewer_ready(page), 30, "the viewer's image")
            assert first["step"] == cb.captured_steps[0]
            check_shown(page, first)
            shoot(page, f"viewer_step_{first['step']}.png")

            # ArrowRight on the focused slider (the viewer also listens to
            # ArrowRight on the document, so one press may move two samples)
            page.locator(".step-slider [role=slider]").focus()
            page.keyboard.press("ArrowRight")
            moved = wait_until(lambda: viewer_ready(page, not_src=first["src"]), 30, "the next step's image")
            assert moved["step"] != first["step"], (first, moved)
            assert moved["step"] > first["step"]
            check_shown(page, moved)
            shoot(page, f"viewer_step_{moved['step']}.png")

        finally:
            browser.close()
    print(f"node labels as displayed at 1440x900, px by step: {label_px}")

    TEST_OUTPUT.mkdir(exist_ok=True)
    for shot in shots:
        assert shot.stat().st_size > 10_000, f"{shot} looks empty"
        shutil.copy(shot, TEST_OUTPUT / shot.name)


@pytest.mark.browser
def test_two_experiments_under_one_logdir_are_two_runs(tmp_path):
    """exp_a/backward_graph and exp_b/backward_graph, both with the default run_name, under
    one --logdir: the dashboard lists two runs, each with its own records."""
    from paddleviz_hooks import BackwardGraphRecorder

    root = tmp_path / "logs"
    for exp in ("exp_a", "exp_b"):
        net = paddle.nn.Sequential(paddle.nn.Linear(4, 3), paddle.nn.ReLU(), paddle.nn.Linear(3, 2))
        with BackwardGraphRecorder(str(root / exp), net, every=1, verbose=0, view_max_px=300,
                                   formats=("json", "png")) as rec:
            for step in range(1, 3 if exp == "exp_a" else 4):
                with rec.step(step):
                    net(paddle.randn([2, 4])).sum().backward()
    with VisualDLServer(root, tmp_path / "visualdl.log") as srv:
        wait_until(lambda: len(srv.api("runs")) >= 2, 30, "two runs in /app/api/runs")
        runs = srv.api("runs")
        assert len(runs) == 2 and len(set(runs)) == 2, runs
        images = srv.tags("image")
        steps = {}
        for run in runs:
            assert "backward_graph/from_step_000001" in images[run], images
            steps[run] = [r["step"] for r in srv.api("image/list", run=run, tag="backward_graph/from_step_000001")]
        assert sorted(map(len, steps.values())) == [2, 3], steps
        # the Graphs tab: every capture of both experiments, each label naming its experiment
        graphs = [os.path.basename(r) for r in srv.api("graph_runs")]
        assert graphs == [f"step_{s:06d}-{exp}.backward_graph" for exp, n in (("exp_a", 2), ("exp_b", 3))
                          for s in range(1, n + 1)], graphs


# --------------------------------------------------------------------------
# VisualDL's Graphs tab: one interactive graph per capture
# --------------------------------------------------------------------------
SIDEBAR_JS = """() => {
  const props = {};
  for (const label of document.querySelectorAll('label.property-name')) {
    const value = label.parentElement.querySelector('.argument-text');
    if (value) props[label.getAttribute('title') || label.textContent.trim()] = value.textContent.trim();
  }
  return props;
}"""


def bring_into_view(page, locator, tries: int = 25) -> None:
    """Pan the graph with the mouse wheel, as a person does, until ``locator`` is on screen."""
    for _ in range(tries):
        box = locator.bounding_box()
        if box and 130 < box["y"] < 840 and 30 < box["x"] < 1100:
            return
        page.mouse.move(600, 500)
        dx = 0 if box is None or 30 < box["x"] < 1100 else box["x"] - 560
        dy = 300 if box is None else box["y"] - 480
        page.mouse.wheel(dx, dy)
        page.wait_for_timeout(250)
    raise AssertionError(f"{locator} never came into view")


def test_graphs_tab_lists_every_capture(server, trained):
    log_dir, cb = trained
    runs = server.api("graph_runs")
    labels = [f"step_{s:06d}-{log_dir.name}.{RUN}" for s in cb.captured_steps]
    assert [os.path.basename(r) for r in runs] == labels, runs
    assert all(os.path.dirname(r) == os.path.realpath(log_dir / RUN / "graphs") for r in runs), runs
    assert len(server.api("runs")) == 2, "graph folders are not scalar/image runs"


def graphs_tab_page(browser, server):
    """A 1440x900 page on the Graphs tab, its first view drawn (the ``features`` box is there)."""
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.set_default_timeout(30_000)
    page.goto(server.url + "/app/graph/dynamic_graph", timeout=60_000)
    page.frame_locator("iframe").locator("g[id='node-/features']").wait_for(timeout=60_000)
    return page


@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Debian's Chromium at {CHROMIUM}")
def test_graphs_tab_search_finds_dotted_names(server, trained, tmp_path):
    """The Graphs tab's search box finds a layer and a parameter by the dotted names used in
    every other view (``features.0``, ``features.0.weight``), not only by ``/features/0``.

    Runs before the test that opens layers: VisualDL keeps opened layers per client on the
    server, and a page that loads with layers open sometimes searches only the visible graph."""
    sync_api = pytest.importorskip("playwright.sync_api")
    found = {}
    with sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = graphs_tab_page(browser, server)
            page.wait_for_load_state("networkidle")  # the search needs the whole graph (get_all_nodes)
            box = page.get_by_placeholder("Search")
            for query, path in (("features.0", "/features/0"), ("features.0.weight", "/features/0/weight"),
                                ("fc.2.bias", "/fc/2/bias")):
                found[query] = None
                for _ in range(3):  # the box answers a debounced query: type it again if it was lost
                    box.click()
                    box.fill("")
                    box.fill(query)
                    try:
                        page.locator(f"li[title='{path}']").first.wait_for(timeout=10_000)
                        found[query] = True
                        break
                    except sync_api.TimeoutError:
                        found[query] = page.locator("li[title]").evaluate_all("els => els.map(e => e.title)")[:20]
                if query == "features.0.weight":
                    TEST_OUTPUT.mkdir(exist_ok=True)
                    (TEST_OUTPUT / "graphs_tab_search_dotted.png").write_bytes(page.screenshot())
                page.get_by_text("Cancel").first.click()
        finally:
            browser.close()
    assert all(v is True for v in found.values()), found


@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Debian's Chromium at {CHROMIUM}")
def test_graphs_tab_in_chromium(server, trained, tmp_path):
    """The Graphs tab lists each capture; "+" opens a layer; a click on a node shows its gradient."""
    sync_api = pytest.importorskip("playwright.sync_api")
    log_dir, cb = trained
    labels = [f"step_{s:06d}-{log_dir.name}.{RUN}" for s in cb.captured_steps]
    step1 = json.loads(step_file(log_dir / RUN, cb.captured_steps[0], "json").read_text())
    conv = next(n for n in step1["nodes"] if n["key"].startswith("op:features.0[0]/Conv2d#"))
    into_conv = [e["grad"] for e in step1["edges"] if e["dst"] == conv["id"]]
    assert len(into_conv) == 1
    shots = []
    with sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = graphs_tab_page(browser, server)
            graph = page.frame_locator("iframe")
            layer = graph.locator("g[id='node-/features']")
            for label in labels:  # "Choose a model": run, step (and trigger) per capture
                assert page.get_by_text(label, exact=True).is_visible(), label
            # the first view shows the top-level layers closed
            assert graph.locator("g[id^='node-/features/']").count() == 0
            shots.append(("graphs_tab_first_view.png", page.screenshot()))

            bring_into_view(page, layer)
            layer.locator(".node-item-buttons").click()  # its "+"
            sub = graph.locator("g[id='node-/features/0']")
            sub.wait_for()
            bring_into_view(page, sub)
            sub.locator(".node-item-buttons").click()
            op = graph.locator("g[id='node-/features/0/Conv2d']")
            op.wait_for()
            shots.append(("graphs_tab_layer_opened.png", page.screenshot()))

            bring_into_view(page, op)
            op.locator(".node-item-type").click()
            page.get_by_text("Node Properties").wait_for()
            page.wait_for_function(f"() => ({SIDEBAR_JS})().paddle !== undefined")
            props = page.evaluate(SIDEBAR_JS)
            shots.append(("graphs_tab_node_attributes.png", page.screenshot()))
        finally:
            browser.close()
    assert props["paddle"] == conv["name"] == "Conv2dGradNodeFinal", props
    assert props["layer"] == "features.0" and props["op"] == "Conv2d", props
    grad = into_conv[0]
    assert props["shape"] == "[" + ", ".join(map(str, grad["shape"])) + "]", props
    assert props["dtype"] == grad["dtype"], props
    for key in ("norm", "min", "max"):
        assert float(props[key]) == grad[key], (key, props[key], grad[key])
    assert props["NaN"] == str(grad["nan"]) and props["Inf"] == str(grad["inf"]), props
    TEST_OUTPUT.mkdir(exist_ok=True)
    for name, png in shots:
        assert len(png) > 10_000, f"{name} looks empty"
        (TEST_OUTPUT / name).write_bytes(png)


@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Debian's Chromium at {CHROMIUM}")
def test_scalars_page_keeps_the_users_curves_first(server):
    """The user's train/* group is first and open; ours come after it and their charts draw."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.set_default_timeout(30_000)
            page.goto(server.url + "/app/scalar", timeout=60_000)
            page.get_by_text("~grad_norm", exact=True).first.wait_for(timeout=60_000)
            page.wait_for_function("() => document.querySelectorAll('canvas').length >= 2")  # train/*
            ys = {g: page.get_by_text(g, exact=True).first.bounding_box()["y"]
                  for g in ("train", "~backward_graph", "~grad_norm")}
            assert ys["train"] < ys["~backward_graph"] < ys["~grad_norm"], ys
            charts = page.locator("canvas").count()  # chart titles and curves are drawn in canvases
            page.get_by_text("~grad_norm", exact=True).first.click()  # opens the group: fc, features
            page.wait_for_function(f"() => document.querySelectorAll('canvas').length >= {charts + 2}")
            page.wait_for_timeout(1500)
            png = page.screenshot(full_page=True)
        finally:
            browser.close()
    TEST_OUTPUT.mkdir(exist_ok=True)
    (TEST_OUTPUT / "dashboard_scalars.png").write_bytes(png)

