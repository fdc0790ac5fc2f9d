"""Grad nodes: reading ``Tensor.grad_fn`` safely and walking the graph.

Paddle's grad node wrappers (``GradNodeBase``) are only touched here and in
the other modules of this package. ``walk_graph`` turns the live graph into
plain :class:`~paddleviz_hooks.graph.Node`/``Edge`` records; the wrappers it
keeps (``Walk.wrappers``) must be cleared once a capture is over, since
holding them keeps the C++ graph alive.
"""

from __future__ import annotations

import ctypes
import re
import sys
from typing import Any, Sequence

import paddle

from ..graph import Edge, GradMeta, Node, op_display_name

__all__ = ["grad_fn", "has_graph", "walk_graph", "prune_to_inputs", "Walk", "parameter_names", "strip_wrapper_prefix",
           "structure_fingerprint", "dtype_name", "made_by_backward"]

# Grad nodes a backward makes when it builds a gradient's own graph (create_graph=True):
# Paddle names them after the op whose gradient they differentiate (MatmulDoubleGradNode,
# TanhTripleGradNode, Conv2dGradGradNodeFinal).
_HIGHER_ORDER = re.compile(r"(?:Double|Triple)GradNode|GradGradNode")


def made_by_backward(name: str) -> bool:
    """Whether a grad node of this class name is made by a backward (``create_graph=True``),
    not by a forward op.

    Examples:
        >>> made_by_backward("MatmulDoubleGradNode"), made_by_backward("Conv2dGradGradNodeFinal")
        (True, True)
        >>> made_by_backward("MatmulGradNode")
        False
    """
    return _HIGHER_ORDER.search(name) is not None


# --------------------------------------------------------------------------
# Tensor.grad_fn without Paddle's reference leak
# --------------------------------------------------------------------------
# Paddle 3.3.1's `Tensor.grad_fn` getter keeps one extra reference to the
# wrapper it returns, on every access: the wrapper, and the C++ grad node with
# every node it reaches, are never freed (about 25 KB per access for a small
# MLP; the trigger watch and the layer hooks read grad_fn on every step). The
# leak is measured once; only if the getter is seen to keep exactly one extra
# reference is it given back, so a Paddle that fixes the bug is left alone.
_grad_fn_leak: bool | None = None
_Py_DecRef = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_DecRef", ctypes.pythonapi))


def _measure_grad_fn_leak() -> bool | None:
    with paddle.set_grad_enabled(True):  # also when first called under no_grad
        t = paddle.ones([1])
        t.stop_gradient = False
        y = t * 2.0
    g = y.grad_fn
    if g is None:
        return None  # cannot tell here: measure again next time
    before = sys.getrefcount(g)
    h = y.grad_fn
    extra = sys.getrefcount(g) - before - 1
    del h
    if extra == 1:
        _Py_DecRef(g)
        _Py_DecRef(g)
    return extra == 1


def grad_fn(t: Any) -> Any:
    """``t.grad_fn`` (None for non-tensors), without leaking the grad node."""
    global _grad_fn_leak
    g = getattr(t, "grad_fn", None)
    if g is not None:
        if _grad_fn_leak is None:
            _grad_fn_leak = _measure_grad_fn_leak()
        if _grad_fn_leak:
            _Py_DecRef(g)
    return g




# Saved tensors our pack hook stored detached (``saved.py``), by (address, shape,
# dtype) -> the address of the original's grad node, which the stored copy no
# longer has; a recompute's PyLayer reads its saved inputs back as such copies
# (``nested.py``). Plain ints: nothing is kept alive. Cleared when a forward is armed.
_SAVED_FROM: dict[tuple[int, tuple[int, ...], str], int] = {}


def note_saved(copy: Any, original: Any) -> None:
    """Remember which grad node the detached ``copy`` of a saved tensor came from."""
    gf = grad_fn(original)
    if gf is not None:
        _SAVED_FROM[(copy.data_ptr(), tuple(copy.shape), dtype_str(copy.dtype))] = gf.node_ptr()


def forget_saved() -> None:
    _SAVED_FROM.clear()


def grad_node_ptr(t: Any) -> int | None:
    """Address of ``t``'s grad node; for a saved tensor our pack hook stored
    detached (a leaf of its own), that of the original; None without one."""
    if _SAVED_FROM:
        ptr = _SAVED_FROM.get((t.data_ptr(), tuple(t.shape), dtype_str(t.dtype)))
        if ptr is not None:
            return ptr
    gf = grad_fn(t)
    return gf.node_ptr() if gf is not None else None


_DTYPE_STR: dict[tuple[type, Any], str] = {}  # str() of a paddle dtype runs Python code: once per dtype


def dtype_str(dtype: Any) -> str:
    """``str(dtype)`` (``"paddle.float32"``), remembered: hooks ask for it per gradient and per save."""
    key = (type(dtype), dtype)  # old and new dtype enums may compare equal but print differently
    s = _DTYPE_STR.get(key)
    if s is None:
        s = _DTYPE_STR[key] = str(dtype)
    return s


_DTYPE_NAME: dict[tuple[type, Any], str] = {}


def dtype_name(dtype: Any) -> str:
    """``paddle.float32`` -> ``"float32"`` (remembered per dtype, as :func:`dtype_str`)."""
    key = (type(dtype), dtype)
    s = _DTYPE_NAME.get(key)
    if s is None:
        s = _DTYPE_NAME[key] = dtype_str(dtype).rpartition(".")[2]
    return s


def has_graph(t: Any) -> bool:
    """Whether a gradient can flow back from ``t``.

    A tensor with ``stop_gradient=True`` still has a ``grad_fn`` (an
    accumulation node) in Paddle 3.3, but no gradient flows from it.
    """
    return grad_fn(t) is not None and not t.stop_gradient


# --------------------------------------------------------------------------
# walking the graph
# --------------------------------------------------------------------------
def parameter_names(params: Any) -> dict[int, tuple[str, Any]]:
    """Map accumulation-node address -> (parameter name, parameter).

    Args:
        params: a ``paddle.nn.Layer`` or a dict name -> parameter/tensor.

    Raises:
        TypeError: ``params`` is neither.
    """
    if isinstance(params, paddle.nn.Layer):
        items = params.named_parameters()
    elif isinstance(params, dict):
        items = params.items()
    else:
        raise TypeError(
            f"params must be a paddle.nn.Layer or a dict of name -> Tensor, got {type(params).__name__}"
        )
    out: dict[int, tuple[str, Any]] = {}
    for name, p in items:
        if not isinstance(p, paddle.Tensor):
            raise TypeError(f"params[{name!r}] must be a paddle.Tensor, got {type(p).__name__}")
        gf = grad_fn(p)
        if gf is not None:
            out[gf.node_ptr()] = (strip_wrapper_prefix(str(name)), p)
    return out


def strip_wrapper_prefix(name: str) -> str:
    # paddle.DataParallel (and paddle.Model's adapters) wrap the network as `_layers`.
    while name.startswith("_layers."):
        name = name[len("_layers."):]
    return name


class Walk:
    """Nodes and edges found from some roots, plus the live wrappers."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.edges: list[Edge] = []
        self.wrappers: list[Any] = []  # id -> GradNodeBase (None for roots)
        self.out_edges: dict[int, list[Edge]] = {}
        self.root_edges: dict[int, Edge] = {}  # grad node id -> edge from its root
        self.roots: list[tuple[int, Edge]] = []  # (index in the roots, its edge) of every root walked
        self.ids: dict[int, int] = {}  # grad node address -> node id, for the grad nodes walked

    def release(self) -> None:
        """Drop the grad node wrappers (holding them keeps the C++ graph alive)."""
        self.wrappers.clear()

    def leaf_pointers(self) -> list[tuple[Node, int]]:
        """(node, accumulation-node address) of every parameter leaf reached."""
        return [(n, gn.node_ptr()) for gn, n in zip(self.wrappers, self.nodes) if n.kind == "param"]


_OP_NAMES: dict[str, str] = {}  # grad node class name -> readable op name (a few hundred kinds)


def walk_graph(
    roots: Sequence[Any],
    param_names: dict[int, tuple[str, Any]] | None = None,
) -> Walk:
    """Breadth-first walk from the roots' ``grad_fn`` along ``next_functions``."""
    param_names = param_names or {}
    w = Walk()
    ids = w.ids
    queue: list[Any] = []

    def node_for(gn: Any) -> int:
        ptr = gn.node_ptr()
        nid = ids.get(ptr)
        if nid is not None:
            return nid
        nid = len(w.nodes)
        ids[ptr] = nid
        name = gn.name()
        if name == "GradNodeAccumulation":
            named = param_names.get(ptr)
            if named is not None:
                pname, p = named
                node = Node(nid, "param", name, "Parameter", param=pname,
                            shape=tuple(int(s) for s in p.shape), dtype=dtype_name(p.dtype))
            else:
                node = Node(nid, "input", name, "Leaf")
        else:
            op = _OP_NAMES.get(name)
            if op is None:
                if len(_OP_NAMES) > 4096:
                    _OP_NAMES.clear()
                op = _OP_NAMES[name] = op_display_name(name)
            node = Node(nid, "op", name, op)
        w.nodes.append(node)
        w.wrappers.append(gn)
        queue.append((gn, nid))
        return nid

    for i, t in enumerate(roots):
        gf = grad_fn(t)
        if gf is None:
            continue
        rid = len(w.nodes)
        label = "loss" if len(roots) == 1 else f"output {i}"
        w.nodes.append(Node(rid, "root", label, label, shape=tuple(int(s) for s in t.shape),
                            dtype=dtype_name(t.dtype)))
        w.wrappers.append(None)
        gid = node_for(gf)
        e = Edge(rid, gid, 0, GradMeta(shape=tuple(int(s) for s in t.shape), dtype=dtype_name(t.dtype)))
        w.edges.append(e)
        w.root_edges.setdefault(gid, e)
        w.roots.append((i, e))

    head = 0
    while head < len(queue):
        gn, src = queue[head]
        head += 1
        outs = []
        for slot, nxt in enumerate(gn.next_functions):
            if nxt is None:
                continue
            e = Edge(src, node_for(nxt), slot)
            w.edges.append(e)
            outs.append(e)
        w.out_edges[src] = outs
    return w


def prune_to_inputs(w: Walk, input_ptrs: set[int]) -> Walk:
    """The part of a walk that ``paddle.grad(roots, inputs)`` computes.

    Paddle runs only the grad nodes from which an input's node can be reached
    (not the node of a non-leaf input itself, unless another input lies below
    it) and computes only the slots leading to such nodes or to an input: the
    rest is dropped (nodes renumbered in the same order). Measured on Paddle
    3.3.1, ``docs/paddle-autograd.md``.
    """
    n = len(w.nodes)
    succ: list[list[int]] = [[] for _ in range(n)]
    for e in w.edges:
        succ[e.src].append(e.dst)
    is_input = [gn is not None and gn.node_ptr() in input_ptrs for gn in w.wrappers]
    reaches = [False] * n  # an input is reachable through at least one edge
    order = _topological(n, succ)
    for i in reversed(order):
        reaches[i] = any(is_input[j] or reaches[j] for j in succ[i])
    runs = [w.nodes[i].kind == "root" or reaches[i] for i in range(n)]
    keep = [runs[i] or is_input[i] for i in range(n)]
    new_id = {}
    out = Walk()
    for i in range(n):
        if keep[i]:
            new_id[i] = len(out.nodes)
            node = w.nodes[i]
            node.id = new_id[i]
            out.nodes.append(node)
            out.wrappers.append(w.wrappers[i])
    out.ids = {p: new_id[i] for p, i in w.ids.items() if i in new_id}
    kept: set[int] = set()
    for e in w.edges:
        if runs[e.src] and keep[e.dst] and (runs[e.dst] or is_input[e.dst]):
            kept.add(id(e))
            e.src, e.dst = new_id[e.src], new_id[e.dst]
            out.edges.append(e)
            if out.nodes[e.src].kind != "root":
                out.out_edges.setdefault(e.src, []).append(e)
    for i, e in w.roots:
        if id(e) in kept:
            out.roots.append((i, e))
            out.root_edges.setdefault(e.dst, e)
    for i, node in enumerate(out.nodes):
        if node.kind != "root":
            out.out_edges.setdefault(i, [])
    return out


def _topological(n: int, succ: list[list[int]]) -> list[int]:
    """Node ids in an order where every edge goes forward (the walk is acyclic)."""
    indeg = [0] * n
    for s in succ:
        for j in s:
            indeg[j] += 1
    order = [i for i in range(n) if indeg[i] == 0]
    for i in order:
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                order.append(j)
    return order


def structure_fingerprint(walk: Walk) -> int:
    """A hash of a walk's structure: op kinds, parameter names and edges."""
    return hash((tuple((n.name, n.param) for n in walk.nodes), tuple((e.src, e.dst) for e in walk.edges)))


