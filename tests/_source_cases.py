"""Models whose forward makes ops in many ways, for comparing forward source lines.

Each case builds its model and runs ``step(cap_kwargs)``: one forward and
backward inside ``capture_backward`` (new model, same seed each call), and
returns the capture's graphs. ``tests/test_source_notes.py`` compares the
sources the wrapped op calls note with the ones Paddle's dump gives.
"""

from __future__ import annotations

from typing import Any, Callable

import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.distributed.fleet.utils import recompute

from paddleviz_hooks import capture_backward


class MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class ResBlock(nn.Layer):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2D(c, c, 3, padding=1, bias_attr=False), nn.BatchNorm2D(c)
        self.conv2, self.bn2 = nn.Conv2D(c, c, 3, padding=1, bias_attr=False), nn.BatchNorm2D(c)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + x)  # residual add


class ConvNet(nn.Layer):
    """resnet18-like: a stem, residual blocks, pooling and a head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2D(3, 8, 3, padding=1), nn.BatchNorm2D(8), nn.ReLU(), nn.MaxPool2D(2))
        self.blocks = nn.Sequential(ResBlock(8), ResBlock(8))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.blocks(self.stem(x))
        return self.head(paddle.flatten(F.adaptive_avg_pool2d(h, 1), 1))


class Clip(paddle.autograd.PyLayer):
    @staticmethod
    def forward(ctx, x):
        y = paddle.tanh(x)
        ctx.save_for_backward(y)
        return y * 2.0

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensor()
        return dy * 2.0 * (1 - y * y)


class WithPyLayer(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(Clip.apply(self.fc1(x)))


class Block(nn.Layer):
    def __init__(self, d=8):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Recomputed(nn.Layer):
    def __init__(self, reentrant):
        super().__init__()
        self.embed, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.blocks = nn.LayerList([Block() for _ in range(2)])
        self.reentrant = reentrant

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = recompute(b, h, use_reentrant=self.reentrant)
        return self.head(h)


class Tensors(nn.Layer):
    """Indexing (x[...] and x[...] = v), Tensor dunders, an in-place op, add_n, a concat and a split."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.w = self.create_parameter([6, 6])

    def forward(self, x):
        h = self.fc(x)
        a = h[:, 1:4] * 2 + h[:, :3]  # slices, __mul__, __add__
        b = -(h @ self.w) ** 2 / 3 - 1  # __matmul__, __pow__, __neg__, __truediv__, __sub__
        c = 1 - b[0]  # __rsub__ of a row
        a[0] = b[1, :3] * 0.5  # set in place
        d = h[h > 0].sum() + paddle.add_n([a.sum(), b.mean(), c.max()])  # a mask, add_n
        e = paddle.concat([a, b[:, :3]], axis=1)
        e.add_(paddle.ones_like(e))  # in place
        p, q = paddle.split(e, 2, axis=1)
        return (p * q).sum() + d


class Cloned(nn.Layer):
    """``x.clone()``: Tensor's C method makes an Assign node with no wrapped entry point."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.fc1(x).clone())


class Inner(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return F.relu(self.fc(x)) * 2.0


class WithStatic(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.inner = paddle.jit.to_static(Inner(), full_graph=True)

    def forward(self, x):
        return self.fc2(self.inner(paddle.tanh(self.fc1(x))))


def _simple(make: Callable[[], nn.Layer], shape: list[int]) -> Callable[[dict], list[Any]]:
    def step(kw: dict) -> list[Any]:
        paddle.seed(0)
        net = make()
        x = paddle.randn(shape)
        with capture_backward(net, **kw) as cap:
            net(x).mean().backward()
        return cap.graphs

    return step


def _grad_penalty(kw: dict) -> list[Any]:
    paddle.seed(0)
    net = MLP()
    x = paddle.randn([3, 6])
    x.stop_gradient = False
    with capture_backward(net, **kw) as cap:
        y = net(x)
        (g,) = paddle.grad(y.sum(), x, create_graph=True)
        (y.mean() + (g * g).sum()).backward()
    return cap.graphs


def _encoder(kw: dict) -> list[Any]:
    paddle.seed(0)
    net = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 2)
    x = paddle.randn([2, 4, 16])
    with capture_backward(net, **kw) as cap:
        net(x).mean().backward()
    return cap.graphs


def _static_sub(kw: dict) -> list[Any]:
    paddle.seed(0)
    net = WithStatic()
    x = paddle.randn([2, 6])
    net(x)  # compiled outside the capture
    with capture_backward(net, **kw) as cap:
        net(x).mean().backward()
    return cap.graphs


CASES: dict[str, Callable[[dict], list[Any]]] = {
    "mlp": _simple(MLP, [3, 6]),
    "conv": _simple(ConvNet, [2, 3, 8, 8]),
    "encoder": _encoder,
    "pylayer": _simple(WithPyLayer, [3, 6]),
    "grad_penalty": _grad_penalty,
    "recompute": _simple(lambda: Recomputed(True), [2, 4]),
    "recompute_nonreentrant": _simple(lambda: Recomputed(False), [2, 4]),
    "to_static": _static_sub,
    "tensors": _simple(Tensors, [3, 6]),
    "clone": _simple(Cloned, [3, 6]),
}


def sources(graphs: list[Any]) -> list[dict[str, tuple]]:
    """Per graph: node key -> (its source, its source note), op nodes only."""
    return [{n.key: (n.source, n.source_note) for n in g.nodes if n.kind == "op"} for g in graphs]
