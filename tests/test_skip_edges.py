"""Skip connections are observed: a UNet's concatenated skips, residual adds, add_n.

Concat and AddN nodes take no post-hook, and the node a skip reaches also
receives the gradient of its other consumer (a UNet encoder's ReLU output feeds
its pooling and, later, the decoder's concat), so neither end of the edge shows
it. The capture reads it from what the Concat received (``capture/joins.py``).
The oracle is the test's own tensor hooks: on the concatenated tensor (whose
gradient, cut at the skip's channels with numpy, is the skip's gradient) and
on the residual sums (both branches of ``x + f(x)`` carry its gradient).
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

from paddleviz_hooks import BackwardGraph, capture_backward
from paddleviz_hooks.collapse import collapse_graph
from paddleviz_hooks.render import to_dot

SEEN: dict[str, np.ndarray] = {}  # tensor name -> the gradient the test's own hook saw


def _watch(t: paddle.Tensor, name: str) -> None:
    t.register_hook(lambda g: SEEN.__setitem__(name, g.numpy().astype(np.float64)))


class Down(nn.Layer):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv, self.act, self.pool = nn.Conv2D(cin, cout, 3, padding=1), nn.ReLU(), nn.MaxPool2D(2)

    def forward(self, x):
        skip = self.act(self.conv(x))  # feeds the pooling and the decoder's concat
        return self.pool(skip), skip


class Up(nn.Layer):
    def __init__(self, cin, cskip, cout):
        super().__init__()
        self.up, self.conv, self.act = nn.Upsample(scale_factor=2), nn.Conv2D(cin + cskip, cout, 3, padding=1), nn.ReLU()

    def forward(self, x, skip):
        cat = paddle.concat([self.up(x), skip], axis=1)
        _watch(cat, self.full_name())
        return self.act(self.conv(cat))


class Residual(nn.Layer):
    """``x + f(x)`` and ``add_n([x, g(x)])``: x also feeds the branch, so it receives two gradients."""

    def __init__(self, c):
        super().__init__()
        self.f, self.g = nn.Conv2D(c, c, 3, padding=1), nn.Conv2D(c, c, 1)

    def forward(self, x):
        y = x + self.f(x)
        _watch(y, "add")
        z = paddle.add_n([y, self.g(y)])
        _watch(z, "add_n")
        return z


class UNet(nn.Layer):
    def __init__(self):
        super().__init__()
        self.d1, self.d2 = Down(1, 4), Down(4, 8)
        self.mid = Residual(8)
        self.u2, self.u1 = Up(8, 8, 4), Up(4, 4, 4)
        self.head = nn.Conv2D(4, 1, 1)

    def forward(self, x):
        x, s1 = self.d1(x)
        x, s2 = self.d2(x)
        x = self.mid(x)
        return self.head(self.u1(self.u2(x, s2), s1))


def _meta_of(a: np.ndarray) -> tuple[float, float, float]:
    return float(np.sqrt(np.sum(a * a))), float(a.min()), float(a.max())


def _check(edge, want: np.ndarray, what: str) -> None:
    assert edge.grad is not None, f"{what}: {edge.note}"
    assert edge.grad.shape == want.shape, what
    norm, lo, hi = _meta_of(want)
    assert edge.grad.norm == pytest.approx(norm, rel=1e-6), what
    assert (edge.grad.min, edge.grad.max) == pytest.approx((lo, hi), rel=1e-6), what


def _edges(g: BackwardGraph, src_op: str, src_layer: str | None = None):
    return {(g.nodes[e.dst].layer, g.nodes[e.dst].op): e for e in g.edges
            if g.nodes[e.src].op == src_op and (src_layer is None or g.nodes[e.src].layer == src_layer)}


def test_unet_skips_and_residual_adds_carry_their_gradients():
    paddle.seed(0)
    SEEN.clear()
    model = UNet()
    with capture_backward(model) as cap:
        model(paddle.randn([2, 1, 8, 8])).square().mean().backward()
    g = cap.graph
    assert not [e for e in g.edges if e.grad is None]
    for name, skip_layer, up_layer, up_channels in ((model.u1.full_name(), "d1.act", "u1.up", 4),
                                                    (model.u2.full_name(), "d2.act", "u2.up", 8)):
        cat = SEEN[name]  # the gradient the Concat received: its inputs' gradients are slices of it
        out = _edges(g, "Concat", up_layer.split(".")[0])
        assert set(out) == {(skip_layer, "Relu"), (up_layer, "NearestInterp")}, out
        _check(out[(skip_layer, "Relu")], cat[:, up_channels:], f"skip into {skip_layer}")
        _check(out[(up_layer, "NearestInterp")], cat[:, :up_channels], f"decoder path into {up_layer}")
        assert out[(skip_layer, "Relu")].note is None
    # the residual add and the add_n pass their gradient, unchanged, to both branches
    for op, name in (("Add", "add"), ("AddN", "add_n")):
        out = [e for e in g.edges if g.nodes[e.src].op == op and g.nodes[e.src].layer == "mid"]
        assert len(out) == 2, op
        for e in out:
            _check(e, SEEN[name], f"{op} -> {g.nodes[e.dst].op}")
    # the skip is drawn with its numbers, as an observed (solid) edge
    dot = to_dot(g)
    skip = _edges(g, "Concat", "u1")[("d1.act", "Relu")]
    line = next(ln for ln in dot.splitlines() if ln.strip().startswith(f"n{skip.src} -> n{skip.dst} "))
    assert "not observed" not in line and "dashed" not in line and "|g|" in line, line


class Blocked(nn.Layer):
    """Gradients Paddle gives no way to read, each with its reason on the edge."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        h = F.relu(self.a(x))
        # two inputs without gradient around the skip: where its slice starts is unknown
        cat = paddle.concat([x, h, x], axis=1)
        # einsum takes no hook and h also gets the gradient of the concat
        e = paddle.einsum("ij,jk->ik", h, self.b.weight)
        return cat.sum() + e.sum() + self.b(h).sum()


def test_where_a_gradient_cannot_be_read_the_edge_says_why():
    paddle.seed(1)
    model = Blocked()
    with capture_backward(model) as cap:
        model(paddle.randn([2, 3])).backward()
    g = cap.graph
    (skip,) = [e for e in g.edges if g.nodes[e.src].op == "Concat"]
    assert skip.grad is None
    assert skip.note == "Concat takes no hook; the sizes of its inputs are not known"
    into_h = [e for e in g.edges if g.nodes[e.src].op == "Einsum" and g.nodes[e.dst].op == "Relu"]
    assert [e.note for e in into_h] == ["Einsum takes no hook; its receiver adds it to other gradients"]
    assert into_h[0].grad is None
    # kept through JSON and layer boxes, and shown under "not observed"
    again = BackwardGraph.from_json(g.to_json())
    assert [e.note for e in again.edges] == [e.note for e in g.edges]
    boxed = collapse_graph(g, depth=1)
    assert {e.note for e in boxed.edges} >= {skip.note}
    dot = to_dot(g)
    line = next(ln for ln in dot.splitlines() if ln.strip().startswith(f"n{skip.src} -> n{skip.dst} "))
    assert "not observed" in line and "(Concat takes no hook; the sizes of its inputs are not known)" in line
    assert "dashed" in line
    # every other edge is observed, and no observed edge carries a note (the einsum's edge into the
    # weight b also feeds: its shape is the parameter's, its values unseen)
    assert all((e.grad is None or e.grad.norm is None) == (e.note is not None) for e in g.edges
               if g.nodes[e.src].kind == "op")
    assert math.isfinite(g.global_grad_norm())


def test_a_concat_into_an_in_place_backward_shows_what_it_sent():
    """Tanh's backward overwrites the gradient it received with the one it passes on: read at
    the receiver (as before), the Concat's edge showed Tanh's output (0.20 where 0.41 flowed)."""
    paddle.seed(0)
    SEEN.clear()
    lin, out = nn.Linear(4, 4), nn.Linear(8, 2)
    with capture_backward(nn.LayerList([lin, out])) as cap:
        cat = paddle.concat([paddle.tanh(lin(paddle.randn([3, 4]))), paddle.randn([3, 4])], axis=1)
        _watch(cat, "cat")
        out(cat).square().mean().backward()
    g = cap.graph
    (e,) = [e for e in g.edges if g.nodes[e.src].op == "Concat"]
    assert g.nodes[e.dst].op == "Tanh"
    _check(e, SEEN["cat"][:, :4], "Concat -> Tanh")
