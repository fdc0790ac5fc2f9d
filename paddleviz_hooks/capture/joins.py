"""Gradients leaving a Concat or AddN node, read from what the node received.

Neither node can take a post-hook (``hazards.py``: a ``Tensor[]`` input), so
nothing sees the gradients they pass on. Yet their backward is plain:

* **AddN** passes the gradient it received, unchanged, to every input.
* **Concat** cuts the gradient it received into one slice per input, along the
  concatenation axis, in input order; a slice is as large as its input.

So the gradient along a concatenated skip connection (a UNet's encoder
feature map joining the decoder, a DenseNet's feature reuse) is a slice of
what the Concat received, exactly. What it received is what the hooked nodes
feeding it produced, added in the order they ran (Paddle adds them in that
order). The slices' sizes come from the receivers: the gradient a hooked
receiver got has the shape of the tensor it made (``in_meta``), a parameter
has its shape, and at most one unknown size (an input that takes no gradient,
an input leaf, a node receiving several tensors) is what is left of the
received size. The axis is the one dimension where those shapes differ from
the received one. The received gradient is held until the slices can be cut,
usually as soon as the first receiver reports, at the latest when the
backward ends, then dropped.

An edge whose gradient still is unknown after that gets the reason in
``Edge.note`` (:func:`explain`). Not seen either way: a user's own
``register_hook`` on the concatenated tensor that changes its gradient (the
Concat then cuts the changed one).
"""

from __future__ import annotations

from typing import Any

import paddle

from ..graph import Edge, GradMeta, Node
from ..hazards import EDGE_NOTES
from . import stats

__all__ = ["Joins", "explain"]

_CUT = "ConcatGradNode"
_SAME = "AddNGradNodeFinal"


class Joins:
    """The Concat and AddN nodes of one backward and what flowed into them.

    Args:
        nodes, edges, out_edges: the walk's (``gradnode.Walk``).
        wrappers: the walk's live grad node wrappers (read here, at set-up only).
        in_meta: node id -> the single gradient it received, filled by the
            hooks as the backward runs (read, never written).
        with_stats, queue: as ``stats.grad_meta``.
    """

    def __init__(self, nodes: list[Node], edges: list[Edge], out_edges: dict[int, list[Edge]],
                 wrappers: list[Any], in_meta: dict[int, GradMeta], with_stats: bool,
                 queue: stats.StatsQueue) -> None:
        self.nodes, self.out_edges, self.in_meta = nodes, out_edges, in_meta
        self.with_stats, self.queue = with_stats, queue
        self.slots: dict[int, int] = {}  # Concat id -> its forward inputs (None entries included)
        self.same: set[int] = set()  # AddN ids
        for nid, n in enumerate(nodes):
            if n.kind == "op" and n.name == _CUT:
                self.slots[nid] = len(wrappers[nid].next_functions)
            elif n.kind == "op" and n.name == _SAME:
                self.same.add(nid)
        self.into: dict[int, int] = {}  # join id -> edges into it
        self.feeds: dict[int, list[int]] = {}  # receiver id -> Concats it receives from
        for e in edges:
            if self.wants(e.dst):
                self.into[e.dst] = self.into.get(e.dst, 0) + 1
            if e.src in self.slots:
                self.feeds.setdefault(e.dst, []).append(e.src)
        self.arrived: dict[int, list[Any]] = {}  # join id -> gradients arrived so far, in order
        self.received: dict[int, Any] = {}  # join id -> what it received, until cut
        self.why: dict[int, str] = {}  # join id -> EDGE_NOTES key, when its edges stay unknown

    def __bool__(self) -> bool:
        return bool(self.slots or self.same)

    def wants(self, nid: int) -> bool:
        """Whether ``nid`` is a Concat or AddN node: hooks hand over what they send it."""
        return nid in self.slots or nid in self.same

    def arrive(self, dst: int, grad: Any) -> None:
        """One gradient sent to the join ``dst`` (by a hook, or cut from another join)."""
        got = self.arrived.setdefault(dst, [])
        got.append(grad)
        if len(got) < self.into.get(dst, 0):
            return
        del self.arrived[dst]
        total = got[0]
        for g in got[1:]:
            total = total + g  # as Paddle adds them: in the order they arrived
        if stats.is_dist(total):  # cutting a distributed tensor would communicate
            self.why[dst] = "other"
            return
        self.received[dst] = total
        self._pass_on(dst)

    def reported(self, nid: int) -> None:
        """``nid`` reported what it received (``in_meta``): a size it cuts may be known now."""
        for j in self.feeds.get(nid, ()):
            if j in self.received:
                self._pass_on(j)

    def finish(self) -> None:
        """The backward is over: cut what can be cut, note why the rest cannot; drop every tensor."""
        for j in list(self.received):
            self._pass_on(j)
        for j in self.received:
            self.why[j] = "sizes"
        for j in (*self.slots, *self.same):
            self.why.setdefault(j, "received")
        self.arrived.clear()
        self.received.clear()

    def _pass_on(self, j: int) -> None:
        r = self.received[j]
        outs = self.out_edges.get(j, [])
        pieces = [r] * len(outs) if j in self.same else self._cut(j, r, outs)
        if pieces is None:
            return
        del self.received[j]
        self.why[j] = "done"
        for e, p in zip(outs, pieces):
            e.grad = stats.grad_meta(p, self.with_stats, self.queue)
            if self.wants(e.dst):
                self.arrive(e.dst, p)

    def _shape(self, nid: int) -> tuple[int, ...] | None:
        n = self.nodes[nid]
        if n.kind == "param":
            return n.shape
        m = self.in_meta.get(nid)
        return m.shape if m is not None else None

    def _cut(self, j: int, r: Any, outs: list[Edge]) -> list[Any] | None:
        """The slices of ``r`` along the Concat ``j``'s edges; None: the sizes are not known (yet)."""
        whole = tuple(r.shape)
        shapes: list[tuple[int, ...] | None] = [None] * self.slots[j]
        for e in outs:
            shapes[e.slot] = self._shape(e.dst)
        if self.slots[j] == 1:
            return [r] * len(outs)
        known = [s for s in shapes if s is not None]
        axes = {d for s in known for d in range(len(whole)) if len(s) == len(whole) and s[d] != whole[d]}
        unknown = [i for i, s in enumerate(shapes) if s is None]
        if any(len(s) != len(whole) for s in known) or len(axes) > 1:
            return None  # not a Concat as described above: left unknown
        if len(axes) != 1 or len(unknown) > 1:
            return None  # the axis or a size may come with a later receiver
        axis = axes.pop()
        sizes = [s[axis] if s is not None else 0 for s in shapes]
        rest = whole[axis] - sum(sizes)
        if rest < 0 or (rest and not unknown) or any(
                s[d] != whole[d] for s in known for d in range(len(whole)) if d != axis):
            return None
        if unknown:
            sizes[unknown[0]] = rest
        pieces = []
        for e in outs:
            start = sum(sizes[: e.slot])
            p = paddle.slice(r, axes=[axis], starts=[start], ends=[start + sizes[e.slot]])
            pieces.append(p if p.is_contiguous() else p.contiguous())
        return pieces


def explain(nodes: list[Node], edges: list[Edge], joins: Joins | None) -> None:
    """``Edge.note`` for every edge leaving a node without a hook whose gradient stayed unknown."""
    in_count: dict[int, int] = {}
    for e in edges:
        in_count[e.dst] = in_count.get(e.dst, 0) + 1
    for e in edges:
        src = nodes[e.src]
        if e.grad is not None or e.note is not None or src.kind != "op" or src.hooked:
            continue
        key = joins.why.get(e.src) if joins is not None else None
        if key in (None, "done", "other"):
            key = "shared" if in_count.get(e.dst, 0) > 1 else "other"
        e.note = EDGE_NOTES[key].format(op=src.op)
