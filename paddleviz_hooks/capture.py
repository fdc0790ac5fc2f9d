"""The only module that touches Paddle's autograd internals.

How a capture works (facts in ``shared/notes/paddle-autograd.md``):

* While at least one capture is active, ``paddle.base.core.eager.run_backward``
  and ``run_partial_grad`` are replaced by a dispatcher. ``Tensor.backward``,
  ``paddle.autograd.backward`` and ``paddle.grad`` look those functions up at
  call time, so every entry point is seen. The originals are put back when the
  last capture ends, also on exceptions and KeyboardInterrupt.
* When a backward starts, each active capture walks the graph from the roots
  (the graph is freed by backward, so it has to be walked *before*), and puts a
  post-hook on every node that can safely take one (``hazards.py``). The hooks
  record the gradients that really flow and always return them unchanged.
* When the backward returns, the hooks are removed, every grad node wrapper is
  dropped (holding them would keep the C++ graph alive) and a plain
  :class:`~paddleviz_hooks.graph.BackwardGraph` is built.
* With a layer given, forward pre/post hooks on every sublayer attribute the op
  nodes created during the forward to the innermost layer that ran them.
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading
import time
import warnings
from typing import Any, Callable, Iterable, Sequence

import paddle
from paddle.base import core

from .graph import BackwardGraph, Edge, GradMeta, Node, op_display_name
from .hazards import hook_hazard

__all__ = ["BackwardCapture", "capture_backward", "walk_graph", "parameter_names", "structure_fingerprint"]

_FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64"}


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


def _grad_fn(t: Any) -> Any:
    """``t.grad_fn`` (None for non-tensors), without leaking the grad node."""
    global _grad_fn_leak
    g = getattr(t, "grad_fn", None)
    if g is not None:
        if _grad_fn_leak is None:
            _grad_fn_leak = _measure_grad_fn_leak()
        if _grad_fn_leak:
            _Py_DecRef(g)
    return g


# --------------------------------------------------------------------------
# the backward dispatcher: one patch shared by every active capture
# --------------------------------------------------------------------------
class _Dispatcher:
    """Installs the backward patch while any capture is active."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._active: list["BackwardCapture"] = []
        self._orig_backward: Callable | None = None
        self._orig_grad: Callable | None = None

    def activate(self, cap: "BackwardCapture") -> None:
        with self._lock:
            if not self._active:
                self._orig_backward = core.eager.run_backward
                self._orig_grad = core.eager.run_partial_grad
                core.eager.run_backward = self._run_backward
                core.eager.run_partial_grad = self._run_partial_grad
            self._active.append(cap)

    def deactivate(self, cap: "BackwardCapture") -> None:
        with self._lock:
            if cap in self._active:
                self._active.remove(cap)
            if not self._active and self._orig_backward is not None:
                core.eager.run_backward = self._orig_backward
                core.eager.run_partial_grad = self._orig_grad
                self._orig_backward = self._orig_grad = None

    @property
    def installed(self) -> bool:
        return self._orig_backward is not None

    def _run_backward(self, tensors, grad_tensors, retain_graph, *rest):
        return self._run(self._orig_backward, "backward", tensors, retain_graph,
                         (tensors, grad_tensors, retain_graph, *rest))

    def _run_partial_grad(self, outputs, inputs, grad_outputs, retain_graph, *rest):
        return self._run(self._orig_grad, "grad", outputs, retain_graph,
                         (outputs, inputs, grad_outputs, retain_graph, *rest))

    def _run(self, original, entry, roots, retain_graph, args):
        with self._lock:
            caps = list(self._active)
        grad_was = paddle.is_grad_enabled()
        sessions: list = []
        ok = False
        try:
            # inside the try: an interrupt while walking still unhooks what was hooked
            for cap in caps:
                sessions.append((cap, cap._begin(list(roots), entry)))
            result = original(*args)
            # A KeyboardInterrupt/SystemExit that hit one of our hooks was held
            # back so Paddle could finish the backward (raised inside a hook it
            # would surface as Paddle's OSError); deliver it now, as itself.
            held = next((s.interrupt for _, s in sessions if s is not None and s.interrupt is not None), None)
            if held is not None:
                raise held
            ok = True
            return result
        finally:
            # A hook that raised (or a KeyboardInterrupt inside one) leaves
            # Paddle's grad mode off for the rest of the process: restore it.
            if paddle.is_grad_enabled() != grad_was:
                paddle.set_grad_enabled(grad_was)
            for cap, s in sessions:
                cap._end(s, ok=ok, retain_graph=bool(retain_graph))


_DISPATCHER = _Dispatcher()


# --------------------------------------------------------------------------
# gradient metadata
# --------------------------------------------------------------------------
def _dtype_name(dtype: Any) -> str:
    name = str(dtype)
    return name.split(".")[-1]


def _grad_meta(t: Any, stats: bool) -> GradMeta:
    """Shape, dtype and (optionally) cheap statistics of one gradient tensor."""
    meta = GradMeta(shape=tuple(int(s) for s in t.shape), dtype=_dtype_name(t.dtype))
    if not stats or meta.dtype not in _FLOAT_DTYPES or t.size == 0:
        return meta
    f = t.reshape([-1])
    if meta.dtype != "float32" and meta.dtype != "float64":
        f = f.astype("float32")
    # square().sum() is cheaper than dot(f, f) or linalg.norm on CPU and far
    # more accurate: both of those accumulate float32 serially (relative error
    # 2e-4 at 0.5M elements, 3e-3 at 4M; square().sum() stays near 1e-8).
    # min/max are two more reductions without a temporary copy (unlike abs).
    sq = float(paddle.square(f).sum())
    meta.min = float(f.min())
    meta.max = float(f.max())
    if math.isfinite(sq):
        meta.norm = math.sqrt(sq)
        return meta
    meta.nan = int(paddle.isnan(f).sum())
    meta.inf = int(paddle.isinf(f).sum())
    if meta.nan or meta.inf:
        meta.norm = math.nan if meta.nan else math.inf
    else:  # finite elements whose squares overflow
        meta.norm = float(paddle.linalg.norm(f.astype("float64")))
    return meta


def _flat_tensors(slots: Iterable[Any]) -> list[Any]:
    """Initialized tensors of a hook's gradient slots, in order."""
    flat = []
    for slot in slots:
        for t in slot if isinstance(slot, (list, tuple)) else (slot,):
            if t is not None and t._is_initialized():
                flat.append(t)
    return flat


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
        gf = _grad_fn(p)
        if gf is not None:
            out[gf.node_ptr()] = (_strip_wrapper_prefix(str(name)), p)
    return out


def _strip_wrapper_prefix(name: str) -> str:
    # paddle.DataParallel (and paddle.Model's adapters) wrap the network as `_layers`.
    while name.startswith("_layers."):
        name = name[len("_layers."):]
    return name


class _Walk:
    """Nodes and edges found from some roots, plus the live wrappers."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.edges: list[Edge] = []
        self.wrappers: list[Any] = []  # id -> GradNodeBase (None for roots)
        self.out_edges: dict[int, list[Edge]] = {}
        self.root_edges: dict[int, Edge] = {}  # grad node id -> edge from its root


def walk_graph(
    roots: Sequence[Any],
    param_names: dict[int, tuple[str, Any]] | None = None,
    layer_of: Callable[[int], tuple[str, int] | None] | None = None,
) -> _Walk:
    """Breadth-first walk from the roots' ``grad_fn`` along ``next_functions``."""
    param_names = param_names or {}
    w = _Walk()
    ids: dict[int, int] = {}
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
                            shape=tuple(int(s) for s in p.shape), dtype=_dtype_name(p.dtype))
            else:
                node = Node(nid, "input", name, "Leaf")
        else:
            node = Node(nid, "op", name, op_display_name(name))
            where = layer_of(ptr) if layer_of is not None else None
            if where is not None:
                node.layer, node.call = where
        w.nodes.append(node)
        w.wrappers.append(gn)
        queue.append(gn)
        return nid

    for i, t in enumerate(roots):
        gf = _grad_fn(t)
        if gf is None:
            continue
        rid = len(w.nodes)
        label = "loss" if len(roots) == 1 else f"output {i}"
        w.nodes.append(Node(rid, "root", label, label, shape=tuple(int(s) for s in t.shape),
                            dtype=_dtype_name(t.dtype)))
        w.wrappers.append(None)
        gid = node_for(gf)
        e = Edge(rid, gid, 0, GradMeta(shape=tuple(int(s) for s in t.shape), dtype=_dtype_name(t.dtype)))
        w.edges.append(e)
        w.root_edges.setdefault(gid, e)

    head = 0
    while head < len(queue):
        gn = queue[head]
        head += 1
        src = ids[gn.node_ptr()]
        outs = []
        for slot, nxt in enumerate(gn.next_functions):
            if nxt is None:
                continue
            e = Edge(src, node_for(nxt), slot)
            w.edges.append(e)
            outs.append(e)
        w.out_edges[src] = outs
    return w


def structure_fingerprint(walk: _Walk) -> int:
    """A hash of a walk's structure: op kinds, parameter names and edges."""
    return hash((tuple((n.name, n.param) for n in walk.nodes), tuple((e.src, e.dst) for e in walk.edges)))


# --------------------------------------------------------------------------
# layer attribution through forward hooks
# --------------------------------------------------------------------------
class _LayerAttribution:
    """Forward hooks on every sublayer that attribute op nodes to layers.

    The hooks only record, per layer call, the grad nodes of its outputs and
    of its inputs (cheap enough to run on every step); the walk that claims
    nodes for layers runs lazily, when a backward is actually captured.
    Inner layers finish first, so processing records in order lets the
    innermost layer claim a node before its parents.
    """

    MAX_RECORDS = 20000  # forwards without a backward must not pile up

    def __init__(self, layer: paddle.nn.Layer) -> None:
        self.layer = layer
        self.types: dict[str, str] = {}
        self.owner: dict[int, tuple[str, int]] = {}
        # (path, call, output grad node wrappers, input node addresses); the
        # wrappers keep those nodes alive so their addresses are not reused.
        self._records: list[tuple[str, int, list[Any], set[int]]] = []
        self._stack: list[set[int]] = []
        self._calls: dict[str, int] = {}
        self._handles: list[Any] = []

    def install(self) -> None:
        for path, sub in self.layer.named_sublayers(include_self=True):
            if type(sub).__name__ == "DataParallel":
                continue
            path = _strip_wrapper_prefix(path) if path != "_layers" else ""
            self.types[path] = type(sub).__name__
            # with_kwargs: tensors passed by keyword are seen too
            self._handles.append(sub.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(
                sub.register_forward_post_hook(self._make_post(path), with_kwargs=True)
            )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.reset()

    def reset(self) -> None:
        self.owner.clear()
        self._records.clear()
        self._stack.clear()
        self._calls.clear()

    def lookup(self, ptr: int) -> tuple[str, int] | None:
        if self._records:
            self._resolve()
        return self.owner.get(ptr)

    def _pre(self, layer, args, kwargs):
        try:
            stops = set()
            for t in _tensors_in((args, kwargs)):
                gf = _grad_fn(t)
                if gf is not None:
                    stops.add(gf.node_ptr())
            self._stack.append(stops)
        except Exception:  # never break the forward
            self._stack.append(set())
        return None

    def _make_post(self, path: str):
        def post(layer, args, kwargs, outputs):
            stops = self._stack.pop() if self._stack else set()
            try:
                outs = [_grad_fn(t) for t in _tensors_in(outputs)]
                outs = [g for g in outs if g is not None]
                if outs:
                    call = self._calls.get(path, 0)
                    self._calls[path] = call + 1
                    if len(self._records) >= self.MAX_RECORDS:
                        del self._records[: self.MAX_RECORDS // 2]
                    self._records.append((path, call, outs, stops))
            except Exception:
                pass
            return None

        return post

    def _resolve(self) -> None:
        for path, call, outs, stops in self._records:
            self._claim(outs, stops, (path, call))
        self._records.clear()

    def _claim(self, todo: list[Any], stops: set[int], where: tuple[str, int]) -> None:
        seen: set[int] = set()
        todo = list(todo)
        while todo:
            gn = todo.pop()
            ptr = gn.node_ptr()
            if ptr in seen or ptr in stops:
                continue
            seen.add(ptr)
            if gn.name() == "GradNodeAccumulation":
                continue
            if ptr not in self.owner:  # inner layers ran first and keep their claim
                self.owner[ptr] = where
            todo.extend(n for n in gn.next_functions if n is not None)


def _tensors_in(obj: Any) -> list[Any]:
    """Tensors inside nested tuples/lists/dicts (forward inputs or outputs)."""
    found = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, paddle.Tensor):
            found.append(o)
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
    return found


# --------------------------------------------------------------------------
# the public context manager
# --------------------------------------------------------------------------
class _Session:
    """State of one capture of one backward call."""

    def __init__(self, cap: "BackwardCapture", walk: _Walk, entry: str, t0: float):
        self.cap = cap
        self.walk = walk
        self.entry = entry
        self.handles: list[Any] = []
        self.in_meta: dict[int, GradMeta] = {}
        self.errors: list[BaseException] = []
        self.interrupt: BaseException | None = None
        self.returned: list[list[Any]] = []  # what the hooks returned; emptied in _end
        self.hook_seconds = 0.0
        self.prepare_seconds = time.perf_counter() - t0
        self.loss: float | None = None
        self.trigger: str | None = None


class BackwardCapture:
    """Captures the backward graph of every backward run inside a ``with`` block.

    Use :func:`capture_backward` to make one.

    Attributes:
        graphs: one :class:`BackwardGraph` per backward call, in order.
        graph: the last captured graph.
    """

    def __init__(
        self,
        layer: paddle.nn.Layer | None = None,
        *,
        grad_stats: bool = True,
        params: Any = None,
        on_graph: Callable[[BackwardGraph], None] | None = None,
        keep_graphs: bool = True,
        max_graphs: int | None = None,
        when: Callable[[list[Any], Callable[[], Any]], str | None] | None = None,
        after_backward: Callable[[bool], None] | None = None,
    ) -> None:
        if layer is not None and not isinstance(layer, paddle.nn.Layer):
            raise TypeError(
                f"layer must be a paddle.nn.Layer or None, got {type(layer).__name__}; "
                "pass your model, e.g. capture_backward(model)"
            )
        if not isinstance(grad_stats, bool):
            raise TypeError(f"grad_stats must be True or False, got {grad_stats!r}")
        if params is not None and not isinstance(params, (dict, paddle.nn.Layer)):
            raise TypeError(
                f"params must be a paddle.nn.Layer or a dict of name -> Tensor, got {type(params).__name__}"
            )
        if on_graph is not None and not callable(on_graph):
            raise TypeError(f"on_graph must be callable, got {type(on_graph).__name__}")
        if max_graphs is not None and (not isinstance(max_graphs, int) or max_graphs < 1):
            raise ValueError(f"max_graphs must be a positive int or None, got {max_graphs!r}")
        self.layer = layer
        self.grad_stats = grad_stats
        self.params = params
        self.on_graph = on_graph
        self.keep_graphs = keep_graphs
        self.max_graphs = max_graphs
        # when(roots, walk) -> trigger label, or None to let this backward
        # run unobserved; `walk()` gives the (cached) structure walk.
        self.when = when
        self.after_backward = after_backward
        self.graphs: list[BackwardGraph] = []
        self.errors: list[str] = []
        self.meta: dict[str, Any] = {}
        self._active = False
        self._attribution: _LayerAttribution | None = None
        self._param_names: dict[int, tuple[str, Any]] = {}
        self._warned: set[str] = set()

    # -- context protocol ---------------------------------------------------
    def __enter__(self) -> "BackwardCapture":
        if self._active:
            raise RuntimeError("this capture is already active; create a new capture_backward() per block")
        try:
            source = self.params if self.params is not None else self.layer
            self._param_names = parameter_names(source) if source is not None else {}
            if self.layer is not None:
                self._attribution = _LayerAttribution(self.layer)
                self._attribution.install()
            _DISPATCHER.activate(self)
            self._active = True
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._teardown()

    def _teardown(self) -> None:
        self._active = False
        _DISPATCHER.deactivate(self)
        if self._attribution is not None:
            self._attribution.remove()
            self._attribution = None
        self._param_names = {}

    @property
    def graph(self) -> BackwardGraph:
        """The last captured graph.

        Raises:
            RuntimeError: no backward ran inside the block.
        """
        if not self.graphs:
            raise RuntimeError(
                "no backward graph was captured: call loss.backward(), paddle.grad() or "
                "paddle.autograd.backward() inside the `with capture_backward(...)` block"
            )
        return self.graphs[-1]

    # -- called by the dispatcher -----------------------------------------
    def _begin(self, roots: list[Any], entry: str) -> _Session | None:
        t0 = time.perf_counter()
        try:
            if not any(_grad_fn(t) is not None for t in roots):
                return None
            layer_of = self._attribution.lookup if self._attribution is not None else None
            cache: list[_Walk] = []

            def walk() -> _Walk:
                if not cache:
                    cache.append(walk_graph(roots, self._param_names, layer_of))
                return cache[0]

            trigger = self.when(roots, walk) if self.when is not None else None
            if self.when is not None and trigger is None:
                if cache:
                    cache[0].wrappers.clear()
                return None
            s = _Session(self, walk(), entry, t0)
            s.trigger = trigger
            if len(roots) == 1 and roots[0].size == 1:
                s.loss = float(roots[0])
            self._hook_all(s)
            s.prepare_seconds = time.perf_counter() - t0
            return s
        except Exception as exc:  # observability never breaks training
            self._warn_once("capture", f"backward graph capture failed and was skipped: {exc!r}")
            return None

    def _hook_all(self, s: _Session) -> None:
        w = s.walk
        needs_in: set[int] = set()
        for nid, node in enumerate(w.nodes):
            if node.kind != "op":
                continue
            reason = hook_hazard(node.name)
            if reason is not None:
                node.note = reason
                needs_in.update(e.dst for e in w.out_edges.get(nid, ()))
        for nid, node in enumerate(w.nodes):
            if node.kind != "op" or node.note is not None:
                continue
            hook = self._make_hook(s, nid, nid in needs_in)
            s.handles.append(w.wrappers[nid]._register_post_hook(hook))
            node.hooked = True

    def _make_hook(self, s: _Session, nid: int, want_in: bool):
        stats = self.grad_stats
        out_edges = s.walk.out_edges.get(nid, [])
        root_edge = s.walk.root_edges.get(nid)

        def hook(outs, ins):
            t = time.perf_counter()
            try:
                produced = _flat_tensors(outs)
                for e, g in zip(out_edges, produced):
                    e.grad = _grad_meta(g, stats)
                if root_edge is not None or want_in:
                    received = _flat_tensors(ins)
                    if len(received) == 1:
                        m = _grad_meta(received[0], stats)
                        if root_edge is not None:
                            root_edge.grad = m
                        s.in_meta[nid] = m
            except Exception as exc:  # a raising hook would abort backward
                s.errors.append(exc)
            except BaseException as exc:  # Ctrl-C: re-raised when the backward returns
                if s.interrupt is None:
                    s.interrupt = exc
            s.hook_seconds += time.perf_counter() - t
            # Paddle 3.3.1 never releases the object a node post-hook returns
            # (one reference leaks per call, and with it every gradient tensor
            # in it: about 1 MB per capture of a 64x512 MLP). Return a fresh list
            # of the same slots and empty it when the backward is over
            # (_end): only an empty list is left behind.
            ret = list(outs)
            s.returned.append(ret)
            return ret

        return hook

    def _end(self, s: _Session | None, ok: bool, retain_graph: bool) -> None:
        if s is None:
            if not retain_graph and self._attribution is not None:
                self._attribution.reset()
            self._after(ok)
            return
        t0 = time.perf_counter()
        try:
            for h in s.handles:
                try:
                    h.remove()
                except Exception:
                    pass
            s.handles.clear()
            for ret in s.returned:  # see _make_hook: drop the gradients Paddle leaks
                ret.clear()
            s.returned.clear()
            s.walk.wrappers.clear()
            if not retain_graph and self._attribution is not None:
                self._attribution.reset()  # that forward's graph is consumed
            if not ok:
                return
            if s.errors:
                self._warn_once("hook", f"gradient recording failed at {len(s.errors)} nodes: {s.errors[0]!r}")
            graph = self._build(s)
            graph.meta["capture_ms"] = round(
                1000 * (s.prepare_seconds + s.hook_seconds + time.perf_counter() - t0), 3
            )
            if self.keep_graphs:
                self.graphs.append(graph)
                if self.max_graphs is not None and len(self.graphs) > self.max_graphs:
                    del self.graphs[0]
            if self.on_graph is not None:
                self.on_graph(graph)
        except Exception as exc:
            self._warn_once("finish", f"backward graph capture failed and was skipped: {exc!r}")
        self._after(ok)

    def _after(self, ok: bool) -> None:
        if self.after_backward is None:
            return
        try:
            self.after_backward(ok)
        except Exception as exc:
            self._warn_once("after", f"post-backward check failed: {exc!r}")

    def _build(self, s: _Session) -> BackwardGraph:
        w = s.walk
        in_count: dict[int, int] = {}
        for e in w.edges:
            in_count[e.dst] = in_count.get(e.dst, 0) + 1
        for e in w.edges:
            if e.grad is not None:
                continue
            # An unhooked producer: the receiver saw the same tensor when it
            # is its only incoming gradient.
            if in_count.get(e.dst) == 1 and e.dst in s.in_meta:
                e.grad = s.in_meta[e.dst]
            elif w.nodes[e.dst].kind == "param":
                leaf = w.nodes[e.dst]
                e.grad = GradMeta(shape=leaf.shape, dtype=leaf.dtype)
        graph = BackwardGraph(
            nodes=w.nodes,
            edges=w.edges,
            layers=dict(self._attribution.types) if self._attribution is not None else {},
            meta={"entry": s.entry, "grad_stats": self.grad_stats, **self.meta},
        )
        if s.loss is not None:
            graph.meta["loss"] = s.loss
        if s.trigger is not None:
            graph.meta["trigger"] = s.trigger
        graph.assign_keys()
        return graph

    def _warn_once(self, cause: str, message: str) -> None:
        self.errors.append(message)
        if cause not in self._warned:
            self._warned.add(cause)
            warnings.warn(f"paddleviz_hooks: {message}", RuntimeWarning, stacklevel=3)


def capture_backward(
    layer: paddle.nn.Layer | None = None,
    *,
    grad_stats: bool = True,
    params: Any = None,
) -> BackwardCapture:
    """Capture the backward graph of every backward call inside a ``with`` block.

    Every backward started in the block, by ``loss.backward()``,
    ``paddle.autograd.backward(...)`` or ``paddle.grad(...)``, is walked when it
    starts and observed while it runs; gradients are never changed.

    Args:
        layer: the model. When given, forward hooks installed for the block
            attribute op nodes to sublayers (``encoder.layers.3.linear1``) and
            parameters are named as in ``layer.named_parameters()``. Run the
            forward pass inside the block for layer attribution.
        grad_stats: record L2 norm, min, max and NaN/Inf counts of every
            gradient (costs a few reductions per gradient); False records
            shapes and dtypes only.
        params: names for parameter leaves when ``layer`` is not given: a
            ``paddle.nn.Layer`` or a dict name -> tensor.

    Returns:
        A :class:`BackwardCapture`; ``cap.graphs`` holds one graph per backward,
        ``cap.graph`` the last.

    Raises:
        TypeError: ``layer`` or ``params`` of the wrong type.

    Example:
        >>> with capture_backward(model) as cap:
        ...     loss = paddle.nn.functional.cross_entropy(model(x), y)
        ...     loss.backward()
        >>> print(cap.graph.summary())
    """
    return BackwardCapture(layer, grad_stats=grad_stats, params=params)


def _dispatcher_installed() -> bool:
    """True while the backward patch is in place (for tests)."""
    return _DISPATCHER.installed
