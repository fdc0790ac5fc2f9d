"""``paddle.jit.to_static`` programs opened up: the ops behind a ``Dy2StGradNode``.

Under ``to_static`` a whole compiled program is one ``Dy2StGradNode`` in the
backward graph, and hooks on it never fire. Two things make it readable:

* :class:`ProgramRuns` chains a recorder into Paddle's run hook
  (``PartialProgramLayer.HOOKED_RUN_IMPL``, one slot, called for every
  program run in both SOT and AST mode) for the duration of a capture. Each
  run maps the ``Dy2StGradNode`` of its outputs to the program layer that ran
  it, and remembers which grad nodes its inputs came from. The map is reset
  after every backward (node addresses are reused).
* :func:`describe_program` reads that layer's backward program (op names,
  shapes, dtypes, which op feeds which, which op produces each input and
  parameter gradient) into plain Python, cached per program;
  :meth:`ProgramRuns.open` splices it into a :class:`~.gradnode.Walk` in
  place of the node's direct edges: the node feeds the ops that receive
  its output gradients, and the ops that produce input and parameter
  gradients feed the node's ``next_functions``.

Gradient values inside a program cannot be seen: its ops are drawn
unhooked, with the note :data:`~paddleviz_hooks.hazards.PROGRAM_OP_NOTE`
(``hook_hazard`` of any ``dialect.op`` name).
Parameter gradients behind it are still exact: the capture's parameter hooks
fire under ``to_static`` too.
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from .._interrupts import held_interrupts
from ..graph import Edge, GradMeta, Node
from ..hazards import hook_hazard
from .gradnode import Walk, dtype_name, grad_fn, has_graph

__all__ = ["ProgramRuns", "ProgramOps", "describe_program", "DY2ST_NODE"]

#: Paddle's grad node class name for a ``to_static`` program.
DY2ST_NODE = "Dy2StGradNode"


def _partial_program_layer() -> Any:
    """Paddle's ``PartialProgramLayer`` class, or None where it has no run hook."""
    try:
        from paddle.jit.dy2static.pir_partial_program import PartialProgramLayer
    except Exception:
        return None
    return PartialProgramLayer if hasattr(PartialProgramLayer, "HOOKED_RUN_IMPL") else None


# --------------------------------------------------------------------------
# describing a backward program
# --------------------------------------------------------------------------
@dataclass
class ProgramOps:
    """A backward program as plain data (no Paddle objects).

    Attributes:
        ops: per op, (Paddle op name, program names of the parameters among
            its operands).
        edges: (producer op, consumer op, result index, shape, dtype): a
            gradient computed by one op and used by another.
        entries: (consumer op, output-gradient index, shape, dtype): where the
            gradients the program receives (``output_grad_k``) go in.
        exits: program value name (``input_grad_k``, ``param_grad_k``) ->
            (producer op, result index).
        input_grads: ``input_grad_k`` names, one per program input (None
            where the input takes no gradient).
        param_grads: parameter program name -> its ``param_grad_k`` name.
        scopes: per op, the name scope Paddle recorded on its forward op
            (``struct_name``: ``/Sequential_1/BasicBlock/ReLU_1/``, one part per
            layer call; AST mode only), or None.
        scope_params: name scope -> program names of the parameters its
            forward ops use directly.
    """

    ops: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    edges: list[tuple[int, int, int, tuple[int, ...] | None, str | None]] = field(default_factory=list)
    entries: list[tuple[int, int, tuple[int, ...] | None, str | None]] = field(default_factory=list)
    exits: dict[str, tuple[int, int]] = field(default_factory=dict)
    input_grads: list[str | None] = field(default_factory=list)
    param_grads: dict[str, str] = field(default_factory=dict)
    scopes: list[str | None] = field(default_factory=list)
    scope_params: dict[str, tuple[str, ...]] = field(default_factory=dict)


_DESCRIBED: "weakref.WeakKeyDictionary[Any, tuple[int, ProgramOps]]" = weakref.WeakKeyDictionary()


def _value_meta(v: Any) -> tuple[tuple[int, ...] | None, str | None]:
    try:
        return tuple(int(s) for s in v.shape), dtype_name(v.dtype)
    except Exception:  # a vector or other non-dense value
        return None, None


def describe_program(ppl: Any) -> ProgramOps:
    """The backward program run by a ``PartialProgramLayer``, cached per program.

    Builtin ops (``builtin.combine``, ``builtin.split``, ``shadow_output``)
    are looked through, not shown. Only ops a received gradient reaches are
    kept: shape and constant ops that no gradient flows through are left out.

    Args:
        ppl: the ``PartialProgramLayer`` (from the run hook).

    Returns:
        A :class:`ProgramOps`.
    """
    program = ppl.train_program  # not .program: that one follows the train/eval flag
    cached = _DESCRIBED.get(ppl)
    if cached is not None and cached[0] == id(program):
        return cached[1]
    names = program.program_name_attr
    block = program.backward_program.global_block()
    arg_name = {v.id: k for k, v in block.kwargs().items()}
    out = ProgramOps()
    find_scope = _scope_finder(program.forward_program, out, set(names.get("fp", ())))
    index: dict[int, int] = {}  # PIR op id -> our op index
    for op in block.ops:
        name = op.name()
        if name.startswith("builtin."):
            if name == "builtin.shadow_output":
                src = _producer(op.operands_source()[0], index)
                if src is not None:
                    out.exits[op.attrs().get("output_name", "")] = src
            continue
        grads: list[tuple[Any, int, int]] = []  # (value, producer, result index)
        entries: list[tuple[Any, int]] = []
        params: list[str] = []
        for v in _sources(_operands(op)):
            d = v.get_defining_op()
            if d is None:
                arg = arg_name.get(v.id, "")
                if arg.startswith("output_grad_"):
                    entries.append((v, int(arg.rsplit("_", 1)[1])))
                elif arg in names.get("fp", ()):
                    params.append(arg)
            elif d.id() in index:
                grads.append((v, index[d.id()], v.index()))
        if not grads and not entries:
            continue  # no received gradient flows through this op
        i = len(out.ops)
        index[op.id()] = i
        out.ops.append((name, tuple(params)))
        saved = {arg_name[v.id] for v in op.operands_source() if v.get_defining_op() is None and v.id in arg_name}
        out.scopes.append(find_scope(name, saved - {a for a in saved if a.startswith("output_grad_")}))
        for v, k in entries:
            out.entries.append((i, k, *_value_meta(v)))
        for v, src, res in grads:
            out.edges.append((src, i, res, *_value_meta(v)))
    out.input_grads = [g if g != "Fake_var" else None for g in names.get("bx_g", ())]
    out.param_grads = {p: g for p, g in zip(names.get("fp", ()), names.get("bp_g", ())) if g != "Fake_var"}
    _DESCRIBED[ppl] = (id(program), out)
    return out


def _scope_finder(forward: Any, out: ProgramOps, param_names: set[str]) -> Callable[[str, set[str]], str | None]:
    """Matches a grad op to its forward op by the forward values it reads.

    ``x_grad`` reads saved forward values (``middle_k``, parameters, inputs);
    its forward op is the ``x`` (or in-place ``x_``) op among whose inputs and
    outputs they all are. Fills ``out.scope_params`` on the way.

    Returns:
        ``find(grad op name, saved value names)`` -> the forward op's name
        scope, or None when there is none or it is ambiguous.
    """
    name_of: dict[str, str] = {}
    block = forward.global_block()
    for op in block.ops:
        n = op.name()
        if n == "builtin.parameter":
            name_of[op.results()[0].id] = op.attrs().get("parameter_name", "")
        elif n == "pd_op.data":
            name_of[op.results()[0].id] = op.attrs().get("name", "")
        elif n == "builtin.shadow_output":
            name_of.setdefault(op.operands_source()[0].id, op.attrs().get("output_name", ""))
    by_kind: dict[str, list[tuple[set[str], str]]] = {}
    for op in block.ops:
        scope = op.attrs().get("struct_name") if op.has_attr("struct_name") else None
        if not scope:
            continue
        values = {name_of[v.id] for v in (*op.operands_source(), *op.results()) if v.id in name_of}
        by_kind.setdefault(op.name().rstrip("_"), []).append((values, scope))
        params = tuple(sorted(values & param_names))
        if params:
            out.scope_params[scope] = tuple(sorted(set(out.scope_params.get(scope, ())) | set(params)))

    def find(grad_name: str, saved: set[str]) -> str | None:
        if not saved or not grad_name.endswith("_grad"):
            return None
        found = {scope for values, scope in by_kind.get(grad_name[: -len("_grad")], ()) if saved <= values}
        return found.pop() if len(found) == 1 else None

    return find


def _operands(op: Any) -> list[Any]:
    """An op's operands, plus the outer values its nested blocks use (a
    control-flow op such as ``pd_op.if`` takes gradients that way)."""
    values = list(op.operands_source())
    if op.num_regions():
        for block in op.blocks():
            for inner in block.ops:
                values.extend(_operands(inner))
    return values


def _sources(values: list[Any]) -> list[Any]:
    """Operands with ``builtin.combine``/``builtin.split`` looked through."""
    flat: list[Any] = []
    todo = list(values)
    while todo:
        v = todo.pop(0)
        d = v.get_defining_op()
        if d is not None and d.name() in ("builtin.combine", "builtin.split", "builtin.slice"):
            todo[:0] = d.operands_source()
        else:
            flat.append(v)
    return flat


def _producer(v: Any, index: dict[int, int]) -> tuple[int, int] | None:
    vs = _sources([v])
    if len(vs) != 1:
        return None
    d = vs[0].get_defining_op()
    if d is None or d.id() not in index:
        return None
    return index[d.id()], vs[0].index()


# --------------------------------------------------------------------------
# seeing program runs
# --------------------------------------------------------------------------
class _RunHook:
    """The one run hook shared by every active :class:`ProgramRuns`.

    Installed while at least one is active, chained in front of the hook
    that was there before, which is put back when the last one stops (the
    same pattern as the backward dispatcher), so captures may end in any
    order and leave Paddle's slot as they found it.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._active: list["ProgramRuns"] = []
        self._prev: Callable | None = None
        self._installed = False

    def activate(self, runs: "ProgramRuns") -> None:
        cls = _partial_program_layer()
        if cls is None:
            return
        with self._lock, held_interrupts():
            if runs in self._active:
                return
            if not self._installed:
                self._prev = cls.HOOKED_RUN_IMPL
                self._installed = True  # before the slot: a deactivate cut short here still puts it back
                cls.HOOKED_RUN_IMPL = self.run
            self._active.append(runs)

    def deactivate(self, runs: "ProgramRuns") -> None:
        """Stop ``runs``; the last one puts the previous hook back (a second call finishes
        what an interrupt cut short)."""
        with self._lock, held_interrupts():
            if runs in self._active:
                self._active.remove(runs)
            if self._active or not self._installed:
                return
            cls = _partial_program_layer()
            if cls.HOOKED_RUN_IMPL == self.run or cls.HOOKED_RUN_IMPL == self._prev:
                cls.HOOKED_RUN_IMPL = self._prev
                self._installed = False
                self._prev = None
            # else someone chained a hook on top of ours and still holds it:
            # ours stays in their chain, passing every run through unchanged

    def run(self, run, inputs, parameters, attrs):
        # Paddle calls us from PartialProgramLayer.call_run_impl_with_hook,
        # called by __call__ (AST, full_graph=True) or sot_call (SOT). Only AST
        # records name scopes that can be trusted: SOT gives an op the scope
        # of the next layer call.
        try:
            scoped = sys._getframe(2).f_code.co_name == "__call__"
        except Exception:
            scoped = False
        prev = self._prev
        outs = prev(run, inputs, parameters, attrs) if prev is not None else run(inputs, parameters, attrs)
        with self._lock:
            active = list(self._active)
        if active:
            try:
                found = _dy2st_outputs(inputs, outs)
                ppl = getattr(run, "__self__", None)
                if found and ppl is not None:
                    for runs in active:
                        runs._record(ppl, found, scoped)
            except Exception as exc:  # never break the forward
                for runs in active:
                    runs._warn("to_static", f"a to_static program run could not be recorded: {exc!r}")
        return outs


def _dy2st_outputs(inputs: Any, outs: Any) -> dict[int, list[int | None]]:
    """Dy2St node address of each output -> grad node addresses of the run's inputs."""
    found: dict[int, list[int | None]] = {}
    in_ptrs: list[int | None] | None = None
    for t in outs if isinstance(outs, (list, tuple)) else (outs,):
        gf = grad_fn(t)
        if gf is not None and gf.name() == DY2ST_NODE:
            if in_ptrs is None:
                in_ptrs = [grad_fn(x).node_ptr() if has_graph(x) else None for x in (inputs or ())]
            found[gf.node_ptr()] = in_ptrs
    return found


_RUN_HOOK = _RunHook()


class ProgramRuns:
    """Records, while installed, which program each ``Dy2StGradNode`` runs.

    Args:
        warn: ``warn(cause, message)``, called when recording a run fails
            (the run itself always goes on).

    Example:
        >>> runs = ProgramRuns(lambda cause, msg: None)
        >>> runs.install(); runs.remove()
        >>> from paddle.jit.dy2static.pir_partial_program import PartialProgramLayer
        >>> PartialProgramLayer.HOOKED_RUN_IMPL is None
        True
    """

    MAX_RUNS = 10000  # forwards without a backward must not pile up

    def __init__(self, warn: Callable[[str, str], None]) -> None:
        self._warn = warn
        # node address -> (ppl, input node addresses, whether its name scopes can be trusted)
        self._runs: dict[int, tuple[Any, list[int | None], bool]] = {}

    def install(self) -> None:
        """Start recording (the shared run hook is chained in front of whatever is there)."""
        _RUN_HOOK.activate(self)

    def remove(self) -> None:
        """Stop recording; the last one active puts the previous run hook back."""
        _RUN_HOOK.deactivate(self)
        self._runs.clear()

    def reset(self) -> None:
        """Forget the runs seen so far (after each backward: node addresses are reused)."""
        self._runs.clear()

    def _record(self, ppl: Any, found: dict[int, list[int | None]], scoped: bool) -> None:
        if len(self._runs) >= self.MAX_RUNS:
            self._runs.clear()
        for ptr, in_ptrs in found.items():
            self._runs[ptr] = (ppl, in_ptrs, scoped)

    # ------------------------------------------------------------ splicing
    def open(self, walk: Walk) -> int:
        """Splice the program ops of every recorded ``Dy2StGradNode`` into ``walk``.

        Args:
            walk: a fresh walk (wrappers still held).

        Returns:
            How many program nodes were opened.
        """
        opened = 0
        calls: dict[str, int] = {}  # layer -> calls numbered so far
        # the walk meets the program that ran last first: number calls from the other end
        for nid in reversed(range(len(walk.nodes))):
            node = walk.nodes[nid]
            if node.kind != "op" or node.name != DY2ST_NODE or walk.wrappers[nid] is None:
                continue
            run = self._runs.get(walk.wrappers[nid].node_ptr())
            if run is None:
                continue
            try:
                _splice(walk, nid, describe_program(run[0]), run[0], run[1], run[2], calls)
                opened += 1
            except Exception as exc:
                self._warn("to_static", f"a to_static program could not be opened; it stays one node: {exc!r}")
        return opened


def _scope_layers(desc: ProgramOps, layer_of_param: dict[str, str | None]) -> dict[str, str]:
    """Name scope -> layer path, anchored on the scopes whose ops use parameters.

    A scope has one part per layer call, so ``/Sequential/BasicBlock/Conv2D/``
    using ``layer1.0.conv1.weight`` also names ``/Sequential/BasicBlock/`` ->
    ``layer1.0`` and ``/Sequential/`` -> ``layer1``.
    """
    found: dict[str, str] = {}
    for scope, params in desc.scope_params.items():
        layers = {layer_of_param.get(p) for p in params} - {None}
        if len(layers) != 1:
            continue
        parts, path = scope.strip("/").split("/"), layers.pop().split(".")
        while parts and path and len(path) >= len(parts):
            found.setdefault("/".join(parts), ".".join(path))
            parts, path = parts[:-1], path[:-1]
    return found


def _enclosing(places: list[tuple[str, int]], dy2st: Node) -> tuple[str | None, int]:
    """The innermost layer call containing every (layer, call) given, within the program's layer."""
    if len(set(places)) == 1:
        return places[0]
    paths = [p.split(".") if p else [] for p, _ in places]
    common: list[str] = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    path = ".".join(common)
    if any(p == path for p, _ in places):  # one of them is the enclosing layer itself
        calls = {c for p, c in places if p == path}
        if len(calls) == 1:
            return path, calls.pop()
        path = ".".join(common[:-1])  # different calls of one layer: their parent holds both
    if dy2st.layer is not None and not (path == dy2st.layer or path.startswith(dy2st.layer + ".")
                                        or dy2st.layer == ""):
        return dy2st.layer, dy2st.call
    return path, (dy2st.call if path == dy2st.layer else 0)


def _innermost(scope: str | None, in_scope: dict[str, str]) -> str | None:
    """The layer of the innermost known scope containing ``scope``."""
    parts = scope.strip("/").split("/") if scope else []
    while parts:
        path = in_scope.get("/".join(parts))
        if path is not None:
            return path
        parts = parts[:-1]
    return None


def _splice(walk: Walk, nid: int, desc: ProgramOps, ppl: Any, in_ptrs: list[int | None], scoped: bool,
            calls: dict[str, int]) -> None:
    dy2st = walk.nodes[nid]
    old = walk.out_edges.get(nid, [])
    ptr_of = {id(e): walk.wrappers[e.dst].node_ptr() for e in old if walk.wrappers[e.dst] is not None}
    next_node = {ptr_of[id(e)]: walk.nodes[e.dst] for e in old if id(e) in ptr_of}
    # which program gradient each of the node's next functions receives
    wanted: dict[int, list[str]] = {}
    for k, ptr in enumerate(in_ptrs):
        if ptr is not None and k < len(desc.input_grads) and desc.input_grads[k] is not None:
            wanted.setdefault(ptr, []).append(desc.input_grads[k])
    layer_of_param: dict[str, str | None] = {}
    for p in getattr(ppl, "_params", ()):
        gf = grad_fn(p)
        if gf is None:
            continue
        ptr = gf.node_ptr()
        if p.name in desc.param_grads:
            wanted.setdefault(ptr, []).append(desc.param_grads[p.name])
        leaf = next_node.get(ptr)
        if leaf is not None and leaf.param is not None and dy2st.layer is not None:
            layer_of_param[p.name] = leaf.param.rsplit(".", 1)[0] if "." in leaf.param else ""

    base = len(walk.nodes)
    # A layer called k times in the program has k ops of each kind using its
    # parameters; the backward program lists them last call first.
    seen: dict[tuple, int] = {}
    uses: list[tuple[str, int] | None] = []
    for name, params in desc.ops:
        layers = {layer_of_param.get(p) for p in params} - {None}
        if len(layers) != 1:
            uses.append(None)
            continue
        key = (layers.pop(), name, params)
        uses.append((key[0], seen.get(key, 0)))
        seen[key] = seen.get(key, 0) + 1
    n_calls: dict[str, int] = {}
    for (layer, _, _), n in seen.items():
        n_calls[layer] = max(n, n_calls.get(layer, 0))
    in_scope = _scope_layers(desc, layer_of_param) if scoped and dy2st.layer is not None else {}
    producers: dict[int, list[int]] = {}
    for src, dst, *_ in desc.edges:
        producers.setdefault(dst, []).append(src)
    placed: dict[int, tuple[str, int]] = {}  # op -> (layer, call) known from parameters or scopes
    for i, ((name, _), use, scope) in enumerate(zip(desc.ops, uses, desc.scopes)):
        node = Node(len(walk.nodes), "op", name, name.split(".", 1)[-1], note=hook_hazard(name))
        where = _innermost(scope, in_scope)
        if use is not None:
            node.layer, node.call = use[0], calls.get(use[0], 0) + n_calls[use[0]] - 1 - use[1]
        elif where is not None and where != dy2st.layer:
            node.layer = where
        elif name == "pd_op.add_n" and all(j in placed for j in producers.get(i, [None])):
            # A gradient sum has no forward op: it adds up the uses of one
            # value, all made inside the layer call enclosing its producers.
            node.layer, node.call = _enclosing([placed[j] for j in producers[i]], dy2st)
        else:
            node.layer, node.call = dy2st.layer, dy2st.call
        if use is not None or (node.layer, node.call) != (dy2st.layer, dy2st.call):
            placed[i] = (node.layer, node.call)
        walk.nodes.append(node)
        walk.wrappers.append(None)
        walk.out_edges[node.id] = []
    for layer, n in n_calls.items():
        calls[layer] = calls.get(layer, 0) + n

    def add(src: int, dst: int, slot: int, grad: GradMeta | None) -> Edge:
        e = Edge(src, dst, slot, grad)
        walk.edges.append(e)
        walk.out_edges.setdefault(src, []).append(e)
        return e

    kept, dropped = [], set()
    for e in old:
        producers = [desc.exits[g] for g in wanted.get(ptr_of.get(id(e)), ()) if g in desc.exits]
        if not producers:
            kept.append(e)  # a gradient the program passes straight through, or not mapped
            continue
        dropped.add(id(e))
        for op, res in producers:
            add(base + op, e.dst, res, None)
    walk.edges[:] = [e for e in walk.edges if id(e) not in dropped]
    walk.out_edges[nid] = []
    for slot, (op, k, shape, dtype) in enumerate(desc.entries):
        add(nid, base + op, slot, GradMeta(shape, dtype))
    for e in kept:
        e.slot += len(desc.entries)
        walk.out_edges[nid].append(e)
    for src, dst, res, shape, dtype in desc.edges:
        add(base + src, base + dst, res, GradMeta(shape, dtype))
