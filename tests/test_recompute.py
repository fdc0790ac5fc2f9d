"""Recompute: the step's graph shows the recomputed blocks, their layers and every parameter.

Reentrant recompute (``paddle.distributed.fleet.utils.recompute``, the LLM
default) runs a second backward inside the PyLayer's grad node; it is stitched
into the step's graph at that node. Non-reentrant recompute is an ordinary
graph. Both through ``capture_backward``, the recorder and ``Model.fit``, with
norms equal to float64 norms of ``param.grad`` and gradients bit-identical to
an uncaptured run.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn as nn
import pytest
from paddle.distributed.fleet.utils import recompute

from paddleviz_hooks import BackwardGraph, BackwardGraphCallback, BackwardGraphRecorder, capture_backward, summarize
from paddleviz_hooks.capture import dispatcher_installed

D, BLOCKS = 8, 3


class Block(nn.Layer):
    """A pre-norm residual block: norm, attention-like mixing, MLP."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mix = nn.Linear(d, d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        h = x + self.mix(self.norm(x))
        return h + self.down(nn.functional.gelu(self.up(h)))


class Net(nn.Layer):
    def __init__(self, reentrant: bool | None = True) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.blocks = nn.LayerList([Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(D, 3)
        self.reentrant = reentrant  # None: no recompute

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) if self.reentrant is None else recompute(block, h, use_reentrant=self.reentrant)
        return self.head(h).mean(axis=1)


def _norm64(t) -> float:
    return float(np.linalg.norm(t.numpy().astype("float64").ravel()))


def _batch():
    paddle.seed(5)
    return paddle.randn([2, 5, 4]), paddle.to_tensor([[0], [2]])


def _step(net, capture: bool):
    x, y = _batch()
    if not capture:
        nn.functional.cross_entropy(net(x), y).backward()
        return None
    with capture_backward(net) as cap:
        nn.functional.cross_entropy(net(x), y).backward()
    return cap


def _net(reentrant):
    paddle.seed(0)
    return Net(reentrant)


def _assert_exact(graph: BackwardGraph, net: nn.Layer) -> None:
    """Every parameter that got a gradient is reached, with the norm of param.grad."""
    got = graph.params()
    want = {n: _norm64(p.grad) for n, p in net.named_parameters() if p.grad is not None}
    assert len(want) == 4 + BLOCKS * 8
    assert set(got) == set(want)
    for name, norm in want.items():
        assert got[name].norm == pytest.approx(norm, rel=1e-5), name
    assert graph.global_grad_norm() == pytest.approx(float(np.sqrt(sum(v * v for v in want.values()))), rel=1e-5)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_capture_reaches_every_parameter_with_exact_norms(reentrant):
    net = _net(reentrant)
    cap = _step(net, capture=True)
    assert len(cap.graphs) == 1  # one graph for the step, inner backwards stitched in
    g = cap.graph
    _assert_exact(g, net)
    # the recomputed ops keep their layers: every block's linears and norm
    plain = _step(_net(None), capture=True).graph
    assert g.count_ops()["Matmul"] == plain.count_ops()["Matmul"] == 2 + 3 * BLOCKS
    want_layers = {f"blocks.{i}.{sub}" for i in range(BLOCKS) for sub in ("norm", "mix", "up", "down")}
    assert want_layers <= {n.layer for n in g.nodes if n.kind == "op"}
    # only the real loss is a root
    assert [(n.name, n.shape) for n in g.nodes if n.kind == "root"] == [("loss", ())]
    assert g.meta["backward"] == {"index": 1, "of": 1, "entry": "backward"}
    if reentrant:
        assert g.meta["nested"] == BLOCKS
        pylayers = [n for n in g.nodes if n.op == "PyLayer:RecomputeFunction"]
        assert len(pylayers) == BLOCKS
        out = g.out_edges()
        # each sits in the block it recomputed and leads to that block's recomputed ops
        assert sorted(p.layer for p in pylayers) == [f"blocks.{i}" for i in range(BLOCKS)]
        for p in pylayers:
            inner = [e for e in out[p.id] if g.nodes[e.dst].layer == p.layer and g.nodes[e.dst].op == "Add"]
            assert len(inner) == 1
            # the activation gradient the inner backward started from was observed
            assert inner[0].grad.shape == (2, 5, D) and inner[0].grad.norm > 0
        assert "3 backwards run inside this one (recompute)" in summarize(g)
    else:
        assert "nested" not in g.meta
    assert not dispatcher_installed()


def test_each_recompute_node_passes_on_its_block_input_gradient():
    """What a recompute PyLayer returns (the sum over its block input's uses) is on its outgoing edge."""
    g = _step(_net(True), capture=True).graph
    plain, (x, y), want = _net(None), _batch(), {}
    h = plain.embed(x)
    for i, block in enumerate(plain.blocks):
        h.register_hook(lambda grad, i=i: want.__setitem__(f"blocks.{i}", _norm64(grad)))
        h = block(h)
    nn.functional.cross_entropy(plain.head(h).mean(axis=1), y).backward()
    out = g.out_edges()
    got = {}
    for p in (n for n in g.nodes if n.op == "PyLayer:RecomputeFunction"):
        (edge,) = [e for e in out[p.id] if g.nodes[e.dst].layer != p.layer]  # to the block before
        got[p.layer] = edge.grad.norm
    assert got.keys() == want.keys()
    for layer, norm in want.items():
        assert got[layer] == pytest.approx(norm, rel=1e-5), layer


def test_recompute_inputs_say_what_they_are_in_the_drawing():
    """The leaves of the inner backwards (each block's held input) are labelled as such, not
    as "input" like the model's own inputs, in full detail and collapsed."""
    from paddleviz_hooks.collapse import collapse_graph
    from paddleviz_hooks.render import to_dot

    g = _step(_net(True), capture=True).graph
    leaves = [n for n in g.nodes if n.kind == "input"]
    assert len(leaves) == BLOCKS
    for graph in (g, collapse_graph(g, depth=1)):
        src = to_dot(graph)
        assert src.count('label="recompute input\\n(held by the PyLayer)"') == BLOCKS, src
        assert 'label="input"' not in src


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_gradients_bit_identical_with_and_without_capture(reentrant):
    a, b = _net(reentrant), _net(reentrant)
    _step(a, capture=True)
    _step(b, capture=False)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert pa.grad.numpy().tobytes() == pb.grad.numpy().tobytes(), name


def test_a_parameter_used_inside_and_outside_the_recomputed_block_gets_its_total():
    """The inner backward adds to a parameter the outer one reaches too: its norm is of the sum."""
    paddle.seed(0)
    shared = nn.Linear(D, D)

    class Tied(nn.Layer):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, D)
            self.shared = shared
            self.block = Block()

        def forward(self, x):
            h = self.shared(self.embed(x))
            h = recompute(lambda t: self.shared(self.block(t)), h)
            return h.mean(axis=1)

    net = Tied()
    x, y = _batch()
    with capture_backward(net) as cap:
        nn.functional.cross_entropy(net(x)[:, :3], y).backward()
    got = cap.graph.params()
    for name, p in net.named_parameters():
        assert got[name].norm == pytest.approx(_norm64(p.grad), rel=1e-5), name
    assert len([n for n in cap.graph.nodes if n.param == "shared.weight"]) == 1


def test_recorder_hand_loop_records_the_stitched_graph(tmp_path):
    net = _net(True)
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=net.parameters())
    x, y = _batch()
    with BackwardGraphRecorder(str(tmp_path), net, steps=[2], capture_first=False, verbose=0,
                               formats=("json",), visualdl=False) as rec:
        for step in (1, 2):
            with rec.step(step):
                nn.functional.cross_entropy(net(x), y).backward()
            if step == 2:
                want = {n: _norm64(p.grad) for n, p in net.named_parameters()}
            opt.step()
            opt.clear_grad()
    assert sorted(p.name for p in (tmp_path / "backward_graph").glob("*.json")) == ["step_000002.json"]
    g = BackwardGraph.from_json((tmp_path / "backward_graph" / "step_000002.json").read_text())
    got = g.params()
    assert set(got) == set(want)
    for name, norm in want.items():
        assert got[name].norm == pytest.approx(norm, rel=1e-5), name


class _Applied(paddle.optimizer.SGD):
    """SGD that notes the float64 norm of every param.grad it is about to apply."""

    def __init__(self, net, **kw):
        super().__init__(parameters=net.parameters(), **kw)
        self.names = {id(p): n for n, p in net.named_parameters()}
        self.applied: list[dict[str, float]] = []

    def minimize(self, loss, *args, **kwargs):
        self.applied.append({self.names[id(p)]: _norm64(p.grad) for p in self._parameter_list
                             if p.grad is not None})
        return super().minimize(loss, *args, **kwargs)


class _Data(paddle.io.Dataset):
    def __init__(self, n: int = 8):
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((n, 5, 4)).astype("float32")
        self.y = rng.integers(0, 3, size=(n, 1)).astype("int64")

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self):
        return len(self.x)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_model_fit_with_recompute_records_every_parameter(tmp_path, reentrant):
    paddle.seed(0)
    model = paddle.Model(Net(reentrant))
    opt = _Applied(model.network, learning_rate=0.1)
    model.prepare(opt, nn.CrossEntropyLoss())
    cb = BackwardGraphCallback(str(tmp_path), steps=[2], capture_first=False, verbose=0, formats=("json",),
                               visualdl=False)
    model.fit(_Data(), epochs=1, batch_size=2, shuffle=False, verbose=0, callbacks=[cb])
    assert cb.captured_steps == [2]
    g = BackwardGraph.from_json((tmp_path / "backward_graph" / "step_000002.json").read_text())
    want = opt.applied[1]  # step 2's param.grad, before the optimizer applied it
    got = g.params()
    assert set(got) == set(want) and len(want) == 4 + BLOCKS * 8
    for name, norm in want.items():
        assert got[name].norm == pytest.approx(norm, rel=1e-5), name
    assert g.meta.get("nested", 0) == (BLOCKS if reentrant else 0)


class _GradInside(paddle.autograd.PyLayer):
    """A PyLayer whose backward runs paddle.grad on a graph it builds (a nested 'grad' backward)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        ctx.save_for_backward(x)
        with paddle.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensor()
        x = x.detach()
        x.stop_gradient = False
        with paddle.set_grad_enabled(True):
            y = ctx.layer(x)
        (gx,) = paddle.grad(y, x, grad_outputs=g)
        return gx


class _TwoPyLayers(nn.Layer):
    """Two PyLayers of one class on the same input: which one runs a nested backward is ambiguous."""

    def __init__(self, ambiguous: bool) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 3)
        self.ambiguous = ambiguous

    def forward(self, x):
        h = self.head.weight.sum() * 0 + x  # a graph before the PyLayers
        out = _GradInside.apply(h, self.a)
        if self.ambiguous:
            out = out + _GradInside.apply(h, self.b)
        return self.head(out)


def test_a_custom_pylayer_running_paddle_grad_is_stitched_in():
    paddle.seed(0)
    net = _TwoPyLayers(ambiguous=False)
    x = paddle.randn([2, D])
    x.stop_gradient = False
    with capture_backward(net) as cap:
        net(x).sum().backward()
    assert len(cap.graphs) == 1 and cap.graph.meta["nested"] == 1
    g = cap.graph
    at = next(n for n in g.nodes if n.op == "PyLayer:GradInside")
    assert {g.nodes[e.dst].layer for e in g.out_edges()[at.id]} >= {"a"}
    assert cap.errors == []


def test_an_ambiguous_nested_backward_is_kept_apart_not_guessed():
    paddle.seed(0)
    net = _TwoPyLayers(ambiguous=True)
    x = paddle.randn([2, D])
    x.stop_gradient = False
    with pytest.warns(RuntimeWarning, match="could not be told for sure"):
        with capture_backward(net) as cap:
            net(x).sum().backward()
    outer = cap.graph
    assert "nested" not in outer.meta
    inner = [g for g in cap.graphs if g.meta["backward"].get("nested")]
    assert len(inner) == 2 and len(cap.graphs) == 3
    for g in inner:
        assert [n.name for n in g.nodes if n.kind == "root"] == ["activation"]
        assert "backward run inside another" in summarize(g)


def test_ctrl_c_inside_a_nested_backward_arrives_as_itself(monkeypatch):
    from paddleviz_hooks.capture import stats as stats_mod

    net = _net(True)
    real, calls = stats_mod.grad_meta, [0]

    def interrupting(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 30:  # inside the second block's recomputed backward
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(stats_mod, "grad_meta", interrupting)
    x, y = _batch()
    with pytest.raises(KeyboardInterrupt):
        with capture_backward(net):
            nn.functional.cross_entropy(net(x), y).backward()
    assert not dispatcher_installed() and paddle.is_grad_enabled()
    monkeypatch.undo()
    plain = _net(True)
    _step(plain, capture=False)
    for (name, p), q in zip(net.named_parameters(), plain.parameters()):  # the backward had finished
        assert p.grad.numpy().tobytes() == q.grad.numpy().tobytes(), name
