"""BackwardCapture: one capture of every backward run inside a ``with`` block.

* When a backward starts (seen through the dispatcher, ``dispatch.py``), each
  active capture walks the graph from the roots (the graph is freed by
  backward, so it has to be walked *before*, ``gradnode.py``) and puts a
  post-hook on every node that can safely take one (``hazards.py``). The hooks
  record the gradients that really flow (``stats.py``) and always return them
  unchanged.
* When the backward returns, the hooks are removed, every grad node wrapper is
  dropped (holding them would keep the C++ graph alive) and a plain
  :class:`~paddleviz_hooks.graph.BackwardGraph` is built.
* With a layer given, forward pre/post hooks on every sublayer attribute the op
  nodes created during the forward to the innermost layer that ran them
  (``attribution.py``).
* A backward run inside another (reentrant recompute) is captured as a child
  session and stitched into the enclosing graph at the PyLayer node that ran
  it (``nested.py``); the step then has one graph with every op and parameter.
* Every number is the gradient that flowed (``docs/paddle-autograd.md``, "What an
  edge holds"): the root edge is read by a tensor hook on the root, before its
  node's kernel can rewrite it in place; an edge filled from its receiver says
  "overwritten" when that receiver's kernel rewrote it; ``paddle.grad`` graphs
  hold only what it computed, its inputs' numbers from what it returned; a node
  used several times keeps the exact sum it received (``Node.received``).
* Every graph says which backward of its block (or step) it is:
  ``meta["backward"] = {"index": i, "of": n or None, "entry": ...}``.
* With ``saved_memory=True``, the tensors saved for backward during the
  forward are recorded (``saved.py``) and put on the graph: ``Node.saved_bytes``
  and ``meta["saved_memory"]``. Observing starts when the block is entered and
  again after each backward, and stops when a backward starts.
* With ``sources=True`` (the default), each op node gets the lines of the
  user's code that called its forward op (``Node.source``, ``source.py``): the
  forward call stacks Paddle records while its flag is on, armed the same way.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import replace
from typing import Any, Callable

import paddle

from ..graph import BackwardGraph, GradMeta
from .._interrupts import held_interrupts, pop_each, run_all
from ..hazards import PROGRAM_OP_NOTE, SHARES_RECEIVED_UNCHANGED, hook_hazard
from ..warn import WarnOnce
from .attribution import LayerAttribution, frame_name, mark_layer_notes
from .dispatch import DISPATCHER
from .gradnode import Walk, forget_saved, grad_fn, grad_node_ptr, parameter_names, prune_to_inputs, walk_graph
from .joins import Joins, explain
from .static import ProgramRuns
from .cut import CUT_KINDS, cut
from .nested import place, pylayer_context, stitch
from .saved import SavedMemory
from . import source as sources_
from .sync import AppliedGrads, data_parallel_world, local_scalar
from . import gcpause, stats

# Models whose captured forward had an op node no wrapped op call noted (source.py): a
# model's forward is much the same every step, so their later captures read the dump
# without noting every op call first (only conv2d and add_n calls, which the dump lacks).
_NOTES_MISSED: "weakref.WeakSet[Any]" = weakref.WeakSet()

__all__ = ["BackwardCapture", "capture_backward"]


# --------------------------------------------------------------------------
# the public context manager
# --------------------------------------------------------------------------
class _ParamTotals:
    """What each parameter received over one backward and the backwards nested in it.

    A parameter's leaf hook fires once per backward that reaches it, before
    Paddle adds the gradient to ``param.grad``. Nested backwards (recompute)
    can reach a parameter again: with ``keep``, the total so far is kept so a
    later contribution is added to it (a fresh tensor: the first gradient may
    be ``param.grad``'s own storage, which the next accumulation changes).
    """

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        world = data_parallel_world()
        # several processes: param.grad is also read after the backward (sync.py)
        self.applied = AppliedGrads(*world) if world is not None else None
        self.metas: dict[int, GradMeta] = {}
        self.tensors: dict[int, Any] = {}
        self.hooked: set[int] = set()  # parameters whose hook is in place
        self.applied_metas: dict[int, GradMeta] = {}  # filled after the backward (sync.py)

    def clear(self) -> None:
        self.tensors.clear()
        if self.applied is not None:
            self.applied.clear()


class _Session:
    """State of one capture of one backward call."""

    def __init__(self, cap: "BackwardCapture", walk: Walk, entry: str, t0: float,
                 parent: "_Session | None" = None):
        self.cap = cap
        self.walk = walk
        self.entry = entry
        self.parent = parent
        self.ptrs: list[int | None] = [gn.node_ptr() if gn is not None else None for gn in walk.wrappers]
        self.totals = parent.totals if parent is not None else _ParamTotals(
            keep=any(n.name.startswith("GradNodePyLayer_") for n in walk.nodes))
        # gradient statistics of the whole backward, nested ones included: read
        # when it is over (one device synchronisation, see stats.py)
        self.stats = parent.stats if parent is not None else stats.StatsQueue()
        self.param_hooks: list[int] = []  # parameters this session hooked
        self.children: list[tuple[int, "_Session"]] = []  # (node id here, stitched inner session)
        self.at: int | None = None  # where this nested session is stitched into its parent
        self.index = 0  # which backward of the block (top-level sessions)
        # a nested backward's non-parameter leaves (the recomputed block's detached
        # inputs): the sum of what reaches each, which its PyLayer passes on
        self.leaf_sums: dict[int, Any] | None = None
        self.handles: list[Any] = []  # node post-hooks and parameter hooks, removed in _end
        self.in_meta: dict[int, GradMeta] = {}
        self.joins: Joins | None = None  # Concat/AddN nodes: their gradients read from what they received
        self.errors: list[BaseException] = []
        self.interrupt: BaseException | None = None
        self.kept: list[Any] = []  # gradients a later hook reads what they became (see _make_hook)
        self.readers: set[int] = set()  # nodes whose hooks read what they received
        self.watched: set[int] = set()  # nodes whose hooks tell whether a gradient hook changed their input
        self.summed: set[int] = set()  # nodes whose hooks read the sum they received (Node.received)
        # such a node -> the addresses of the parts sent to it: Paddle adds them into the first
        # part's buffer, so a sum in none of them was made anew (a gradient hook's): no sum of the parts
        self.sent_parts: dict[int, list[int]] = {}
        self.hook_seconds = 0.0
        self.prepare_seconds = time.perf_counter() - t0
        self.loss: float | None = None
        self.trigger: str | None = None
        self.calls: dict[str, str] = {}  # layer-call tree of the walked nodes
        self.saved: tuple[dict[int, int], dict[str, Any]] | None = None  # see saved.py
        self.roots: list[Any] = []  # the tensors the backward starts from (their hooks read the root edges)
        self.inputs: list[Any] | None = None  # paddle.grad's inputs
        self.results: Any = None  # what paddle.grad returned for them (set by the dispatcher)
        # node id of a Concat/Stack with one incoming edge -> [its input slots, the gradient it received]
        self.cuts: dict[int, list[Any]] = {}
        self.in_count: dict[int, int] = {}  # incoming edges per node
        # parameter used once -> (address, in-place version, statistics) of what its one producer sent it
        self.sent: dict[int, tuple[int, int, GradMeta]] = {}
        # op node with one incoming edge, from a hooked op -> (address, in-place version) of what
        # that op sent it: another tensor received, or that one changed, means a gradient hook
        # may have changed it on the way (see _make_hook; the numbers decide, in _graph)
        self.sent_to: dict[int, tuple[int, int | None]] = {}
        self.after_hook: dict[int, GradMeta] = {}  # node id -> what it received instead (Edge.after_hook)
        self.wants_stacks = False  # its forward ran with call stacks recorded (source.py)
        # node address -> the frames the wrapped op calls noted (source.noted), and whether
        # every node that gets a source has one (then the backward needs no dump)
        self.made: dict[int, Any] | None = None
        self.whole = False
        self.stacks: dict[int, Any] | None = None  # node address -> stack, set by the dispatcher


def _changed(sent: GradMeta | None, received: GradMeta) -> bool:
    """Whether the gradient a node received differs from the one sent to it, as far as
    the numbers of both tell (a copy has the very same numbers; without numbers: not known)."""
    if sent is None or sent.norm is None or received.norm is None:
        return False
    return (sent.shape, sent.norm, sent.min, sent.max, sent.nan, sent.inf) != (
        received.shape, received.norm, received.min, received.max, received.nan, received.inf)


def _version(t: Any) -> int | None:
    """A gradient's in-place version (None for sparse rows, which keep none: Paddle warns)."""
    return None if t.is_selected_rows() else t._inplace_version()


_RETURNED = threading.local()


def _returned_list() -> list[Any]:
    """The list this thread's post-hooks return (see ``_make_hook``)."""
    ret = getattr(_RETURNED, "list", None)
    if ret is None:
        ret = _RETURNED.list = []
    return ret


def _observe(s: _Session, record: Callable[[Any], None], grad: Any) -> None:
    """Run a tensor hook's recording: a failure is kept for one warning (a raising hook would
    abort the backward), a Ctrl-C is held until the backward returns, the time is counted."""
    t = time.perf_counter()
    try:
        record(grad)
    except Exception as exc:
        s.errors.append(exc)
    except BaseException as exc:  # Ctrl-C: re-raised when the backward returns
        if s.interrupt is None:
            s.interrupt = exc
    s.hook_seconds += time.perf_counter() - t


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
        warn: Callable[[str, str], None] | None = None,
        saved_memory: bool = False,
        sources: bool = True,
    ) -> None:
        if layer is not None and not isinstance(layer, paddle.nn.Layer):
            raise TypeError(
                f"layer must be a paddle.nn.Layer or None, got {type(layer).__name__}; "
                "pass your model, e.g. capture_backward(model)"
            )
        if not isinstance(grad_stats, bool):
            raise TypeError(f"grad_stats must be True or False, got {grad_stats!r}")
        if not isinstance(saved_memory, bool):
            raise TypeError(f"saved_memory must be True or False, got {saved_memory!r}")
        if not isinstance(sources, bool):
            raise TypeError(f"sources must be True or False, got {sources!r}")
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
        # run unobserved; `walk()` gives the (cached) structure walk. Asked for
        # every top-level backward (a nested one is observed with its parent);
        # `entry_now` says which entry point started it.
        self.when = when
        self.after_backward = after_backward
        self.graphs: list[BackwardGraph] = []
        self.failures: list[str] = []  # why a backward it chose to capture gave no graph (a recorder reads it)
        self.meta: dict[str, Any] = {}
        #: top-level backwards started while active (nested ones are part of theirs)
        self.backwards_seen = 0
        #: "backward" or "grad": the entry point of the backward starting now
        self.entry_now = "backward"
        self._active = False
        self._attribution: LayerAttribution | None = None
        self._param_names: dict[int, tuple[str, Any]] = {}
        self._warn = warn or WarnOnce()
        self._programs = ProgramRuns(self._warn)  # to_static programs run in the block
        self._collections = gcpause.Pause()  # held off while hooks go in and out (gcpause.py)
        self.saved_memory = saved_memory
        self._saved: SavedMemory | None = None
        self._saved_on = False  # observe saved tensors in the forwards of this block
        self._backwards = 0  # backwards under way (a recompute's inner one runs inside another)
        #: set to a list to keep, per graph, the grad node address of every node (None: no
        #: grad node); for checks against hooks on the forward's tensors (tests/truth)
        self.node_ptrs: list[list[int | None]] | None = None
        #: record the forward source line of each op (``Node.source``)
        self.sources = sources
        #: arm source recording when the block is entered (the recorder's trigger
        #: watch, active on every step, arms it only for captured steps instead)
        self.sources_from_enter = True
        self._sources_on = False  # arm the forwards of this block (again for the next one, see _end)
        self._sources_held = False  # this capture holds Paddle's call-stack flag on now
        # after a backward, the flag goes on again at the layer's next forward, not at once: the
        # update in between (an optimizer's ops) runs without it (see _end)
        self._sources_at_forward = False
        self._forward_hooks: list[Any] = []  # the layer's pre-hook that sees its forward begin
        # a backward of this capture (or of another capture of its layer, _NOTES_MISSED) had an
        # op node no wrapped call noted: its later forwards note only what the dump lacks
        # (conv2d, add_n), the dump being read anyway (source.py)
        self._notes_missed = False
        self._held_notes = True  # what this capture's arm asked for, said again by its disarm

    # -- context protocol ---------------------------------------------------
    def __enter__(self) -> "BackwardCapture":
        if self._active:
            raise RuntimeError("this capture is already active; create a new capture_backward() per block")
        try:  # whatever raises where (a Ctrl-C is held until set-up is over), nothing stays half-installed
            with held_interrupts():
                self._collections.start()  # thousands of hook handles on a deep model (gcpause.py)
                source = self.params if self.params is not None else self.layer
                self._param_names = parameter_names(source) if source is not None else {}
                if self.layer is not None:
                    self._attribution = LayerAttribution(self.layer)
                    self._attribution.install()
                    if self.sources:  # one line: registered and kept for removal with nothing in between
                        self._forward_hooks.append(self.layer.register_forward_pre_hook(self._at_forward))
                self._programs.install()
                DISPATCHER.activate(self)
                self._active = True
                if self.saved_memory:
                    self.observe_saved(True)
                if self.sources and self.sources_from_enter:
                    self.observe_sources(True)
                self._collections.end()
            return self
        except BaseException:
            self._teardown()
            raise

    def __exit__(self, *exc: Any) -> None:
        run_all(self._teardown, self._number_backwards)  # each part runs, whatever the other raises

    def _number_backwards(self) -> None:
        for g in self.graphs:  # now the block's number of backwards is known
            info = g.meta.get("backward")
            if isinstance(info, dict) and info.get("of") is None:
                info["of"] = self.backwards_seen

    def _teardown(self) -> None:
        """Remove everything ``__enter__`` installed; every part is removed whatever
        another part raises (the first exception is raised after)."""
        with held_interrupts():
            self._active = False
            run_all(self._collections.start, lambda: self.observe_saved(False), lambda: self.observe_sources(False),
                    sources_.drop_notes, self._drop_saved, lambda: DISPATCHER.deactivate(self), self._drop_forward_hook,
                    self._programs.remove, self._drop_attribution, self._collections.end)
            self._param_names = {}

    def _drop_forward_hook(self) -> None:
        pop_each(self._forward_hooks, lambda h: h.remove())

    def _at_forward(self, layer: Any, inputs: Any) -> None:
        """The layer's forward begins: the call-stack flag goes on again if a backward let it go."""
        if self._sources_at_forward and not self._backwards:
            self._sources_at_forward = False
            self._hold_sources(self._sources_on and self._active)
        return None

    def _drop_saved(self) -> None:
        self._saved = None

    def _drop_attribution(self) -> None:
        if self._attribution is not None:
            self._attribution.remove()
            self._attribution = None

    def observe_saved(self, on: bool) -> None:
        """Start (or stop) recording what the forwards save for backward.

        The recorder turns it on at the start of a selected step only, so
        steps that are not captured arm nothing. A failure to arm is one
        warning; training goes on unobserved.
        """
        self._saved_on = on and self._active
        if not self._saved_on:
            if self._saved is not None:
                self._saved.disarm()
                self._saved.release()
            forget_saved()  # the step's saved copies are gone with its graph
            return
        try:
            if self._saved is None:
                a = self._attribution
                self._saved = SavedMemory(self.layer, a.current_frame if a is not None else None,
                                          frame_name if a is not None else None)
            self._saved.arm()
        except Exception as exc:
            self._saved_on = False
            self._warn("saved", f"saved-tensor memory is not observed: {exc!r}")

    def observe_sources(self, on: bool) -> None:
        """Start (or stop) recording where the forwards call their ops.

        Like :meth:`observe_saved`: on at the start of a captured step (or
        block) until its backward starts, again for the next forward while on (see ``_end``).
        """
        self._sources_on = on and self._active
        self._sources_at_forward = False
        self._hold_sources(self._sources_on)

    def _layer_missed(self) -> bool:
        try:
            return self.layer is not None and self.layer in _NOTES_MISSED
        except TypeError:  # a layer that cannot be weakly referenced
            return False

    def _missed_notes(self) -> None:
        self._notes_missed = True
        try:
            if self.layer is not None:
                _NOTES_MISSED.add(self.layer)
        except TypeError:
            pass

    def _hold_sources(self, on: bool) -> None:
        """Hold (or let go of) Paddle's call-stack flag for this capture."""
        if on and not self._sources_held:
            self._sources_held = True  # before: an arm cut short is still disarmed by the teardown
            self._held_notes = not (self._notes_missed or self._layer_missed())
            self._sources_held = sources_.arm(notes=self._held_notes)
            if not self._sources_held:
                self._warn("sources", "forward source lines are not recorded: Paddle's call-stack flag "
                                      "could not be set")
        elif not on and self._sources_held:
            sources_.disarm(notes=self._held_notes)
            self._sources_held = False  # after: a second call finishes an interrupted one

    @property
    def errors(self) -> list[str]:
        """Every capture problem met so far (each also warned once per cause)."""
        return self._warn.messages

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
    def _begin(self, roots: list[Any], entry: str, nested: bool = False,
               parent: _Session | None = None, inputs: Any = None) -> _Session | None:
        t0 = time.perf_counter()
        self._backwards += 1
        saved = self._saved if self._saved is not None and self._saved.armed else None
        stacks = self._sources_held  # this backward's forward ran with call stacks on
        keep_stacks = False  # on through a backward that recomputes a block
        try:
            if saved is not None:
                saved.disarm()  # the forward is over: the backward saves nothing of the step's
            if not any(grad_fn(t) is not None for t in roots):
                return None
            if nested:  # observed exactly when the backward it runs inside is
                return self._begin_nested(roots, entry, parent, t0) if parent is not None else None
            self.backwards_seen += 1
            cache: list[Walk] = []

            def walk() -> Walk:
                if not cache:
                    cache.append(self._walk(roots))
                    self._programs.open(cache[0])  # to_static programs opened
                return cache[0]

            self.entry_now = entry
            trigger = self.when(roots, walk) if self.when is not None else None
            if self.when is not None and trigger is None:
                if cache:
                    cache[0].release()
                return None
            w = walk()
            if inputs is not None:  # paddle.grad: only what it computes
                inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
                w = prune_to_inputs(w, {p for p in map(grad_node_ptr, inputs) if p is not None})
                cache[0].release()
            s = _Session(self, w, entry, t0)
            s.roots, s.inputs = list(roots), inputs
            s.trigger = trigger
            s.wants_stacks = stacks
            # the notes of its ops (paddle.grad: Paddle's dump of it names copies of the grad
            # nodes, with no stack: only the notes give its ops their lines); without the flag
            # held now, those of a forward noted while it was, whose backward comes after
            # another's (two forwards, then two backwards)
            if stacks or (self._sources_on and sources_.has_notes()):
                s.made, s.whole = sources_.noted(s.walk.nodes, s.ptrs, PROGRAM_OP_NOTE)
                if not stacks:
                    s.wants_stacks = bool(s.made)
                elif not (s.whole or sources_._FORCE_DUMP):
                    self._missed_notes()
            keep_stacks = stacks and any(n.name.startswith("GradNodePyLayer_") for n in s.walk.nodes)
            self._snapshot_calls(s)
            s.index = self.backwards_seen
            if saved is not None:
                try:
                    ids = {gn.node_ptr(): i for i, gn in enumerate(s.walk.wrappers) if gn is not None}
                    s.saved = saved.collect(ids, {i: n.op for i, n in enumerate(s.walk.nodes)})
                except Exception as exc:  # the graph is still captured, without it
                    self._warn("saved", f"saved-tensor memory is not observed: {exc!r}")
            if len(roots) == 1 and roots[0].size == 1:
                s.loss = local_scalar(roots[0])  # float() of a Partial loss would be a collective
            if stacks and not keep_stacks:  # the forward is over; with the flag on, Paddle
                self._hold_sources(False)  # would format a call stack for every hook registered
            self._hook_all(s)
            s.prepare_seconds = time.perf_counter() - t0
            return s
        except Exception as exc:  # observability never breaks training
            self.failures.append(f"capture failed: {exc!r}")
            self._warn("capture", f"backward graph capture failed and was skipped: {exc!r}")
            return None
        finally:
            if saved is not None:
                saved.release()  # the saves' grad node wrappers go now
            if stacks and not nested and not keep_stacks:
                self._hold_sources(False)  # the forward is over

    def _walk(self, roots: list[Any]) -> Walk:
        """The graph from ``roots``, its op nodes given their layer calls."""
        w = walk_graph(roots, self._param_names)
        if self._attribution is not None:
            self._attribution.assign(w)
        return w

    def _snapshot_calls(self, s: _Session) -> None:
        """The layer-call tree of the walked nodes, taken now: attribution is
        reset before the graph is built."""
        if self._attribution is not None:
            s.calls = self._attribution.call_parents(
                {f"{n.layer}#{n.call}" for n in s.walk.nodes if n.layer is not None})

    def _begin_nested(self, roots: list[Any], entry: str, parent: _Session, t0: float) -> _Session:
        """A backward inside ``parent``'s: walk and hook it, and find the node that runs it."""
        s = _Session(self, self._walk(roots), entry, t0, parent=parent)
        s.roots = list(roots)
        s.wants_stacks = parent.wants_stacks and self._sources_held  # the recomputed forward ran with them
        if s.wants_stacks:
            s.made, s.whole = sources_.noted(s.walk.nodes, s.ptrs, PROGRAM_OP_NOTE)
        for node in s.walk.nodes:  # its roots are activations (recompute's block outputs), not a loss
            if node.kind == "root":
                node.name = node.op = "activation" if len(roots) == 1 else node.name
        s.leaf_sums = {}
        self._snapshot_calls(s)
        pw = parent.walk
        next_ptrs = {nid: {parent.ptrs[e.dst] for e in out} for nid, out in pw.out_edges.items()}
        s.at = place(pylayer_context(), pw.nodes, parent.ptrs, next_ptrs, {at for at, _ in parent.children})
        self._hook_all(s)
        s.prepare_seconds = time.perf_counter() - t0
        return s

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
        joins = Joins(w.nodes, w.edges, w.out_edges, w.wrappers, s.in_meta, self.grad_stats, s.stats)
        s.joins = joins if joins else None
        into: dict[int, int] = {}  # incoming edges per node (plain ints: this runs every captured step)
        for e in w.edges:
            into[e.dst] = into.get(e.dst, 0) + 1
        s.in_count = into
        hooked_op = [n.kind == "op" and n.note is None for n in w.nodes]
        # one incoming edge, both ends hooked: the receiver tells whether it got what was sent
        s.watched = {e.dst for e in w.edges if into[e.dst] == 1 and hooked_op[e.dst] and hooked_op[e.src]}
        read_sum = self._sum_readers(s, into)
        s.readers = needs_in | read_sum
        s.summed = read_sum
        for nid, node in enumerate(w.nodes):
            if node.name in CUT_KINDS and into.get(nid) == 1 and w.wrappers[nid] is not None:
                s.cuts[nid] = [len(w.wrappers[nid].next_functions), None]
        for i, e in w.roots:  # what each root receives, read before its node's kernel can rewrite it
            t = s.roots[i] if i < len(s.roots) else None
            if t is not None and not t.stop_gradient:
                s.handles.append(t.register_hook(self._make_root_hook(s, e)))
        for nid, node in enumerate(w.nodes):
            if node.kind == "param":
                self._hook_param(s, nid)
            if node.kind != "op" or node.note is not None:
                continue
            hook = self._make_hook(s, nid, nid in needs_in, nid in read_sum)
            s.handles.append(w.wrappers[nid]._register_post_hook(hook))
            node.hooked = True

    def _hook_param(self, s: _Session, nid: int) -> None:
        """A parameter hook records the gradient this backward adds to ``param.grad``.

        A leaf hook receives the sum over every use of the parameter, after the
        user's own hooks (registered earlier, they run first), whatever grad
        nodes it passed through, hookable or not. It returns None: the
        gradient is never changed.
        """
        ptr = s.ptrs[nid]
        named = self._param_names.get(ptr)
        totals = s.totals
        if named is None or named[1].stop_gradient or ptr in totals.hooked:
            return  # an enclosing backward's hook on it sees this backward's share too
        with_stats = self.grad_stats
        sent = s.sent

        def record(grad):
            prev = totals.tensors.get(ptr)
            total = grad if prev is None else prev + grad  # before Paddle adds grad to param.grad
            got = sent.get(nid) if prev is None else None
            if got is not None and got[0] == grad.data_ptr() and got[1] == _version(grad):
                totals.metas[ptr] = got[2]  # the very tensor its one producer sent, unchanged: same numbers
            else:
                totals.metas[ptr] = stats.grad_meta(total, with_stats, s.stats)
                if got is not None:  # a gradient hook on it replaced it, or changed it in place
                    s.after_hook[nid] = totals.metas[ptr]
            if totals.applied is not None:
                totals.applied.note(ptr, named[1], total)
            if totals.keep:
                totals.tensors[ptr] = total

        def hook(grad):
            _observe(s, record, grad)
            return None

        s.handles.append(named[1].register_hook(hook))
        totals.hooked.add(ptr)
        s.param_hooks.append(ptr)

    def _sum_readers(self, s: _Session, into: dict[int, int]) -> set[int]:
        """Hooked ops that receive over several edges, each from a hooked op: their hooks read
        what they received in all (``Node.received``).

        Paddle adds the parts into the first part's buffer, which the producers' hooks keep
        until the backward is over (``_Session.kept``): the receiving op's kernel cannot
        rewrite a buffer another reference holds in place, so its post-hook reads the exact
        sum, at no extra arithmetic.
        """
        if not self.grad_stats:
            return set()  # shapes only: the sum would tell nothing more
        w = s.walk
        nodes = w.nodes
        hooked = [n.kind == "op" and n.note is None for n in nodes]  # notes are set just before
        found = {dst for dst, k in into.items() if k > 1 and hooked[dst]}
        for e in w.edges:
            if e.dst in found and not hooked[e.src]:
                found.discard(e.dst)
        return found

    def _make_root_hook(self, s: _Session, e: Any):
        """A tensor hook on a root: it runs before the root's node, with what the node receives."""
        with_stats = self.grad_stats

        def record(grad):
            e.grad = stats.grad_meta(grad, with_stats, s.stats)
            if e.dst in s.cuts:
                s.cuts[e.dst][1] = grad
            if s.joins is not None and s.joins.wants(e.dst):
                s.joins.arrive(e.dst, grad)

        def hook(grad):
            _observe(s, record, grad)
            return None

        return hook

    def _make_hook(self, s: _Session, nid: int, want_in: bool, want_sum: bool = False):
        with_stats = self.grad_stats
        queue = s.stats
        out_edges = s.walk.out_edges.get(nid, [])
        sums = s.leaf_sums
        to_leaf = ([i for i, e in enumerate(out_edges) if s.walk.nodes[e.dst].kind == "input"]
                   if sums is not None else [])
        cuts = s.cuts
        nodes = s.walk.nodes
        keeps_values = s.walk.nodes[nid].name in SHARES_RECEIVED_UNCHANGED
        sent = s.sent
        once = {i for i, e in enumerate(out_edges)  # edges into a parameter used once: its leaf hook reuses them
                if nodes[e.dst].kind == "param" and s.in_count.get(e.dst) == 1}
        joins = s.joins
        to_join = [i for i, e in enumerate(out_edges) if joins.wants(e.dst)] if joins is not None else []
        keep = [i for i, e in enumerate(out_edges) if e.dst in s.readers]
        kept = s.kept
        watched = s.watched
        send_to = [i for i, e in enumerate(out_edges) if e.dst in watched]
        parts_to = [i for i, e in enumerate(out_edges) if e.dst in s.summed]
        sent_parts = s.sent_parts
        sent_to = s.sent_to
        check_in = nid in watched
        after_hook = s.after_hook

        def hook(outs, ins):
            t = time.perf_counter()
            try:
                produced = stats.flat_tensors(outs)
                paired = len(produced) == len(out_edges)
                if keep:  # held until the backward is over, so no kernel rewrites it before its reader
                    kept.extend([produced[i] for i in keep] if paired else produced)
                if paired:
                    for i, (e, g) in enumerate(zip(out_edges, produced)):
                        e.grad = stats.grad_meta(g, with_stats, queue)
                        if i in once:
                            sent[e.dst] = (g.data_ptr(), _version(g), e.grad)
                        if e.dst in cuts:
                            cuts[e.dst][1] = g  # cut into its inputs' parts when the backward is over
                    for i in send_to:
                        sent_to[out_edges[i].dst] = (produced[i].data_ptr(), _version(produced[i]))
                    for i in parts_to:
                        sent_parts.setdefault(out_edges[i].dst, []).append(produced[i].data_ptr())
                else:  # holes or extra slots: no gradient is put on an edge it may not belong to
                    for e in out_edges:
                        e.grad = GradMeta(note="unpaired")
                if check_in:  # not the tensor its one producer sent (a copy made contiguous, a hook's),
                    at = sent_to.pop(nid, None)  # or that tensor changed in place (by a hook)
                    received = stats.flat_tensors(ins) if at is not None else ()
                    if len(received) == 1 and (received[0].data_ptr(), _version(received[0])) != at:
                        r = received[0]  # read unless this kernel already wrote into it: then it cannot tell
                        if keeps_values or not r.size or all(r.data_ptr() != g.data_ptr() for g in produced):
                            after_hook[nid] = stats.grad_meta(r, with_stats, queue)
                for i in to_leaf:  # before Paddle accumulates it into the leaf (see _ParamTotals)
                    if i < len(produced):
                        prev = sums.get(out_edges[i].dst)
                        sums[out_edges[i].dst] = produced[i] if prev is None else prev + produced[i]
                if to_join and paired:
                    for i in to_join:  # a Concat/AddN cuts or copies it (joins.py)
                        joins.arrive(out_edges[i].dst, produced[i])
                if want_in or want_sum:
                    received = stats.flat_tensors(ins)  # several: several forward outputs
                    if len(received) == 1:
                        r = received[0]
                        if not keeps_values and r.size and any(r.data_ptr() == g.data_ptr() for g in produced):
                            # the kernel wrote what it passes on into the buffer it received
                            m = stats.grad_meta(r, False)
                            m.note = "overwritten"
                        else:
                            m = stats.grad_meta(r, with_stats, queue)
                        if want_in:
                            s.in_meta[nid] = m
                            if joins is not None:
                                joins.reported(nid)
                        if want_sum and m.note is None and r.data_ptr() in sent_parts.pop(nid, ()):
                            nodes[nid].received = m  # the sum of the parts sent (none replaced it)
            except Exception as exc:  # a raising hook would abort backward
                s.errors.append(exc)
            except BaseException as exc:  # Ctrl-C: re-raised when the backward returns
                if s.interrupt is None:
                    s.interrupt = exc
            s.hook_seconds += time.perf_counter() - t
            # Paddle 3.3.1 never releases the object a node post-hook returns (one
            # reference leaks per call, and with it every gradient tensor in it: about
            # 1 MB per capture of a 64x512 MLP). So every post-hook of a thread returns
            # the same list, emptied and filled again at each call (Paddle has taken the
            # tensors out of it by then: nothing runs in between) and emptied when a
            # backward is over: a leaked reference costs no memory, and each gradient is
            # freed when Paddle is done with it, as in a backward not captured (lists
            # emptied only at the end kept every gradient of the backward alive at once;
            # a fresh list per call leaked 56 bytes each). Only the gradients a later hook
            # reads what they became are kept (``kept``).
            ret = _returned_list()
            ret.clear()
            ret.extend(outs)
            return ret

        return hook

    def _end(self, s: _Session | None, ok: bool, retain_graph: bool) -> None:
        if s is not None:
            run_all(lambda: self._unhook(s))  # first: nothing of this backward's stays hooked
        self._backwards = max(0, self._backwards - 1)
        if self._saved_on and self._active and not self._backwards:
            self.observe_saved(True)  # the next forward of the block
        if not self._backwards and self._sources_on and self._active:
            # a backward() that consumed its graph: the next graph needs a new forward of the
            # layer, the flag goes on again when that begins (an optimizer's update comes first);
            # after paddle.grad or retain_graph=True more ops may follow at once (a gradient
            # penalty): on now, as without a layer to see a forward begin
            if self._forward_hooks and not retain_graph and (s is None or s.entry == "backward"):
                self._sources_at_forward = True
            else:
                self._hold_sources(True)
        if not retain_graph:
            self._programs.reset()  # that forward's program runs are consumed
        if s is None:
            if not retain_graph and self._attribution is not None:
                self._attribution.reset()
            if not self._backwards:  # a backward run inside another (recompute) is checked with it
                self._after(ok)
            return
        t0 = time.perf_counter()
        try:
            if s.joins is not None:
                s.joins.finish()  # before _fill_received: a cut slice is exact
            if s.wants_stacks or self.sources:
                sources_.apply_stacks(s.walk.nodes, s.ptrs, s.stacks if s.wants_stacks else None,
                                      PROGRAM_OP_NOTE, nested=s.parent is not None)
            if s.parent is None:
                mark_layer_notes(s.walk.nodes, attributed=self._attribution is not None)
            s.walk.release()
            if not retain_graph and self._attribution is not None:
                # that forward's graph is consumed (a nested one: the recomputed forward's);
                # its node addresses are reused by later graphs (another forward's, still
                # waiting for its backward, keeps its layers)
                self._attribution.consumed(s.ptrs)
            if s.parent is not None:
                self._end_nested(s, ok)
                return
            if not ok:
                s.totals.clear()
                s.stats.clear()
                return
            if s.errors:
                self._warn("hook", f"gradient recording failed at {len(s.errors)} nodes: {s.errors[0]!r}")
            graph = self._build(s)
            graph.meta["capture_ms"] = round(
                1000 * (s.prepare_seconds + s.hook_seconds + time.perf_counter() - t0), 3
            )
            self._deliver(graph)
        except Exception as exc:
            self.failures.append(f"capture failed: {exc!r}")
            self._warn("finish", f"backward graph capture failed and was skipped: {exc!r}")
        self._after(ok)

    @staticmethod
    def _unhook(s: _Session) -> None:
        """Remove the session's hooks (idempotent: a second call finishes an interrupted one)."""
        pop_each(s.handles, _remove_quietly)
        s.roots, s.sent = [], {}  # s.cuts: used, then dropped, by _fill_received
        s.totals.hooked.difference_update(s.param_hooks)
        _returned_list().clear()  # see _make_hook: drop the gradients the last post-hook returned
        s.kept.clear()

    def _deliver(self, graph: BackwardGraph) -> None:
        if self.keep_graphs:
            self.graphs.append(graph)
            if self.max_graphs is not None and len(self.graphs) > self.max_graphs:
                del self.graphs[0]
        if self.on_graph is not None:
            self.on_graph(graph)

    def _end_nested(self, s: _Session, ok: bool) -> None:
        """A nested backward is over: hand it to its parent, or keep it as its own graph."""
        if not ok:
            return
        if s.errors:
            self._warn("hook", f"gradient recording failed at {len(s.errors)} nodes: {s.errors[0]!r}")
        self._fill_received(s)
        self._leaf_totals(s)
        self._merge_children(s)
        explain(s.walk.nodes, s.walk.edges, s.joins)  # after stitching: it may fill the PyLayer's edge
        if s.at is not None:
            s.parent.children.append((s.at, s))
            s.parent.hook_seconds += s.prepare_seconds + s.hook_seconds  # the step's capture cost
            return
        self._warn("unplaced", "a backward ran inside another backward but the node that ran it could not "
                               "be told for sure; it is kept as its own graph (meta['backward']['nested'])")
        s.stats.resolve()
        graph = self._graph(s, s.walk.nodes, s.walk.edges, s.ptrs)
        graph.meta["backward"] = {"index": None, "of": None, "entry": s.entry, "nested": True}
        self._deliver(graph)

    def _after(self, ok: bool) -> None:
        if self.after_backward is None:
            return
        try:
            self.after_backward(ok)
        except Exception as exc:
            self._warn("after", f"post-backward check failed: {exc!r}")

    @staticmethod
    def _fill_received(s: _Session) -> None:
        """An unhooked producer's edge: the receiver saw the same tensor when it is its only input
        (unless the receiver's kernel rewrote it first: then the edge says so)."""
        w = s.walk
        in_count: dict[int, int] = {}
        for e in w.edges:
            in_count[e.dst] = in_count.get(e.dst, 0) + 1
        BackwardCapture._cut(s)
        after_hook = s.after_hook
        for e in w.edges:
            if e.grad is None and in_count[e.dst] == 1 and e.dst in s.in_meta:
                e.grad = s.in_meta[e.dst]
            if after_hook and in_count[e.dst] == 1 and e.dst in after_hook:
                e.after_hook = after_hook[e.dst]

    @staticmethod
    def _cut(s: _Session) -> None:
        """A Stack's outgoing edges, cut from the gradient it received (``cut.py``)."""
        cuts, s.cuts = s.cuts, {}
        w = s.walk
        for nid, (slots, received) in cuts.items():
            if received is None:
                continue
            shapes: list[tuple[int, ...] | None] = [None] * slots
            for e in w.out_edges.get(nid, []):
                d = w.nodes[e.dst]
                shape = d.shape if d.kind == "param" else (s.in_meta[e.dst].shape if e.dst in s.in_meta else None)
                if e.slot < slots:
                    shapes[e.slot] = shape
            parts = cut(w.nodes[nid].name, received, shapes)
            for e in w.out_edges.get(nid, []):
                part = parts[e.slot] if e.slot < slots else None
                if part is not None and (e.grad is None or e.grad.norm is None):
                    e.grad = stats.grad_meta(part, s.cap.grad_stats, s.stats)

    def _leaf_totals(self, s: _Session) -> None:
        """A detached input's total gradient, when every gradient reaching it was seen."""
        sums, s.leaf_sums = s.leaf_sums or {}, None
        w = s.walk
        for nid, total in sums.items():
            into = [e for e in w.edges if e.dst == nid]
            if all(w.nodes[e.src].hooked for e in into):
                w.nodes[nid].grad = stats.grad_meta(total, self.grad_stats, s.stats)

    @staticmethod
    def _merge_children(s: _Session) -> None:
        """Stitch the nested backwards (already merged with theirs) into this session's graph."""
        for at, child in s.children:
            s.calls.update({k: v for k, v in child.calls.items() if k not in s.calls})
            sources_.prefix_recomputed(s.walk.nodes[at], child.walk.nodes)
            stitch(s.walk.nodes, s.walk.edges, s.ptrs, at, child.walk.nodes, child.walk.edges, child.ptrs)
        s.children.clear()

    def _build(self, s: _Session) -> BackwardGraph:
        self._fill_received(s)
        if s.saved is not None:  # node ids of this session's own walk, before stitching
            node_bytes, saved_meta = s.saved
            for nid, nbytes in node_bytes.items():
                s.walk.nodes[nid].saved_bytes = nbytes
        stitched = len(s.children)
        self._merge_children(s)
        explain(s.walk.nodes, s.walk.edges, s.joins)  # after stitching: it may fill the PyLayer's edge
        sync = self._read_applied(s)
        s.stats.resolve()  # every statistic of this backward, in one read
        graph = self._graph(s, s.walk.nodes, s.walk.edges, s.ptrs)
        s.totals.clear()
        if sync is not None:
            graph.meta["grad_sync"] = sync
        graph.meta["backward"] = {"index": s.index, "of": None, "entry": s.entry}
        if stitched:
            graph.meta["nested"] = stitched
        if s.loss is not None:
            graph.meta["loss"] = s.loss
        if s.trigger is not None:
            graph.meta["trigger"] = s.trigger
        if s.saved is not None:
            graph.meta["saved_memory"] = saved_meta
        return graph

    def _grad_results(self, s: _Session, nodes: list, ptrs: list) -> None:
        """``paddle.grad``: each input's node gets what it returned (its leaf hooks do not run):
        a parameter's row, another node's received gradient (the sum over its uses)."""
        if s.inputs is None or s.results is None:
            return
        at = {p: i for i, p in enumerate(ptrs) if p is not None}
        results = s.results if isinstance(s.results, (list, tuple)) else [s.results]
        for t, r in zip(s.inputs, results):
            ptr = grad_node_ptr(t)
            if r is None or ptr not in at:
                continue
            n = nodes[at[ptr]]
            m = stats.grad_meta(r, self.grad_stats, s.stats)
            if n.kind == "param":
                n.grad = m
            else:
                n.received = m
        s.stats.resolve()
        s.inputs = s.results = None

    def _read_applied(self, s: _Session) -> dict[str, Any] | None:
        """Several processes: each parameter's applied gradient, read from ``param.grad`` now.

        Returns:
            ``meta["grad_sync"]``: ``rank``, ``world_size``, ``params`` (how
            many were read) and ``changed`` (how many ``param.grad`` differ
            from what this rank's backward alone added: synchronised; 0 under
            ``no_sync()``, where applied and local are the same); None in a
            single process or when reading failed (one warning).
        """
        ag = s.totals.applied
        if ag is None or not ag.params:  # one process, or only distributed tensors (not read)
            if ag is not None:
                ag.clear()
            return None
        try:
            s.totals.applied_metas, changed = ag.read(self.grad_stats, s.stats)
        except Exception as exc:
            s.totals.applied_metas = {}
            self._warn("applied", f"param.grad after the backward was not read (gradients shown are "
                                  f"this rank's local ones): {exc!r}")
            return None
        finally:
            ag.clear()
        return {"rank": ag.rank, "world_size": ag.world, "params": len(s.totals.applied_metas),
                "changed": changed}

    def _graph(self, s: _Session, nodes: list, edges: list, ptrs: list) -> BackwardGraph:
        """Parameter totals in place, the rest of the edges filled, keys given."""
        metas = s.totals.metas
        for n, p in zip(nodes, ptrs):
            if n.kind == "param" and p in metas:
                n.grad = metas[p]
        self._grad_results(s, nodes, ptrs)
        in_count: dict[int, int] = {}
        for e in edges:
            in_count[e.dst] = in_count.get(e.dst, 0) + 1
        for e in edges:
            if e.grad is not None:
                continue
            if in_count.get(e.dst) == 1 and nodes[e.dst].grad is not None:
                e.grad = nodes[e.dst].grad  # a parameter used once: its total is this edge's
            elif nodes[e.dst].kind == "param":
                leaf = nodes[e.dst]
                e.grad = GradMeta(shape=leaf.shape, dtype=leaf.dtype)
        for e in edges:  # a copy with the same numbers is no change; unknown numbers tell nothing
            if e.after_hook is not None and not _changed(e.grad, e.after_hook):
                e.after_hook = None
        applied = s.totals.applied_metas
        for n, p in zip(nodes, ptrs):  # edges keep what flowed: the local gradient
            if n.kind == "param" and p in applied:
                n.local_grad, n.grad = n.grad, applied[p]
        graph = BackwardGraph(
            nodes=nodes,
            edges=edges,
            layers=dict(self._attribution.types) if self._attribution is not None else {},
            calls=s.calls,
            meta={"entry": s.entry, "grad_stats": self.grad_stats, **self.meta},
        )
        graph.assign_keys()
        if self.node_ptrs is not None:
            self.node_ptrs.append(list(ptrs))
        return graph



def _remove_quietly(handle: Any) -> None:
    try:
        handle.remove()
    except Exception:  # a hook whose node is gone already
        pass


def capture_backward(
    layer: paddle.nn.Layer | None = None,
    *,
    grad_stats: bool = True,
    params: Any = None,
    saved_memory: bool = False,
    sources: bool = True,
    **unknown: Any,
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
        saved_memory: record the tensors each forward in the block saves for
            its backward (activation memory): bytes per grad node
            (``Node.saved_bytes``), per layer call and per op in
            ``graph.meta["saved_memory"]``. Run the forward inside the block.
        sources: record where the user's code called each op's forward
            (``Node.source``: file, line, function and code of each frame):
            while the forward runs, Paddle's op entry points are wrapped and
            each op call's caller lines are noted for the grad nodes it made.
            Only when an op was made where no wrapper sees it (a C method
            such as ``x.clone()``) are its lines read from the stacks Paddle
            keeps under ``FLAGS_call_stack_level=3`` (on from the start of the
            block until a backward starts, and again from the layer's next
            forward; back at your value after), through Paddle's backward
            dump into a temporary folder. Run the forward inside the block.

    Returns:
        A :class:`BackwardCapture`; ``cap.graphs`` holds one graph per backward,
        ``cap.graph`` the last.

    Raises:
        TypeError: ``layer`` or ``params`` of the wrong type.

    Examples:
        >>> import paddle
        >>> model = paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.ReLU(), paddle.nn.Linear(8, 3))
        >>> x, y = paddle.randn([2, 4]), paddle.to_tensor([[0], [2]])
        >>> with capture_backward(model) as cap:
        ...     loss = paddle.nn.functional.cross_entropy(model(x), y)
        ...     loss.backward()
        >>> sorted(cap.graph.params())
        ['0.bias', '0.weight', '2.bias', '2.weight']
        >>> cap.graph.count_ops()["Matmul"]
        2
    """
    if unknown:  # a typo: the closest option is named
        from ..argcheck import reject_unknown

        reject_unknown("capture_backward", unknown, ("layer", "grad_stats", "params", "saved_memory", "sources"))
    return BackwardCapture(layer, grad_stats=grad_stats, params=params, saved_memory=saved_memory,
                           sources=sources)

