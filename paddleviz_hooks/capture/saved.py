"""Saved activations: what a step holds between its forward and its backward.

Paddle's one way to see the tensors an op keeps for its backward is
``paddle.autograd.saved_tensors_hooks``: its pack hook is called for every
dense tensor saved in the forward. :class:`SavedMemory` installs such a pair
for the forward of a captured step and records, per save, the storage
(counted once however many ops save it), its bytes, dtype and shape, the
layer call running, and the grad node holding it:

* The pack hook cannot see the grad node (Paddle creates it after the
  kernel), so while armed every ``paddle._C_ops`` function, Tensor's C
  arithmetic methods and ``PyLayer.apply`` are wrapped (``opcalls.py``, the
  wrapping shared with forward source lines): the saves made during one such
  call belong to the grad nodes that call made (a saved output to the node
  producing it, anything else to the node next to the inputs).
  ``no_node_bytes`` counts saves whose node is not in the captured graph
  (a branch the backward does not reach) or that no wrapped call made.
* Parameters and buffers are not activations: their saves are listed apart
  (``params_bytes``).
* Paddle allows one pair of saved-tensor hooks at a time, and a block's exit
  resets them for everyone. While armed, ``register``/``reset`` are patched:
  when the user's own hooks (or non-reentrant recompute, which uses them)
  start, ours step aside so theirs work exactly as without us, and come back
  when they end; what their block saved is then named in ``unobserved``,
  with the allocator's growth over it.
* The pack hook returns ``t.detach()`` (same storage): returning ``t`` itself
  would make a saved output hold its own grad node, a cycle that leaks every
  step. No grad node reference is kept by the hook; the op wrappers hold
  them only until the backward starts.

Everything is removed by :meth:`SavedMemory.disarm`, which is idempotent.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import paddle
from paddle.base import core

from ..graph import op_display_name
from . import opcalls
from .attribution import tensors_in
from .gradnode import dtype_name, forget_saved, grad_fn, note_saved
from .opcalls import _TENSOR_METHODS, _op_sites  # noqa: F401  (where they were first defined)

__all__ = ["SavedMemory", "allocated_bytes", "storage_key"]

_ARMED_LOCK = threading.Lock()
_ARMED: list["SavedMemory"] = []  # at most one tracker observes at a time


def allocated_bytes() -> int | None:
    """Bytes Paddle's allocator holds now on the current device (None where unknown).

    On the CPU this is the host counter; on a GPU the device's own counter
    (activations live there).
    """
    try:
        device = paddle.get_device()
        if device.startswith("gpu"):
            index = int(device.partition(":")[2] or 0)
            return int(core.device_memory_stat_current_value("Allocated", index))
        if device == "cpu":
            return int(core.host_memory_stat_current_value("Allocated", 0))
    except Exception:
        pass
    return None


def storage_key(t: Any) -> tuple[int, int]:
    """(address of the allocation holding ``t``, its size in bytes)."""
    return t.data_ptr() - t._offset(), int(t._holder_size())


class _Save:
    """One pack call: a saved tensor and where it was saved."""

    __slots__ = ("key", "nbytes", "dtype", "shape", "frame", "persistable", "node")

    def __init__(self, key, nbytes, dtype, shape, frame, persistable):
        self.key, self.nbytes, self.dtype, self.shape = key, nbytes, dtype, shape
        self.frame, self.persistable = frame, persistable
        self.node: Any = None  # grad node wrapper of the op call that saved it (until collect)


class SavedMemory:
    """Observes the tensors saved for backward while armed.

    Args:
        layer: the model (its parameters and buffers are not activations),
            or None (then tensors marked persistable are taken as parameters).
        current_call: returns the innermost layer-call frame running now, and
            ``call_name(frame)`` its ``"path#call"`` once known (see
            ``attribution.py``); None without layer attribution.
        call_name: see ``current_call``.
    """

    def __init__(self, layer: paddle.nn.Layer | None = None,
                 current_call: Callable[[], Any] | None = None,
                 call_name: Callable[[Any], str | None] | None = None) -> None:
        """See the class docstring."""
        self.layer = layer
        self._current_call = current_call
        self._call_name = call_name
        self.saves: list[_Save] = []
        self.unobserved: list[dict[str, Any]] = []
        self.failed = 0
        self.armed = False
        self._ours = False  # our hook pair is the registered one
        self._theirs: dict[str, Any] | None = None  # the user's block under way
        self._param_keys: set[int] = set()
        self._alloc0: int | None = None
        self._alloc1: int | None = None
        self._listening = False  # the op calls are told to us (opcalls.py)
        # one record per layer call: [frame, saves before it ended, {input storage: (bytes, weakref)}]
        self._inputs: list[list[Any]] = []
        self._open: list[list[Any]] = []  # records of the calls under way
        self._handles: list[Any] = []
        self._orig_register: Callable | None = None
        self._orig_reset: Callable | None = None

    # ----------------------------------------------------------- arm/disarm
    def arm(self) -> None:
        """Start observing (a new forward). Raises only on programming errors."""
        if self.armed:
            return
        forget_saved()
        self.saves.clear()
        self.unobserved.clear()
        self.failed = 0
        self._alloc1 = None
        with _ARMED_LOCK:
            if _ARMED:
                self.unobserved.append({"what": "another capture was observing saved tensors", "bytes": None})
                return
            _ARMED.append(self)
        self.armed = True
        try:
            self._param_keys = self._parameter_keys()
            self._orig_register = core.eager.register_saved_tensors_hooks
            self._orig_reset = core.eager.reset_saved_tensors_hooks
            try:
                self._orig_register(self._pack, self._unpack)
                self._ours = True
            except ValueError:  # the user's own pair is active: leave it alone
                self.unobserved.append({"what": "saved_tensors_hooks active when the forward began", "bytes": None})
            core.eager.register_saved_tensors_hooks = self._their_register
            core.eager.reset_saved_tensors_hooks = self._their_reset
            self._listening = True  # before: a listen cut short is still undone by disarm
            opcalls.listen(saved=self)
            if self.layer is not None and self._current_call is not None:
                for sub in self.layer.sublayers(include_self=True):  # after attribution's: its frame is on top
                    if type(sub).__name__ != "DataParallel":  # attribution gives it no frame either
                        self._handles.append(sub.register_forward_pre_hook(self._pre, with_kwargs=True))
                        self._handles.append(sub.register_forward_post_hook(self._post))
            self._alloc0 = allocated_bytes()
        except BaseException:
            self.disarm()
            raise

    def disarm(self) -> None:
        """Stop observing: our hooks, wrappers and patches are all removed."""
        if not self.armed:
            return
        self._alloc1 = allocated_bytes()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._listening:
            opcalls.unlisten(saved=True)
            self._listening = False
        if self._orig_register is not None:
            core.eager.register_saved_tensors_hooks = self._orig_register
            core.eager.reset_saved_tensors_hooks = self._orig_reset
        if self._ours:
            self._orig_reset()
            self._ours = False
        if self._theirs is not None:  # their block is still open: it goes on being theirs
            self._close_theirs(still_open=True)
        self._orig_register = self._orig_reset = None
        self.armed = False
        with _ARMED_LOCK:
            if self in _ARMED:
                _ARMED.remove(self)

    def release(self) -> None:
        """Drop every grad node wrapper and record (after :meth:`collect`)."""
        self.saves.clear()
        self._inputs.clear()
        self._open.clear()

    # --------------------------------------------------------------- hooks
    def _pack(self, t: Any) -> Any:
        try:
            key, nbytes = storage_key(t)
            frame = self._current_call() if self._current_call is not None else None
            self.saves.append(_Save(key, nbytes, dtype_name(t.dtype), tuple(t.shape),
                                    frame, bool(t.persistable)))
        except Exception:
            self.failed += 1
        try:
            d = t.detach()  # same storage; t itself would form a cycle that leaks every step
            d.stop_gradient = t.stop_gradient  # PyLayers (reentrant recompute) read it back
            note_saved(d, t)  # where it came from, for stitching a recompute's backward (nested.py)
            return d
        except Exception:
            return t

    def _pre(self, layer: Any, args: Any, kwargs: Any) -> None:
        """Which storages each layer call receives (a recomputed call keeps them)."""
        try:
            keys = {}
            for t in tensors_in((args, kwargs)):
                if t._is_initialized():
                    key, nbytes = storage_key(t)
                    keys[key] = (nbytes, weakref.ref(t))
            record = [self._current_call(), None, keys]
        except Exception:
            self.failed += 1
            record = [None, None, {}]
        self._inputs.append(record)
        self._open.append(record)
        return None

    def _post(self, layer: Any, args: Any, outputs: Any) -> None:
        if self._open:
            self._open.pop()[1] = len(self.saves)
        return None

    @staticmethod
    def _unpack(t: Any) -> Any:
        return t

    def _their_register(self, pack: Any, unpack: Any) -> Any:
        """The user's (or recompute's) ``saved_tensors_hooks`` starts: ours step aside."""
        if self._ours:
            self._orig_reset()
            self._ours = False
        result = self._orig_register(pack, unpack)  # raises exactly as without us
        self._theirs = {"what": _whose(pack), "alloc": allocated_bytes()}
        return result

    def _their_reset(self) -> Any:
        """Their block ends (it resets every pair): ours come back."""
        result = self._orig_reset()
        if self._theirs is not None:
            self._close_theirs(still_open=False)
        if self.armed and not self._ours:
            try:
                self._orig_register(self._pack, self._unpack)
                self._ours = True
            except ValueError:
                pass
        return result

    def _close_theirs(self, still_open: bool) -> None:
        a0, a1 = self._theirs["alloc"], allocated_bytes()
        entry = {"what": self._theirs["what"], "bytes": None if a0 is None or a1 is None else a1 - a0}
        if still_open:
            entry["what"] += " (still open when the backward began)"
        for u in self.unobserved:  # one entry per kind, sizes added
            if u["what"] == entry["what"]:
                u["count"] = u.get("count", 1) + 1
                if u["bytes"] is not None and entry["bytes"] is not None:
                    u["bytes"] += entry["bytes"]
                break
        else:
            self.unobserved.append(entry)
        self._theirs = None

    # ------------------------------------------------------ op attribution
    def _claim(self, start: int, out: Any, args: Any) -> None:
        """The saves from ``start`` on were made by the op call that returned ``out``.

        One call can make several grad nodes (``linear`` makes Matmul and
        Add): a saved output belongs to the node producing it, anything else
        (inputs, masks, statistics) to the deepest node the call made, the
        one next to its inputs.
        """
        try:
            produced: dict[int, Any] = {}  # storage address -> grad node making that output
            new: list[Any] = []
            for t in tensors_in(out):
                gn = grad_fn(t)
                if gn is not None:
                    produced.setdefault(storage_key(t)[0], gn)
                    new.append(gn)
            if not new:
                return
            stops = {gn.node_ptr() for gn in map(grad_fn, tensors_in(args)) if gn is not None}
            seen = {gn.node_ptr() for gn in new}
            head = 0
            while head < len(new) and len(new) < 8:  # the nodes this call made, outputs first
                for nxt in new[head].next_functions:
                    if nxt is None or nxt.node_ptr() in seen or nxt.node_ptr() in stops:
                        continue
                    if nxt.name() == "GradNodeAccumulation":
                        continue
                    seen.add(nxt.node_ptr())
                    new.append(nxt)
                head += 1
            for s in self.saves[start:]:
                if s.node is None:  # an inner call claimed its own first
                    s.node = produced.get(s.key) or new[-1]
        except Exception:
            self.failed += 1

    def _parameter_keys(self) -> set[int]:
        if self.layer is None:
            return set()
        keys = set()
        for t in list(self.layer.parameters()) + list(self.layer.buffers()):
            try:
                if t._is_initialized():
                    keys.add(storage_key(t)[0])
            except Exception:
                pass
        return keys

    # -------------------------------------------------------------- result
    def _recompute_table(self, activations: set[int], limit: int = 200) -> dict[str, dict[str, int]]:
        """Per layer call: what its ops hold, its inputs, and what recomputing it would free.

        ``held``: bytes of the storages saved inside the call (its sublayers
        included). ``inputs``: bytes of the storages it received, which a
        recomputed call keeps. ``frees``: what recomputing it would give
        back: the storages only its ops save, less its inputs among them
        (still kept) and less the inputs nothing saves yet (kept from
        then on). The ``limit`` calls that free most are kept.
        """
        if self._call_name is None:
            return {}
        size: dict[int, int] = {}
        first: dict[int, int] = {}  # storage -> index of its first save
        savers: dict[int, list[list[str]]] = {}  # storage -> the call chain of each save
        for i, s in enumerate(self.saves):
            if s.key in activations:
                size[s.key] = s.nbytes
                first.setdefault(s.key, i)
                savers.setdefault(s.key, []).append(_chain(s.frame, self._call_name))
        held: dict[str, set[int]] = {}
        only: dict[str, int] = {}
        for key, chains in savers.items():
            common = set(chains[0]).intersection(*chains[1:])
            for name in set().union(*chains):
                held.setdefault(name, set()).add(key)
            for name in common:
                only[name] = only.get(name, 0) + size[key]
        inputs: dict[str, dict[int, tuple[int, bool]]] = {}  # call -> storage -> (bytes, saved)
        for frame, end, keys in self._inputs:
            name = frame[1] if frame is not None else None  # a call without its own index has no row
            if name not in held:
                continue
            for k, (nbytes, ref) in keys.items():
                if k in self._param_keys:
                    continue
                # An address names one storage only while it lives: an input nobody
                # saved is freed, and a later save may reuse its address. A save is
                # of this input if it came before the call ended (both alive then)
                # or the input is still alive now.
                same = k in first and ((end is not None and first[k] < end) or ref() is not None)
                inputs.setdefault(name, {})[k] = (nbytes, same)
        table = {}
        for name, keys in held.items():
            ins = inputs.get(name, {})
            kept = sum(b for k, (b, same) in ins.items() if not same or all(name in c for c in savers[k]))
            table[name] = {"held": sum(size[k] for k in keys), "inputs": sum(b for b, _ in ins.values()),
                           "frees": only.get(name, 0) - kept}
        ranked = sorted(table.items(), key=lambda kv: (-kv[1]["frees"], kv[0]))[:limit]
        return dict(ranked)

    def collect(self, node_ids: dict[int, int], op_names: dict[int, str]) -> tuple[dict[int, int], dict[str, Any]]:
        """Per-node bytes and the summary, after :meth:`disarm`.

        Args:
            node_ids: grad node address -> node id in the captured graph.
            op_names: node id -> readable op name.

        Returns:
            (node id -> bytes it is the first to save, ``meta["saved_memory"]``).
            A storage saved by several ops is counted once, at its first save.
        """
        seen: set[int] = set()
        params: set[int] = set()
        params_bytes = total = outside = 0
        node_bytes: dict[int, int] = {}
        by_layer: dict[str, int] = {}
        by_op: dict[str, int] = {}
        by_dtype: dict[str, int] = {}
        for s in self.saves:
            if s.nbytes <= 0 or s.key == 0:
                continue
            if s.key in self._param_keys or (self.layer is None and s.persistable):
                if s.key not in params:
                    params.add(s.key)
                    params_bytes += s.nbytes
                continue
            if s.key in seen:
                continue
            seen.add(s.key)
            total += s.nbytes
            nid = node_ids.get(s.node.node_ptr()) if s.node is not None else None
            if nid is not None:
                node_bytes[nid] = node_bytes.get(nid, 0) + s.nbytes
                op = op_names.get(nid, "?")
            else:
                outside += s.nbytes
                op = op_display_name(s.node.name()) if s.node is not None else "?"
            name = self._call_name(s.frame) if self._call_name is not None and s.frame is not None else None
            layer = name if name is not None else "?"
            by_layer[layer] = by_layer.get(layer, 0) + s.nbytes
            by_op[op] = by_op.get(op, 0) + s.nbytes
            by_dtype[s.dtype] = by_dtype.get(s.dtype, 0) + s.nbytes
        recompute = self._recompute_table(seen)
        growth = None if self._alloc0 is None or self._alloc1 is None else self._alloc1 - self._alloc0
        meta = {
            "total_bytes": total,
            "saves": len(self.saves),
            "by_layer": _sorted(by_layer),
            "by_op": _sorted(by_op),
            "by_dtype": _sorted(by_dtype),
            "params_bytes": params_bytes,
            "no_node_bytes": outside,
            "allocated_growth": growth,
            "recompute": recompute,
            "unobserved": [dict(u) for u in self.unobserved],
        }
        if self.failed:
            meta["unobserved"].append({"what": f"{self.failed} saves that could not be read", "bytes": None})
        meta["unobserved"].extend({"what": what, "bytes": None} for what in _blind_spots(op_names.values()))
        return node_bytes, meta


def _blind_spots(ops: Any) -> list[str]:
    """Ops of the graph that may hold tensors the pack hook never sees.

    Examples:
        >>> for line in _blind_spots(["Matmul", "PyLayer:Clip", "PyLayer:RecomputeFunction", "Dy2St"]):
        ...     print(line)
        to_static program (Dy2St): the activations inside it
        PyLayer:Clip: what it keeps as plain ctx attributes (only ctx.save_for_backward is seen)
    """
    found = []
    for op in sorted(set(ops)):
        if op.startswith("PyLayer") and op != "PyLayer:RecomputeFunction":  # recompute saves its inputs only
            found.append(f"{op}: what it keeps as plain ctx attributes (only ctx.save_for_backward is seen)")
        elif op.startswith("Dy2St"):
            found.append(f"to_static program ({op}): the activations inside it")
    return found


def _chain(frame: Any, call_name: Callable[[Any], str | None]) -> list[str]:
    """The layer calls a frame runs inside, innermost first (named ones only)."""
    names: list[str] = []
    while frame is not None:
        name = call_name(frame)
        if name is not None and name not in names:
            names.append(name)
        frame = frame[2]
    return names


def _sorted(d: dict[str, int]) -> dict[str, int]:
    return dict(sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))


def _whose(pack: Any) -> str:
    """Who installed a pair of saved-tensor hooks, from its pack function."""
    module = getattr(pack, "__module__", "") or ""
    if "recompute" in module:
        return "non-reentrant recompute (use_reentrant=False)"
    name = getattr(pack, "__qualname__", None) or type(pack).__name__
    return f"your own saved_tensors_hooks ({name})"
