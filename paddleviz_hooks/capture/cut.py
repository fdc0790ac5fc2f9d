"""The gradients a Stack passes on, cut from the one it received.

``StackGradNode`` takes no post-hook (``hazards.py``), and the op receiving
from it often rewrites its incoming gradient in place (Relu, Swish...: see
``docs/paddle-autograd.md``), so reading it there comes too late. Its
backward is exact arithmetic, though: each input's gradient is one index of
the gradient the node received along the stacking axis. The capture keeps
that received gradient (the tensor its producer's hook saw) and cuts it once
the backward is over, where the axis can be told for sure from the shapes of
the gradients its inputs received; where it cannot (three [3, 3] tensors
stacked into [3, 3, 3]) the edge keeps what it had. (Concat and AddN: ``joins.py``.)
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["CUT_KINDS", "cut"]

CUT_KINDS = frozenset({"StackGradNode"})


def cut(kind: str, received: Any, shapes: Sequence[tuple[int, ...] | None]) -> list[Any | None]:
    """The part of ``received`` each input slot got (None where it cannot be told).

    Args:
        kind: ``"StackGradNode"``.
        received: the gradient the node received (a Tensor).
        shapes: per forward input slot, the shape of the gradient that input
            received, None when unknown (no gradient, or not seen).

    Examples:
        >>> import paddle
        >>> g = paddle.arange(6, dtype="float32").reshape([2, 3])
        >>> [p.tolist() for p in cut("StackGradNode", g, [(3,), (3,)])]
        [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        >>> cut("StackGradNode", paddle.zeros([3, 3, 3]), [(3, 3)] * 3)  # axis ambiguous
        [None, None, None]
    """
    full = tuple(int(s) for s in received.shape)
    known = {s for s in shapes if s is not None}
    none = [None] * len(shapes)
    if kind not in CUT_KINDS or len(known) != 1:
        return none
    shape = known.pop()
    axes = [p for p in range(len(full))
            if full[p] == len(shapes) and full[:p] + full[p + 1:] == tuple(shape)]
    if len(axes) != 1:
        return none  # the stacking axis cannot be told from the shapes
    axis = axes[0]
    return [received.slice([axis], [i], [i + 1]).squeeze(axis) if s is not None else None
            for i, s in enumerate(shapes)]
