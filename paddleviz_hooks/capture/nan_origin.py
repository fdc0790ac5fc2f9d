"""Where a NaN/Inf really starts: replay one step's forward under Paddle's numerics checker.

Once a forward op makes a NaN every later value is NaN, so the first
non-finite *gradient* is always at the loss; and Paddle's CPU ``relu(NaN)``
returns 0, so a NaN can be born in the forward and show up only in the
gradients. Gradients alone cannot name the op. This module:

* :class:`StepInputs` keeps, for the current step only, what the top layer's
  first call received (inputs, RNG state), what it returned, and the
  gradient its outputs received in the backward (a forward pre/post hook and
  one tensor hook per output: about a microsecond per step).
* :func:`locate` re-runs that forward once under Paddle's numerics checker
  (level 0: the first op whose output holds NaN/Inf raises) and reads the op
  type from the error and the layer, file and line from the traceback.
* :func:`replay_step` re-runs forward and backward with ``paddle.grad`` (which
  leaves ``param.grad`` alone), so a capture active around it records the
  bad step's graph before the optimizer writes NaN into the weights.
* Inputs holding NaN are the origin; inputs holding only ±inf (attention
  masks) are not: :func:`_first_nan_op` finds the first op making a NaN.
* For an origin op whose output needs no gradient (no grad node),
  :func:`_entry_key` finds the node where that output enters the graph
  (kept in ``graph.meta["nonfinite_entry"]``), or nothing when unsure.
* :func:`find_nonfinite_origin` is the same locate for notebooks and
  hand-written loops.

Every replay restores what it may change: Paddle's flags, the RNG state,
grad mode and every non-trainable tensor of the model (BatchNorm
statistics); the checker's console line (written by C code to file
descriptor 1) is captured, never shown. Python side effects of ``forward``
(counters, caches) are replayed and not undone.

:func:`locate` returns a :class:`~paddleviz_hooks.graph.NonfiniteOrigin`
(``kind`` one of :data:`KINDS`), which ``paddleviz_hooks.findings`` keeps in
the graph's record; :func:`find_nonfinite_origin` returns it as a dict.
"""

from __future__ import annotations

import contextlib
import ctypes
import linecache
import os
import re
import sys
import tempfile
import threading
import traceback
from typing import Any, Iterator

import numpy as np
import paddle

from .._interrupts import held_interrupts, pop_each, run_all
from ..graph import ORIGIN_KINDS, BackwardGraph, NonfiniteOrigin, op_display_name
from .attribution import tensors_in
from .gradnode import grad_fn, strip_wrapper_prefix
from .opcalls import _TENSOR_METHODS, _op_sites, is_wrapper
from .source import users_file

__all__ = ["KINDS", "ORIGIN_KEYS", "StepInputs", "find_nonfinite_origin", "has_nonfinite", "locate",
           "replay_step"]

#: Keys of an origin dict (:func:`find_nonfinite_origin`).
ORIGIN_KEYS = tuple(NonfiniteOrigin.__dataclass_fields__)

#: What made the NaN/Inf (see :data:`paddleviz_hooks.graph.ORIGIN_KINDS`).
KINDS = ORIGIN_KINDS

_FLAGS = ("FLAGS_check_nan_inf", "FLAGS_check_nan_inf_level")
_PADDLE_DIR = os.path.dirname(os.path.abspath(paddle.__file__)) + os.sep
_PADDLE_JIT_DIR = os.path.join(_PADDLE_DIR, "jit") + os.sep
_OP_RE = re.compile(r"op=([A-Za-z0-9_.]+)")
_COUNT_RE = re.compile(r"num_(nan|inf)=(\d+)")
_DTYPE_RE = re.compile(r"dtype=([A-Za-z0-9_]+)")
_DTYPES = {"fp32": "float32", "fp64": "float64", "fp16": "float16", "bf16": "bfloat16"}


def _inexact(t: Any) -> bool:
    """Whether ``t`` can hold NaN/Inf: a floating-point or complex tensor (a complex element
    is non-finite when its real or imaginary part is)."""
    return t.is_floating_point() or t.is_complex()


def has_nonfinite(obj: Any) -> bool:
    """Whether any floating-point or complex tensor inside ``obj`` (nested lists, tuples, dicts) holds NaN/Inf.

    Examples:
        >>> has_nonfinite(([paddle.to_tensor([1.0])], {"x": paddle.to_tensor([float("nan")])}))
        True
        >>> has_nonfinite((paddle.to_tensor([1, 2]), 3.0))
        False
    """
    for t in tensors_in(obj):
        if t._is_initialized() and t.size and _inexact(t):
            if not bool(paddle.isfinite(t).all()):
                return True
    return False


def _has_nan(obj: Any) -> bool:
    """Whether any floating-point or complex tensor inside ``obj`` holds NaN (±inf is a legitimate value: masks)."""
    for t in tensors_in(obj):
        if t._is_initialized() and t.size and _inexact(t):
            if bool(paddle.isnan(t).any()):
                return True
    return False


def _origin(kind: str, **fields: Any) -> NonfiniteOrigin:
    return NonfiniteOrigin(kind, **fields)


class StepInputs:
    """What the top layer's latest call in the current step received and returned.

    The latest call is the one whose backward ran last (with gradient
    accumulation, the current micro-batch).

    Args:
        layer: the model (the layer called once per step).

    Attributes:
        args, kwargs: the inputs of the latest call since :meth:`reset`
            (references, not copies), or None when the layer was not called.
        rng: ``paddle.get_rng_state()`` when that call started.
        outputs: what it returned.
        out_grads: output tensor index -> the gradient it received in the
            backward (filled by the backward).
    """

    def __init__(self, layer: paddle.nn.Layer) -> None:
        self.layer = layer
        self._handles: list[Any] = []
        self.paused = False
        self.reset()

    def install(self) -> "StepInputs":
        self._handles.append(self.layer.register_forward_pre_hook(self._pre, with_kwargs=True))
        self._handles.append(self.layer.register_forward_post_hook(self._post, with_kwargs=True))
        return self

    def remove(self) -> None:
        """Remove both hooks (whatever one removal raises) and drop the step's references."""
        run_all(lambda: pop_each(self._handles, lambda h: h.remove()), self.reset)

    def reset(self) -> None:
        """Drop every reference kept for the step (call it when a step ends)."""
        self.args: tuple | None = None
        self.kwargs: dict = {}
        self.rng: Any = None
        self.outputs: Any = None
        self.out_grads: dict[int, Any] = {}
        self.hooked = 0  # outputs whose gradient is being kept
        self._recording = False
        self._call = getattr(self, "_call", 0) + 1  # hooks of earlier calls no longer write

    def new_step(self) -> None:
        """A step starts (or ends): drop what earlier steps kept, but not the inputs of a call
        under way now (a step opened from the model's own forward hook, as ``attach`` does,
        starts after this layer's pre-hook has kept them)."""
        if not self._recording:
            self.reset()

    @property
    def seen(self) -> bool:
        """Whether the layer was called since the last :meth:`reset`."""
        return self.args is not None

    def _pre(self, layer: Any, args: tuple, kwargs: dict) -> None:
        if self.paused or self._recording:  # a replay, or the layer calling itself
            return None
        try:
            self.reset()
            self.args, self.kwargs = tuple(args), dict(kwargs)
            self.rng = paddle.get_rng_state()
            self._recording = True
        except Exception:  # never break the forward
            self.reset()
        return None

    def _post(self, layer: Any, args: tuple, kwargs: dict, outputs: Any) -> None:
        if not self._recording:
            return None
        self._recording = False
        try:
            self.outputs = outputs
            for i, t in enumerate(tensors_in(outputs)):
                if not t.stop_gradient and grad_fn(t) is not None:
                    t.register_hook(self._grad_hook(i, self._call))
                    self.hooked += 1
        except Exception:
            pass
        return None

    def _grad_hook(self, i: int, call: int):
        def hook(grad: Any) -> None:
            try:
                if call == self._call:
                    self.out_grads[i] = grad
            except Exception:
                pass
            return None  # the gradient is never changed

        return hook


# --------------------------------------------------------------------------
# restoring what a replay may change
# --------------------------------------------------------------------------
def _frozen_state(layer: paddle.nn.Layer) -> list[tuple[Any, Any]]:
    """Every non-trainable tensor of ``layer`` (buffers, frozen parameters) with a copy."""
    seen: set[int] = set()
    out = []
    tensors = [b for _, b in layer.named_buffers()] + [p for p in layer.parameters() if p.stop_gradient]
    with paddle.no_grad():
        for t in tensors:
            if t is None or id(t) in seen or not t._is_initialized():
                continue
            seen.add(id(t))
            out.append((t, t.clone()))
    return out


@contextlib.contextmanager
def _restored(layer: paddle.nn.Layer, rng: Any = None) -> Iterator[None]:
    """Run a replay (from RNG state ``rng`` when given) and put everything back after."""
    rng_now = paddle.get_rng_state()
    grad_was = paddle.is_grad_enabled()
    frozen = _frozen_state(layer)

    def put_back() -> None:
        with paddle.no_grad():
            for t, value in frozen:
                t.set_value(value)

    try:
        if rng is not None:
            paddle.set_rng_state(rng)
        yield
    finally:
        with held_interrupts():  # every part is put back, whatever raises where
            run_all(lambda: paddle.set_grad_enabled(grad_was), put_back, lambda: paddle.set_rng_state(rng_now))


@contextlib.contextmanager
def _numerics_checker(level: int = 0) -> Iterator[Any]:
    """Paddle's numerics checker at ``level`` for the block (0: the first op making NaN/Inf raises;
    1: every such op prints a line, nothing raises); its fd-1 lines go to the file it yields,
    never to the user."""
    old = paddle.get_flags(list(_FLAGS))
    try:
        sys.stdout.flush()
    except Exception:
        pass
    sink = tempfile.TemporaryFile()
    held: list[int] = []  # the saved fd 1, while it is redirected

    def hide() -> None:
        try:
            saved = os.dup(1)
        except OSError:  # no file descriptor 1: nothing to hide the line from
            return
        held.append(saved)
        os.dup2(sink.fileno(), 1)

    def show() -> None:
        try:
            ctypes.CDLL(None).fflush(None)  # C stdio buffers go to the sink, not to the user
        except Exception:
            pass
        if held:
            os.dup2(held[0], 1)
            os.close(held.pop())

    try:
        with held_interrupts():  # a Ctrl-C lands before or after, never between, these steps
            hide()
            paddle.set_flags({_FLAGS[0]: True, _FLAGS[1]: level})
        yield sink
    finally:
        with held_interrupts():
            run_all(lambda: paddle.set_flags(old), show, sink.close)


def _layer_paths(layer: paddle.nn.Layer) -> dict[int, tuple[str, str]]:
    return {id(sub): ("" if path == "_layers" else strip_wrapper_prefix(path), type(sub).__name__)
            for path, sub in layer.named_sublayers(include_self=True)
            if type(sub).__name__ != "DataParallel"}


def _from_checker_error(exc: BaseException, layer: paddle.nn.Layer) -> NonfiniteOrigin | None:
    """The origin named by the checker's error: op and counts from its message, the rest from its
    traceback (see :func:`_from_stack`)."""
    tb = exc.__traceback__
    try:
        return _from_stack(str(exc), [(f, n) for f, n in traceback.walk_tb(tb)], layer)
    finally:
        traceback.clear_frames(tb)  # the frames hold the replay's tensors


def _from_stack(text: str, stack: list[tuple[Any, int]], layer: paddle.nn.Layer) -> NonfiniteOrigin | None:
    """The origin named by a checker line ``text`` (op, the produced tensor's NaN/Inf counts) and the
    Python stack running the op (``(frame, line)`` pairs, outermost first): layer and line from the
    stack, whether the output needs a gradient from the inputs of the innermost Paddle function (the
    op's wrapper) in it."""
    m = _OP_RE.search(text)
    if m is None:
        return None
    paths = _layer_paths(layer)
    where = file = line = None
    needs_grad: bool | None = None
    in_program = False
    for frame, lineno in stack:
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in paths:
            where = paths[id(owner)]  # the innermost layer call wins
        name = os.path.abspath(frame.f_code.co_filename)
        if users_file(frame.f_code.co_filename):
            file, line = frame.f_code.co_filename, lineno  # the innermost line of the user's code
        if name.startswith(_PADDLE_JIT_DIR):
            in_program = True  # a to_static program: its inputs do not say what its ops need
        elif name.startswith(_PADDLE_DIR) and not isinstance(owner, paddle.nn.Layer):
            # a Paddle function (not a layer's __call__/forward): the innermost one holding
            # floating-point tensors is the op's own wrapper; its inputs decide
            floats = [t for t in tensors_in(dict(frame.f_locals)) if _inexact(t)]
            if floats:
                needs_grad = any(not t.stop_gradient for t in floats)
    code = linecache.getline(file, line).strip() if file else ""
    counts = {k: int(v) for k, v in _COUNT_RE.findall(text)}
    dtype = _DTYPE_RE.search(text)
    return _origin("forward", op=m.group(1), layer=where[0] if where else None,
                   layer_class=where[1] if where else None, file=file, line=line, code=code or None,
                   needs_grad=None if in_program else needs_grad, in_program=in_program,
                   dtype=_DTYPES.get(dtype.group(1), dtype.group(1)) if dtype else None,
                   nan=counts.get("nan"), inf=counts.get("inf"))


def _checked_forward(layer: paddle.nn.Layer, args: tuple, kwargs: dict, rng: Any,
                     outputs: list | None = None) -> NonfiniteOrigin | None:
    """One forward under the checker; the forward origin, or None when it is finite
    (then what it returned is appended to ``outputs``, when given).

    Gradients stay on (nothing runs a backward of it), so that the inputs of
    the origin's op say whether its output needs a gradient.

    The forward runs in a thread of its own, started for it: the checker
    appends the Python stack of every op to a per-thread string that nothing
    resets, which made each later checked forward of a thread slower (37 ms
    for a 2-layer encoder's first, 263 ms by its 40th); a fresh thread starts
    empty and frees the string when it ends.
    """

    def forward() -> None:
        with _numerics_checker(), paddle.set_grad_enabled(True):
            out = layer(*args, **kwargs)
        if outputs is not None:
            outputs.append(out)

    with _restored(layer, rng):
        try:
            _in_fresh_thread(forward)
        except RuntimeError as exc:
            found = _from_checker_error(exc, layer)
            if found is None:
                raise
            return found
    return None


class _NanFound(BaseException):
    """Ends a traced forward at the first op whose output holds NaN (a BaseException: a
    ``forward`` catching Exception does not swallow it; when something still does, the
    finding kept in the trace's state stands)."""

    def __init__(self, text: str, stack: list[tuple[Any, int]]) -> None:
        super().__init__(text)
        self.text, self.stack = text, stack


def _first_nan_op(layer: paddle.nn.Layer, args: tuple, kwargs: dict, rng: Any) -> tuple[NonfiniteOrigin | None, bool]:
    """The first op of one forward whose output holds NaN, and whether the forward's output holds NaN/Inf.

    For inputs holding ±inf (attention masks): the op that first makes a
    ±inf from them (``scores + mask``) made nothing wrong; what went wrong is
    the first NaN (softmax over a fully masked row). The checker at level 1
    prints a line for every op whose output holds NaN/Inf and raises
    nothing; a trace function (this replay's thread only) flushes C stdio at
    every Python event and reads the new lines: the first line with NaN was
    printed by an op run since the previous event, by the frame running then,
    on the line that frame was running (:func:`_from_stack`).
    """
    libc = ctypes.CDLL(None)
    state: dict[str, Any] = {"pos": 0, "sink": None}
    last: dict[int, int] = {}  # frame id -> the line it is running

    def check(running: Any) -> None:
        libc.fflush(None)
        sink = state["sink"]
        end = os.fstat(sink.fileno()).st_size
        if end == state["pos"]:
            return
        sink.seek(state["pos"])
        new = sink.read(end - state["pos"]).decode("utf-8", "replace")
        state["pos"] = end
        for text in new.splitlines():
            counts = dict(_COUNT_RE.findall(text))
            if int(counts.get("nan", 0)):
                stack = []
                f = running
                while f is not None:
                    stack.append((f, last.get(id(f), f.f_lineno) if f is running else f.f_lineno))
                    f = f.f_back
                state["found"] = _NanFound(text, stack[::-1])
                raise state["found"]

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if "found" in state:
            return None
        running = frame.f_back if event == "call" else frame
        if running is not None:
            check(running)
        last[id(frame)] = frame.f_lineno
        return trace

    def forward() -> bool:
        with _numerics_checker(1) as sink, paddle.set_grad_enabled(True):
            state["sink"] = sink
            sys.settrace(trace)
            try:
                out = layer(*args, **kwargs)
            finally:
                sys.settrace(None)
        return has_nonfinite(out)

    with _restored(layer, rng):
        try:
            out_bad = bool(_in_fresh_thread(forward))
        except _NanFound:
            out_bad = True
        found = state.pop("found", None)
        if found is None:
            return None, out_bad
        origin = _from_stack(found.text, found.stack, layer)
        found.stack = []  # the frames hold the replay's tensors
        return origin, True


def _in_fresh_thread(fn: Any) -> Any:
    """``fn()`` in a new thread while this one waits; its exception is raised here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, name="paddleviz-hooks-nan-check", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def locate(layer: paddle.nn.Layer, kept: StepInputs, graph: BackwardGraph | None = None,
           loss_nonfinite: bool = False) -> NonfiniteOrigin:
    """Where this step's NaN/Inf starts.

    Args:
        layer: the model.
        kept: the step's inputs, outputs and RNG state (``kept.seen`` must be True).
        graph: the step's captured (or replayed) backward graph, for the
            first non-finite gradient and the origin's node key.
        loss_nonfinite: whether the loss was NaN/Inf.

    Returns:
        The origin (``kind`` one of :data:`KINDS`); for a forward op, ``key``
        names its grad node in ``graph`` when it has one.
    """
    kept.paused = True
    replayed: list = []
    try:
        found = _forward_origin(layer, kept.args, kept.kwargs, kept.rng, replayed)
    finally:
        kept.paused = False
    if found is not None and found.kind != "forward":
        return found
    if found is not None:
        found.key = _node_key(graph, found)
        if graph is not None and found.key is None and found.needs_grad is False:
            kept.paused = True
            try:
                entry = _entry_key(layer, kept.args, kept.kwargs, kept.rng, graph, found)
            finally:
                kept.paused = False
            if entry is not None:
                graph.meta[ENTRY_META] = entry
        return found
    if has_nonfinite(kept.outputs):
        return _origin("not_reproduced")
    sites = graph.nonfinite_sites() if graph is not None else []
    if loss_nonfinite or (sites and sites[0].layer is None):
        return _origin("outside")
    if graph is not None and graph.meta.get("replayed") and not graph.nonfinite_count():
        return _origin("not_reproduced")
    if replayed and not _same_values(replayed[0], kept.outputs):
        # a finite replay says the forward was finite only if it is the step's forward: one that
        # depends on more than its inputs and the RNG (a counter) ran differently
        return _origin("not_reproduced")
    return _origin("backward")


def _same_values(a: Any, b: Any) -> bool:
    """Whether two forward results hold the same tensors, up to rounding (a kernel may sum in
    another order when run again), NaN equal to NaN.

    Examples:
        >>> t = paddle.to_tensor([1.0, 2.0])
        >>> _same_values((t, {"x": t}), (t + 1e-9, {"x": t})), _same_values(t, t * 2)
        (True, False)
    """
    xs, ys = tensors_in(a), tensors_in(b)
    if len(xs) != len(ys):
        return False
    for x, y in zip(xs, ys):
        if tuple(x.shape) != tuple(y.shape):
            return False
        if x._is_initialized() and y._is_initialized() and x.size and _inexact(x):
            if not np.allclose(x.numpy(), y.numpy(), rtol=1e-4, atol=1e-6, equal_nan=True):
                return False
    return True


def _forward_origin(layer: paddle.nn.Layer, args: tuple, kwargs: dict, rng: Any,
                    outputs: list | None = None) -> NonfiniteOrigin | None:
    """What one forward of ``layer`` on these inputs says; None when it is finite (then,
    when it ran one checked forward, what that returned is appended to ``outputs``).

    Inputs holding NaN are the origin; then trainable weights holding NaN/Inf.
    Inputs holding only ±inf (masks, a legitimate value) are the origin only
    when no op of the forward makes a NaN and the forward's output is
    non-finite; else the first op making a NaN is.
    """
    if _has_nan((args, kwargs)):
        return _origin("input")
    weights = _nonfinite_weights(layer)
    if weights is not None:
        return weights
    if has_nonfinite((args, kwargs)):
        found, out_bad = _first_nan_op(layer, args, kwargs, rng)
        return found or (_origin("input") if out_bad else None)
    return _checked_forward(layer, args, kwargs, rng, outputs)


def _nonfinite_weights(layer: paddle.nn.Layer) -> NonfiniteOrigin | None:
    """The ``weights`` origin when a trainable parameter already holds NaN/Inf."""
    for name, p in layer.named_parameters():
        if not p.stop_gradient and has_nonfinite(p):
            path = name.rpartition(".")[0]
            sub = dict(layer.named_sublayers(include_self=True)).get(path)
            return _origin("weights", layer=strip_wrapper_prefix(path),
                           layer_class=type(sub).__name__ if sub is not None else None)
    return None


#: ``graph.meta`` key of the node where the output of an origin op without a grad node enters the
#: graph, when :func:`locate` found it (``paddleviz_hooks.findings`` reads it).
ENTRY_META = "nonfinite_entry"


def _entry_key(layer: paddle.nn.Layer, args: tuple, kwargs: dict, rng: Any, graph: BackwardGraph,
               origin: NonfiniteOrigin) -> str | None:
    """Key of the node of ``graph`` where the output of an origin op that needs no gradient enters it.

    One more forward, with every Paddle op (``paddle._C_ops`` and Tensor's C
    arithmetic methods) wrapped for this replay's thread: the first op call
    that takes a tensor needing no gradient holding what the origin made
    (NaN; Inf when the origin made only Inf) and makes a grad node is where
    it enters; its node in ``graph`` is the one of the same op in the same
    layer, when there is exactly one. None when that cannot be said.
    """
    paths = _layer_paths(layer)
    want_nan = bool(origin.nan)
    box: dict[str, Any] = {}
    me: list[Any] = []

    def note(a: tuple, k: dict, out: Any) -> None:
        made = [gn for gn in map(grad_fn, tensors_in(out)) if gn is not None]
        if not made:
            return
        for t in tensors_in((a, k)):
            if t.stop_gradient and t._is_initialized() and t.size and _inexact(t) and bool(
                    (paddle.isnan(t) if want_nan else ~paddle.isfinite(t)).any()):
                where = None
                f = sys._getframe(2)
                while f is not None and where is None:
                    owner = f.f_locals.get("self")
                    if owner is not None and id(owner) in paths:
                        where = paths[id(owner)][0]
                    f = f.f_back
                box["op"], box["layer"] = op_display_name(made[0].name()), where
                return

    def wrap(f: Any) -> Any:
        def op(*a: Any, **k: Any) -> Any:
            out = f(*a, **k)
            if me and threading.current_thread() is me[0] and "op" not in box:
                with paddle.no_grad():
                    note(a, k, out)
            return out
        return op

    patched: list[tuple[Any, str, Any]] = []
    try:
        for owner, name in _op_sites():
            f = owner.__dict__.get(name)
            # an op, or a capture's wrapper of one (opcalls.py: armed for the next forward)
            if type(f).__name__ == "builtin_function_or_method" or is_wrapper(f):
                patched.append((owner, name, f))
                setattr(owner, name, wrap(f))
        for name in _TENSOR_METHODS:
            f = paddle.Tensor.__dict__.get(name)
            if f is not None and (type(f).__name__ == "method_descriptor" or is_wrapper(f)):
                patched.append((paddle.Tensor, name, f))
                setattr(paddle.Tensor, name, wrap(f))

        def forward() -> None:
            me.append(threading.current_thread())
            with paddle.set_grad_enabled(True):
                layer(*args, **kwargs)

        with _restored(layer, rng):
            _in_fresh_thread(forward)
    finally:
        with held_interrupts():  # every op is put back, a Ctrl-C or not
            pop_each(patched, lambda p: setattr(*p))
    if "op" not in box:
        return None
    same = [n for n in graph.nodes if n.kind == "op" and n.op == box["op"] and n.layer == box["layer"]]
    return same[0].key if len(same) == 1 else None


def _norm_op(name: str) -> str:
    return name.replace("_", "").lower()


def _node_key(graph: BackwardGraph | None, origin: NonfiniteOrigin) -> str | None:
    """Key of the grad node of the origin's op in its layer (its first call), if the graph has it.

    An op whose output needs no gradient has no grad node: an op of the same
    name in its layer would be another one. An op of a compiled program is
    one of the program's ops (``sqrt_`` -> ``sqrt_grad``), in its layer or a
    sublayer."""
    if graph is None or not origin.op or origin.needs_grad is False:
        return None
    want = _norm_op(origin.op.rstrip("_"))
    layer = origin.layer
    for n in graph.nodes:
        if n.kind != "op":
            continue
        if origin.in_program:
            inside = n.layer is not None and layer is not None and (
                layer == "" or n.layer == layer or n.layer.startswith(layer + "."))
            if inside and _norm_op(n.op) == want + "grad":
                return n.key
        elif n.layer == layer and _norm_op(n.op) == want:
            return n.key
    return None


def replay_step(layer: paddle.nn.Layer, kept: StepInputs) -> bool:
    """Re-run the step's forward and backward (``paddle.grad``: ``param.grad`` is untouched).

    The backward starts from the model's outputs with the gradients they
    received in the step's own backward, so a capture active around this
    call records the model's part of the step's graph with the same
    gradients. RNG, grad mode and non-trainable tensors are restored.

    Returns:
        False when there is nothing to replay (no output received a gradient).
    """
    if not kept.seen or not kept.out_grads:
        return False
    params = [p for p in layer.parameters() if not p.stop_gradient]
    kept.paused = True
    try:
        with _restored(layer, kept.rng):
            paddle.set_grad_enabled(True)
            outs = tensors_in(layer(*kept.args, **kept.kwargs))
            pairs = [(outs[i], g) for i, g in sorted(kept.out_grads.items()) if i < len(outs)]
            if not pairs or not params:
                return False
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
            if _reaches_recompute(roots):
                # reentrant recompute runs its block's backward with backward(), which
                # adds to param.grad even under paddle.grad (and gives paddle.grad nothing
                # for the block's parameters): replay with backward(), then put every
                # param.grad back as it was
                with _grads_restored(params):
                    paddle.autograd.backward(roots, grads)
            else:
                paddle.grad(roots, params, grad_outputs=grads, allow_unused=True)
    finally:
        kept.paused = False
    return True


RECOMPUTE_NODE = "GradNodePyLayer_RecomputeFunction"


def _reaches_recompute(roots: list[Any], limit: int = 100000) -> bool:
    """Whether the graph behind ``roots`` holds a reentrant recompute node."""
    todo = [g for g in (grad_fn(t) for t in roots) if g is not None]
    seen: set[int] = set()
    while todo and len(seen) < limit:
        gn = todo.pop()
        ptr = gn.node_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        if gn.name() == RECOMPUTE_NODE:
            return True
        todo.extend(n for n in gn.next_functions if n is not None)
    return False


@contextlib.contextmanager
def _grads_restored(params: list[Any]) -> Iterator[None]:
    """Every ``param.grad`` of ``params`` as it was before the block (values and absence)."""
    with paddle.no_grad():
        kept = [(p, p.grad.clone() if p.grad is not None else None) for p in params]
    try:
        yield
    finally:
        with paddle.no_grad():
            for p, g in kept:
                if g is None:
                    p.clear_gradient(False)
                else:
                    p.grad.set_value(g)


def find_nonfinite_origin(model: paddle.nn.Layer, *inputs: Any, **kwargs: Any) -> dict[str, Any] | None:
    """Run one checked forward of ``model`` and say which op first makes a NaN/Inf.

    For notebooks and hand-written loops: call it with the batch of the step
    that went wrong. Nothing of the training state changes: Paddle's flags,
    the RNG state, grad mode and BatchNorm statistics are put back, and the
    checker's console line is not printed.

    Args:
        model: the ``paddle.nn.Layer``.
        *inputs: the positional arguments ``model`` is called with.
        **kwargs: its keyword arguments.

    Returns:
        None when the forward is finite everywhere; else a dict with
        ``kind`` (``"forward"``: an op of the forward; ``"input"``: the
        inputs hold NaN, or ±inf that reaches the output with no op making
        a NaN (±inf alone, an attention mask, is a legitimate value);
        ``"weights"``: a trainable parameter holds NaN/Inf, ``layer`` names
        its layer), ``op`` (Paddle's op type, e.g. ``"sqrt"``),
        ``layer`` (dotted sublayer path, ``""`` for the model itself),
        ``layer_class``, ``file``, ``line`` and ``code`` (the source line
        that called the op), ``needs_grad`` (whether the op's output needs a
        gradient), ``dtype``, ``nan`` and ``inf`` (the tensor it produced),
        and ``call``/``key`` (None: no graph here).

    Raises:
        TypeError: ``model`` is not a ``paddle.nn.Layer``.

    Examples:
        >>> class Net(paddle.nn.Layer):
        ...     def forward(self, x):
        ...         return paddle.log(x)
        >>> o = find_nonfinite_origin(Net(), paddle.to_tensor([1.0, -1.0]))
        >>> o["kind"], o["op"], o["layer"], o["layer_class"], o["code"]
        ('forward', 'log', '', 'Net', 'return paddle.log(x)')
        >>> find_nonfinite_origin(Net(), paddle.to_tensor([1.0, 2.0])) is None
        True
    """
    if not isinstance(model, paddle.nn.Layer):
        raise TypeError(f"model must be a paddle.nn.Layer, got {type(model).__name__}; "
                        "call find_nonfinite_origin(model, x) with your model and its inputs")
    found = _forward_origin(model, inputs, kwargs, None)
    return found.to_dict() if found is not None else None
