"""Both gradients under 2-process data parallel, recorded in a hand-written loop.

One ``paddle.distributed.launch`` job (2 CPU ranks, gloo) trains a small MLP
wrapped in ``paddle.DataParallel`` for 3 steps, each rank on its own data,
four times from the same initial weights:

* ``plain``: no capture (the reference losses and weights);
* ``local``: before each step, a backward under ``no_sync()`` gives this
  rank's own (local) gradient norms, then the step runs as in ``plain``;
* ``synced``: a ``BackwardGraphRecorder`` captures every step;
* ``nosync``: captured, every backward under ``no_sync()``;
* ``trigger``: only ``on_nonfinite`` captures; rank 1 alone gets a NaN input
  at step 2.

Each rank writes ``result_rank<k>.json``: its losses and weights (bytes),
the float64 norms of ``param.grad`` after each backward, and its run folder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from _browser import CHROMIUM, launch_chromium
from _distkit import launch
from paddleviz_hooks import BackwardGraph, summarize
from paddleviz_hooks.render import to_dot

PARAMS = ["0.bias", "0.weight", "2.bias", "2.weight"]
STEPS = 3

WORKER = '''
import argparse, json, os
import numpy as np
import paddle
import paddle.distributed as dist
from paddleviz_hooks import BackwardGraphRecorder

STEPS = 3


def net():
    paddle.seed(0)
    return paddle.nn.Sequential(paddle.nn.Linear(6, 8), paddle.nn.Tanh(), paddle.nn.Linear(8, 3))


def batches(rank):
    rng = np.random.default_rng(10 + rank)  # each rank its own data: local gradients differ
    return [(paddle.to_tensor(rng.standard_normal((2, 6)).astype("float32")),
             paddle.to_tensor(rng.integers(0, 3, (2, 1)).astype("int64"))) for _ in range(STEPS)]


def norms(model):
    return {n[len("_layers."):]: float(np.linalg.norm(p.grad.numpy().astype("float64")))
            for n, p in model.named_parameters()}


def train(data, out=None, local_first=False, sync=True):
    model = paddle.DataParallel(net())
    rec = None if out is None else BackwardGraphRecorder(
        out, model, every=1, ranks="all", formats=["json"], visualdl=False, verbose=0)
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    losses, applied, local = [], [], []
    for step, (x, y) in enumerate(data, start=1):
        if local_first:  # this rank's own gradient: a backward under no_sync()
            with model.no_sync():
                paddle.nn.functional.cross_entropy(model(x), y).backward()
            local.append(norms(model))
            opt.clear_grad()
        ctx = rec.step(step) if rec is not None else None
        if ctx is not None:
            ctx.__enter__()
        if sync:
            loss = paddle.nn.functional.cross_entropy(model(x), y)
            loss.backward()
        else:
            with model.no_sync():
                loss = paddle.nn.functional.cross_entropy(model(x), y)
                loss.backward()
        if ctx is not None:
            ctx.__exit__(None, None, None)
        losses.append(loss.numpy().tobytes().hex())
        applied.append(norms(model))
        opt.step()
        opt.clear_grad()
    if rec is not None:
        rec.close()
    weights = {n: p.numpy().tobytes().hex() for n, p in model.named_parameters()}
    return {"losses": losses, "applied": applied, "local": local, "weights": weights,
            "run_dir": rec.run_dir if rec is not None else None}


def nan_on_rank1(out, rank):
    """Step 2 of rank 1 gets a NaN input; only the triggers may capture."""
    model = paddle.DataParallel(net())
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    rec = BackwardGraphRecorder(out, model, every=1000, capture_first=False, ranks="all", on_nonfinite=True,
                                formats=["json"], visualdl=False, verbose=0)
    for step, (x, y) in enumerate(batches(rank) + batches(rank)[:1], start=1):
        if step == 2 and rank == 1:
            x = x.numpy()
            x[0, 0] = np.nan
            x = paddle.to_tensor(x)
        with rec.step(step):
            paddle.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.clear_grad()
    rec.close()
    return {"captured": rec.captured_steps, "triggers": {str(k): v for k, v in rec.triggers.items()},
            "run_dir": rec.run_dir}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dist.init_parallel_env()
    rank = dist.get_rank()
    data = batches(rank)
    res = {"rank": rank, "plain": train(data), "local": train(data, local_first=True)}
    for case, sync in (("synced", True), ("nosync", False)):
        res[case] = train(data, os.path.join(a.out, case), sync=sync)
    res["trigger"] = nan_on_rank1(os.path.join(a.out, "trigger"), rank)
    with open(os.path.join(a.out, f"result_rank{rank}.json"), "w") as f:
        json.dump(res, f)
    print("worker done", rank, flush=True)
'''


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("dist_grads")
    out = work / "out"
    rc, seconds, report = launch(work, WORKER, "--out", str(out), timeout=240)
    assert rc == 0, report
    print(f"2-process launch: {seconds:.1f} s")
    return {r: json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)}


def graphs(res: dict, case: str) -> list[BackwardGraph]:
    d = Path(res[case]["run_dir"])
    return [BackwardGraph.from_json((d / f"step_{s:06d}.json").read_text()) for s in range(1, STEPS + 1)]


def rel_err(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("rank", [0, 1])
def test_capture_changes_nothing(results, rank):
    res = results[rank]
    assert res["synced"]["losses"] == res["plain"]["losses"]
    assert res["synced"]["weights"] == res["plain"]["weights"]
    assert res["local"]["weights"] == res["plain"]["weights"]  # the no_sync reference trained the same


@pytest.mark.parametrize("rank", [0, 1])
def test_applied_is_param_grad_and_local_is_the_ranks_own(results, rank):
    res = results[rank]
    assert Path(res["synced"]["run_dir"]).name == ("rank_1" if rank else "backward_graph")
    for step, g in enumerate(graphs(res, "synced")):
        assert g.meta["grad_sync"] == {"rank": rank, "world_size": 2, "params": 4, "changed": 4}
        applied, local = g.params(), g.params(local=True)
        assert sorted(applied) == sorted(local) == PARAMS
        for name in PARAMS:
            want_applied = res["synced"]["applied"][step][name]  # float64 norm of param.grad
            want_local = res["local"]["local"][step][name]  # the same rank's backward under no_sync()
            assert rel_err(applied[name].norm, want_applied) < 1e-5, (step, name)
            assert rel_err(local[name].norm, want_local) < 1e-5, (step, name)
            assert rel_err(applied[name].norm, want_local) > 1e-3, (step, name)  # really two numbers
        assert g.global_grad_norm() != pytest.approx(g.global_grad_norm(local=True), rel=1e-3)
        assert BackwardGraph.from_json(g.to_json()) == g


def test_applied_is_the_same_on_both_ranks(results):
    for a, b in zip(graphs(results[0], "synced"), graphs(results[1], "synced")):
        assert a.global_grad_norm() == pytest.approx(b.global_grad_norm(), rel=1e-6)
        assert a.global_grad_norm(local=True) != pytest.approx(b.global_grad_norm(local=True), rel=1e-3)


@pytest.mark.parametrize("rank", [0, 1])
def test_no_sync_records_that_applied_is_local(results, rank):
    res = results[rank]
    for step, g in enumerate(graphs(res, "nosync")):
        assert g.meta["grad_sync"] == {"rank": rank, "world_size": 2, "params": 4, "changed": 0}
        for name, m in g.params().items():
            assert m == g.params(local=True)[name]
            assert rel_err(m.norm, res["nosync"]["applied"][step][name]) < 1e-5


def test_drawing_and_summary_say_which_gradient(results):
    g = graphs(results[0], "synced")[0]
    applied, local = g.params(), g.params(local=True)
    dot = to_dot(g)
    for name in PARAMS:  # the parameter box: after all-reduce; the edge into it: what flowed, local
        assert f"all-reduced |g| {applied[name].norm:.3g}" in dot, name
        assert f"|g| {local[name].norm:.3g}" in dot, name
    text = summarize(g)
    assert f"global grad norm {g.global_grad_norm():.4g};" in text
    assert "after all-reduce over 2 ranks; rank 0's own (local) gradients: global norm" in text
    quiet = summarize(graphs(results[0], "nosync")[0])
    assert "all-reduce" not in quiet and "not synchronised" in quiet
    assert "all-reduced" not in to_dot(graphs(results[0], "nosync")[0])


def test_a_trigger_on_one_rank_captures_on_that_rank(results):
    """Rank 1's NaN loss captures its own step 2; rank 0's loss is finite, so it
    captures nothing there, but the all-reduce hands it NaN gradients: it
    captures the next step (no replay under data parallel). Nothing hangs."""
    r0, r1 = results[0]["trigger"], results[1]["trigger"]
    assert (r1["captured"], r1["triggers"]) == ([2], {"2": "nonfinite_loss"})
    assert (r0["captured"], r0["triggers"]) == ([3], {"3": "nonfinite_grad"})
    assert Path(r1["run_dir"]).name == "rank_1" and Path(r0["run_dir"]).name == "backward_graph"
    g = BackwardGraph.from_json((Path(r1["run_dir"]) / "step_000002.json").read_text())
    assert math.isnan(g.meta["loss"]) and g.meta["grad_sync"]["rank"] == 1




def _drop_last_node(path: Path) -> None:
    """A rank whose graph lost a node: what a structural difference between ranks looks like."""
    d = json.loads(path.read_text())
    last = len(d["nodes"]) - 1
    d["nodes"] = d["nodes"][:-1]
    d["edges"] = [e for e in d["edges"] if last not in (e["src"], e["dst"])]
    path.write_text(json.dumps(d))


@pytest.fixture(scope="module")
def rank_report(results, tmp_path_factory):
    import shutil

    from paddleviz_hooks.sinks.report import build_report

    log = tmp_path_factory.mktemp("rank_report") / "backward_graph"
    shutil.copytree(results[0]["synced"]["run_dir"], log)
    _drop_last_node(log / "rank_1" / "step_000002.json")
    html = Path(build_report(log, log.parent / "report.html"))
    return html, [graphs(results[r], "synced") for r in (0, 1)]


def test_report_compares_each_rank_with_rank_0(rank_report):
    html, (g0, g1) = rank_report
    text = html.read_text()
    for step in (1, 3):
        a, b = g0[step - 1], g1[step - 1]
        assert (f"Compared with rank 0 at step {step}</h3><ul class=\"facts ranks\"><li>same graph structure as rank 0"
                f"</li><li>global grad norm {b.global_grad_norm():.4g} here, {a.global_grad_norm():.4g} on rank 0</li>"
                f"<li>before all-reduce (each rank&#x27;s own data): {b.global_grad_norm(local=True):.4g} here, "
                f"{a.global_grad_norm(local=True):.4g} on rank 0</li>") in text
    assert ('<h3 class="bad ranks">Compared with rank 0 at step 2</h3><ul class="facts ranks"><li>graph structure '
            'differs from rank 0: 0 nodes only here, 1 only on rank 0') in text
    assert text.count("Compared with rank 0") == 3  # rank 0's own panels compare with nothing


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's Chromium at /usr/bin/chromium")
def test_rank_report_in_chromium(rank_report, tmp_path):
    import shutil

    from playwright.sync_api import sync_playwright

    html, _ = rank_report
    errors = []
    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(html.as_uri())
            page.wait_for_selector("#stage svg")
            options = page.locator("#run-select option").all_inner_texts()
            assert options[:2] == ["backward_graph (3 steps)", "rank_1 (3 steps)"], options
            page.select_option("#run-select", "1")
            slider = page.locator("#step-slider")
            slider.focus()
            page.keyboard.press("ArrowRight")  # step 2: the structural difference
            panel = page.locator("#panel-1-1")
            assert panel.is_visible()
            assert panel.locator("h3.bad.ranks").inner_text() == "Compared with rank 0 at step 2"
            assert "graph structure differs from rank 0" in panel.locator("ul.ranks").inner_text()
            shot = tmp_path / "report_ranks.png"
            page.screenshot(path=str(shot), full_page=True)
            out = Path(__file__).resolve().parents[1] / "test-output"
            out.mkdir(exist_ok=True)
            shutil.copy(shot, out / "report_ranks.png")
        finally:
            browser.close()
    assert errors == []


def _insert_op_after_root(path: Path, op: str) -> None:
    """Rank 1 ran one more op right after the loss: the root's gradient flows through it first."""
    d = json.loads(path.read_text())
    new = len(d["nodes"])
    d["nodes"].append({"id": new, "kind": "op", "name": f"{op}GradNode", "op": op, "layer": None, "call": 0,
                       "param": None, "shape": None, "dtype": None, "hooked": True, "note": None, "key": ""})
    first = next(e for e in d["edges"] if e["src"] == 0)
    d["edges"].append({**first, "src": new})
    first["dst"] = new
    path.write_text(json.dumps(d))


@pytest.fixture(scope="module")
def merged_report(results, tmp_path_factory):
    import shutil

    from paddleviz_hooks.sinks.report import build_report

    log = tmp_path_factory.mktemp("merged_report") / "backward_graph"
    shutil.copytree(results[0]["synced"]["run_dir"], log)
    _insert_op_after_root(log / "rank_1" / "step_000002.json", "Exp")
    html = Path(build_report(log, log.parent / "report.html"))
    return html, [graphs(results[r], "synced") for r in (0, 1)]


def test_merged_view_matches_ranks_and_flags_the_extra_op(merged_report):
    from paddleviz_hooks.ranks import compare_ranks
    from paddleviz_hooks.sinks.report import _read_graph

    html, (g0, g1) = merged_report
    log = html.parent / "backward_graph"
    for step in (1, 2, 3):
        view = compare_ranks({0: _read_graph(str(log / f"step_{step:06d}.json")),
                              1: _read_graph(str(log / "rank_1" / f"step_{step:06d}.json"))})
        for name in PARAMS:  # the records' norms, rank by rank: applied (equal) and local (differ)
            assert view.param_norms[name] == {r: g[step - 1].params()[name].norm for r, g in enumerate((g0, g1))}
            assert view.local_param_norms[name] == {
                r: g[step - 1].params(local=True)[name].norm for r, g in enumerate((g0, g1))}
        if step == 2:
            assert view.differing_ranks() == [1] and view.missing == {}
            (extra,) = view.only_on[1]
            assert extra.startswith("op:?[0]/Exp#")
            (pair,) = view.missing_edges  # the loss fed its first op directly on rank 0 only
            assert pair[0] == "root#0" and view.missing_edges[pair] == [1]
        else:
            assert not view.structure_differs and view.only_on == {}


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's Chromium at /usr/bin/chromium")
def test_merged_report_in_chromium(merged_report, tmp_path):
    import shutil

    from playwright.sync_api import sync_playwright

    from paddleviz_hooks.text import fmt_num

    html, (g0, g1) = merged_report
    errors = []
    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 950})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(html.as_uri())
            page.wait_for_selector("#stage svg")
            options = page.locator("#run-select option").all_inner_texts()
            assert options == ["backward_graph (3 steps)", "rank_1 (3 steps)",
                               "backward_graph: ranks 0, 1 merged (3 steps)"], options
            page.select_option("#run-select", "2")
            assert page.locator("#mode").inner_text() == "ranks merged"
            cells = page.locator("#strip span")
            assert [cells.nth(i).get_attribute("class").strip() for i in range(3)] == [
                "current", "ranks-differ", ""]
            # step 1, same structure: every value shown is the record's, rank by rank
            panel = page.locator("#panel-2-0")
            assert panel.locator("h3.ranks").get_attribute("class") == "same ranks"
            for css, local in (("applied", False), ("local", True)):
                for name in PARAMS:
                    row = panel.locator(f"table.{css} tr", has=page.locator(f"td:text-is('{name}')"))
                    shown = row.locator("td.num").all_inner_texts()
                    assert shown == [fmt_num(g[0].params(local=local)[name].norm, 4) for g in (g0, g1)], (css, name)
            labels = page.eval_on_selector_all("#stage svg g.edge text", "els => els.map(e => e.textContent)")
            for name in PARAMS:  # the edge into each parameter: each rank's own gradient
                want = f"|g| r0 {fmt_num(g0[0].params(local=True)[name].norm)} / r1 {fmt_num(g1[0].params(local=True)[name].norm)}"
                assert want in labels, (name, labels)
            assert page.locator("#stage svg .pvh-rank-only, #stage svg .pvh-rank-differs").count() == 0
            # step 2: rank 1 ran one more op; it is drawn only-on-rank-1 and named in the panel
            page.keyboard.press("ArrowRight")
            panel = page.locator("#panel-2-1")
            assert panel.is_visible() and panel.locator("h3.ranks").get_attribute("class") == "bad ranks"
            assert "graph structure of rank 1 differs from rank 0: 1 node only on rank 1" in panel.inner_text()
            assert panel.locator("ul.nodes.ranks li").all_inner_texts()[0].startswith("only on rank 1 Exp")
            only = page.locator("#stage svg g.node.pvh-rank-only")
            assert only.count() == 1 and "only on rank 1" in only.text_content()
            assert page.locator("#mode").inner_text() == "ranks merged"
            shot = tmp_path / "report_ranks_merged.png"
            page.screenshot(path=str(shot))
            out = Path(__file__).resolve().parents[1] / "test-output"
            out.mkdir(exist_ok=True)
            shutil.copy(shot, out / "report_ranks_merged.png")
            # each rank's own drawing of the step, side by side
            assert page.locator("#side-label").is_visible()
            page.check("#side")
            figures = page.locator("#stage .side-by-side figure")
            assert figures.locator("figcaption").all_inner_texts() == ["rank 0", "rank 1"]
            assert figures.nth(0).locator("svg").count() == 1 and figures.nth(1).locator("svg").count() == 1
            assert "Exp" not in figures.nth(0).text_content() and "Exp" in figures.nth(1).text_content()
            page.screenshot(path=str(tmp_path / "side.png"))
            shutil.copy(tmp_path / "side.png", out / "report_ranks_side.png")
            page.select_option("#run-select", "0")  # an ordinary run has no side-by-side view
            assert not page.locator("#side-label").is_visible()
            assert page.locator("#stage > svg").count() == 1
        finally:
            browser.close()
    assert errors == []
