"""Per-layer gradient-norm scalars to a depth the user chooses (``scalar_depth=``).

The oracle is independent of the library: each parameter's ``param.grad`` in
float64 after one backward, grouped by the first ``depth`` components of its
owning layer's dotted path, root-sum-square per group.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from paddleviz_hooks import BackwardGraphCallback, BackwardGraphRecorder, Sink

GROUP = "~grad_norm/"


class Inner(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.a = paddle.nn.Linear(2, 2)
        self.b = paddle.nn.Sequential(paddle.nn.Linear(2, 2), paddle.nn.Tanh(), paddle.nn.Linear(2, 2))

    def forward(self, x):
        return self.b(self.a(x))


class Nested(paddle.nn.Layer):
    """Depth 1: 4 groups; 2: 3 + blocks; 3: 3 + 2 per block; 4 (deepest): 3 + 3 per block."""

    def __init__(self, blocks: int):
        super().__init__()
        self.stem = paddle.nn.Linear(3, 2)
        self.blocks = paddle.nn.LayerList([Inner() for _ in range(blocks)])
        self.head = paddle.nn.Linear(2, 1)
        self.scale = self.create_parameter([1])  # the top layer's own parameter

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x) * self.scale


class Keeps(Sink):
    """A dashboard that keeps the scalars it is given."""

    name = "keeps"

    def __init__(self):
        self.scalars: dict[str, float] = {}

    def data(self, record):
        self.scalars.update({k[len(GROUP):]: v for k, v in record.scalars.items() if k.startswith(GROUP)})


def _oracle(model: paddle.nn.Layer, depth: int) -> dict[str, float]:
    sq: dict[str, float] = {}
    for name, p in model.named_parameters():
        layer = name.split(".")[:-1]
        group = ".".join(layer[:depth]) if layer else "top_layer_params"
        g = p.grad.numpy().astype(np.float64)
        sq[group] = sq.get(group, 0.0) + float(np.sum(g * g))
    return {k: math.sqrt(v) for k, v in sq.items()}


def _record(tmp_path, blocks: int, **options) -> tuple[dict[str, float], paddle.nn.Layer]:
    paddle.seed(3)
    model, sink = Nested(blocks), Keeps()
    with BackwardGraphRecorder(str(tmp_path), model, steps=[1], capture_first=False, sinks=[sink], visualdl=False,
                               formats=("json",), viewer_px=None, verbose=0, **options) as rec:
        with rec.step(1):
            model(paddle.randn([4, 3])).square().mean().backward()
    return sink.scalars, model


@pytest.mark.parametrize("blocks, options, depth", [
    (2, {}, 4),                     # every level fits in 30 scalars: the deepest (9 scalars)
    (11, {}, 3),                    # depth 4 would give 36 scalars: depth 3 gives 25
    (11, {"scalar_depth": 2}, 2),   # the user's depth: 14 scalars
    (2, {"scalar_depth": 9}, 4),    # deeper than the model: every layer with parameters
])
def test_layer_scalars_go_to_the_chosen_depth(tmp_path, blocks, options, depth):
    got, model = _record(tmp_path, blocks, **options)
    want = _oracle(model, depth)
    assert sorted(got) == sorted(want)
    assert len(got) <= 30 or "scalar_depth" in options
    for name, norm in want.items():
        assert got[name] == pytest.approx(norm, rel=1e-6, abs=1e-12), name
    if depth >= 3:  # dotted layer paths, as everywhere else
        assert "blocks.1.a" in got and "stem" in got and "top_layer_params" in got


@pytest.mark.parametrize("value, error", [(0, ValueError), (-1, ValueError), ("2", TypeError), (True, TypeError),
                                          (1.5, TypeError)])
def test_a_bad_scalar_depth_is_refused_when_made(value, error):
    with pytest.raises(error, match=f"scalar_depth must be an int >= 1 or None, got {value!r}"):
        BackwardGraphRecorder("unused", scalar_depth=value)
    with pytest.raises(error, match="scalar_depth"):
        BackwardGraphCallback("unused", scalar_depth=value)
