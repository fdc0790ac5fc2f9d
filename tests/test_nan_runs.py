"""The two runs of issue 27, end to end: one NaN/Inf origin in every view, and in Chromium.

A small CNN with BatchNorm under ``Model.fit`` (learning rate 1e30 from step
30 on) and a tiny Transformer encoder in a hand-written loop (step 13's batch
goes through ``paddle.log`` of a negative value). The origin the recorder
stores is checked against the runs' own forward hooks (the first layer call
whose inputs are finite and outputs are not) and against the line the models
mark; then every view (``test_nan_views.assert_forward_origin``) and, in
Chromium, Model Explorer (opens on the origin), VisualDL's Graphs tab (names
it) and the report (one "starts here"). Screenshots go to ``test-output/``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from paddleviz_hooks import BackwardGraph
from paddleviz_hooks.sinks.report import build_report

from _browser import CHROMIUM, launch_chromium
from _nanruns import ENCODER_BAD_STEP, cnn_run, encoder_run, line_of
from test_nan_views import Views, assert_forward_origin

RUNS_FILE = "_nanruns.py"
TEST_OUTPUT = Path(__file__).resolve().parents[1] / "test-output"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("nanruns")
    cb, cnn_oracle = cnn_run(str(root / "cnn"))
    rec, enc_oracle = encoder_run(str(root / "enc"))
    return root, cb, cnn_oracle, rec, enc_oracle


def _bad(triggers: dict) -> int:
    return min(s for s, t in triggers.items() if t.startswith("nonfinite"))


def test_cnn_under_model_fit_names_one_origin_everywhere(runs, tmp_path):
    root, cb, oracle, _, _ = runs
    bad = _bad(cb.triggers)
    run = root / "cnn" / "backward_graph"
    g = BackwardGraph.from_json((run / f"step_{bad:06d}.json").read_text())
    o = g.nonfinite.origin
    assert bad > 30 and o.layer == oracle[bad]  # the first layer to turn finite inputs non-finite
    assert (o.op, o.layer, o.line) == ("batch_norm", "block1.1", line_of("cnn"))
    # the other BatchNorm is where the first gradient turned non-finite: a fact of its own
    assert g.nonfinite.first_gradient.layer == "block2.1"
    assert set(g.nonfinite.buffers) >= {"block1.1._variance"} and g.nonfinite.weights == ()
    v = Views(run, bad, tmp=tmp_path)
    assert_forward_origin(v, "batch_norm", "block1.1", line_of("cnn"), in_graph=True,
                          first_op=g.nonfinite.first_gradient.op, file=RUNS_FILE)
    assert "First capture" not in v.report_panel and "Changes since step 30" in v.report_panel


def test_encoder_log_of_the_batch_names_one_origin_everywhere(runs, tmp_path):
    root, _, _, rec, oracle = runs
    assert _bad(rec.triggers) == ENCODER_BAD_STEP
    run = root / "enc" / "backward_graph"
    v = Views(run, ENCODER_BAD_STEP, tmp=tmp_path)
    o = v.graph.nonfinite.origin
    assert oracle[ENCODER_BAD_STEP] == "" and o.layer == ""  # made in the model's own forward
    first = v.graph.nonfinite.first_gradient
    assert first.kind == "root"  # the loss is NaN: the model output's gradient is the first non-finite one
    assert_forward_origin(v, "log", "", line_of("encoder"), in_graph=False, first_op="the model output",
                          file=RUNS_FILE)
    # compared with step 10 (ordinary, rooted at the loss) from the model output
    assert "Changes since step 10" in v.report_panel
    assert "replayed from the model output" in v.report_panel and "ops gone" not in v.report_panel


# --------------------------------------------------------------------------
# in Chromium
# --------------------------------------------------------------------------
@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Debian's Chromium at {CHROMIUM}")
def test_one_origin_in_chromium(runs, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    from test_dashboard import VisualDLServer, bring_into_view, wait_until
    from test_explorer import _explore_cli, _stop

    root, cb, _, rec, _ = runs
    cases = [("cnn", _bad(cb.triggers), "batch_norm", "block1.1"), ("enc", ENCODER_BAD_STEP, "log", "")]
    shots: list[tuple[str, bytes]] = []
    with sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            for name, bad, op, layer in cases:
                run = root / name / "backward_graph"
                said = f"first produced by op '{op}'"
                # Model Explorer opens on the origin; the side panel names it; a search finds it
                proc, url = _explore_cli(root / name, tmp_path / f"me_{name}", tmp_path / f"me_{name}.log")
                try:
                    page = browser.new_page(viewport={"width": 1400, "height": 900})
                    page.set_default_timeout(30_000)
                    page.goto(url, timeout=60_000)
                    page.locator(".graph-selector-label").wait_for()
                    page.wait_for_function(f"() => document.body.innerText.includes({said!r})")
                    assert f"step {bad}" in page.locator(".graph-selector-label").inner_text()
                    page.wait_for_timeout(800)
                    shots.append((f"nan_{name}_explorer_opened_at_origin.png", page.screenshot()))
                    page.locator("input[placeholder*='Search']").first.fill(op)
                    page.wait_for_timeout(800)
                    shots.append((f"nan_{name}_explorer_search_{op}.png", page.screenshot()))
                    assert page.locator("mat-tree-node .node-label").filter(has_text=op).count() >= 1
                    page.close()
                finally:
                    _stop(proc)

                # VisualDL's Graphs tab: the capture's entry, its origin named in a node's type
                folder = next(f for f in os.listdir(run / "graphs") if f.startswith(f"step_{bad:06d}"))
                with VisualDLServer(root / name, tmp_path / f"vdl_{name}.log") as srv:
                    wait_until(lambda: any(r.endswith(folder) for r in srv.api("graph_runs")), 30, "graph run")
                    page = browser.new_page(viewport={"width": 1440, "height": 900})
                    page.set_default_timeout(30_000)
                    page.goto(srv.url + "/app/graph/dynamic_graph", timeout=60_000)
                    page.get_by_text(folder, exact=True).first.wait_for(timeout=60_000)
                    page.get_by_text(folder, exact=True).first.click()
                    graph = page.frame_locator("iframe")
                    path = "/" + "/".join(layer.split(".")) if layer else ""
                    target = graph.locator(f"g[id='node-{path}/{'BatchNorm' if layer else op}']")
                    if layer:  # open the boxes down to the origin's layer
                        parts = layer.split(".")
                        for i in range(1, len(parts) + 1):
                            box = graph.locator(f"g[id='node-/{'/'.join(parts[:i])}']")
                            box.wait_for(timeout=60_000)
                            bring_into_view(page, box)
                            box.locator(".node-item-buttons").click()
                    target.wait_for(timeout=60_000)
                    bring_into_view(page, target)
                    page.wait_for_timeout(500)
                    shots.append((f"nan_{name}_graphs_tab_origin.png", page.screenshot()))
                    (tmp_path / "last.png").write_bytes(shots[-1][1])
                    text = target.text_content()
                    assert "NaN/Inf starts here" in text, text
                    page.close()

                # the report: the step's panel says "starts here" once
                html = build_report(str(root / name), str(tmp_path / f"report_{name}.html"))
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.goto(Path(html).as_uri())
                page.wait_for_selector("#stage svg")
                slider = page.locator("#step-slider")
                steps = [int(x) for x in page.evaluate(
                    "() => Array.from(document.querySelectorAll('section.step-panel h2')).map(h => h.innerText)"
                    ".filter(t => t.startsWith('step ')).map(t => t.split(' ')[1])")]
                slider.focus()
                target_index = steps.index(bad)
                while int(slider.input_value()) < target_index:
                    page.keyboard.press("ArrowRight")
                panel = page.locator("section.step-panel:visible")
                assert panel.locator(".badge", has_text="starts here").count() == 1
                assert said in panel.inner_text()
                page.wait_for_timeout(500)
                shots.append((f"nan_{name}_report_panel.png", page.screenshot()))
                page.close()
        finally:
            browser.close()
    TEST_OUTPUT.mkdir(exist_ok=True)
    for fname, png in shots:
        assert len(png) > 10_000, f"{fname} looks empty"
        (TEST_OUTPUT / fname).write_bytes(png)
