"""BackwardGraphCallback under 2-process CPU data parallel (gloo).

One ``python -m paddle.distributed.launch --nproc_per_node 2`` job runs three
short ``paddle.Model.fit`` trainings, each into its own log directory:

* ``default``: ``ranks`` left at its default (0): only rank 0 writes, into
  ``LOG_DIR/backward_graph``; there is no ``rank_1`` folder.
* ``all``: ``ranks="all"``: rank 1 writes into ``backward_graph/rank_1``.
* ``all_dp``: ``ranks="all"`` with the network itself wrapped in
  ``paddle.DataParallel``, so its parameters really are named
  ``_layers.conv.weight`` ...; the captured graphs must name them without the
  ``_layers.`` prefix.

Each rank also writes ``result_rank<k>.json`` (its captured steps and the
network's parameter names) for the assertions here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from paddleviz_hooks import BackwardGraph

from _distkit import launch, tail

RUN = "backward_graph"
STEPS_PER_RANK = 4  # 64 samples, 2 ranks, batch 8
EXPECTED_STEPS = [1, 2, 4]  # capture_first + every=2

WORKER = textwrap.dedent(
    """
    import argparse, json, os
    import numpy as np
    import paddle
    import paddle.distributed as dist
    from paddleviz_hooks import BackwardGraphCallback


    class Net(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.conv = paddle.nn.Conv2D(1, 4, 3, padding=1)
            self.pool = paddle.nn.MaxPool2D(2, 2)
            self.fc = paddle.nn.Linear(4 * 7 * 7, 10)

        def forward(self, x):
            x = self.pool(paddle.nn.functional.relu(self.conv(x)))
            return self.fc(paddle.flatten(x, 1))


    class Data(paddle.io.Dataset):
        def __init__(self, n):
            rng = np.random.default_rng(0)
            self.y = rng.integers(0, 10, size=n).astype("int64")
            self.x = rng.standard_normal((n, 1, 14, 14)).astype("float32")

        def __getitem__(self, i):
            return self.x[i], self.y[i : i + 1]

        def __len__(self):
            return len(self.y)


    def fit(out, ranks, wrap, record=True):
        paddle.seed(0)
        net = Net()
        if wrap:
            # the user wrapped the network: its parameters are named "_layers.*"
            net = paddle.DataParallel(net)
        model = paddle.Model(
            net,
            inputs=[paddle.static.InputSpec([None, 1, 14, 14], "float32", "x")],
            labels=[paddle.static.InputSpec([None, 1], "int64", "label")],
        )
        model.prepare(paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters()),
                      paddle.nn.CrossEntropyLoss())
        kwargs = {} if ranks is None else {"ranks": ranks}
        cb = BackwardGraphCallback(out, every=2, verbose=0, **kwargs)
        model.fit(Data(64), epochs=1, batch_size=8, callbacks=[cb] if record else [], verbose=0, shuffle=False)
        rank = dist.get_rank()
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"result_rank{rank}.json"), "w") as f:
            json.dump({
                "rank": rank,
                "world_size": dist.get_world_size(),
                "captured_steps": cb.captured_steps,
                "dropped_steps": cb.dropped_steps,
                "run_dir": cb.run_dir,
                "network_type": type(model.network).__name__,
                "param_names": [n for n, _ in model.network.named_parameters()],
                "weights": {n: p.numpy().tobytes().hex() for n, p in model.network.named_parameters()},
            }, f)


    if __name__ == "__main__":
        p = argparse.ArgumentParser()
        p.add_argument("--out", required=True)
        a = p.parse_args()
        dist.init_parallel_env()  # before any paddle.DataParallel
        fit(os.path.join(a.out, "default"), None, wrap=False)
        fit(os.path.join(a.out, "all"), "all", wrap=False)
        fit(os.path.join(a.out, "all_dp"), "all", wrap=True)
        fit(os.path.join(a.out, "plain"), "all", wrap=False, record=False)
        print("worker done", dist.get_rank(), flush=True)
    """
)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    work = tmp_path_factory.mktemp("dist")
    out = work / "out"
    rc, seconds, report = launch(work, WORKER, "--out", str(out))
    assert rc == 0, report
    print(f"2-process launch: {seconds:.1f} s")
    return out, report


def results(out: Path, case: str) -> dict[int, dict]:
    found = {}
    for rank in (0, 1):
        path = out / case / f"result_rank{rank}.json"
        assert path.is_file(), f"rank {rank} left no result for {case!r}"
        found[rank] = json.loads(path.read_text())
    return found


def step_jsons(run_dir: Path) -> dict[int, dict]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in sorted(run_dir.glob("step_*.json"))}


def param_names(graph: dict) -> set[str]:
    return {n["param"] for n in graph["nodes"] if n.get("kind") == "param"}


def test_two_ranks_really_ran(launched):
    out, report = launched
    for case in ("default", "all", "all_dp"):
        res = results(out, case)
        assert {r["world_size"] for r in res.values()} == {2}, report
        assert [res[0]["rank"], res[1]["rank"]] == [0, 1]


def test_default_ranks_records_rank0_only(launched):
    out, report = launched
    res = results(out, "default")
    run_dir = out / "default" / RUN
    assert res[0]["captured_steps"] == EXPECTED_STEPS, (res, report)
    assert res[1]["captured_steps"] == [] and res[1]["run_dir"] is None, res[1]
    graphs = step_jsons(run_dir)
    assert sorted(graphs) == EXPECTED_STEPS
    assert not (run_dir / "rank_1").exists(), sorted(os.listdir(run_dir))
    assert not [p for p in run_dir.rglob("*") if "rank_" in p.name], "another rank wrote something"
    assert list(run_dir.glob("vdlrecords*")), "no VisualDL records from rank 0"
    for graph in graphs.values():
        assert param_names(graph) == set(res[0]["param_names"])


@pytest.mark.parametrize("case", ["all", "all_dp"])
def test_all_ranks_record_their_own_graphs(launched, case):
    out, report = launched
    res = results(out, case)
    run_dir = out / case / RUN
    rank_dirs = {0: run_dir, 1: run_dir / "rank_1"}
    per_rank = {}
    for rank, d in rank_dirs.items():
        assert res[rank]["captured_steps"] == EXPECTED_STEPS, (rank, res[rank], report)
        assert res[rank]["run_dir"] is not None and Path(res[rank]["run_dir"]).resolve() == d.resolve()
        per_rank[rank] = step_jsons(d)
        assert sorted(per_rank[rank]) == EXPECTED_STEPS, f"rank {rank}: {sorted(os.listdir(d))}"
        for step in EXPECTED_STEPS:
            assert (d / f"step_{step:06d}.png").is_file()
        assert list(d.glob("vdlrecords*")), f"no VisualDL records from rank {rank}"
    assert not (run_dir / "rank_0").exists()
    # rank 1's graphs are its own (its data shard gives another loss), not a copy of rank 0's
    losses = {r: [per_rank[r][s]["meta"]["loss"] for s in EXPECTED_STEPS] for r in (0, 1)}
    assert losses[0] != losses[1], losses


def test_dataparallel_prefix_is_stripped(launched):
    """Parameter and layer names in the JSON never start with ``_layers.``."""
    out, _ = launched
    res = results(out, "all_dp")
    names = res[0]["param_names"]
    assert res[0]["network_type"] == "DataParallel"
    assert names and all(n.startswith("_layers.") for n in names), names  # the prefix is really there
    expected = {n[len("_layers."):] for n in names}
    for case in ("all_dp", "all", "default"):
        for rank_dir in (out / case / RUN, out / case / RUN / "rank_1"):
            for step, graph in step_jsons(rank_dir).items():
                got = param_names(graph)
                assert got == expected, f"{case} {rank_dir.name} step {step}: {sorted(got)}"
                layers = [n.get("layer") for n in graph["nodes"] if n.get("layer")] + list(graph["layers"])
                assert not [x for x in layers if x.startswith("_layers")], f"{case} step {step}: {layers}"
                assert any(n.get("layer") == "conv" for n in graph["nodes"]), "no op attributed to conv"


def test_fit_weights_are_bit_identical_with_and_without_capture(launched):
    out, _ = launched
    captured, plain = results(out, "all"), results(out, "plain")
    for rank in (0, 1):
        assert captured[rank]["weights"] == plain[rank]["weights"], rank


def test_fit_records_applied_and_local_gradients(launched):
    """Model.fit under 2 ranks: parameter norms are those after all-reduce, the same on
    both ranks; each rank's local norms (its own data shard) are kept beside them."""
    out, _ = launched
    run_dir = out / "all" / RUN
    graphs = {r: step_jsons(d) for r, d in ((0, run_dir), (1, run_dir / "rank_1"))}
    for step in EXPECTED_STEPS:
        g = {r: BackwardGraph.from_dict(graphs[r][step]) for r in (0, 1)}
        for r in (0, 1):
            sync = g[r].meta["grad_sync"]
            assert sync == {"rank": r, "world_size": 2, "params": 4, "changed": 4}, (step, sync)
        applied = {r: g[r].params() for r in (0, 1)}
        local = {r: g[r].params(local=True) for r in (0, 1)}
        assert sorted(applied[0]) == sorted(applied[1]) == ["conv.bias", "conv.weight", "fc.bias", "fc.weight"]
        for name in applied[0]:
            a0, a1 = applied[0][name].norm, applied[1][name].norm
            assert a0 == pytest.approx(a1, rel=1e-6), (step, name, a0, a1)  # all-reduced: one gradient
            assert local[0][name].norm != pytest.approx(local[1][name].norm, rel=1e-3), (step, name)
        assert g[0].global_grad_norm() == pytest.approx(g[1].global_grad_norm(), rel=1e-6)
        # the edges into a parameter carry what flowed there: this rank's local gradient
        fc_weight = next(n for n in g[0].nodes if n.param == "fc.weight")
        into = [e.grad.norm for e in g[0].edges if e.dst == fc_weight.id]
        assert into == [local[0]["fc.weight"].norm]
    # each rank's VisualDL run has both series
    from visualdl import LogReader

    for r, d in ((0, run_dir), (1, run_dir / "rank_1")):
        reader = LogReader(file_path=str(next(d.glob("vdlrecords*"))))
        for tag, local in (("~backward_graph/global_grad_norm", False), ("~backward_graph/local_grad_norm", True)):
            got = {rec.id: rec.value for rec in reader.get_data("scalar", tag)}
            want = {s: BackwardGraph.from_dict(graphs[r][s]).global_grad_norm(local=local) for s in EXPECTED_STEPS}
            assert got.keys() == want.keys(), (r, tag, got)
            assert all(got[s] == pytest.approx(want[s], rel=1e-5) for s in want), (r, tag, got, want)


def test_dashboard_shows_each_rank_as_a_run(launched, tmp_path):
    """``visualdl --logdir LOG_DIR`` lists rank 1's records as their own run."""
    out, _ = launched
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    exe = Path(sys.executable).with_name("visualdl")
    with open(tmp_path / "visualdl.log", "wb") as log:
        proc = subprocess.Popen([str(exe), "--logdir", str(out / "all"), "--host", "127.0.0.1", "--port", str(port),
                                 "--disable-telemetry", "--cache-timeout", "1"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def get(path, **params):
            url = base + path + ("?" + urllib.parse.urlencode(params) if params else "")
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.status, r.read()

        deadline = time.monotonic() + 60
        runs = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if get("/alive")[0] == 204:
                    runs = json.loads(get("/app/api/runs")[1])["data"]
                    if len(runs) >= 2:
                        break
            except OSError:
                pass
            time.sleep(0.25)
        assert runs is not None, f"visualdl did not come up:\n{tail(tmp_path / 'visualdl.log')}"
        # named "<log dir>/<run_name>[/rank_K]"
        assert sorted(runs) == ["all/backward_graph", "all/backward_graph/rank_1"], runs
        for run in runs:
            listed = json.loads(get("/app/api/image/list", run=run, tag="backward_graph/from_step_000001")[1])["data"]
            assert [rec["step"] for rec in listed] == EXPECTED_STEPS, (run, listed)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: only what we started
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
