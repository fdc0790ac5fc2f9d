"""Auto-parallel (dynamic mode) on 2 CPU ranks: shards, placements, reshard as communication.

One ``paddle.distributed.launch`` job: a 2-layer MLP sharded with
``dist.shard_layer`` (``fc1`` column-parallel: weight ``Shard(1)``, bias
``Shard(0)``; ``fc2`` row-parallel: weight ``Shard(0)``, bias replicated) and
one explicit ``dist.reshard`` of the hidden activation to ``Replicate()``.
Only rank 0 captures (``capture_backward``), so a collective call of ours
would hang the job; rank 1 trains plainly. Both ranks run the same forward and
backward twice (from the same weights), rank 0 capturing the first; rank 0
writes the graph and its local gradients of both runs.

A second model puts a replicated ``fc0`` before a column-parallel ``fc1``: the
gradient fc1 sends back to ``fc0``'s output is ``Partial`` (each rank holds a
summand of it until Paddle reduces it). A tensor hook on that activation, in
a run without capture, gives the reference summand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from _distkit import launch
from paddleviz_hooks import BackwardGraph
from paddleviz_hooks.render import to_dot

WORKER = '''
import json, os, sys
import numpy as np
import paddle
import paddle.distributed as dist
from paddleviz_hooks import capture_backward

mesh = dist.ProcessMesh([0, 1], dim_names=["x"])


class MLP(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = paddle.nn.Linear(8, 16)
        self.fc2 = paddle.nn.Linear(16, 8)

    def forward(self, x):
        h = paddle.nn.functional.relu(self.fc1(x))
        h = dist.reshard(h, mesh, [dist.Replicate()])
        return self.fc2(h)


def shard_fn(name, layer, pm):
    if name == "fc1":
        layer.weight = dist.shard_tensor(layer.weight, pm, [dist.Shard(1)])
        layer.bias = dist.shard_tensor(layer.bias, pm, [dist.Shard(0)])
    elif name == "fc2":
        layer.weight = dist.shard_tensor(layer.weight, pm, [dist.Shard(0)])


def run(capture):
    paddle.seed(0)
    model = dist.shard_layer(MLP(), mesh, shard_fn)
    for p in model.parameters():
        p.stop_gradient = False  # shard_tensor drops it
    x = dist.shard_tensor(paddle.randn([4, 8]), mesh, [dist.Replicate()])
    if capture:
        with capture_backward(model) as cap:
            model(x).mean().backward()
    else:
        model(x).mean().backward()
    grads = {n: p.grad._local_value().numpy() for n, p in model.named_parameters()}
    return (cap if capture else None), grads, {n: p.name for n, p in model.named_parameters()}


class Partial(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc0 = paddle.nn.Linear(8, 8)
        self.fc1 = paddle.nn.Linear(8, 16)

    def forward(self, x, seen=None):
        h = paddle.tanh(self.fc0(x))
        if seen is not None:
            h.register_hook(lambda g: seen.append((g.placements, g._local_value().numpy())))
        return self.fc1(h)


def shard_fc1(name, layer, pm):
    if name == "fc1":
        layer.weight = dist.shard_tensor(layer.weight, pm, [dist.Shard(1)])
        layer.bias = dist.shard_tensor(layer.bias, pm, [dist.Shard(0)])


def run_partial(capture, reference=False):
    paddle.seed(1)
    model = dist.shard_layer(Partial(), mesh, shard_fc1)
    for p in model.parameters():
        p.stop_gradient = False
    x = dist.shard_tensor(paddle.randn([4, 8]), mesh, [dist.Replicate()])
    seen = []
    if capture:
        with capture_backward(model) as cap:
            model(x).mean().backward()
    else:  # the same on every rank: a hook may change what the ranks exchange
        model(x, seen if reference else None).mean().backward()
    grads = {n: p.grad._local_value().numpy().tobytes() for n, p in model.named_parameters()}
    return (cap if capture else None), grads, seen


if __name__ == "__main__":
    out = sys.argv[1]
    dist.init_parallel_env()
    rank = dist.get_rank()
    pcap, pgrads, _ = run_partial(capture=rank == 0)
    _, pplain, seen = run_partial(capture=False, reference=True)
    if rank == 0:
        with open(os.path.join(out, "graph_partial.json"), "w") as f:
            f.write(pcap.graph.to_json())
        with open(os.path.join(out, "result_partial.json"), "w") as f:
            json.dump({"errors": pcap.errors, "same": pgrads == pplain, "placements": [str(p) for p in seen[0][0]],
                       "norm": float(np.linalg.norm(seen[0][1].astype("float64")))}, f)
    cap, captured, names = run(capture=rank == 0)
    _, plain, _ = run(capture=False)
    if rank == 0:
        with open(os.path.join(out, "graph.json"), "w") as f:
            f.write(cap.graph.to_json())
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"errors": cap.errors, "names": names,
                       "same": {n: captured[n].tobytes() == plain[n].tobytes() for n in plain},
                       "norms": {n: float(np.linalg.norm(g.astype("float64"))) for n, g in plain.items()}}, f)
    print("worker done", rank, flush=True)
'''

EXPECTED = {  # name -> global shape, this rank's shard, placements
    "fc1.weight": ((8, 16), (8, 8), ("Shard(dim=1)",)),
    "fc1.bias": ((16,), (8,), ("Shard(dim=0)",)),
    "fc2.weight": ((16, 8), (8, 8), ("Shard(dim=0)",)),
    "fc2.bias": ((8,), (8,), ("Replicate()",)),
}


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    work = tmp_path_factory.mktemp("auto_parallel")
    out = work / "out"
    out.mkdir()
    rc, seconds, report = launch(work, WORKER, str(out), timeout=180)
    assert rc == 0, report
    print(f"2-process launch: {seconds:.1f} s")
    return out


@pytest.fixture(scope="module")
def rank0(out_dir):
    return BackwardGraph.from_json((out_dir / "graph.json").read_text()), json.loads((out_dir / "result.json").read_text())


@pytest.fixture(scope="module")
def partial(out_dir):
    return (BackwardGraph.from_json((out_dir / "graph_partial.json").read_text()),
            json.loads((out_dir / "result_partial.json").read_text()))


def test_capture_on_one_rank_changes_nothing(rank0):
    graph, res = rank0
    assert res["errors"] == []
    assert res["same"] == {name: True for name in EXPECTED}  # local gradients bit-identical


def test_parameters_show_global_shape_shard_and_placements(rank0):
    graph, res = rank0
    assert all(n.endswith(".dist") for n in res["names"].values()), res["names"]  # Paddle renamed them
    params = graph.params()
    assert sorted(params) == sorted(EXPECTED)  # structured names, no ".dist"
    for name, (shape, local, placements) in EXPECTED.items():
        m = params[name]
        assert (m.shape, m.local_shape, m.placements) == (shape, local, placements), name
        node = next(n for n in graph.nodes if n.param == name)
        assert node.shape == shape
        # statistics are of this rank's shard, exactly what p.grad._local_value() holds
        assert m.norm == pytest.approx(res["norms"][name], rel=1e-5), name


def test_reshard_is_drawn_as_communication(rank0):
    graph, _ = rank0
    assert graph.count_ops().get("Reshard") == 1
    reshard = next(n for n in graph.nodes if n.op == "Reshard")
    assert reshard.name == "ReshardGradNode" and reshard.layer == ""
    # its post-hook never fires: not hooked, so it does not claim gradient data it never saw
    assert not reshard.hooked and reshard.note == "reshard (communication): post-hooks never fire"
    out = [e for e in graph.edges if e.src == reshard.id]
    assert len(out) == 1 and out[0].grad is not None  # recovered: Relu received exactly that gradient
    assert (out[0].grad.shape, out[0].grad.local_shape, out[0].grad.placements) == ((4, 16), (4, 8), ("Shard(dim=1)",))
    dot = to_dot(graph)
    stmt = next(line for line in dot.splitlines() if line.strip().startswith(f"n{reshard.id} ["))
    assert "communication between ranks" in stmt and "#ffe0b2" in stmt, stmt
    assert "communication between ranks" in dot.split("legend", 1)[1]
    # edges and parameter boxes name the shard: fc1's weight gradient is [8, 16] globally, [8, 8] here
    assert re.search(r"\[8, 16\] f32.*shard \[8, 8\] Shard\(dim=1\)", dot, re.S)
    plain = to_dot(BackwardGraph.from_json(graph.to_json()))
    assert plain == dot  # the JSON round trip keeps shards and placements
    assert np.isfinite(graph.global_grad_norm())


def test_partial_gradient_is_recorded_and_drawn_as_a_summand(partial):
    graph, res = partial
    assert res["errors"] == [] and res["same"]  # capture changed no gradient bit
    # the loss (mean of a column-sharded output) is Partial too: reading it would be an all-reduce
    # that rank 1 never joins (the job used to abort in gloo): not observed instead
    assert "loss" not in graph.meta
    assert res["placements"] == ["Partial(reduce_type=SUM)"]  # what the user's own hook sees
    fc1_matmul = next(n for n in graph.nodes if n.op == "Matmul" and n.layer == "fc1")
    tanh = next(n for n in graph.nodes if n.op == "Tanh")
    (edge,) = [e for e in graph.edges if (e.src, e.dst) == (fc1_matmul.id, tanh.id)]
    m = edge.grad
    assert (m.shape, m.local_shape, m.placements) == ((4, 8), (4, 8), ("Partial(reduce_type=SUM)",))
    assert m.norm == pytest.approx(res["norm"], rel=1e-5)  # this rank's summand, as the hook saw it
    # every other gradient of the model is Shard or Replicate
    others = {p for e in graph.edges if e is not edge and e.grad is not None for p in e.grad.placements or ()}
    assert others and not any(p.startswith("Partial") for p in others), others
    dot = to_dot(graph)
    label = next(line for line in dot.splitlines() if line.strip().startswith(f"n{fc1_matmul.id} -> n{tanh.id} "))
    assert "shard [4, 8] Partial(reduce_type=SUM)" in label, label
    assert f"|g| {m.norm:.3g} (this rank's summand)" in label, label
    assert BackwardGraph.from_json(graph.to_json()) == graph
