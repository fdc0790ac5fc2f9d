"""An independent oracle for captured backward graphs.

While a step runs, every tensor a Paddle op returns gets a tensor hook of
ours (``Tensor.register_hook``): it receives the gradient of that tensor,
the sum over all its uses, before the op's backward runs. Together with
``param.grad`` and what ``paddle.grad`` returns, this is compared with every
number a capture recorded or a collapsed view draws:

* an edge into a node with one incoming edge carries the gradient of that
  node's (single) forward output;
* ``Node.received`` is the gradient of the node's forward output;
* the root edge is the gradient the backward started with (1 for a scalar
  loss);
* a parameter row is ``param.grad`` (or the ``paddle.grad`` result), and a
  parameter that received nothing is not listed;
* an edge of a collapsed view standing for several real edges carries the
  exact gradient they sum to, or is marked as a combined figure.

An edge the capture marks as not observed (with its reason) is counted, not
failed: that is the honest answer. A number shown where the oracle has a
different one is a failure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import paddle

from paddleviz_hooks import capture_backward
from paddleviz_hooks.capture.gradnode import grad_fn
from paddleviz_hooks.capture.saved import _op_sites  # where Paddle's op functions live (no numbers)
from paddleviz_hooks.collapse import collapse_with_map, layer_depths

REL = 1e-6  # float64 norms of the same float32 values: equal up to summation order


def _norm(a: Any) -> float:
    a = a.numpy() if isinstance(a, paddle.Tensor) else a
    return float(np.sqrt(np.sum(np.square(np.asarray(a, dtype=np.float64)))))


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return False
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= REL * max(abs(a), abs(b), 1e-30) + 1e-30


# --------------------------------------------------------------------------
# tensor hooks on every op output
# --------------------------------------------------------------------------
_TENSOR_OPS = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
               "__rtruediv__", "__matmul__", "__pow__", "__rpow__", "__neg__", "__getitem__")


class TensorHooks:
    """While active, hooks every op output; ``grads[ptr]`` = {tensor id: gradient (float64 numpy)}."""

    def __init__(self) -> None:
        self.grads: dict[int, dict[int, np.ndarray]] = {}
        self._patched: list[tuple[Any, str, Any]] = []
        self._handles: list[Any] = []
        self._alive: list[Any] = []  # keeps tensor ids unique while the step runs

    def reset(self) -> None:
        self.grads.clear()

    def _watch(self, out: Any) -> None:
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if not isinstance(t, paddle.Tensor) or t.stop_gradient:
                continue
            g = grad_fn(t)
            if g is None or g.name() == "GradNodeAccumulation":
                continue
            ptr, key = g.node_ptr(), id(t)
            self._alive.append(t)

            def hook(grad, ptr=ptr, key=key):
                if grad is None or not grad._is_initialized():
                    return None
                got = self.grads.setdefault(ptr, {})
                a = grad.numpy().astype(np.float64)
                got[key] = got[key] + a if key in got else a
                return None

            self._handles.append(t.register_hook(hook))

    def _wrap(self, f: Any) -> Any:
        def wrapper(*args, **kwargs):
            out = f(*args, **kwargs)
            try:
                self._watch(out)
            except Exception:  # a tensor that takes no hook: no oracle for it
                pass
            return out

        return wrapper

    def __enter__(self) -> "TensorHooks":
        for mod, name in _op_sites():  # every paddle._C_ops function, and its copies imported by name
            v = vars(mod).get(name)
            self._patched.append((mod, name, v))
            setattr(mod, name, self._wrap(v))
        for name in _TENSOR_OPS:
            f = paddle.Tensor.__dict__.get(name)
            if f is not None:
                self._patched.append((paddle.Tensor, name, f))
                setattr(paddle.Tensor, name, self._wrap(f))
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, f in reversed(self._patched):
            setattr(owner, name, f)
        self._patched.clear()

    def release(self) -> None:
        """Remove the hooks (those of tensors whose graph is gone are gone already)."""
        while self._handles:
            handle = self._handles.pop()
            try:
                handle.remove()
            except Exception:
                continue
        self._alive.clear()


# --------------------------------------------------------------------------
# a case and its check
# --------------------------------------------------------------------------
@dataclass
class Case:
    """One model step: ``run(between)`` does the forward and the backward (or ``paddle.grad``)
    and returns ``{"grads": {param name or tensor: result}}`` for ``paddle.grad`` steps;
    ``between()`` is called before the backward that is checked (the last one), so hooks of an
    earlier backward in the same step (a gradient penalty's ``paddle.grad``) are forgotten."""

    model: paddle.nn.Layer
    run: Callable[[Callable[[], None]], dict | None]
    root: float | None = 1.0  # norm of the gradient the checked backward starts with (None: not checked)


@dataclass
class Result:
    counts: dict[str, list[int]] = field(default_factory=dict)  # check -> [ok, checked, not observed, no oracle]
    failures: list[str] = field(default_factory=list)

    def add(self, check: str, ok: bool | None, why: str = "", unobserved: bool = False) -> None:
        c = self.counts.setdefault(check, [0, 0, 0, 0])
        if unobserved:
            c[2] += 1
        elif ok is None:
            c[3] += 1
        else:
            c[1] += 1
            c[0] += ok
            if not ok and len(self.failures) < 20:
                self.failures.append(f"{check}: {why}")

    @property
    def passed(self) -> bool:
        return not self.failures


CHECKS = ("edges", "root", "params", "received", "boxes")


def check_case(make: Callable[[], Case], which: int = -1) -> Result:
    """Run one case under a capture and the oracle, and compare (``which``: the graph checked)."""
    paddle.seed(7)
    np.random.seed(7)
    case = make()
    model = case.model
    model.clear_gradients()
    cap = capture_backward(model)
    cap.node_ptrs = []
    hooks = TensorHooks()
    try:
        with hooks, cap:
            extra = case.run(hooks.reset) or {}
        graph, ptrs = cap.graphs[which], cap.node_ptrs[which]
        oracle = {p: list(v.values()) for p, v in hooks.grads.items()}
    finally:
        hooks.release()
    res = Result()
    _compare(graph, ptrs, oracle, model, extra, case.root, res)
    return res


def _compare(graph, ptrs, oracle, model, extra, root, res: Result) -> None:
    inn = graph.in_edges()
    params = dict(model.named_parameters())
    results = extra.get("grads")

    def truth_of(nid: int) -> float | None:
        """Norm of the gradient node ``nid`` received in all (None: no oracle)."""
        n = graph.nodes[nid]
        if n.kind == "param":
            if results is not None:
                r = results.get(n.param)
                return None if r is None else _norm(r)
            p = params.get(n.param)
            return None if p is None or p.grad is None else _norm(p.grad)
        got = oracle.get(ptrs[nid]) if ptrs[nid] is not None else None
        if not got or len(got) != 1:  # no hook, or several forward outputs
            return None
        return _norm(got[0])

    # edges
    for e in graph.edges:
        src = graph.nodes[e.src]
        if src.kind == "root":
            if root is None:
                continue
            ok = e.grad is not None and _close(e.grad.norm, root)
            res.add("root", ok, f"root edge {None if e.grad is None else e.grad.norm} != {root}")
            continue
        unobserved = e.grad is None or e.grad.note is not None or e.grad.norm is None
        if unobserved:
            res.add("edges", None, unobserved=True)
            continue
        if len(inn[e.dst]) != 1:
            res.add("edges", None)  # one use among several: checked through the sum (received / boxes)
            continue
        want = truth_of(e.dst)
        res.add("edges", None if want is None else _close(e.grad.norm, want),
                f"{src.op}->{graph.nodes[e.dst].op}{graph.nodes[e.dst].param or ''} drawn {e.grad.norm:.6g} real {want}")
    # parameter rows
    rows = graph.params()
    names = set(results) if results is not None else {n for n, p in params.items() if not p.stop_gradient}
    for name in names:
        if results is not None:
            r = results.get(name)
            want = None if r is None else _norm(r)
        else:
            p = params[name]
            want = None if p.grad is None else _norm(p.grad)
        got = rows.get(name)
        if want is None:
            res.add("params", got is None or got.norm is None, f"{name} listed but received nothing")
        else:
            res.add("params", got is not None and _close(got.norm, want),
                    f"{name} row {None if got is None else got.norm} != param.grad {want}")
    extra_rows = set(rows) - names
    for name in extra_rows:
        res.add("params", False, f"{name} listed but not asked for / not trainable")
    # received sums
    for n in graph.nodes:
        if n.received is not None and n.received.norm is not None and n.kind != "param":
            want = truth_of(n.id)
            res.add("received", None if want is None else _close(n.received.norm, want),
                    f"{n.op} received {n.received.norm:.6g} real {want}")
    # collapsed views at every depth
    deepest = max(layer_depths(graph).values(), default=0)
    for depth in range(0, deepest + 1):
        small, node_of = collapse_with_map(graph, depth=depth)
        for ce in small.edges:
            if graph_node_is_root(small, ce.src) or ce.grad is None or ce.grad.norm is None or ce.grad.note:
                continue
            real = [e for e in graph.edges if node_of[e.src] == ce.src and node_of[e.dst] == ce.dst
                    and (e.grad is None or ce.grad.shape is None or e.grad.shape == ce.grad.shape)]
            if ce.grad.parts > 1:
                res.add("boxes", len(real) >= ce.grad.parts, f"depth {depth}: combined edge of {len(real)} real ones")
                continue
            if len(real) == 1:
                e = real[0]
                if len(inn[e.dst]) != 1:
                    res.add("boxes", None)
                    continue
                want = truth_of(e.dst)
            else:
                dsts = {e.dst for e in real}
                if len(dsts) != 1 or len(inn[next(iter(dsts))]) != len(real):
                    res.add("boxes", False, f"depth {depth}: one figure for {len(real)} real edges of several tensors")
                    continue
                want = truth_of(next(iter(dsts)))
            res.add("boxes", None if want is None else _close(ce.grad.norm, want),
                    f"depth {depth}: box edge {ce.grad.norm:.6g} real {want}")


def graph_node_is_root(g, nid: int) -> bool:
    return g.nodes[nid].kind == "root"


def cell(res: Result, check: str) -> str:
    c = res.counts.get(check)
    if not c:
        return "-"
    ok, checked, unobs, none = c
    text = f"{ok}/{checked}"
    if unobs:
        text += f" n/o{unobs}"
    if ok != checked:
        text = "FAIL " + text
    return text
