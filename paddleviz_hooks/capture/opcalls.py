"""Paddle's op entry points, wrapped while someone listens to the op calls.

Two parts of a capture want to see each forward op call as it returns:
saved-tensor memory (``saved.py``: the saves made during the call belong to
the grad nodes it made) and forward source lines (``source.py``: the caller's
frames, noted for the grad nodes it made). Both share the one wrapping layer
here:

* every ``paddle._C_ops`` function, and each copy of one imported by name
  elsewhere in paddle (``paddle.matmul`` is ``paddle._C_ops.matmul``),
  Tensor's C arithmetic methods (``x + y``) and ``PyLayer.apply`` are
  replaced by a wrapper that calls the op and then tells the listeners;
* wrapping is counted: :func:`listen` adds a listener (and wraps when it is
  the first), :func:`unlisten` removes it (and the last one puts every
  original back), both with a Ctrl-C held, so nothing is left wrapped on any
  exit path of the capture that armed it;
* with no listener left, a wrapper someone kept calls its op and nothing else.

A wrapper is a Python function: its frames (this file's) are never a source
line; ``source.py`` leaves them out of every stack it keeps. Each op's
wrapper is made once per process, so arming only sets attributes.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import paddle

from .._interrupts import held_interrupts

__all__ = ["listen", "unlisten", "listening", "is_wrapper"]

# Tensor's C arithmetic methods that make grad nodes (the ones in Python call _C_ops)
_TENSOR_METHODS = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
                   "__rtruediv__", "__matmul__", "__pow__", "__rpow__", "__neg__", "__div__", "__rdiv__")
# Tensor's C methods behind x[...] and x[...] = v (Paddle's Python __getitem__ and
# __setitem__ call them): they make Slice, MaskedSelect, SetValue... nodes in C++.
# Wrapped for sources only: saved memory has never claimed the saves made in them.
_INDEXING = {"_getitem_dygraph": 2, "_setitem_dygraph": 2 | 1}  # _NO_CLAIM, | _INPLACE
_INHERITED = object()  # a patched class attribute that was inherited: delete it again

_LOCK = threading.Lock()
_PATCHED: list[tuple[Any, str, Any]] = []  # (owner, name, what was there), while any listener is on
# The listeners. _saved: the SavedMemory whose saves the calls claim (saved.py).
# _before, _after: forward source lines (source.py): _after(out, args, kwargs, known,
# frame of the op's caller) after each call, known being what _before(args, kwargs)
# gave before an in-place op (None for other ops). None: not listening.
_saved: Any = None
_before: Callable[..., Any] | None = None
_after: Callable[..., None] | None = None
# what source.py's format_stack noted inside the call under way; emptied before each call
pending: list[Any] = [None]
# sources note only the calls of ops whose grad node Paddle keeps no stack on (set_narrow)
_narrow = False

FILE = __file__  # this file's frames are wrapper frames: never a source line


def listen(saved: Any = None, sources: tuple[Callable[..., Any], Callable[..., None]] | None = None) -> None:
    """Add a listener (one of the two: ``saved``, or ``sources`` as (before, after));
    the first one on wraps every op entry point.

    Raises only what a failed wrapping raises, after putting back what it had
    wrapped (the listener is then not added).
    """
    global _saved, _before, _after
    with _LOCK, held_interrupts():
        if not _PATCHED:
            try:
                _wrap()
            except BaseException:
                _unwrap()
                raise
        if saved is not None:
            _saved = saved
        if sources is not None:
            _before, _after = sources


def unlisten(saved: bool = False, sources: bool = False) -> None:
    """Remove a listener; with none left every original is put back (idempotent)."""
    global _saved, _before, _after
    with _LOCK, held_interrupts():
        if saved:
            _saved = None
        if sources:
            _before = _after = None
        if _saved is None and _after is None:
            _unwrap()


def set_narrow(on: bool) -> None:
    """Sources note only ``conv2d`` and ``add_n`` calls (True), or every call."""
    global _narrow
    _narrow = on


def listening() -> bool:
    """Whether the op entry points are wrapped now."""
    return bool(_PATCHED)


def _call(f: Any, args: tuple, kwargs: dict, kind: int) -> Any:
    """Call an op, then tell the listeners. Paddle, formatting a call stack inside
    ``f``, finds this function's frame (or the op wrapper's, which does the same
    when only sources listen) innermost (``source.py`` reads that).
    ``kind``: :data:`_INPLACE` and :data:`_NO_CLAIM` bits."""
    saved = _saved
    after = _after if not _narrow or kind & _UNTRACED else None  # sources note this call
    if saved is None and after is None:  # no listener for this call
        return f(*args, **kwargs)
    known = _before(args, kwargs) if kind & _INPLACE and after is not None else None
    pending[0] = None
    n = len(saved.saves) if saved is not None else 0
    out = f(*args, **kwargs)
    if saved is not None and len(saved.saves) > n and not kind & _NO_CLAIM:
        saved._claim(n, out, (args, kwargs))
    if after is not None:
        after(out, args, kwargs, known, sys._getframe(2))
    return out



_SITES: list[tuple[Any, str]] | None = None
_PLAN: list[tuple[Any, str, Any, Any]] | None = None
_WRAPPERS: dict[int, Any] = {}  # id(op) -> its wrapper, made once: arming only sets attributes


_INPLACE = 1  # the op gives its first input a new grad node (add_, relu_, x[i] = v)
_NO_CLAIM = 2  # saved memory does not claim the saves made in it (only sources listen)
_UNTRACED = 4  # Paddle keeps no stack on the grad node it makes: noted even when narrow


def _wrapper(f: Any, kind: int = 0) -> Any:
    op = _WRAPPERS.get(id(f))
    if op is None:
        name = getattr(f, "__name__", "op")
        if name.endswith("_") and not name.endswith("__"):
            kind |= _INPLACE
        if name in ("conv2d", "add_n"):  # Conv2dGradNodeFinal, AddNGradNodeFinal
            kind |= _UNTRACED

        def op(*args, **kwargs):
            after = _after
            if after is None or _saved is not None:
                return _call(f, args, kwargs, kind)
            if _narrow and not kind & _UNTRACED:
                return f(*args, **kwargs)
            # sources alone (most captured steps): _call's work here, one call less per op
            known = _before(args, kwargs) if kind & _INPLACE else None
            pending[0] = None
            out = f(*args, **kwargs)
            after(out, args, kwargs, known, sys._getframe(1))
            return out

        op.__name__ = name
        op.__doc__ = getattr(f, "__doc__", None)
        op._paddleviz_op = f  # keeps f alive, so its id is never reused
        _WRAPPERS[id(f)] = op
    return op


#: the code of the functions that call an op: Paddle, formatting a call stack from inside
#: the op, finds one of them innermost
CALL_CODES = (_call.__code__, _wrapper(len).__code__)
_WRAPPERS.pop(id(len))


def is_wrapper(f: Any) -> bool:
    """Whether ``f`` is one of this module's op wrappers."""
    return type(f).__name__ == "function" and getattr(f, "_paddleviz_op", None) is not None


def _wrap() -> None:
    patched = _PATCHED
    for owner, name, op, wrapper in _op_plan():  # thousands of sites: kept lean
        d = owner.__dict__
        f = d.get(name)
        if f is not op:  # changed since the scan: wrap what is there now if it is still an op
            if type(f).__name__ != "builtin_function_or_method":
                continue
            wrapper = _wrapper(f)
        patched.append((owner, name, f))
        d[name] = wrapper
    for name in _TENSOR_METHODS:
        f = paddle.Tensor.__dict__.get(name)
        if f is not None and type(f).__name__ == "method_descriptor":
            _patch(paddle.Tensor, name, _wrapper(f))
    for name, kind in _INDEXING.items():
        f = paddle.Tensor.__dict__.get(name)
        if f is not None and type(f).__name__ == "method_descriptor":
            _patch(paddle.Tensor, name, _wrapper(f, kind))
    base = paddle.autograd.PyLayer.__mro__[1]  # core.eager.PyLayer, whose apply is C
    raw = base.__dict__.get("apply")
    if raw is not None and "apply" not in paddle.autograd.PyLayer.__dict__:
        def apply(cls, *args, **kwargs):
            return _call(raw.__get__(None, cls), args, kwargs, False)

        _patch(paddle.autograd.PyLayer, "apply", classmethod(apply))


def _patch(owner: Any, name: str, new: Any) -> None:
    orig = owner.__dict__.get(name, _INHERITED)
    _PATCHED.append((owner, name, orig))
    setattr(owner, name, new)


def _unwrap() -> None:
    """Put back every original (idempotent: a second call finishes an interrupted one)."""
    while _PATCHED:
        owner, name, orig = _PATCHED[-1]
        try:
            if orig is _INHERITED:
                if name in owner.__dict__:
                    delattr(owner, name)
            elif isinstance(owner, type):
                setattr(owner, name, orig)
            else:
                owner.__dict__[name] = orig
        except Exception:
            pass
        _PATCHED.pop()


def _op_plan() -> list[tuple[Any, str, Any, Any]]:
    """(module, name, op, its wrapper) for every site of :func:`_op_sites`, made once."""
    global _PLAN
    if _PLAN is None:
        _PLAN = [(owner, name, f, _wrapper(f)) for owner, name in _op_sites()
                 for f in [vars(owner).get(name)] if type(f).__name__ == "builtin_function_or_method"]
    return _PLAN


def _op_sites() -> list[tuple[Any, str]]:
    """(owner, name) of every ``paddle._C_ops`` function and of its copies
    imported by name elsewhere in paddle (``paddle.matmul`` is
    ``paddle._C_ops.matmul``). Scanned once."""
    global _SITES
    if _SITES is None:
        ops = {id(f): f for name, f in vars(paddle._C_ops).items()
               if not name.startswith("_") and type(f).__name__ == "builtin_function_or_method"}
        sites = []
        for mod in list(sys.modules.values()):
            if not (getattr(mod, "__name__", "") or "").startswith("paddle"):
                continue
            try:
                items = list(vars(mod).items())
            except TypeError:
                continue
            sites.extend((mod, name) for name, v in items if id(v) in ops and ops[id(v)] is v)
        _SITES = sites
    return _SITES
