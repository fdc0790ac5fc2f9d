"""The plain data model of a captured backward graph.

Nothing here imports paddle: a :class:`BackwardGraph` is nodes, edges and
numbers, so it can be saved, loaded, compared and drawn on a machine without
paddle (the CLI and the background worker rely on that).

Edges point the way gradients flow: from the node that produced a gradient to
the node that receives it, so the root (the loss) is the only source and the
leaves (parameters, inputs) are sinks.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, NamedTuple

__all__ = [
    "BackwardGraph",
    "Edge",
    "GradMeta",
    "Node",
    "UNOBSERVED_REASONS",
    "NonfiniteOrigin",
    "NonfiniteRecord",
    "NonfiniteSite",
    "SourceFrame",
    "float_from_json",
    "float_to_json",
    "is_communication",
    "merge_grad_metas",
    "op_display_name",
    "parse_json",
]

FORMAT_VERSION = 1
NODE_KINDS = ("root", "op", "param", "input", "layer")

#: Why a gradient's values were not observed (``GradMeta.note``):
#: ``overwritten``: read after the receiving op's backward ran, which rewrote
#: the buffer it received in place (``ReluGradNode`` and many more) and whose
#: producer takes no hook; ``not_computed``: ``paddle.grad`` did not compute
#: this slot (it leads to no requested input); ``unpaired``: the gradients a
#: node passed on could not be matched with its edges one to one.
UNOBSERVED_REASONS = ("overwritten", "not_computed", "unpaired")


def op_display_name(grad_node_name: str) -> str:
    """Turn Paddle's grad node class name into a readable op name.

    Args:
        grad_node_name: the C++ class name, e.g. ``"MatmulGradNode"``.

    Returns:
        The op name without Paddle's suffixes, e.g. ``"Matmul"``;
        ``"Conv2dGradNodeFinal"`` gives ``"Conv2d"``, a PyLayer node
        ``"GradNodePyLayer_MyOp_..."`` gives ``"PyLayer:MyOp"``.

    Examples:
        >>> op_display_name("CrossEntropyWithSoftmaxGradNode")
        'CrossEntropyWithSoftmax'
        >>> op_display_name("GradNodePyLayer__Twice")
        'PyLayer:Twice'
        >>> op_display_name("GradNodePyLayer_mp_allreduce_eager")  # tensor parallel
        'PyLayer:mp_allreduce'
    """
    name = grad_node_name
    if name.startswith("GradNodePyLayer_") and name.endswith("_eager"):  # fleet's communication PyLayers
        return "PyLayer:" + name[len("GradNodePyLayer_"):-len("_eager")]
    if name.startswith("GradNodePyLayer_"):
        inner = name[len("GradNodePyLayer_"):]
        head = inner.split("_")[0] or inner.strip("_")  # a class named _Twice keeps its name
        return "PyLayer:" + head if head else "PyLayer"
    if name == "GradNodeAccumulation":
        return "Accumulation"
    for suffix in ("GradNodeFinal", "GradNode", "GradNodeCompat"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


#: Readable op names of grad nodes that communicate between ranks: auto-parallel's
#: explicit reshard, fleet tensor parallel's PyLayers, sequence parallel's PyLayers.
COMMUNICATION_OPS = frozenset({
    "Reshard", "PyLayer:c_identity", "PyLayer:c_split", "PyLayer:mp_allreduce",
    "PyLayer:ScatterOp", "PyLayer:GatherOp", "PyLayer:AllGatherOp", "PyLayer:ReduceScatterOp",
})


def is_communication(op: str) -> bool:
    """Whether a readable op name is a grad node that communicates between ranks.

    Examples:
        >>> is_communication(op_display_name("ReshardGradNode")), is_communication("Matmul")
        (True, False)
    """
    return op in COMMUNICATION_OPS


class SourceFrame(NamedTuple):
    """One frame of the user's code on the way to a forward op call.

    ``code`` is the source line as Paddle recorded it (stripped; ``""`` when
    the file could not be read).
    """

    file: str
    line: int
    function: str
    code: str = ""


#: Why an op node has no :attr:`Node.source` (worded in ``paddleviz_hooks.text``):
#: ``"static"`` an op inside a to_static program; ``"internal"`` made by Paddle
#: with no Python caller of the user's; ``"unrecorded"`` its forward ran before
#: the capture was armed or decided (or with Paddle's own dump path in use); ``"backward"``
#: an op a backward made (``paddle.grad(create_graph=True)``): Paddle keeps no stack for it.
SOURCE_NOTES = ("static", "internal", "unrecorded", "backward")

#: Why an op node has no :attr:`Node.layer` although the capture had a model to attribute it to
#: (worded in ``paddleviz_hooks.text``): ``"unrecorded"`` its forward ran before the capture's
#: layer hooks were in place (a forward outside ``with rec.step():``), so where it ran is unknown;
#: ``"backward"`` an op of a gradient's own graph, made by a backward with ``create_graph=True``
#: (``MatmulDoubleGradNode``), not by a forward;
#: an op with no layer and no note ran outside every layer of the model (the loss).
LAYER_NOTES = ("unrecorded", "backward")


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_values(obj: Any) -> dict[str, Any]:
    """A dataclass's fields by name, in order: ``dataclasses.asdict`` without its deep copy, for
    the classes whose fields are scalars or converted by their ``to_dict`` (a capture's JSON is
    written on the training process, where ``asdict`` took most of the time)."""
    names = _FIELD_NAMES.get(type(obj))
    if names is None:
        names = _FIELD_NAMES[type(obj)] = tuple(f.name for f in fields(obj))
    return {name: getattr(obj, name) for name in names}


@dataclass
class GradMeta:
    """What is known of one gradient tensor flowing along an edge.

    ``norm``, ``min`` and ``max`` are None when gradient statistics were off
    or the gradient was neither a floating-point nor a complex tensor;
    ``nan``/``inf`` count non-finite elements (only counted when the norm is
    not finite). Of a complex gradient, ``norm`` is ``sqrt(sum |z|**2)``, an
    element with a NaN real or imaginary part counts once as NaN (else, with
    an infinite part, once as Inf), and ``min``/``max`` are None: complex
    numbers have no order. A gradient of no elements (a shape with a 0) has
    ``norm`` 0 and no ``min``/``max``.

    A distributed tensor (auto-parallel) keeps its global ``shape``, this
    rank's shard shape in ``local_shape`` and its ``placements`` per mesh
    dimension (``"Shard(dim=1)"``, ``"Replicate()"``, ``"Partial(...)"``);
    its statistics are those of this rank's shard (reading the whole tensor
    would need communication). Both are None for an ordinary tensor.

    ``note`` says why the values of a gradient were not observed, as one of
    the codes in :data:`UNOBSERVED_REASONS` (worded by ``text.py``); its
    statistics are then None. ``parts`` is 1 for one gradient; more for a
    figure combining that many different gradients (an edge of a collapsed
    view standing for several real edges): its ``norm`` is then the
    root-sum-square of their norms, which is not the norm of any one tensor.
    """

    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    norm: float | None = None
    min: float | None = None
    max: float | None = None
    nan: int = 0
    inf: int = 0
    local_shape: tuple[int, ...] | None = None
    placements: tuple[str, ...] | None = None
    note: str | None = None
    parts: int = 1

    @property
    def nonfinite(self) -> int:
        """Number of NaN and Inf elements."""
        return self.nan + self.inf

    @property
    def absmax(self) -> float | None:
        """Largest absolute element, when min/max are known."""
        if self.min is None or self.max is None:
            return None
        return max(abs(self.min), abs(self.max))

    def to_dict(self) -> dict[str, Any]:
        d = _field_values(self)  # its tuples are made lists below
        d["shape"] = list(self.shape) if self.shape is not None else None
        for k in ("norm", "min", "max"):
            d[k] = float_to_json(d[k])
        for k in ("local_shape", "placements"):  # written only for distributed tensors
            if d[k] is None:
                del d[k]
            else:
                d[k] = list(d[k])
        if d["note"] is None:  # written only when set: older readers stay able to load the file
            del d["note"]
        if d["parts"] == 1:
            del d["parts"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GradMeta":
        return cls(
            shape=tuple(d["shape"]) if d.get("shape") is not None else None,
            dtype=d.get("dtype"),
            norm=float_from_json(d.get("norm")),
            min=float_from_json(d.get("min")),
            max=float_from_json(d.get("max")),
            nan=int(d.get("nan", 0)),
            inf=int(d.get("inf", 0)),
            local_shape=tuple(d["local_shape"]) if d.get("local_shape") is not None else None,
            placements=tuple(d["placements"]) if d.get("placements") is not None else None,
            note=d.get("note"),
            parts=int(d.get("parts", 1)),
        )


@dataclass
class Node:
    """One node of the backward graph.

    Attributes:
        id: index in ``BackwardGraph.nodes`` (breadth-first order from the root).
        kind: ``"root"`` (the tensor backward started from), ``"op"`` (a grad
            node), ``"param"`` (a named parameter leaf) or ``"input"`` (any
            other leaf: an input with ``stop_gradient=False``, or a parameter
            whose name is unknown).
        name: Paddle's grad node class name (``"MatmulGradNode"``), or
            ``"loss"``-like labels for the root.
        op: readable op name (``"Matmul"``).
        layer: dotted sublayer path that created the node
            (``"encoder.layers.3.linear1"``), ``""`` for the top layer, None
            when unknown (ops outside the model, e.g. the loss).
        call: call index of that layer when it ran more than once (0 first).
        param: parameter name for ``kind == "param"``.
        shape / dtype: of the parameter or root tensor, when known.
        hooked: whether gradients were recorded at this node.
        note: why a node was not hooked, when it was not.
        key: stable identity across steps (see ``BackwardGraph.assign_keys``).
        count: for ``kind == "layer"`` (a collapsed box, see
            ``paddleviz_hooks.collapse``): how many identical sibling
            layers it stands for (``"x N"``); 1 otherwise.
        calls: for a box of one call of a layer called several times in
            this graph, how many calls it had (the box is call ``call + 1``
            of ``calls``); 1 otherwise.
        ops: for a box, the op nodes folded into it.
        unhooked: for a box, how many of those carry no gradient data.
        params: for a box, the parameter leaves folded into it.
        norm: for a box, the L2 norm of those parameters' gradients (None
            when unknown).
        nonfinite: for a box, NaN/Inf elements in gradients that stayed
            inside it.
        saved_bytes: for an op, bytes of the tensors it saved for backward
            in the forward (activations; a storage saved by several ops is
            counted at the first); for a box, the sum over its ops. 0 when
            nothing was saved or it was not observed (see
            ``BackwardGraph.meta["saved_memory"]``).
        grad: for a parameter, the gradient this backward added to
            ``param.grad``: the sum over all its uses, after the user's own
            hooks (None when it was not observed, e.g. graphs saved by older
            versions). Under multi-process data parallel it is the gradient
            applied: what the backward changed in ``param.grad`` once the
            gradients were synchronised across ranks (all-reduce).
        local_grad: under multi-process data parallel, the gradient this
            rank's own backward produced for the parameter, before
            synchronisation (see ``meta["grad_sync"]``); None otherwise.
        received: for an op that received gradients over several edges (a
            forward tensor used several times), the sum of what arrived, read
            when it ran (the norm of a sum cannot be had from the norms of its
            parts); for the node of a non-leaf ``paddle.grad`` input, what
            ``paddle.grad`` returned for it. None otherwise or when not
            observed.
        source: for an op, where its forward op was called: the frames of
            the user's code (:class:`SourceFrame`; Paddle, the standard
            library and this package left out), outermost first; None when
            not recorded.
        source_note: for an op without ``source``, why (one of
            :data:`SOURCE_NOTES`); None otherwise.
        layer_note: for an op without ``layer``, when that is not because it
            ran outside the model: why (one of :data:`LAYER_NOTES`); None
            otherwise.
    """

    id: int
    kind: str
    name: str
    op: str = ""
    layer: str | None = None
    call: int = 0
    param: str | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    hooked: bool = False
    note: str | None = None
    key: str = ""
    count: int = 1
    calls: int = 1
    ops: int = 0
    unhooked: int = 0
    params: int = 0
    norm: float | None = None
    nonfinite: int = 0
    grad: GradMeta | None = None
    saved_bytes: int = 0
    local_grad: GradMeta | None = None
    received: GradMeta | None = None
    source: tuple[SourceFrame, ...] | None = None
    source_note: str | None = None
    layer_note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = _field_values(self)  # its tuples and GradMetas are converted below
        d["source"] = [list(f) for f in self.source] if self.source is not None else None
        d["shape"] = list(self.shape) if self.shape is not None else None
        d["grad"] = self.grad.to_dict() if self.grad is not None else None
        d["local_grad"] = self.local_grad.to_dict() if self.local_grad is not None else None
        d["received"] = self.received.to_dict() if self.received is not None else None
        # Box-only fields are written only when set, so graphs without boxes
        # stay readable by versions that do not know them.
        for k, default in _NODE_BOX_DEFAULTS.items():
            if d[k] == default:
                del d[k]
        if "norm" in d:
            d["norm"] = float_to_json(d["norm"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Node":
        d = dict(d)
        if d.get("shape") is not None:
            d["shape"] = tuple(d["shape"])
        if d.get("norm") is not None:
            d["norm"] = float_from_json(d["norm"])
        if d.get("grad") is not None:
            d["grad"] = GradMeta.from_dict(d["grad"])
        if d.get("local_grad") is not None:
            d["local_grad"] = GradMeta.from_dict(d["local_grad"])
        if d.get("received") is not None:
            d["received"] = GradMeta.from_dict(d["received"])
        if d.get("source") is not None:
            d["source"] = tuple(SourceFrame(str(f[0]), int(f[1]), str(f[2]), str(f[3])) for f in d["source"])
        return cls(**d)


_NODE_BOX_DEFAULTS = {"count": 1, "calls": 1, "ops": 0, "unhooked": 0, "params": 0, "norm": None, "nonfinite": 0,
                      "grad": None, "saved_bytes": 0, "local_grad": None, "received": None, "source": None, "source_note": None,
                      "layer_note": None}


@dataclass
class Edge:
    """A gradient flowing from node ``src`` to node ``dst``.

    ``slot`` is the position of ``dst`` among ``src``'s next functions;
    ``grad`` is None when the gradient could not be observed (the producing
    node cannot be hooked safely, see ``paddleviz_hooks.hazards``); ``note``
    then says why, when known.

    ``grad`` is what ``src`` passed on. When a gradient hook (a
    ``Tensor.register_hook`` of the user's, or a library's) changed it before
    ``dst`` received it, ``after_hook`` is what ``dst`` received instead; None
    when nothing changed it, or when that could not be told (an edge into a
    node that receives over several edges).
    """

    src: int
    dst: int
    slot: int = 0
    grad: GradMeta | None = None
    note: str | None = None
    after_hook: GradMeta | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {
            "src": self.src,
            "dst": self.dst,
            "slot": self.slot,
            "grad": self.grad.to_dict() if self.grad is not None else None,
        }
        if self.note is not None:  # written only when there is one
            d["note"] = self.note
        if self.after_hook is not None:
            d["after_hook"] = self.after_hook.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Edge":
        g, h = d.get("grad"), d.get("after_hook")
        return cls(d["src"], d["dst"], d.get("slot", 0), GradMeta.from_dict(g) if g else None,
                   d.get("note") if isinstance(d.get("note"), str) else None,
                   GradMeta.from_dict(h) if h else None)


#: What made a capture's NaN/Inf (``NonfiniteOrigin.kind``):
#: ``forward``: an op of the model's forward (op, layer, file, line, code);
#: ``input``: the batch itself holds NaN/Inf;
#: ``weights``: a trainable parameter already holds NaN/Inf (an earlier update
#: wrote it; ``layer`` is the layer of the first such parameter);
#: ``outside``: the model's outputs were finite, so the loss function (or the
#: labels) made it;
#: ``backward``: the forward is finite everywhere; the NaN/Inf is made in the backward;
#: ``not_reproduced``: the replay of the step was finite although the step was not.
ORIGIN_KINDS = ("forward", "input", "weights", "outside", "backward", "not_reproduced")


@dataclass
class NonfiniteOrigin:
    """Where a step's NaN/Inf was first made, as found by replaying its forward.

    Attributes:
        kind: one of :data:`ORIGIN_KINDS`.
        op: Paddle's op type of a ``forward`` origin (``"log"``, ``"sqrt"``).
        layer: dotted sublayer path whose forward called it (``""``: the
            model's own forward; None: outside every layer, or unknown).
        layer_class: that layer's class name.
        call: which call of that layer (0 first), when the op's grad node is
            in the graph; None when unknown.
        file / line / code: the user's source line that called the op.
        key: the key of the op's grad node in the captured graph; None when
            the graph has none (the op worked on data that needs no gradient,
            or inside a compiled program, or the kind is not ``forward``).
        needs_grad: whether the tensor the op produced needs a gradient (any
            of its floating-point inputs does, with gradients on); None when
            it could not be seen.
        dtype / nan / inf: the tensor the op produced: its dtype and how
            many NaN and Inf elements it held (read from Paddle's checker);
            None when unknown.
        in_program: the op ran inside a compiled program (``to_static``):
            the graph holds the program's ops, not this one.
    """

    kind: str
    op: str | None = None
    layer: str | None = None
    layer_class: str | None = None
    call: int | None = None
    file: str | None = None
    line: int | None = None
    code: str | None = None
    key: str | None = None
    needs_grad: bool | None = None
    dtype: str | None = None
    nan: int | None = None
    inf: int | None = None
    in_program: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NonfiniteOrigin":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


@dataclass
class NonfiniteSite:
    """A node of the graph, as a fact that outlives collapsing: its key and where it ran."""

    key: str
    kind: str = "op"
    op: str = ""
    layer: str | None = None
    call: int = 0
    param: str | None = None

    @classmethod
    def of(cls, node: "Node") -> "NonfiniteSite":
        return cls(node.key, node.kind, node.op, node.layer, node.call, node.param)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NonfiniteSite":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class NonfiniteRecord:
    """The NaN/Inf story of one capture, computed once (``paddleviz_hooks.findings``)
    and read by every view.

    Attributes:
        origin: where the NaN/Inf was first made (a replay of the step's
            forward); None when it was not located (no replay: a graph
            captured by hand, or the inputs were not kept).
        first_gradient: a different fact: the first node whose *gradient*
            turned non-finite (it received finite gradients and passed a
            non-finite one on, see :meth:`BackwardGraph.nonfinite_sites`);
            None when every gradient is finite.
        gradient_sites: how many nodes produced a non-finite gradient.
        entry: when the origin's op has no grad node in the graph, the node
            where its output enters the graph (its first op in the forward
            inside the origin's layer call); None otherwise.
        weights: trainable parameters whose values hold NaN/Inf (an earlier
            update wrote them).
        buffers: non-trainable tensors (BatchNorm running statistics) whose
            values hold NaN/Inf: written by the forward, not by an update.
    """

    origin: NonfiniteOrigin | None = None
    first_gradient: NonfiniteSite | None = None
    gradient_sites: int = 0
    entry: NonfiniteSite | None = None
    weights: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()

    @property
    def any(self) -> bool:
        """Whether there is anything non-finite to tell."""
        return bool(self.origin or self.first_gradient or self.weights or self.buffers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "origin": self.origin.to_dict() if self.origin is not None else None,
            "first_gradient": self.first_gradient.to_dict() if self.first_gradient is not None else None,
            "gradient_sites": self.gradient_sites,
            "entry": self.entry.to_dict() if self.entry is not None else None,
            "weights": list(self.weights),
            "buffers": list(self.buffers),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NonfiniteRecord":
        return cls(
            origin=NonfiniteOrigin.from_dict(d["origin"]) if d.get("origin") else None,
            first_gradient=NonfiniteSite.from_dict(d["first_gradient"]) if d.get("first_gradient") else None,
            gradient_sites=int(d.get("gradient_sites", 0)),
            entry=NonfiniteSite.from_dict(d["entry"]) if d.get("entry") else None,
            weights=tuple(d.get("weights") or ()),
            buffers=tuple(d.get("buffers") or ()),
        )


@dataclass
class BackwardGraph:
    """A captured backward graph: nodes, edges and capture metadata.

    Attributes:
        nodes: node list; ``nodes[i].id == i``.
        edges: gradient-flow edges.
        layers: dotted layer path -> layer class name, for every layer seen.
        calls: the layer-call tree of the forward: ``"path#call"`` -> the
            ``"path#call"`` it ran inside (``"layer1.0.relu#1"`` ->
            ``"layer1.0#0"``), for the calls that made nodes of this graph
            and their ancestors; the top call has no entry. Empty when
            unknown (no layer given, graphs saved by older versions).
        meta: free-form capture facts: ``step``, ``entry`` (``"backward"`` or
            ``"grad"``), ``grad_stats``, ``capture_ms``, ``trigger``,
            ``saved_memory`` (what the forward saved for backward: ``total_bytes``,
            ``by_layer`` ("path#call" -> bytes, ``"?"`` outside any layer
            call), ``by_op``, ``by_dtype``, ``params_bytes``, ``allocated_growth``,
            ``recompute`` (call -> held/inputs/frees bytes), ``unobserved``)...
        nonfinite: the capture's NaN/Inf story (:class:`NonfiniteRecord`),
            set once by ``paddleviz_hooks.findings``; None until then.

    It is plain data: capturing (``paddleviz_hooks.capture``) builds it;
    collapsing, diffing, wording and drawing are functions elsewhere that take
    it (``paddleviz_hooks.collapse``, ``.diff``, ``.text``, ``.render``).

    Examples:
        >>> g = BackwardGraph(
        ...     nodes=[Node(0, "root", "loss", "loss"), Node(1, "op", "MatmulGradNode", "Matmul"),
        ...            Node(2, "param", "GradNodeAccumulation", "Parameter", param="fc.weight")],
        ...     edges=[Edge(0, 1), Edge(1, 2, grad=GradMeta((3, 2), "float32", norm=2.0))])
        >>> g.assign_keys(); [n.key for n in g.nodes]
        ['root#0', 'op:?[0]/Matmul#cea5c0', 'param:fc.weight']
        >>> g.global_grad_norm()
        2.0
        >>> BackwardGraph.from_json(g.to_json()) == g
        True
    """

    nodes: list[Node] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    layers: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    calls: dict[str, str] = field(default_factory=dict)
    nonfinite: NonfiniteRecord | None = None

    # ------------------------------------------------------------------ queries
    def node_by_key(self) -> dict[str, Node]:
        """Map stable key -> node."""
        return {n.key: n for n in self.nodes}

    def out_edges(self) -> dict[int, list[Edge]]:
        """Map node id -> edges leaving it (gradients it produced)."""
        out: dict[int, list[Edge]] = defaultdict(list)
        for e in self.edges:
            out[e.src].append(e)
        return out

    def in_edges(self) -> dict[int, list[Edge]]:
        """Map node id -> edges entering it (gradients it received)."""
        inn: dict[int, list[Edge]] = defaultdict(list)
        for e in self.edges:
            inn[e.dst].append(e)
        return inn

    def count_ops(self) -> dict[str, int]:
        """Number of op nodes of each readable op name."""
        counts: dict[str, int] = defaultdict(int)
        for n in self.nodes:
            if n.kind == "op":
                counts[n.op] += 1
        return dict(counts)

    def params(self, local: bool = False) -> dict[str, GradMeta | None]:
        """Parameters reached by the gradient, name -> gradient metadata.

        The metadata is that of the gradient the backward added to
        ``param.grad`` (``Node.grad``). Only for graphs without it (saved by
        older versions) is it combined from the incoming edges, which is
        exact for a parameter used once.

        Args:
            local: under data parallel, this rank's own gradients before
                synchronisation (``Node.local_grad``) instead of the applied
                ones; the same as the default where no local one was recorded.
        """
        inn = self.in_edges()
        found: dict[str, GradMeta | None] = {}
        for n in self.nodes:
            if n.kind == "param" and n.param is not None:
                if local and n.local_grad is not None:
                    found[n.param] = n.local_grad
                    continue
                if n.grad is not None:
                    found[n.param] = n.grad
                    continue
                metas = [e.grad for e in inn.get(n.id, []) if e.grad is not None]
                found[n.param] = merge_grad_metas(metas)
        return found

    def call_chain(self, layer: str, call: int = 0) -> dict[str, int]:
        """Which call of each enclosing layer the call ``layer#call`` ran inside.

        Args:
            layer: a layer path (``Node.layer``).
            call: its call index (``Node.call``).

        Returns:
            layer path -> call index, for ``layer`` and every call it ran
            inside as far as ``calls`` knows (just ``{layer: call}`` without it).

        Examples:
            >>> g = BackwardGraph(calls={"block.relu#1": "block#0", "block#0": "#0"})
            >>> g.call_chain("block.relu", 1)
            {'block.relu': 1, 'block': 0, '': 0}
        """
        chain = {layer: call}
        name = f"{layer}#{call}"
        while name in self.calls and len(chain) < 1000:  # a malformed tree cannot loop
            name = self.calls[name]
            path, _, index = name.rpartition("#")
            if not index.isdigit():
                break
            chain.setdefault(path, int(index))
        return chain

    def topo_order(self) -> list[int]:
        """Node ids in gradient-flow order (every node after all producers).

        Nodes on a cycle (a collapsed graph can have one: a layer box whose
        ops run before and after another box) and those after it follow, in id order.
        """
        indeg = [0] * len(self.nodes)
        out = self.out_edges()
        for e in self.edges:
            indeg[e.dst] += 1
        ready = [n.id for n in self.nodes if indeg[n.id] == 0]
        order: list[int] = []
        while ready:
            ready.sort(reverse=True)
            nid = ready.pop()
            order.append(nid)
            for e in out.get(nid, []):
                indeg[e.dst] -= 1
                if indeg[e.dst] == 0:
                    ready.append(e.dst)
        if len(order) < len(self.nodes):
            placed = set(order)
            order += [n.id for n in self.nodes if n.id not in placed]
        return order

    def nonfinite_sites(self) -> list[Node]:
        """Nodes that produced a non-finite gradient: the origin first, then
        the others in gradient-flow order.

        The origin is the node that most likely created the NaN/Inf: it
        received only finite gradients and passed a non-finite one on to
        another op. A node whose non-finite gradients all go to leaves (the
        weight gradient of a ``Matmul`` fed NaN activations) only reflects
        activations that went bad further up the forward pass, although it
        comes earlier in gradient-flow order; it is the origin only when there
        is no better candidate.
        """
        bad_edges = [e for e in self.edges if e.grad is not None and e.grad.nonfinite]
        if not bad_edges:
            return []
        bad = {e.src for e in bad_edges}
        received_bad = {e.dst for e in bad_edges}
        order = [i for i in self.topo_order() if i in bad]
        fresh = [i for i in order if i not in received_bad]
        to_op = [
            i for i in fresh
            if any(e.src == i and self.nodes[e.dst].kind not in ("param", "input") for e in bad_edges)
        ]
        origin = (to_op or fresh or order)[0]
        return [self.nodes[origin]] + [self.nodes[i] for i in order if i != origin]

    def nonfinite_nodes(self) -> set[int]:
        """Ids of the nodes a view marks as non-finite: those that passed a NaN/Inf
        gradient on, parameters whose recorded gradient (``node.grad``) holds
        NaN/Inf, and layer boxes holding some."""
        bad = {e.src for e in self.edges if e.grad is not None and e.grad.nonfinite}
        bad.update(n.id for n in self.nodes
                   if (n.kind == "param" and n.grad is not None and n.grad.nonfinite)
                   or (n.kind == "layer" and n.nonfinite))
        return bad

    def nonfinite_count(self) -> int:
        """Non-finite gradient elements over every observed gradient: the edges,
        plus parameter totals whose incoming edges were not all observed."""
        count = sum(e.grad.nonfinite for e in self.edges if e.grad is not None)
        inn = self.in_edges()
        for n in self.nodes:
            if n.grad is not None and any(e.grad is None or e.grad.norm is None for e in inn.get(n.id, [])):
                count += n.grad.nonfinite
        return count

    def global_grad_norm(self, local: bool = False, partial: bool = False) -> float | None:
        """L2 norm over all parameter gradients.

        None without statistics, and None when the norm of some parameter's
        gradient is not known (:meth:`params_without_norm`): a figure that
        leaves a parameter out is not the global norm.

        Args:
            local: of this rank's gradients before synchronisation (see :meth:`params`).
            partial: the norm over the parameters whose gradient norm is known,
                even when some is not (None only when none is).

        Examples:
            >>> g = BackwardGraph(nodes=[Node(0, "param", "", param="a", grad=GradMeta(norm=3.0)),
            ...                          Node(1, "param", "", param="b", grad=GradMeta(norm=4.0))])
            >>> g.global_grad_norm()
            5.0
            >>> g.nodes[1].grad = GradMeta(dtype="complex64")  # saved by a version without complex statistics
            >>> g.global_grad_norm(), g.global_grad_norm(partial=True), g.params_without_norm()
            (None, 3.0, ['b'])
        """
        metas = self.params(local).values()
        norms = [m.norm for m in metas if m is not None and m.norm is not None]
        if not norms or (not partial and len(norms) < len(metas)):
            return None
        return math.sqrt(sum(v * v for v in norms))

    def params_without_norm(self, local: bool = False) -> list[str]:
        """Parameters reached whose gradient norm is not known (statistics off, a gradient
        not observed, or a graph saved by a version that kept no statistics for its dtype)."""
        return [name for name, m in self.params(local).items() if m is None or m.norm is None]

    def layer_grad_norms(self, depth: int = 1, local: bool = False) -> dict[str, float]:
        """L2 norm of the parameter gradients grouped by layer path prefix.

        Args:
            depth: how many leading path components name the group
                (1: top-level layers such as ``"encoder"``).
            local: of this rank's gradients before synchronisation (see :meth:`params`).

        Returns:
            group -> norm; parameters of the top layer itself go to ``"(self)"``. A group
            holding a parameter whose gradient norm is not known is left out (its figure
            would leave that parameter out).
        """
        sq: dict[str, float] = defaultdict(float)
        unknown: set[str] = set()
        for name, m in self.params(local).items():
            parts = name.split(".")[:-1]
            group = ".".join(parts[:depth]) if parts else "(self)"
            if m is None or m.norm is None:
                unknown.add(group)
                continue
            sq[group] += m.norm * m.norm
        return {k: math.sqrt(v) for k, v in sorted(sq.items()) if k not in unknown}

    def saved_bytes_by_layer(self, depth: int = 1) -> dict[str, int]:
        """Bytes held for backward (``meta["saved_memory"]``) grouped by layer path prefix.

        Args:
            depth: how many leading path components name the group.

        Returns:
            group -> bytes, largest first; the top layer's own saves go to
            ``"(self)"``, saves outside any layer call to ``"(outside)"``;
            empty when saved memory was not recorded.

        Examples:
            >>> g = BackwardGraph(meta={"saved_memory": {"by_layer": {
            ...     "enc.layers.0#0": 5, "enc.layers.1#0": 7, "#0": 2, "?": 1}}})
            >>> g.saved_bytes_by_layer()
            {'enc': 12, '(self)': 2, '(outside)': 1}
        """
        m = self.meta.get("saved_memory")
        out: dict[str, int] = defaultdict(int)
        for name, nbytes in (m.get("by_layer") or {}).items() if isinstance(m, dict) else ():
            path, sep, _ = name.rpartition("#")
            group = ".".join(path.split(".")[:depth]) if path else ("(self)" if sep else "(outside)")
            out[group] += nbytes
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    # ------------------------------------------------------------- identities
    def assign_keys(self) -> None:
        """Give every node a key that is stable across steps and processes.

        An op's key is ``op:<layer>[<call>]/<Op>#<signature>``: the layer path
        and call index that ran it, its op name, and six hex digits naming
        its local structure. The signature is a hash (the same in every
        process) of the op and, in slot order, its inputs as far as they lie
        inside its own layer: the parameters it consumes (named relative to
        the layer, so sibling blocks ``layers.0``, ``layers.1`` get the same
        signatures), ops of the same layer call (by their own signature, up
        to three ops back) and ops of sublayers (by their relative path).
        Inputs from outside the layer are left out. So ops inserted anywhere
        else, before or after, in another layer or on another branch, change
        no key; an op inserted right before an op of the same layer call
        changes that op's key (the diff pairs such nodes again by their
        neighbours, see :func:`paddleviz_hooks.diff.diff_graphs`). Only where
        two nodes of one layer call share op and signature does a position
        decide: ``.1``, ``.2``... in depth-first order from the roots.
        Parameter leaves are ``param:<name>``; the root and input leaves are
        numbered in depth-first order (``root#0``, ``input#0``). Memory
        addresses never enter a key.
        """
        children = self._children()
        sigs = self._signatures(children)
        seen: dict[str, int] = defaultdict(int)
        for n in self._dfs_order(children):
            if n.kind == "param" and n.param is not None:
                n.key = "param:" + n.param
                continue
            if n.kind == "op":
                scope = "?" if n.layer is None else (n.layer or "<top>")
                base = f"op:{scope}[{n.call}]/{n.op}#{sigs[n.id]}"
                k = seen[base]
                n.key = base if k == 0 else f"{base}.{k}"
            else:
                base = n.kind
                n.key = f"{base}#{seen[base]}"
            seen[base] += 1

    def keys_current(self) -> bool:
        """Whether every node has a key of the kind :meth:`assign_keys` gives now.

        Graphs saved by versions before op keys carried a signature (``#0``
        instead of ``#df082a``) need :meth:`assign_keys` before they can be
        compared with new captures.
        """
        return all(n.key and (n.kind != "op" or _SIGNED_KEY.search(n.key)) for n in self.nodes)

    def _children(self) -> dict[int, list[Edge]]:
        """Node id -> edges leaving it (its inputs in the forward pass), in slot order."""
        children: dict[int, list[Edge]] = defaultdict(list)
        for e in self.edges:
            children[e.src].append(e)
        for outs in children.values():
            outs.sort(key=lambda e: e.slot)
        return children

    def _signatures(self, children: dict[int, list[Edge]], depth: int = 3) -> dict[int, str]:
        """Op node id -> hash of its op and its inputs inside its own layer (see :meth:`assign_keys`)."""
        ops = [n for n in self.nodes if n.kind == "op"]
        fixed: dict[int, list[tuple]] = {}  # level-independent inputs, (slot, what)
        local: dict[int, list[tuple[int, int]]] = {}  # inputs of the same layer call, (slot, id)
        for n in ops:
            layer, own, loc = n.layer, [], []
            for e in children.get(n.id, ()):
                c = self.nodes[e.dst]
                if c.kind == "param" and c.param is not None:
                    own.append((e.slot, "p", _relative(c.param, layer)))
                elif c.kind == "op" and c.layer == layer and c.call == n.call:
                    loc.append((e.slot, c.id))
                elif c.kind == "op" and c.layer is not None and _below(c.layer, layer):
                    own.append((e.slot, "b", _relative(c.layer, layer)))
            fixed[n.id], local[n.id] = own, loc
        sig = {n.id: n.op for n in ops}
        known: dict[tuple, str] = {}  # sibling blocks repeat the same inputs: hashed once
        for _ in range(depth):
            nxt = {}
            for n in ops:
                inputs = fixed[n.id], [(slot, sig[c]) for slot, c in local[n.id]]
                key = (n.op, tuple(inputs[0]), tuple(inputs[1]))
                h = known.get(key)
                if h is None:
                    h = known[key] = hashlib.blake2b(repr((n.op, *inputs)).encode("utf-8"),
                                                     digest_size=8).hexdigest()
                nxt[n.id] = h
            sig = nxt
        return {i: h[:6] for i, h in sig.items()}

    def _dfs_order(self, children: dict[int, list[Edge]] | None = None) -> list[Node]:
        """Nodes in depth-first pre-order from the sources (roots), inputs in slot order."""
        if children is None:
            children = self._children()
        has_in = {e.dst for e in self.edges}
        starts = [n.id for n in self.nodes if n.id not in has_in]
        seen: set[int] = set()
        order: list[Node] = []
        for s in starts + [n.id for n in self.nodes]:  # a cycle-only rest is still visited
            stack = [s]
            while stack:
                nid = stack.pop()
                if nid in seen:
                    continue
                seen.add(nid)
                order.append(self.nodes[nid])
                stack.extend(e.dst for e in reversed(children.get(nid, ())) if e.dst not in seen)
        return order

    # ------------------------------------------------------------ conversions
    def to_dict(self) -> dict[str, Any]:
        d = {
            "format": "paddleviz-hooks/backward-graph",
            "version": FORMAT_VERSION,
            "meta": _meta_to_json(self.meta),
            "layers": self.layers,
            "nodes": [n.to_dict() for n in self.nodes],
            "edges": [e.to_dict() for e in self.edges],
        }
        if self.calls:  # written only when known, like the box fields
            d["calls"] = self.calls
        frames = _frame_table(d["nodes"])
        if frames:
            d["frames"] = frames
        if self.nonfinite is not None:
            d["nonfinite"] = self.nonfinite.to_dict()
        return d

    def to_json(self, indent: int | None = None) -> str:
        """Serialize losslessly; ``from_json(g.to_json()) == g``."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BackwardGraph":
        """Load a graph from :meth:`to_dict`'s form.

        Raises:
            ValueError: not a backward graph, or a malformed field (the
                message names it: ``nodes[3].kind``, ``meta.step``...).
        """
        if isinstance(d, dict) and d.get("format") == "paddleviz-hooks/graph-diff":
            raise ValueError("a saved diff (format 'paddleviz-hooks/graph-diff'), not a backward graph: "
                             "load it with GraphDiff.from_json")
        if not isinstance(d, dict) or d.get("format") != "paddleviz-hooks/backward-graph":
            raise ValueError(
                "not a paddleviz-hooks backward graph (missing "
                "'format': 'paddleviz-hooks/backward-graph')"
            )
        version = d.get("version", 0)
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"malformed backward graph JSON: version must be an int, got {version!r}")
        if version > FORMAT_VERSION:
            raise ValueError(
                f"graph format version {d.get('version')} is newer than this "
                f"paddleviz-hooks understands ({FORMAT_VERSION}); upgrade paddleviz-hooks"
            )
        _check_fields(d)
        table = d.get("frames") or []
        graph = cls(
            nodes=[_field(f"nodes[{i}]", lambda: Node.from_dict(_frames_of(n, table))) for i, n in enumerate(d["nodes"])],
            edges=[_field(f"edges[{i}]", lambda: Edge.from_dict(e)) for i, e in enumerate(d["edges"])],
            layers=dict(d.get("layers") or {}),
            meta=_meta_from_json(dict(d.get("meta") or {})),
            calls=dict(d.get("calls") or {}),
            nonfinite=_field("nonfinite", lambda: NonfiniteRecord.from_dict(d["nonfinite"])) if d.get("nonfinite") else None,
        )
        ids = {n.id for n in graph.nodes}
        for i, e in enumerate(graph.edges):  # a hand-edited file: say which edge, not a KeyError later
            for end in (e.src, e.dst):
                if end not in ids:
                    raise ValueError(f"malformed backward graph JSON: edge {i} ({e.src} -> {e.dst}) points at "
                                     f"node {end!r}, which is not among its {len(graph.nodes)} nodes")
        return graph

    @classmethod
    def from_json(cls, text: str | bytes) -> "BackwardGraph":
        """Load a graph written by :meth:`to_json`.

        Raises:
            ValueError: the text is not JSON of a backward graph.
        """
        return cls.from_dict(parse_json(text))

    def __repr__(self) -> str:
        return (
            f"BackwardGraph({len(self.nodes)} nodes, {len(self.edges)} edges, "
            f"step={self.meta.get('step')})"
        )


def _malformed(where: str, what: str, value: Any) -> ValueError:
    shown = repr(value)
    return ValueError(f"malformed backward graph JSON: {where} must be {what}, got "
                      f"{shown if len(shown) <= 60 else shown[:57] + '...'}")


def _field(where: str, make: Any) -> Any:
    """``make()``, its error a ``ValueError`` that names the field ``where``."""
    try:
        return make()
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        why = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"malformed backward graph JSON: {where}: {why}") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_number(where: str, v: Any) -> None:
    """A float field as :func:`float_to_json` writes it: a number, null or "nan"/"inf"/"-inf"."""
    if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)):
        return
    if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity"):
        return
    raise _malformed(where, "a number or null", v)


def _check_shape(where: str, v: Any) -> None:
    if v is not None and not (isinstance(v, list) and all(_is_int(x) for x in v)):
        raise _malformed(where, "a list of ints or null", v)


def _check_grad(where: str, g: Any) -> None:
    if g is None:
        return
    if not isinstance(g, dict):
        raise _malformed(where, "an object or null", g)
    for k in ("shape", "local_shape"):
        _check_shape(f"{where}.{k}", g.get(k))
    for k in ("norm", "min", "max"):
        _check_number(f"{where}.{k}", g.get(k))
    for k in ("nan", "inf", "parts"):
        if k in g and not _is_int(g[k]):
            raise _malformed(f"{where}.{k}", "an int", g[k])


def _check_fields(d: dict[str, Any]) -> None:
    """Raise a ``ValueError`` naming the first field of a graph dict that is not of its kind
    (a hand-edited or damaged file: said here, not as an ``AttributeError`` in a view later, and
    not accepted as a wrong value: a step ``"abc"``, a node kind ``"zzz"``)."""
    for k in ("nodes", "edges"):
        if not isinstance(d.get(k), list):
            raise _malformed(k, "a list", d.get(k, "nothing"))
    for k in ("layers", "calls", "meta"):
        if d.get(k) is not None and not isinstance(d[k], dict):
            raise _malformed(k, "an object", d[k])
    for k, v in (d.get("layers") or {}).items():
        if not isinstance(v, str):
            raise _malformed(f"layers[{k!r}]", "a layer class name", v)
    for k, v in (d.get("calls") or {}).items():
        if not isinstance(v, str):
            raise _malformed(f"calls[{k!r}]", "the key of the enclosing call (a string)", v)
    step = (d.get("meta") or {}).get("step")
    if step is not None and not (_is_int(step) and step >= 0):
        raise _malformed("meta.step", "an int >= 0 or null", step)
    frames = d.get("frames")
    if frames is not None:
        if not isinstance(frames, list):
            raise _malformed("frames", "a list", frames)
        for i, f in enumerate(frames):
            if not (isinstance(f, list) and len(f) == 4 and _is_int(f[1])
                    and all(isinstance(x, str) for x in (f[0], f[2], f[3]))):
                raise _malformed(f"frames[{i}]", "[file, line, function, code]", f)
    for i, n in enumerate(d["nodes"]):
        where = f"nodes[{i}]"
        if not isinstance(n, dict):
            raise _malformed(where, "an object", n)
        if n.get("id") != i or not _is_int(n.get("id")):
            raise _malformed(f"{where}.id", f"{i} (its place in the list)", n.get("id"))
        if n.get("kind") not in NODE_KINDS:
            raise _malformed(f"{where}.kind", f"one of {', '.join(NODE_KINDS)}", n.get("kind"))
        _check_shape(f"{where}.shape", n.get("shape"))
        _check_number(f"{where}.norm", n.get("norm"))
        for k in ("grad", "local_grad", "received"):
            _check_grad(f"{where}.{k}", n.get(k))
        src = n.get("source")
        if src is not None and not (isinstance(src, list) and all(
                _is_int(x) and 0 <= x < len(frames or ()) for x in src)):
            raise _malformed(f"{where}.source", "a list of indices into frames", src)
    for i, e in enumerate(d["edges"]):
        where = f"edges[{i}]"
        if not isinstance(e, dict):
            raise _malformed(where, "an object", e)
        for k in ("src", "dst"):
            if not _is_int(e.get(k)):
                raise _malformed(f"{where}.{k}", "a node id (an int)", e.get(k, "nothing"))
        if "slot" in e and not _is_int(e["slot"]):
            raise _malformed(f"{where}.slot", "an int", e["slot"])
        for k in ("grad", "after_hook"):
            _check_grad(f"{where}.{k}", e.get(k))
    nf = d.get("nonfinite")
    if nf:
        if not isinstance(nf, dict):
            raise _malformed("nonfinite", "an object or null", nf)
        for k in ("origin", "first_gradient", "entry"):
            if nf.get(k) is not None and not isinstance(nf[k], dict):
                raise _malformed(f"nonfinite.{k}", "an object or null", nf[k])
        for k in ("weights", "buffers"):
            v = nf.get(k)
            if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
                raise _malformed(f"nonfinite.{k}", "a list of names", v)
        if "gradient_sites" in nf and not _is_int(nf["gradient_sites"]):
            raise _malformed("nonfinite.gradient_sites", "an int", nf["gradient_sites"])


def _frame_table(nodes: list[dict[str, Any]]) -> list[list[Any]]:
    """Replace each node dict's ``source`` frames by indices into one table of
    unique frames (a frame shared by many ops, such as the training loop's
    line, is written once); returns the table."""
    index: dict[tuple, int] = {}
    table: list[list[Any]] = []
    for n in nodes:
        src = n.get("source")
        if src is None:
            continue
        ids = []
        for f in src:
            k = tuple(f)
            i = index.get(k)
            if i is None:
                i = index[k] = len(table)
                table.append(list(f))
            ids.append(i)
        n["source"] = ids
    return table


def _frames_of(node: dict[str, Any], table: list[list[Any]]) -> dict[str, Any]:
    """A node dict of the JSON with its ``source`` indices turned back into frames."""
    src = node.get("source")
    if src is None:
        return node
    return {**node, "source": [table[i] for i in src]}


_SIGNED_KEY = re.compile(r"#[0-9a-f]{6}(\.\d+)?$")


def _below(path: str, layer: str | None) -> bool:
    """Whether layer ``path`` is a sublayer of ``layer`` (None: outside the model, so any layer is)."""
    return layer is None or (path != layer and (layer == "" or path.startswith(layer + ".")))


def _relative(name: str, layer: str | None) -> str:
    """A parameter or layer name relative to ``layer`` when it lies below it (``^`` marks one that does not)."""
    if not layer:
        return name
    return name[len(layer) + 1:] if name.startswith(layer + ".") else "^" + name


def parse_json(text: str | bytes) -> Any:
    """``json.loads`` whose error is a one-line ``ValueError``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None


def merge_grad_metas(metas: Iterable[GradMeta]) -> GradMeta | None:
    """Combine several gradients into one figure, marked as combined (``parts``).

    The norm of a sum is not known from the norms of its parts: the
    root-sum-square given here is the norm of no real tensor, so the result
    says how many gradients it stands for (``GradMeta.parts``) and every
    view words it as a combined figure. Where the exact sum is known (the
    gradient a node received, summed at capture time: ``Node.received``),
    use that instead.
    """
    metas = list(metas)
    if not metas:
        return None
    if len(metas) == 1:
        return metas[0]
    first = metas[0]
    norms = [m.norm for m in metas]
    mins = [m.min for m in metas]
    maxs = [m.max for m in metas]
    return GradMeta(
        shape=first.shape,
        dtype=first.dtype,
        local_shape=first.local_shape,
        placements=first.placements,
        # Norm of the sum is not known from the parts; the root-sum-square is
        # exact for orthogonal contributions and a fair summary otherwise.
        norm=None if None in norms else math.sqrt(sum(v * v for v in norms)),
        parts=sum(m.parts for m in metas),
        min=None if None in mins else min(mins),
        max=None if None in maxs else max(maxs),
        nan=sum(m.nan for m in metas),
        inf=sum(m.inf for m in metas),
    )


def float_to_json(v: float | None) -> float | str | None:
    """A float for strict JSON: NaN and +-Inf become ``"nan"``, ``"inf"``, ``"-inf"``.

    Examples:
        >>> float_to_json(float("inf")), float_to_json(1.5)
        ('inf', 1.5)
    """
    if v is None or math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def float_from_json(v: Any) -> float | None:
    """Inverse of :func:`float_to_json` for a field known to hold a float."""
    if v is None:
        return None
    return float(v)


def _meta_to_json(v: Any) -> Any:
    """Meta values for JSON: a non-finite float is tagged, so a string that
    looks like one (``"inf"``) stays a string on the way back."""
    if isinstance(v, float) and not math.isfinite(v):
        return {"$float": float_to_json(v)}
    if isinstance(v, dict):
        return {k: _meta_to_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_meta_to_json(x) for x in v]
    return v


def _meta_from_json(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) == {"$float"}:
            return float(v["$float"])
        return {k: _meta_from_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_meta_from_json(x) for x in v]
    return v
