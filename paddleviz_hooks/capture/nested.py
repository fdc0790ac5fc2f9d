"""Backwards run inside a backward: find the PyLayer that ran one, and stitch it in.

Reentrant recompute (``paddle.distributed.fleet.utils.recompute``, a PyLayer)
runs, inside its grad node, the block's forward again and a second backward
from the recomputed outputs. The dispatcher sees that inner backward start
while the outer one is still running. This module finds the outer grad node
that ran it (:func:`place`) and splices the inner graph into the outer one at
that node (:func:`stitch`): the PyLayer node then leads to the recomputed
ops, their layers and parameters, as the gradient really flows.
"""

from __future__ import annotations

import sys
from typing import Any

from ..graph import Edge, Node
from ..hazards import RECOMPUTE_INPUT_NOTE
from .gradnode import grad_node_ptr

__all__ = ["DETACHED_INPUT", "pylayer_context", "place", "stitch"]

#: The note on an inner graph's non-parameter leaf (shown on hover; its label says it too).
DETACHED_INPUT = RECOMPUTE_INPUT_NOTE

_MAX_FRAMES = 64


def pylayer_context() -> Any:
    """The context object of the innermost PyLayer backward running on this thread, or None.

    Paddle calls ``ctx.backward(*grads)`` from the grad node; the Python
    frames of that call hold ``ctx`` as their first argument. Only read, on
    the rare nested backward.
    """
    try:
        from paddle.autograd.py_layer import PyLayerBackward
    except ImportError:  # pragma: no cover - every Paddle 3 has it
        return None
    f = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if f is None:
            return None
        code = f.f_code
        if code.co_name == "backward" and code.co_argcount:
            ctx = f.f_locals.get(code.co_varnames[0])
            if isinstance(ctx, PyLayerBackward):
                return ctx
        f = f.f_back
    return None


def place(ctx: Any, nodes: list[Node], ptrs: list[int | None], next_ptrs: dict[int, set[int]],
          stitched: set[int]) -> int | None:
    """The id of the PyLayer node (among ``nodes``) whose backward is ``ctx``'s, or None.

    Candidates are the grad nodes of ``ctx``'s PyLayer class. When several
    remain, those whose inputs include every tensor ``ctx`` saved for
    backward (recompute saves the block's inputs), then those not stitched
    yet, are kept. An ambiguous or missing match gives None: an inner graph is
    never placed by a guess.

    Args:
        ctx: the running PyLayer backward's context (:func:`pylayer_context`).
        nodes: the enclosing backward's nodes.
        ptrs: node id -> grad node address (None for roots).
        next_ptrs: node id -> addresses of its next grad nodes.
        stitched: ids that already received an inner graph.
    """
    cls = getattr(ctx, "_forward_cls", None)
    if ctx is None or cls is None:
        return None
    name = "GradNodePyLayer_" + cls.__name__
    cands = [n.id for n in nodes if n.kind == "op" and (n.name == name or n.name.startswith(name + "_"))]
    if len(cands) > 1:
        saved: set[int] = set()
        try:
            for t in ctx.saved_tensor() or ():
                ptr = grad_node_ptr(t)
                if ptr is not None and not t.stop_gradient:
                    saved.add(ptr)
        except Exception:
            saved = set()
        if saved:
            cands = [c for c in cands if saved <= next_ptrs.get(c, set())]
    if len(cands) > 1:
        fresh = [c for c in cands if c not in stitched]
        cands = fresh or cands
    return cands[0] if len(cands) == 1 else None


def stitch(nodes: list[Node], edges: list[Edge], ptrs: list[int | None], at: int,
           inner_nodes: list[Node], inner_edges: list[Edge], inner_ptrs: list[int | None]) -> None:
    """Splice an inner backward's graph into the enclosing one at node ``at`` (in place).

    The inner roots (the recomputed activations) become ``at`` itself: the
    gradient ``at`` received is what the inner backward started from, so
    ``at`` leads to the inner roots' grad nodes, the edges keeping the
    activations' gradients. A parameter reached in both graphs (also used
    outside the block) is one node. The inner leaves that are not
    parameters are the block's detached inputs; when there is exactly one
    and ``at`` passes its gradient to exactly one node, that unobserved
    outgoing edge gets the leaf's total gradient (``Node.grad``, or its one
    incoming edge's), which is what the PyLayer returns.
    Only parameter leaves are matched by grad node address. The node ``at``
    moves into the innermost layer holding every recomputed op (the block
    that ``recompute`` ran), when that is inside the layer it had.

    Args:
        nodes, edges, ptrs: the enclosing graph (ptrs: node id -> grad node address).
        at: id of the node whose backward ran the inner one.
        inner_nodes, inner_edges, inner_ptrs: the inner graph, discarded after.

    Examples:
        >>> from paddleviz_hooks.graph import GradMeta
        >>> nodes = [Node(0, "root", "loss", "loss"), Node(1, "op", "GradNodePyLayer_F", "PyLayer:F"),
        ...          Node(2, "op", "EmbeddingGradNode", "Embedding")]
        >>> edges, ptrs = [Edge(0, 1), Edge(1, 2)], [None, 11, 12]
        >>> inner = [Node(0, "root", "activation", "activation"), Node(1, "op", "MatmulGradNode", "Matmul"),
        ...          Node(2, "input", "GradNodeAccumulation", "Leaf")]
        >>> g = GradMeta((2, 4), "float32", norm=1.5)
        >>> stitch(nodes, edges, ptrs, 1, inner, [Edge(0, 1), Edge(1, 2, grad=g)], [None, 21, 22])
        >>> [(nodes[e.src].op, nodes[e.dst].op, e.grad and e.grad.norm) for e in edges]
        [('loss', 'PyLayer:F', None), ('PyLayer:F', 'Embedding', 1.5), ('PyLayer:F', 'Matmul', None), ('Matmul', 'Leaf', 1.5)]
    """
    # Only parameters are matched by address: they live as long as the model,
    # while a finished inner graph's nodes are freed and their addresses reused.
    index = {p: i for i, p in enumerate(ptrs) if p is not None and nodes[i].kind == "param"}
    first_slot = 1 + max((e.slot for e in edges if e.src == at), default=-1)
    mapping: dict[int, int] = {}
    roots: dict[int, int] = {}
    new_inputs: list[int] = []
    for n in inner_nodes:
        old = n.id
        if n.kind == "root":
            mapping[old] = at
            roots[old] = len(roots)
            continue
        p = inner_ptrs[old]
        if n.kind == "param" and p in index:
            mapping[old] = index[p]
            continue
        n.id = len(nodes)
        mapping[old] = n.id
        nodes.append(n)
        ptrs.append(p)
        if n.kind == "param":
            index[p] = n.id
        if n.kind == "input":
            n.note = DETACHED_INPUT
            new_inputs.append(n.id)
    have = {(e.src, e.dst, e.slot) for e in edges}
    into: dict[int, list[Edge]] = {}
    for e in inner_edges:
        src, dst = mapping[e.src], mapping[e.dst]
        slot = first_slot + roots[e.src] if e.src in roots else e.slot
        if (src, dst, slot) in have:
            continue
        edge = Edge(src, dst, slot, e.grad, e.note, e.after_hook)
        edges.append(edge)
        into.setdefault(dst, []).append(edge)
    _place_in_layer(nodes[at], [n for n in inner_nodes if n.kind == "op"])
    outer = [e for e in edges if e.src == at and e.slot < first_slot]
    if len(new_inputs) == 1 and len(outer) == 1 and outer[0].grad is None:
        leaf, fed = nodes[new_inputs[0]], into.get(new_inputs[0], [])
        if leaf.grad is not None:
            outer[0].grad = leaf.grad
        elif len(fed) == 1 and fed[0].grad is not None:
            outer[0].grad = fed[0].grad


def _place_in_layer(node: Node, ops: list[Node]) -> None:
    """Put ``node`` in the innermost layer (call) that holds every op of ``ops``.

    Recompute's PyLayer node is made outside the block's forward hooks (the
    block runs under ``no_grad`` first), so attribution gives it the caller's
    layer; the recomputed ops say which block it is.
    """
    if not ops or any(op.layer is None for op in ops):
        return
    parts = [op.layer.split(".") if op.layer else [] for op in ops]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    layer = ".".join(common)
    here = node.layer
    if here is None or not (layer == here or layer.startswith(here + ".") if here else True):
        return
    calls = {op.call for op in ops if op.layer == layer}
    node.layer, node.call = layer, (calls.pop() if len(calls) == 1 else 0)
