"""Applied gradients under multi-process data parallel: what ``param.grad`` received.

Under ``paddle.DataParallel`` a parameter's leaf hook sees the gradient this
rank's own backward produced (the *local* one). Paddle's reducer then
all-reduces and averages the gradients across ranks and writes the result into
``param.grad`` before the backward returns, so what the optimizer applies is
another number on every rank. This module reads that *applied* gradient after
the backward: ``param.grad`` now minus ``param.grad`` before this backward's
first contribution (a copy taken in the leaf hook, before Paddle adds to it).

Everything here is a local read: no collective call is issued, so nothing can
wait on another rank. Only plain dense gradients are read (a distributed
tensor's arithmetic may reshard, which is communication).
"""

from __future__ import annotations

from typing import Any

import paddle

from ..graph import GradMeta
from . import stats

__all__ = ["AppliedGrads", "data_parallel_world", "local_scalar"]


def local_scalar(t: Any) -> float | None:
    """The value of a one-element tensor (a loss), read without communication.

    An auto-parallel tensor's value is read from this rank's local value; a
    ``Partial`` one (e.g. the mean of a sharded output) holds only this rank's
    summand, and reading the whole would be an all-reduce that the other ranks
    never join: None (not observed).

    A loss of shape ``[1]`` or ``[1, 1]`` (``sum(keepdim=True)``, older toolkit code)
    is read as its one element (``float()`` of it fails on numpy 2).

    Examples:
        >>> local_scalar(paddle.to_tensor(2.5)), local_scalar(paddle.to_tensor([[2.5]]))
        (2.5, 2.5)
    """
    if stats.is_dist(t):
        if any(str(p).startswith("Partial") for p in t.placements):
            return None
        t = t._local_value()
    return float(t.reshape([])) if t.ndim else float(t)


def data_parallel_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` when this process is one of several, else None.

    Examples:
        >>> data_parallel_world() is None  # a single process
        True
    """
    try:
        world = paddle.distributed.get_world_size()
        return (paddle.distributed.get_rank(), world) if world > 1 else None
    except Exception:
        return None


class AppliedGrads:
    """Per parameter of one backward: ``param.grad`` before it, its local gradient, then the applied one.

    Args:
        rank: this process's rank.
        world: the number of processes.

    Examples:
        >>> ag = AppliedGrads(0, 2)
        >>> p = paddle.create_parameter([2], "float32")
        >>> ag.note(7, p, paddle.to_tensor([3.0, 4.0]))  # in the leaf hook, before accumulation
        >>> p.grad is None  # nothing was accumulated here: param.grad stays empty
        True
        >>> ag.read(with_stats=True)  # a parameter without param.grad gives nothing
        ({}, 0)
    """

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world
        self.before: dict[int, Any] = {}  # ptr -> copy of param.grad before this backward (None: empty)
        self.local: dict[int, Any] = {}  # ptr -> this rank's gradient (a copy)
        self.params: dict[int, Any] = {}

    def note(self, ptr: int, param: Any, local_total: Any) -> None:
        """Called from a parameter's leaf hook with this backward's local total so far."""
        if stats.is_dist(local_total):
            return
        if ptr not in self.before:
            g = param.grad
            self.before[ptr] = None if g is None or not g._is_initialized() else g.clone()
            self.params[ptr] = param
        self.local[ptr] = local_total.clone()  # the first one may become param.grad's own storage

    def read(self, with_stats: bool, queue: "stats.StatsQueue | None" = None) -> tuple[dict[int, GradMeta], int]:
        """After the backward returned: the applied gradient of each noted parameter.

        Args:
            with_stats: compute norms, min, max.
            queue: the backward's statistics queue (an accelerator's numbers
                are then read with the rest of the backward's, in one transfer).

        Returns:
            ptr -> metadata of ``param.grad`` after minus before, and how many
            parameters' ``param.grad`` differs from before + local (changed by
            synchronisation).
        """
        applied: dict[int, GradMeta] = {}
        same = []  # 0-d booleans, read together
        for ptr, param in self.params.items():
            after = param.grad
            if after is None or not after._is_initialized() or ptr not in self.local:
                continue
            before = self.before.get(ptr)
            local = self.local[ptr]
            expected = local if before is None else before + local  # what Paddle accumulated
            same.append(paddle.equal_all(after, expected))
            applied[ptr] = stats.grad_meta(after if before is None else after - before, with_stats, queue)
        changed = len(same) - int(paddle.stack(same).astype("int32").sum()) if same else 0
        return applied, changed

    def clear(self) -> None:
        self.before.clear()
        self.local.clear()
        self.params.clear()
