"""The self-contained HTML report, built from real captures and opened in Chromium."""

from __future__ import annotations

import pathlib
import json
import math
import os
import re
import shutil

import paddle
import pytest

from paddleviz_hooks import capture_backward
from paddleviz_hooks.diff import diff_graphs
from paddleviz_hooks.sinks.report import ReportError, build_report, find_step_files
from paddleviz_hooks.render.engine import find_engine
from paddleviz_hooks import render_to_file
from _browser import CHROMIUM, launch_chromium

F = paddle.nn.functional
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVIL = 'fc1</script><img src=x onerror="window.__pwned=1">'
STEPS = 12
CHANGED = 6  # the extra block runs at this step only
NAN_AT = 9

pytestmark = pytest.mark.skipif(find_engine() is None, reason="no Graphviz layout engine installed")


class Block(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = paddle.nn.Linear(8, 8)

    def forward(self, x, shift):
        return paddle.sqrt(F.relu(self.fc(x)) + 1.0 - shift)


class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = paddle.nn.Linear(4, 8)
        self.block = Block()
        self.extra = paddle.nn.Linear(8, 8)
        self.head = paddle.nn.Linear(8, 2)

    def forward(self, x, step):
        h = F.relu(self.fc1(x))
        h = self.block(h, 1000.0 if step == NAN_AT else 0.0)
        if step == CHANGED:
            h = self.extra(h)
        return self.head(h)


def _rename_layer(g, old: str, new: str):
    for n in g.nodes:
        if n.layer == old:
            n.layer = new
        if n.param and n.param.startswith(old + "."):
            n.param = new + n.param[len(old):]
    g.layers = {(new if k == old else k): v for k, v in g.layers.items()}
    g.assign_keys()
    return g


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """LOG_DIR with a 12-step run and a small hostile run, and the report built from it."""
    root = tmp_path_factory.mktemp("report")
    log = root / "log"
    main_dir = log / "backward_graphs"
    other_dir = log / "other" / "backward_graphs"
    main_dir.mkdir(parents=True)
    other_dir.mkdir(parents=True)
    paddle.seed(2)
    model = Net()
    with capture_backward(model) as cap:
        for step in range(STEPS):
            x = paddle.randn([3, 4])
            model(x, step).mean().backward()
            model.clear_gradients()
    for i, g in enumerate(cap.graphs):
        g.meta["step"] = i * 10
        (main_dir / f"step_{i * 10:06d}.json").write_text(g.to_json())
        if i % 4 == 0:  # some steps come with their SVG, the others are drawn by the report
            render_to_file(g, str(main_dir / f"step_{i * 10:06d}.svg"))
    # the callback also saves diffs next to the graphs: not steps, skipped silently
    (main_dir / f"step_{CHANGED * 10:06d}_diff.json").write_text(
        diff_graphs(cap.graphs[CHANGED - 1], cap.graphs[CHANGED]).to_json())
    # the second run: names that try to break out of HTML, a foreign file and a hostile SVG
    for i in range(2):
        g = _rename_layer(type(cap.graphs[i]).from_json(cap.graphs[i].to_json()), "fc1", EVIL)
        (other_dir / f"step_{i:06d}.json").write_text(g.to_json())
    (other_dir / "step_000000.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg" onload="window.__pwned=2"></svg>')
    (other_dir / "step_000999.json").write_text(json.dumps({"hello": "world"}))
    out = root / "report.html"
    assert build_report(str(log), str(out)) == str(out)
    return {"root": root, "log": log, "html": out, "graphs": cap.graphs}


def _data(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="pvh-data">(.*?)</script>', html, re.S)
    return json.loads(m.group(1))


def test_report_file_is_self_contained(report):
    html = report["html"].read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I)  # nothing fetched
    assert "<link" not in html and "@import" not in html
    assert html.count("</script>") == 2  # the data block cannot end early
    assert "<img src=x" not in html and "fc1&lt;/script&gt;&lt;img src=x" in html
    data = _data(html)
    assert [len(r["steps"]) for r in data["runs"]] == [STEPS, 2]
    steps = data["runs"][0]["steps"]
    assert [s["step"] for s in steps] == [i * 10 for i in range(STEPS)]
    assert all(s["svg"] is not None for s in steps)  # drawn from JSON where no .svg was saved
    assert [i for i, s in enumerate(steps) if s["changed"]] == [CHANGED, CHANGED + 1]
    assert [i for i, s in enumerate(steps) if s["nonfinite"]] == [NAN_AT]
    assert steps[CHANGED]["diff"] is not None and steps[NAN_AT]["diff"] is not None
    assert "pvh-added" in data["svgs"][steps[CHANGED]["diff"]].replace("&#45;", "-")
    assert "onload" not in data["svgs"][data["runs"][1]["steps"][0]["svg"]]  # hostile SVG replaced
    assert "step_000999.json" in html and "Skipped files" in html
    assert "_diff.json" not in html
    assert oct(os.stat(report["html"]).st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_find_step_files_groups_by_folder(report):
    groups = find_step_files(str(report["log"]))
    assert [(os.path.relpath(d, report["log"]), s) for d, s in groups] == [
        ("backward_graphs", ""), ("backward_graphs", "diff"), (os.path.join("other", "backward_graphs"), "")]
    assert [n for n, _ in groups[(str(report["log"] / "backward_graphs"), "")]] == [i * 10 for i in range(STEPS)]


def test_report_errors(tmp_path):
    with pytest.raises(ReportError, match="no step_"):
        build_report(str(tmp_path), str(tmp_path / "r.html"))
    (tmp_path / "step_000001.json").write_text("{}")
    with pytest.raises(ReportError, match="no readable step_"):
        build_report(str(tmp_path), str(tmp_path / "r.html"))
    with pytest.raises(NotADirectoryError):
        build_report(str(tmp_path / "nope"), str(tmp_path / "r.html"))


@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's Chromium at /usr/bin/chromium")
def test_report_in_chromium(report, tmp_path):
    from playwright.sync_api import sync_playwright

    url = report["html"].as_uri()
    requests, errors, dialogs = [], [], []
    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("request", lambda r: requests.append(r.url))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.goto(url)
            page.wait_for_selector("#stage svg")
            slider = page.locator("#step-slider")
            label = page.locator("#step-label")
            stage = page.locator("#stage")

            # every captured step is on the slider, not 10 of them
            assert slider.get_attribute("max") == str(STEPS - 1)
            assert label.inner_text().startswith("step 0 ")
            first = stage.inner_html()
            slider.focus()
            page.keyboard.press("ArrowRight")
            assert label.inner_text().startswith("step 10 ")
            assert stage.inner_html() != first

            def go(index: int) -> None:
                slider.focus()
                while int(slider.input_value()) < index:
                    page.keyboard.press("ArrowRight")
                while int(slider.input_value()) > index:
                    page.keyboard.press("ArrowLeft")
                assert label.inner_text().startswith(f"step {index * 10} ")

            # the diff is highlighted where the structure changed, and only there
            go(3)
            assert stage.locator(".pvh-added").count() == 0
            assert stage.locator(".pvh-removed").count() == 0
            go(CHANGED)
            assert stage.locator("g.node.pvh-added").count() == 4  # Matmul, Add, weight, bias
            assert stage.locator("g.edge.pvh-added").count() == 5
            assert page.locator("#mode").inner_text() == f"structure changed since step {(CHANGED - 1) * 10}"
            panel = page.locator(f"#panel-0-{CHANGED}")
            assert panel.is_visible() and panel.locator(".badge.added").count() == 4
            page.locator("#highlight").uncheck()
            assert stage.locator(".pvh-added").count() == 0
            page.locator("#highlight").check()
            assert stage.locator("g.node.pvh-added").count() == 4
            go(CHANGED + 1)
            assert stage.locator("g.node.pvh-removed").count() == 4
            ghosts = stage.locator("g.node.pvh-removed").evaluate_all("els => els.map(e => e.textContent)")
            assert any(re.search(r"Matmul\s+in extra\s+\(removed\)", t) for t in ghosts), ghosts  # named by op and layer

            # the keyboard still steps after any control was used
            for control in ("#highlight", "#norms", "#fit", "#prev"):
                before = label.inner_text()
                page.locator(control).click()
                if control in ("#highlight", "#norms"):
                    page.locator(control).click()  # back as it was
                before = label.inner_text()
                page.keyboard.press("ArrowRight")
                assert label.inner_text() != before, f"ArrowRight after using {control}"
            go(NAN_AT)

            # NaN/Inf sites are listed, origin first
            go(NAN_AT)
            nan_panel = page.locator(f"#panel-0-{NAN_AT}")
            sites = nan_panel.locator("ol.sites li")
            assert sites.count() >= 5
            assert "first non-finite gradient" in sites.first.inner_text() and "Sqrt in block" in sites.first.inner_text()
            assert "step 90" in page.locator("#overview-0").inner_text()

            # per-layer gradient norm chart with a marker on the current step
            chart = page.locator("#chart-0")
            assert chart.is_visible() and chart.locator("svg path").count() >= 3
            assert float(chart.locator("#marker-0").get_attribute("x1")) == steps_x(NAN_AT)

            # pan and zoom
            def transform() -> str:
                return page.eval_on_selector("#stage", "e => e.style.transform")

            box = page.locator("#viewport").bounding_box()
            cx, cy = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
            before = transform()
            page.mouse.move(cx, cy)
            page.mouse.wheel(0, -400)
            page.wait_for_function("t => document.getElementById('stage').style.transform !== t", arg=before)
            zoomed = transform()
            assert _scale(zoomed) > _scale(before)
            page.mouse.down()
            page.mouse.move(cx + 120, cy + 60, steps=4)
            page.mouse.up()
            assert transform() != zoomed and _scale(transform()) == _scale(zoomed)
            page.locator("#fit").click()  # the whole drawing
            fitted = _scale(transform())
            assert fitted < _scale(zoomed)
            page.keyboard.press("a")  # back to the automatic view, which follows the steps

            go(CHANGED)
            shot = tmp_path / "report.png"
            page.screenshot(path=str(shot))
            os.makedirs(os.path.join(REPO, "test-output"), exist_ok=True)
            shutil.copy(shot, os.path.join(REPO, "test-output", "report.png"))

            # the second run: hostile names shown as text, never run
            page.select_option("#run-select", "1")
            assert slider.get_attribute("max") == "1"
            assert EVIL in page.locator("#panel-1-0").inner_text() or EVIL in page.locator("#stage").inner_text()
            assert page.evaluate("window.__pwned") is None
            assert page.locator("img").count() == 0
            assert "step_000999.json" in page.locator("aside").inner_text()
            network = list(requests)

            # defence in depth: the page's CSP blocks inline handlers even if markup got in
            console = []
            page.on("console", lambda m: console.append(m.text))
            page.evaluate("""document.getElementById('stage').insertAdjacentHTML(
                'beforeend', '<img src="data:," onerror="window.__pwned=3" onload="window.__pwned=4">')""")
            page.wait_for_timeout(200)
            assert page.evaluate("window.__pwned") is None
            assert any("Content Security Policy" in m for m in console), console
        finally:
            browser.close()
    assert errors == [] and dialogs == []
    assert network and network[0] == url
    assert all(r == url or r.startswith(("data:", "blob:")) for r in network), network


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's Chromium at /usr/bin/chromium")
def test_report_colours_gradient_norm_changes_only_when_asked(tmp_path):
    """Two captures of one structure whose gradients grew x1000: by default the second shows
    the plain graph; "colour gradient-norm changes" shows the diff with coloured edges."""
    from playwright.sync_api import sync_playwright

    run = tmp_path / "log" / "backward_graph"
    run.mkdir(parents=True)
    paddle.seed(0)
    net = paddle.nn.Sequential(paddle.nn.Linear(4, 3), paddle.nn.Tanh(), paddle.nn.Linear(3, 2))
    x = paddle.randn([2, 4])
    with capture_backward(net) as cap:
        for scale in (1.0, 1000.0):
            (net(x).sum() * scale).backward()
    for step, g in zip((1, 2), cap.graphs):
        g.meta["step"] = step
        (run / f"step_{step:06d}.json").write_text(g.to_json())
    out = tmp_path / "report.html"
    build_report(str(tmp_path / "log"), str(out))
    ratio = "g.edge.pvh-ratio-up, g.edge.pvh-ratio-down"
    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(out.as_uri())
            page.wait_for_selector("#stage svg")
            page.keyboard.press("ArrowRight")
            assert page.locator("#step-label").inner_text().startswith("step 2 ")
            stage = page.locator("#stage")
            assert page.locator("#mode").inner_text() == "graph" and stage.locator(ratio).count() == 0
            page.locator("#norms").check()
            assert page.locator("#mode").inner_text() == "changes since step 1"
            assert stage.locator(ratio).count() > 0
            colour = "e => getComputedStyle(e.querySelector('path')).stroke"
            assert stage.locator(ratio).first.evaluate(colour) == "rgb(217, 72, 15)"  # orange: up
            page.locator("#norms").uncheck()
            assert stage.locator(ratio).count() == 0
            page.keyboard.press("ArrowLeft")  # the checkbox gave the keyboard back
            assert page.locator("#step-label").inner_text().startswith("step 1 ")
        finally:
            browser.close()


class _Grows(paddle.nn.Layer):
    """fc1 -> tanh -> (extra, when asked) -> fc2."""

    def __init__(self):
        super().__init__()
        self.fc1, self.extra, self.fc2 = paddle.nn.Linear(4, 3), paddle.nn.Linear(3, 3), paddle.nn.Linear(3, 2)

    def forward(self, x, extra):
        h = F.tanh(self.fc1(x))
        return self.fc2(self.extra(h) if extra else h)


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's Chromium at /usr/bin/chromium")
def test_report_hides_the_norm_legend_with_the_norm_colours(tmp_path):
    """A structure change whose gradients also grew x1000: the diff shown by default (norm
    colouring off) has no visible legend of norm colours; "colour gradient-norm changes" shows it."""
    from playwright.sync_api import sync_playwright

    run = tmp_path / "log" / "backward_graph"
    run.mkdir(parents=True)
    paddle.seed(0)
    net = _Grows()
    x = paddle.randn([2, 4])
    with capture_backward(net) as cap:
        for extra, scale in ((False, 1.0), (True, 1000.0)):
            (net(x, extra).sum() * scale).backward()
    for step, g in zip((1, 2), cap.graphs):
        g.meta["step"] = step
        (run / f"step_{step:06d}.json").write_text(g.to_json())
    out = tmp_path / "report.html"
    build_report(str(tmp_path / "log"), str(out))
    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(out.as_uri())
            page.wait_for_selector("#stage svg")
            page.keyboard.press("ArrowRight")
            assert page.locator("#mode").inner_text() == "structure changed since step 1"
            legend = page.locator("#stage g.node.pvh-norm-legend")
            assert legend.count() == 1 and not legend.is_visible()
            assert page.locator("#stage g.node.pvh-added").count() > 0
            os.makedirs(os.path.join(REPO, "test-output"), exist_ok=True)
            page.keyboard.press("f")  # the whole drawing, legends included
            page.screenshot(path=os.path.join(REPO, "test-output", "report_norm_legend_off.png"))
            page.locator("#norms").check()
            assert legend.is_visible() and "grad norm up over 10x" in legend.text_content()
            page.screenshot(path=os.path.join(REPO, "test-output", "report_norm_legend_on.png"))
        finally:
            browser.close()


def steps_x(i: int) -> float:
    """Where step index ``i`` of ``STEPS`` sits on the 360 px chart: its plot area runs
    from x=44 to x=352 (left axis labels, right margin), steps evenly spread."""
    return round(44 + (352 - 44) * i / (STEPS - 1), 1)


def _scale(transform: str) -> float:
    return float(re.search(r"scale\(([0-9.e+-]+)\)", transform).group(1))


def test_page_inlines_the_asset_files_and_its_csp_allows_exactly_that_script(tmp_path):
    """The page, CSS and JS ship as package files; the written page is still self-contained."""
    import base64
    import hashlib
    from importlib import resources

    log = tmp_path / "log"
    log.mkdir()
    net = paddle.nn.Linear(3, 2)
    with capture_backward(net) as cap:
        net(paddle.randn([2, 3])).sum().backward()
    (log / "step_000001.json").write_text(cap.graph.to_json())
    out = build_report(str(log), str(tmp_path / "r.html"))
    page = pathlib.Path(out).read_text(encoding="utf-8")
    assets = resources.files("paddleviz_hooks.sinks").joinpath("report_assets")
    css = assets.joinpath("report.css").read_text("utf-8")
    js = assets.joinpath("report.js").read_text("utf-8")
    assert f"<style>{css}</style>" in page and f"<script>{js}</script>" in page
    digest = base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode("ascii")
    assert f"script-src 'sha256-{digest}'" in page
    assert "$" + "script" not in page and "$" + "data" not in page  # every placeholder filled



def test_a_steps_micro_batches_are_backwards_of_one_step_not_runs(tmp_path):
    """step_N_b2.json (the second micro-batch) is the same step's second backward, compared with
    the second backward of the step before; the page has one run."""
    from paddleviz_hooks import BackwardGraphRecorder

    paddle.seed(0)
    net = paddle.nn.Sequential(paddle.nn.Linear(4, 3), paddle.nn.Tanh(), paddle.nn.Linear(3, 2))
    with BackwardGraphRecorder(str(tmp_path / "log"), net, every=1, verbose=0, formats=("json",),
                               visualdl=False) as rec:
        for step in (1, 2):
            with rec.step(step, micro_batches=2):
                for _ in range(2):
                    net(paddle.randn([2, 4])).sum().backward()
    run = tmp_path / "log" / "backward_graph"
    assert sorted(p.name for p in run.glob("*.json")) == [
        "step_000001.json", "step_000001_b2.json", "step_000002.json", "step_000002_b2.json"]
    out = tmp_path / "report.html"
    build_report(str(tmp_path / "log"), str(out))
    html = out.read_text()
    data = json.loads(re.search(r'<script type="application/json" id="pvh-data">(.*?)</script>', html, re.S).group(1))
    assert len(data["runs"]) == 1 and 'id="run-select"' not in html and "[b2]" not in html
    steps = [(s["step"], s["role"], s["since"]) for s in data["runs"][0]["steps"]]
    assert steps == [
        (1, "micro-batch 1 of 2", None), (1, "micro-batch 2 of 2", None),
        (2, "micro-batch 1 of 2", "step 1 - micro-batch 1 of 2"),
        (2, "micro-batch 2 of 2", "step 1 - micro-batch 2 of 2")]
    assert "<h2>step 1 - micro-batch 2 of 2</h2>" in html
    assert "Changes since step 1 - micro-batch 2 of 2</h3>" in html
    assert "2 captured steps (4 backwards) in 1 run" in html


# ------------------------------------------------ gradients where a user points
_WORDS = {"nan": "NaN", "inf": "Inf", "-inf": "-Inf"}  # how the JSON writes a non-finite number


def _num(v) -> str:
    """A number of a step's JSON as the tooltips must show it: the JSON's own digits."""
    return _WORDS[v] if isinstance(v, str) else repr(float(v))


def _grad_text(grad: dict) -> str:
    """The numbers of one gradient of the JSON, as the hover text lists them."""
    shape = "[" + ", ".join(str(s) for s in grad["shape"]) + "]"
    return (f"{shape} {grad['dtype']} | norm {_num(grad['norm'])} | min {_num(grad['min'])}, "
            f"max {_num(grad['max'])} | NaN {grad['nan']}, Inf {grad['inf']}")


def _titles(svg: str) -> list[str]:
    import html as _html
    return [_html.unescape(t) for t in re.findall(r'xlink:title="([^"]*)"', svg)]


def test_tooltips_give_each_gradient_as_the_json_has_it(report):
    """Every parameter's tooltip (and so its click panel) has the gradient this backward added to it,
    every edge's the gradient on it, every op with one incoming edge the gradient it received: shape,
    dtype, norm, min, max, NaN, Inf with the very digits of the step's JSON, NaN step included."""
    from paddleviz_hooks.text import describe_node
    from paddleviz_hooks.graph import BackwardGraph

    html = report["html"].read_text()
    data = _data(html)
    steps = data["runs"][0]["steps"]
    for k in (0, 1, NAN_AT):  # step 0's SVG was saved with the JSON, the others drawn by the report
        text = (report["log"] / "backward_graphs" / f"step_{k * 10:06d}.json").read_text()
        d = json.loads(text)  # the numbers as written
        titles = _titles(data["svgs"][steps[k]["svg"]])
        nodes = {n.id: n for n in BackwardGraph.from_json(text).nodes}  # the nodes, to name the ends
        ins: dict[int, list] = {}
        for e in d["edges"]:
            ins.setdefault(e["dst"], []).append(e)
        checked = nonfinite = 0
        for n in d["nodes"]:
            tips = [t for t in titles if re.search(f"\\| key: {re.escape(n['key'])}( \\||$)", t)]
            assert len(tips) == 1, (n["key"], tips)
            if n["kind"] == "param":
                assert f"gradient added to param.grad {_grad_text(n['grad'])}" in tips[0], (tips[0], n["grad"])
                checked += 1
                nonfinite += n["grad"]["nan"] + n["grad"]["inf"]
            elif n["kind"] == "op" and len(ins.get(n["id"], [])) == 1 and not n.get("received"):
                grad = ins[n["id"]][0]["grad"]
                if grad is not None and grad.get("norm") is not None:
                    assert f"gradient received {_grad_text(grad)}" in tips[0], (tips[0], grad)
                    checked += 1
        edge_tips = [t for t in titles if " -> " in t.split(" | ")[0]]
        assert len(edge_tips) == len(d["edges"])
        for e in d["edges"]:
            ends = f"{describe_node(nodes[e['src']])} -> {describe_node(nodes[e['dst']])}"
            if e["grad"] is not None and e["grad"].get("norm") is not None:
                assert f"{ends} | gradient {_grad_text(e['grad'])}" in edge_tips, (ends, e["grad"])
            else:
                assert any(t.startswith(ends + " | ") and "not observed" in t for t in edge_tips), ends
        assert checked >= 8
        assert (nonfinite > 0) == (k == NAN_AT)


@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's Chromium at /usr/bin/chromium")
def test_a_click_shows_the_gradient_and_the_chart_reads(report):
    """A click on a parameter lists its gradient's numbers as the JSON has them; a click on an edge
    its ends and its gradient; a hostile layer name in the panel stays text. The chart has its axes
    titled, a labelled tick at each power of ten, a marked point per capture whose hover text is its
    layer, step and value."""
    from playwright.sync_api import sync_playwright

    d = json.loads((report["log"] / "backward_graphs" / "step_000000.json").read_text())
    bias = next(n for n in d["nodes"] if n.get("param") == "head.bias")
    first_edge = d["edges"][0]
    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(report["html"].as_uri())
            page.wait_for_selector("#stage svg")
            page.keyboard.press("f")
            node = page.locator("#stage g.node").filter(has_text="head.bias").first
            node.click()
            lines = page.locator("#node-info-lines li").all_inner_texts()
            assert page.locator("#node-info-head").inner_text() == "Clicked node"
            assert lines[:2] == ["GradNodeAccumulation", "key: param:head.bias"], lines
            g = bias["grad"]
            assert lines[2:6] == [f"gradient added to param.grad [2] {g['dtype']}", f"norm {_num(g['norm'])}",
                                  f"min {_num(g['min'])}, max {_num(g['max'])}", f"NaN {g['nan']}, Inf {g['inf']}"]
            # an edge: its label is part of it, a click there lists it
            edge = page.locator("#stage g.edge").first
            edge.locator("text").first.click()
            assert page.locator("#node-info-head").inner_text() == "Clicked edge"
            lines = page.locator("#node-info-lines li").all_inner_texts()
            assert lines[0] == "loss -> Mean outside the model", lines
            assert " | ".join(lines[1:]) == "gradient " + _grad_text(first_edge["grad"]), lines

            chart = page.locator("#chart-0 svg")
            axes = chart.locator("text.axis").all_text_contents()
            assert axes == ["gradient L2 norm, log scale", "training step"]
            y_ticks = chart.locator("text.tick.y").all_text_contents()
            # round values only (1, 2 and 5 times a power of ten), placed on a log scale
            assert len(y_ticks) >= 2 and all(re.fullmatch(r"[125](e-\d+)?|0\.0*[125]|[125]0*", v) for v in y_ticks), y_ticks
            ys = [float(v) for v in chart.locator("text.tick.y").evaluate_all("els => els.map(e => e.getAttribute('y'))")]
            vals = [float(v) for v in y_ticks]
            per_decade = [(ys[0] - y) / math.log10(v / vals[0]) for v, y in zip(vals[1:], ys[1:])]
            assert all(abs(p - per_decade[0]) < 0.2 for p in per_decade), (vals, ys)
            x_labels = chart.locator("text.tick.x").all_text_contents()
            assert x_labels[0] == "0" and x_labels[-1] == str((STEPS - 1) * 10) and len(x_labels) <= 7, x_labels
            points = chart.locator("circle.point")
            tips = points.evaluate_all("els => els.map(e => e.querySelector('title').textContent)")
            assert len(tips) >= 3 * STEPS - 3
            graphs = report["graphs"]
            layer, step_i = "head", 3
            want = graphs[step_i].layer_grad_norms(1)[layer]
            assert f"{layer} | step {step_i * 10} | gradient L2 norm {want!r}" in tips, tips[:5]

            page.select_option("#run-select", "1")  # hostile layer names: shown as text
            page.keyboard.press("f")
            title = "g => g.querySelector('a').getAttributeNS('http://www.w3.org/1999/xlink', 'title')"
            for kind in ("node", "edge"):  # one of each whose hover text names the hostile layer
                items = page.locator(f"#stage g.{kind}")
                hit = next(i for i in range(items.count()) if EVIL in (items.nth(i).evaluate(title) or ""))
                items.nth(hit).locator("text").first.click()
                assert page.locator("#node-info-head").inner_text() == f"Clicked {kind}"
                assert any(EVIL in li for li in page.locator("#node-info-lines li").all_inner_texts())
            assert page.evaluate("window.__pwned") is None and page.locator("img").count() == 0
        finally:
            browser.close()
    assert errors == []


def test_the_chart_names_true_steps_and_each_backward_of_a_step(tmp_path):
    """Three steps of two micro-batches: six points a layer, under three step labels (not "step 6"),
    each point's hover text naming its micro-batch and the layer's norm in that capture."""
    from paddleviz_hooks import BackwardGraphRecorder
    from paddleviz_hooks.graph import BackwardGraph

    paddle.seed(0)
    net = paddle.nn.Sequential(paddle.nn.Linear(4, 3), paddle.nn.Tanh(), paddle.nn.Linear(3, 2))
    with BackwardGraphRecorder(str(tmp_path / "log"), net, every=1, verbose=0, formats=("json",),
                               visualdl=False) as rec:
        for step in (1, 2, 3):
            with rec.step(step, micro_batches=2):
                for _ in range(2):
                    net(paddle.randn([2, 4])).sum().backward()
    out = tmp_path / "report.html"
    build_report(str(tmp_path / "log"), str(out))
    chart = re.search(r'<div id="chart-0" hidden>(.*?)</div>', out.read_text(), re.S).group(1)
    assert "step 6" not in chart and "step 4" not in chart
    assert re.findall(r'<text [^>]*class="tick x">([^<]*)</text>', chart) == ["1", "2", "3"]
    assert 'class="axis">gradient L2 norm, log scale</text>' in chart and 'class="axis">training step</text>' in chart
    tips = re.findall(r'<circle class="point"[^>]*><title>([^<]*)</title>', chart)
    assert len(tips) == 2 * 6  # two layers, six captures
    run = tmp_path / "log" / "backward_graph"
    for step in (1, 2, 3):
        for mb, suffix in ((1, ""), (2, "_b2")):
            g = BackwardGraph.from_json((run / f"step_{step:06d}{suffix}.json").read_text())
            for layer, v in g.layer_grad_norms(1).items():
                assert f"{layer} | step {step} - micro-batch {mb} of 2 | gradient L2 norm {v!r}" in tips, tips
