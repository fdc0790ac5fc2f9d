"""A model whose ops sit on known lines, for the forward source-line tests.

Every line that makes ops carries a comment ``# ops: <Op>, ...`` naming the
readable ops (``Node.op``) it makes; the tests read these markers from this
file, so moving a line moves what they expect. Ops come from inside layers
(``Linear``), a helper function called by a layer, the top-level forward and
a block run under reentrant recompute.
"""

from __future__ import annotations

import paddle
import paddle.nn as nn
from paddle.distributed.fleet.utils import recompute


def squash(h):
    """A helper function called by a layer."""
    h = paddle.tanh(h)  # ops: Tanh
    return h * 0.5  # ops: Scale


class Inner(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc(x)  # ops: Matmul, Add
        return squash(h)  # ops: Tanh, Scale


class Recomputed(nn.Layer):
    """Run under reentrant recompute: its ops are made again in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        h = paddle.exp(x * 0.1)  # ops: Scale, Exp
        return self.lin(h)  # ops: Matmul, Add


class Net(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.block = Recomputed()

    def forward(self, x):
        h = self.inner(x)  # ops: Matmul, Add, Tanh, Scale
        h = paddle.sin(h) + x  # ops: Sin, Add
        h = recompute(self.block, h)  # ops: PyLayer:RecomputeFunction, Scale, Exp, Matmul, Add
        return h.sum(axis=-1)  # ops: Sum


def loss_of(net, x):
    return net(x).mean()  # ops: MeanAll, Mean, Matmul, Add, Tanh, Scale, Sin, Exp, Sum, PyLayer:RecomputeFunction


def marked_lines(path: str | None = None) -> dict[int, set[str]]:
    """Line number -> the ops its ``# ops:`` marker names."""
    path = path or __file__.replace(".pyc", ".py")
    out: dict[int, set[str]] = {}
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if "# ops: " in line and not line.lstrip().startswith(("#", '"')):
                out[i] = {s.strip() for s in line.split("# ops: ", 1)[1].split(",")}
    return out


class Convs(nn.Layer):
    """Conv2d and add_n: Paddle keeps no call stack on their grad nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2D(2, 2, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)  # ops: Conv2d, Add, Reshape
        return paddle.add_n([h, x * 2])  # ops: AddN, Scale
