"""Layer attribution: the layer calls of a forward, and which of them made each op."""

from __future__ import annotations

from typing import Any

import paddle

from .._interrupts import run_all
from .gradnode import Walk, grad_fn, made_by_backward, strip_wrapper_prefix

__all__ = ["LayerAttribution", "frame_name", "tensors_in", "mark_layer_notes"]


class LayerAttribution:
    """Attribute op nodes to layers, from the calls of every sublayer.

    Every call of a sublayer is seen around Paddle's ``Layer.__call__``
    (:class:`_LayerCallPatch`, one class attribute rather than a hook pair on
    each sublayer). What is seen only records, per layer call, the grad nodes of its outputs and
    of its inputs (cheap enough to run on every step); the walk that claims
    nodes for layers runs lazily, when a backward is actually captured.
    Inner layers finish first, so processing records in order lets the
    innermost layer claim a node before its parents.

    It also keeps a stack of the layer calls under way, so each call
    knows the call it ran inside: ``parents`` maps ``"path#call"`` to the
    parent's ``"path#call"`` (the layer-call tree of the forward). A call's
    index is given when it ends (only calls whose outputs carry gradient are
    counted), so a call still under way is an unnamed frame that its
    children point to and that is named when it ends.
    """

    MAX_RECORDS = 20000  # forwards without a backward must not pile up

    def __init__(self, layer: paddle.nn.Layer) -> None:
        self.layer = layer
        self.types: dict[str, str] = {}
        self.owner: dict[int, tuple[str, int]] = {}
        # address -> grad node wrapper of a node claimed outside the walk that claimed it (a
        # graph still waiting for its backward): held, so its address is not reused while
        # its claim is kept (:meth:`consumed`)
        self._held: dict[int, Any] = {}
        self._carried: set[int] = set()  # claims kept over one backward (consumed)
        # (path, call, output grad node wrappers, input node addresses); the
        # wrappers keep those nodes alive so their addresses are not reused.
        self._records: list[tuple[str, int, list[Any], set[int]]] = []
        # one frame per layer call under way: [input node addresses, "path#call"
        # once the call has ended, the frame of the call it runs inside]
        self._stack: list[list[Any]] = []
        self._calls: dict[str, int] = {}
        self._links: list[tuple[str, list[Any] | None]] = []  # ("path#call", parent frame)
        self.parents: dict[str, str] = {}
        # id(sublayer) -> its path, for the layer calls :data:`_LAYER_CALLS` reports
        self.paths: dict[int, str] = {}
        self._layers: list[Any] = []

    def install(self) -> None:
        compiled: list[str] = []  # to_static layers: their sublayers run inside a program
        static_function = _static_function()
        paths = self.paths
        for path, sub in self.layer.named_sublayers(include_self=True):
            if type(sub).__name__ == "DataParallel":
                continue
            path = strip_wrapper_prefix(path) if path != "_layers" else ""
            self.types[path] = type(sub).__name__
            if compiled and any(path.startswith(c + ".") or (c == "" and path) for c in compiled):
                # A call seen inside a to_static layer would make SOT fall back to
                # running it eagerly: the capture would change how it runs.
                continue
            if static_function is not None and isinstance(getattr(sub, "forward", None), static_function):
                compiled.append(path)
            paths.setdefault(id(sub), path)  # a layer reached by two paths: its first, as Paddle names it
            self._layers.append(sub)  # alive while its id is a key: no other layer gets its id
        run_all(lambda: _RECOMPUTED.add(self), lambda: _LAYER_CALLS.add(self))

    def remove(self) -> None:
        """Stop seeing layer calls and forget the records (all of it, whatever one step raises)."""
        run_all(lambda: _RECOMPUTED.discard(self), lambda: _LAYER_CALLS.discard(self),
                self.paths.clear, self._layers.clear, self.reset)

    def recomputed(self, fn: Any) -> Any:
        """``fn`` (a function that reentrant recompute re-runs in the backward, outside
        every layer call) attributed to the layer call under way now, as when it
        is not recomputed. None when no layer call is under way."""
        frame = self.current_frame()
        if frame is None:
            return None

        def rerun(*args: Any, **kwargs: Any) -> Any:
            stops = set()
            for t in tensors_in((args, kwargs)):
                gf = grad_fn(t)
                if gf is not None:
                    stops.add(gf.node_ptr())
            out = fn(*args, **kwargs)
            name = frame_name(frame)
            if self.paths and name is not None:  # still installed; the call has its index
                try:
                    outs = [g for g in (grad_fn(t) for t in tensors_in(out)) if g is not None]
                    path, call = name.rsplit("#", 1)
                    if outs:
                        self._records.append((path, int(call), outs, stops))
                except Exception:  # never break the backward
                    pass
            return out

        return rerun

    def consumed(self, ptrs: list[int | None]) -> None:
        """A backward consumed the graph of these node addresses, which later graphs may
        reuse: their claims go. Claims of nodes of another graph still alive (a second
        forward's, made before the first backward, claimed with it) stay for the next
        backward, with the branch of the call tree above them and the nodes held so no
        address is reused (then they go: a graph no backward takes, an output the loss did
        not use, is not held for good); the rest (records, call numbering) starts afresh
        for the next forward, as after :meth:`reset`."""
        owner, held = self.owner, self._held
        for p in list(ptrs) + list(self._carried):
            if p is not None:
                owner.pop(p, None)
                held.pop(p, None)
        if not owner:
            self.reset()
            return
        self._carried = set(owner)
        tree = self.call_parents({f"{path}#{call}" for path, call in owner.values()})
        self._records.clear()
        self._stack.clear()
        self._calls.clear()
        self._links.clear()
        self.parents.clear()
        self.parents.update(tree)

    def reset(self) -> None:
        self._held.clear()
        self._carried = set()
        self.owner.clear()
        self._records.clear()
        self._stack.clear()
        self._calls.clear()
        self._links.clear()
        self.parents.clear()

    def call_parents(self, used: set[str]) -> dict[str, str]:
        """The branches of the layer-call tree that hold the calls in ``used``.

        Args:
            used: ``"path#call"`` of the calls that made the nodes of a graph.

        Returns:
            ``"path#call"`` -> parent ``"path#call"``, for those calls and
            every call they ran inside.
        """
        if self._records or self._links:
            self._resolve()
        tree: dict[str, str] = {}
        for name in used:
            while name in self.parents and name not in tree:
                parent = self.parents[name]
                tree[name] = parent
                name = parent
        return tree

    def assign(self, walk: Walk) -> None:
        """Set ``Node.layer``/``Node.call`` of every op node of a fresh ``walk`` (the layer
        call that claimed its address), claiming the pending records first.

        The claims run over the walk's edges, on plain node ids: a walk holds
        every node reachable from the ones it holds, so a claim that enters it
        never leaves it. Only a record's output node that the walk did not
        reach (an output unused by this backward, an earlier forward) is
        followed on the live grad nodes, until the claim enters the walk.
        """
        if self._records:
            self._claim_walked(walk)
        owner = self.owner
        if not owner:
            return
        nodes = walk.nodes
        for ptr, nid in walk.ids.items():
            node = nodes[nid]
            if node.kind == "op":
                where = owner.get(ptr)
                if where is not None:
                    node.layer, node.call = where

    def current_frame(self) -> list[Any] | None:
        """The innermost layer call under way (name it later with :func:`frame_name`)."""
        return self._stack[-1] if self._stack else None

    def _pre(self, args: tuple, kwargs: dict) -> None:
        """A layer call begins: its frame, with its inputs' grad nodes (where claims stop)."""
        frame: list[Any] = [set(), None, self._stack[-1] if self._stack else None]
        self._stack.append(frame)
        try:
            for t in tensors_in((args, kwargs)):
                gf = grad_fn(t)
                if gf is not None:
                    frame[0].add(gf.node_ptr())
        except Exception:  # never break the forward
            frame[0] = set()

    def _post(self, path: str, outputs: Any) -> None:
        """The layer call at ``path`` returned ``outputs``: recorded when they carry gradient."""
        frame = self._stack.pop() if self._stack else [set(), None, None]
        try:
            outs = [grad_fn(t) for t in tensors_in(outputs)]
            outs = [g for g in outs if g is not None]
            if outs:
                call = self._calls.get(path, 0)
                self._calls[path] = call + 1
                frame[1] = f"{path}#{call}"
                if len(self._records) >= self.MAX_RECORDS:
                    del self._records[: self.MAX_RECORDS // 2]
                if len(self._links) >= self.MAX_RECORDS:
                    del self._links[: self.MAX_RECORDS // 2]
                self._records.append((path, call, outs, frame[0]))
                self._links.append((frame[1], frame[2]))
        except Exception:
            pass

    def _failed(self) -> None:
        """The layer call under way raised: its frame is dropped, nothing recorded."""
        if self._stack:
            self._stack.pop()

    def _resolve(self) -> None:
        for path, call, outs, stops in self._records:
            self._claim(outs, stops, (path, call))
        self._records.clear()
        pending = []
        for name, parent in self._links:
            # a parent whose outputs carried no gradient has no call index:
            # the child hangs under the nearest counted ancestor; a parent
            # still under way (a backward inside a forward) is named later
            while parent is not None and parent[1] is None and not any(parent is f for f in self._stack):
                parent = parent[2]
            if parent is not None and parent[1] is None:
                pending.append((name, parent))
            elif parent is not None:
                self.parents[name] = parent[1]
        self._links[:] = pending

    def _claim(self, todo: list[Any], stops: set[int], where: tuple[str, int],
               ids: dict[int, int] | None = None, walked: list[int] | None = None) -> None:
        """Claim for ``where`` every node reached from the grad nodes ``todo`` without passing
        through ``stops`` (its inputs' nodes) or an accumulation node, unless claimed already.
        With ``ids`` (a walk's address -> node id), a node of the walk is not followed here
        but its id is put on ``walked``, where :meth:`_claim_walked` goes on."""
        seen: set[int] = set()
        todo = list(todo)
        owner = self.owner
        while todo:
            gn = todo.pop()
            ptr = gn.node_ptr()
            if ptr in seen or ptr in stops:
                continue
            seen.add(ptr)
            if ids is not None:
                nid = ids.get(ptr)
                if nid is not None:
                    walked.append(nid)
                    continue
            if gn.name() == "GradNodeAccumulation":
                continue
            if ptr not in owner:  # inner layers ran first and keep their claim
                owner[ptr] = where
                if ids is not None:  # a node of another graph, claimed now: kept until consumed
                    self._held[ptr] = gn
            todo.extend(n for n in gn.next_functions if n is not None)

    def _claim_walked(self, walk: Walk) -> None:
        """:meth:`_resolve`'s claims, in the same order with the same outcome, over the
        walk's successor lists (plain ints) instead of the live grad nodes."""
        ids = walk.ids
        nodes = walk.nodes
        n = len(nodes)
        out_edges = walk.out_edges
        ptr_of: list[int | None] = [None] * n
        for ptr, nid in ids.items():
            ptr_of[nid] = ptr
        owner = self.owner
        own: list[Any] = [owner.get(p) for p in ptr_of] if owner else [None] * n
        # an accumulation node (and a root, never reached) is neither claimed nor followed
        succ: list[list[int]] = []
        for i, node in enumerate(nodes):
            if node.kind == "op":
                succ.append([e.dst for e in out_edges.get(i, ())])
            else:
                succ.append([])
                own[i] = _LEAF
        mark = [-1] * n  # the record that reached each node (or stops there): a per-record seen set
        for r, (path, call, outs, stops) in enumerate(self._records):
            where = (path, call)
            todo: list[int] = []
            live = []
            for gn in outs:
                nid = ids.get(gn.node_ptr())
                if nid is None:
                    live.append(gn)
                else:
                    todo.append(nid)
            if live:  # not reached by this backward: followed live until it enters the walk
                self._claim(live, stops, where, ids, todo)
            for p in stops:  # the inputs' nodes: not entered, as if seen already
                nid = ids.get(p)
                if nid is not None:
                    mark[nid] = r
            while todo:
                i = todo.pop()
                if mark[i] == r:
                    continue
                mark[i] = r
                if own[i] is None:  # inner layers ran first and keep their claim
                    own[i] = where
                todo.extend(succ[i])
        self._records.clear()
        for p, where in zip(ptr_of, own):
            if where is not None and where is not _LEAF:
                owner[p] = where


_LEAF = object()  # _claim_walked: a node no record claims (an accumulation node, a root)


class _RecomputePatch:
    """While any attribution is installed, functions given to reentrant recompute
    that are not layers are wrapped (:meth:`LayerAttribution.recomputed`): the
    re-run in the backward happens outside the layer call that ran them."""

    def __init__(self) -> None:
        self.active: list[LayerAttribution] = []
        self._original: Any = None

    def add(self, attribution: LayerAttribution) -> None:
        self.active.append(attribution)
        if self._original is None:
            try:
                from paddle.distributed.fleet.recompute.recompute import RecomputeFunction
            except Exception:
                return
            original = RecomputeFunction.__dict__["forward"]
            inner = original.__func__ if isinstance(original, staticmethod) else original

            def forward(ctx: Any, run_function: Any, *args: Any, **kwargs: Any) -> Any:
                if not isinstance(run_function, paddle.nn.Layer):
                    for att in list(self.active):
                        wrapped = att.recomputed(run_function)
                        if wrapped is not None:
                            run_function = wrapped
                return inner(ctx, run_function, *args, **kwargs)

            self._original = (RecomputeFunction, original)
            RecomputeFunction.forward = staticmethod(forward)

    def discard(self, attribution: LayerAttribution) -> None:
        if attribution in self.active:
            self.active.remove(attribution)
        if not self.active and self._original is not None:
            cls, original = self._original
            cls.forward = original
            self._original = None  # after: a second call finishes an interrupted one


_RECOMPUTED = _RecomputePatch()


class _LayerCallPatch:
    """While any attribution is installed, ``paddle.nn.Layer.__call__`` is wrapped (once,
    whatever the number of attributions): a call of a layer an attribution holds is
    reported to it around Paddle's own ``__call__`` (:meth:`LayerAttribution._pre` before,
    :meth:`LayerAttribution._post` after, :meth:`LayerAttribution._failed` when it raises).

    One class attribute stands for a pre- and a post-hook on every sublayer: registering
    and removing thousands of hooks per capture is gone, and a layer with no hooks of its
    own keeps Paddle's short call path (a layer with forward hooks takes the long one).
    The layer's own forward hooks, if any, run inside Paddle's ``__call__``: the inputs a
    call records are those it was given.
    """

    def __init__(self) -> None:
        self.active: list[LayerAttribution] = []
        self._original: Any = None
        self._wrapper: Any = None

    def add(self, attribution: LayerAttribution) -> None:
        if attribution in self.active:
            return
        self.active.append(attribution)
        if self._original is not None:
            return
        original = paddle.nn.Layer.__dict__["__call__"]
        active = self.active

        def __call__(layer: Any, /, *inputs: Any, **kwargs: Any) -> Any:  # any keyword is the forward's
            key = id(layer)
            seen = [(a, p) for a in active for p in (a.paths.get(key),) if p is not None]
            if not seen:
                return original(layer, *inputs, **kwargs)
            for a, _ in seen:
                a._pre(inputs, kwargs)
            try:
                outputs = original(layer, *inputs, **kwargs)
            except BaseException:
                for a, _ in seen:
                    a._failed()
                raise
            for a, path in seen:
                a._post(path, outputs)
            return outputs

        __call__.__wrapped__ = original
        self._original = original
        self._wrapper = __call__
        paddle.nn.Layer.__call__ = __call__

    def discard(self, attribution: LayerAttribution) -> None:
        if attribution in self.active:
            self.active.remove(attribution)
        if not self.active and self._original is not None:
            # put back only our own: a tool that wrapped Layer.__call__ over ours since keeps
            # its wrapper (ours, under it, passes every call on while no attribution is active)
            if paddle.nn.Layer.__dict__.get("__call__") is self._wrapper:
                paddle.nn.Layer.__call__ = self._original
            self._original = self._wrapper = None  # after: a second call finishes an interrupted one

    def installed(self) -> bool:
        """Whether ``Layer.__call__`` is wrapped now."""
        return self._original is not None


_LAYER_CALLS = _LayerCallPatch()


def _static_function() -> type | None:
    """The type of a ``layer.forward`` converted by ``paddle.jit.to_static`` (None: unknown)."""
    try:
        from paddle.jit.dy2static.program_translator import StaticFunction
    except Exception:
        return None
    return StaticFunction


def frame_name(frame: list[Any] | None) -> str | None:
    """``"path#call"`` of a layer-call frame once the call has ended; a call
    whose outputs carried no gradient has no index and gives its parent's."""
    while frame is not None and frame[1] is None:
        frame = frame[2]
    return None if frame is None else frame[1]


def tensors_in(obj: Any) -> list[Any]:
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


def mark_layer_notes(nodes: list[Any], attributed: bool = True) -> None:
    """Say why op nodes have no layer when it is not that they ran outside the model.

    An op a backward made (``create_graph=True``: ``MatmulDoubleGradNode``) is
    no forward op: ``layer_note = "backward"``. Of the others, an op with no
    layer ran outside the model (the loss) only if the hooks saw the model's
    forward. When none of them has a layer (and ``attributed``: the capture had a
    model to attribute them to), that forward ran before the hooks
    were in place (outside ``with rec.step():``), so no op's layer is known:
    ``"unrecorded"``. (Call stacks cannot tell it op by op: a dump that could
    not be written whole leaves ops without a stack whose forward was seen.)
    """
    ops = []
    for n in nodes:
        if n.kind != "op":
            continue
        if n.layer is None and made_by_backward(n.name):
            n.layer_note = "backward"
        else:
            ops.append(n)
    if attributed and ops and not any(n.layer is not None for n in ops):
        for n in ops:
            n.layer_note = "unrecorded"
