"""The gradients a Concat or Stack passes on, cut from the one it received.

``ConcatGradNode`` and ``StackGradNode`` take no post-hook (``hazards.py``),
and the op receiving from them often rewrites its incoming gradient in place
(Relu, Swish...: see ``docs/paddle-autograd.md``), so reading it there comes
too late. Their backward is exact arithmetic, though: each input's gradient is
a slice of the gradient the node received (Concat), or one index of it
(Stack). The capture keeps that received gradient (the tensor its producer's
hook saw) and cuts it once the backward is over, where the layout can be
told for sure from the shapes of the gradients its inputs received; anywhere
it cannot (an input of unknown shape, a Stack whose axis is ambiguous) the
edge keeps what it had.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["CUT_KINDS", "cut"]

CUT_KINDS = frozenset({"ConcatGradNode", "StackGradNode"})


def cut(kind: str, received: Any, shapes: Sequence[tuple[int, ...] | None]) -> list[Any | None]:
    """The part of ``received`` each input slot got (None where it cannot be told).

    Args:
        kind: ``"ConcatGradNode"`` or ``"StackGradNode"``.
        received: the gradient the node received (a Tensor).
        shapes: per forward input slot, the shape of the gradient that input
            received, None when unknown (no gradient, or not seen). For a
            Concat one unknown slot is what the others leave.

    Example:
        >>> import paddle
        >>> g = paddle.arange(12, dtype="float32").reshape([2, 6])
        >>> [p.tolist() for p in cut("ConcatGradNode", g, [(2, 2), (2, 4)])]
        [[[0.0, 1.0], [6.0, 7.0]], [[2.0, 3.0, 4.0, 5.0], [8.0, 9.0, 10.0, 11.0]]]
        >>> cut("StackGradNode", paddle.zeros([3, 3, 3]), [(3, 3)] * 3)  # axis ambiguous
        [None, None, None]
    """
    full = tuple(int(s) for s in received.shape)
    if kind == "StackGradNode":
        return _stack(received, full, shapes)
    return _concat(received, full, shapes)


def _concat(received: Any, full: tuple[int, ...], shapes) -> list[Any | None]:
    none = [None] * len(shapes)
    known = [s for s in shapes if s is not None]
    if not known or any(len(s) != len(full) for s in known):
        return none
    axes = {d for s in known for d in range(len(full)) if s[d] != full[d]}
    if len(axes) != 1:
        return none  # one input only, or shapes that do not fit a concat
    axis = axes.pop()
    if any(s[d] != full[d] for s in known for d in range(len(full)) if d != axis):
        return none
    sizes = [None if s is None else s[axis] for s in shapes]
    missing = [i for i, v in enumerate(sizes) if v is None]
    rest = full[axis] - sum(v for v in sizes if v is not None)
    if len(missing) == 1:
        sizes[missing[0]] = rest
    elif missing or rest != 0:
        return none
    if any(v < 0 for v in sizes):
        return none
    out, at = [], 0
    for v in sizes:  # the one slot whose shape was not seen is what the others leave
        out.append(received.slice([axis], [at], [at + v]))
        at += v
    return out


def _stack(received: Any, full: tuple[int, ...], shapes) -> list[Any | None]:
    known = {s for s in shapes if s is not None}
    none = [None] * len(shapes)
    if len(known) != 1:
        return none
    shape = known.pop()
    axes = [p for p in range(len(full))
            if full[p] == len(shapes) and full[:p] + full[p + 1:] == tuple(shape)]
    if len(axes) != 1:
        return none  # the stacking axis cannot be told from the shapes
    axis = axes[0]
    return [received.slice([axis], [i], [i + 1]).squeeze(axis) if s is not None else None
            for i, s in enumerate(shapes)]
