"""VisualDL's viewer picture at the detail its space allows, seen in Chromium on the real server.

A LeNet and a resnet18 (random weights) are captured by ``BackwardGraphRecorder`` into
a log directory each; the real ``visualdl`` server serves it, Chromium opens the image
tab and the click-to-open viewer at 1440x900, and the picture it shows is checked:

* LeNet: every op of the captured graph is in the picture (nothing collapsed), and node
  labels (11 pt) are at least ``VIEWER_LABEL_PX`` high as displayed;
* resnet18: the picture is wrapped into rows and reads like text: in its layout, found
  again from the drawn DOT with ``dot -Tplain``, every edge runs left to right on its line,
  or goes from the end of one line to the start of a line below (``test_plan.against_reading``).

Screenshots land in ``test-output/``.
"""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path

import paddle
import pytest
from paddle import nn

from paddleviz_hooks import BackwardGraph, BackwardGraphRecorder
from paddleviz_hooks.options import RecorderOptions
from paddleviz_hooks.drawworker import VIEWER_LABEL_PX, viewer_png
from paddleviz_hooks.sinks.visualdl import encode_like_visualdl, png_to_array
from paddleviz_hooks.text import every_op_elsewhere, graph_title

from _browser import CHROMIUM, launch_chromium
from test_dashboard import (BLOB_BYTES_JS, TEST_OUTPUT, VisualDLServer, open_image_tab, png_size, viewer_state,
                            wait_until)
from test_plan import against_reading

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Debian's Chromium at {CHROMIUM}"),
              pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz dot")]


def _capture(log_dir: Path, name: str) -> BackwardGraph:
    paddle.seed(0)
    if name == "lenet":
        net = paddle.vision.models.LeNet()
        x, y = paddle.randn([2, 1, 28, 28]), paddle.randint(0, 10, [2, 1])
    else:
        net = paddle.vision.models.resnet18(num_classes=10)
        x, y = paddle.randn([1, 3, 32, 32]), paddle.randint(0, 10, [1, 1])
    with BackwardGraphRecorder(str(log_dir), net, steps=[1], verbose=0, visualdl_graphs=False,
                               formats=("json", "png")) as rec:
        with rec.step(1):
            nn.functional.cross_entropy(net(x), y).backward()
    return BackwardGraph.from_json((log_dir / "backward_graph" / "step_000001.json").read_text())


def _drawn_source(graph: BackwardGraph, info: dict) -> tuple[bytes, str]:
    """The viewer picture drawn again (its plan is cached: one engine run) and the DOT it drew."""
    import paddleviz_hooks.render.plan as plan

    sources = []
    real = plan.run_engine_formats

    def spy(source, formats, **kw):
        sources.append(source)
        return real(source, formats, **kw)

    plan.run_engine_formats = spy
    try:
        # formats without svg: a collapsed picture's title points to the explorer for every op
        png = viewer_png(graph, RecorderOptions.check(), graph_title(graph), info=info,
                         full_detail=every_op_elsewhere())
    finally:
        plan.run_engine_formats = real
    return png, sources[-1]


def test_viewer_picture_detail_and_reading_order_in_chromium(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    shots: list[Path] = []
    found = {}
    for name in ("lenet", "resnet18"):
        log_dir = tmp_path / name / "vdl_log"
        graph = _capture(log_dir, name)
        info: dict = {}
        png, source = _drawn_source(graph, info)
        expected = encode_like_visualdl(png_to_array(png))
        with VisualDLServer(log_dir, tmp_path / f"{name}-visualdl.log") as server, \
                sync_api.sync_playwright() as p:
            wait_until(lambda: len(server.api("runs")) >= 1, 30, "our run listed")
            browser = launch_chromium(p)
            try:
                page, card = open_image_tab(browser, server.url)
                card.click()
                page.locator(".step-slider [role=slider]").wait_for(state="visible")

                v = wait_until(lambda: viewer_state(page), 30, "the viewer's image")
                shown = base64.b64decode(page.evaluate(BLOB_BYTES_JS, v["src"]))
                assert shown == expected, f"{name}: the viewer does not show the picture drawn for it"
                label_px = 11 * info["dpi"] / 72 * v["shown_w"] / v["w"]
                shot = tmp_path / f"viewer_detail_{name}.png"
                page.screenshot(path=str(shot))
                shots.append(shot)
            finally:
                browser.close()
        found[name] = (info, label_px, png_size(png), v["shown_w"] / v["w"])
        assert label_px >= VIEWER_LABEL_PX, (name, info, label_px)
        if name == "lenet":  # every op, nothing collapsed
            assert info["collapsed_depth"] is None and info["nodes"] == len(graph.nodes), info
            assert info["full_detail"]
        else:
            bad = against_reading(source, "LR")
            assert info["bands"] > 1 and not bad, (info, bad)
    print(f"\nviewer pictures (info, label px as shown, png size, shown scale): {found}")
    TEST_OUTPUT.mkdir(exist_ok=True)
    for shot in shots:
        shutil.copy(shot, TEST_OUTPUT / shot.name)
