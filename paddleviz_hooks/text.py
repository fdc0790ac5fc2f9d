"""Every sentence a person reads: summaries, node and layer names, numbers.

One phrase per concept, so the console notice, the VisualDL text record, the
drawing and the report say the same thing the same way. Functions here take
the plain data model (graphs, diffs, box nodes) and return text; escaping is
the caller's job (``paddleviz_hooks.escape``), since the same words go into
DOT, HTML and VisualDL.

Summaries are short lines, one fact each, that still read when a viewer joins
them with spaces (VisualDL's text tab does).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Iterable

from .collapse import CONTAINER_TYPES
from .diff import GraphDiff
from .escape import visible
from .findings import record_of
from .ranks import RankView
from .graph import (BackwardGraph, Edge, GradMeta, Node, NonfiniteOrigin, NonfiniteRecord, SourceFrame, is_communication,
                    merge_grad_metas)
from .hazards import PROGRAM_OP_NOTE, RECOMPUTE_INPUT_NOTE

__all__ = [
    "COMMUNICATION_LEGEND",
    "NOT_OBSERVED",
    "UNOBSERVED_WHY",
    "DASHED_LEGEND",
    "FLOW_LEGEND",
    "NAN_INSIDE",
    "NONFINITE_LEGEND",
    "combined_norm",
    "MODEL_OUTPUT",
    "REPLAYED_FROM_OUTPUT",
    "OUTSIDE_MODEL",
    "diff_side",
    "LAYER_BOX_LEGEND",
    "LAYER_UNRECORDED",
    "LAYER_BACKWARD",
    "node_layer",
    "TOP_LAYER",
    "TOP_PARAMS",
    "WHOLE_MODEL",
    "backward_role",
    "svg_file_note",
    "box_lines",
    "grad_sync_line",
    "rank_comparison_lines",
    "RANKS_DIFFER_LEGEND",
    "RANKS_NORM_LEGEND",
    "RANKS_SYNC_LEGEND",
    "rank_values",
    "rank_presence",
    "rank_view_lines",
    "ranks_title",
    "shard_line",
    "source_frame",
    "source_short",
    "source_lines",
    "source_attrs",
    "SOURCE_NOTES_TEXT",
    "call_name",
    "chart_point_text",
    "capture_title",
    "closing_line",
    "graph_title",
    "picture_title",
    "picture_facts",
    "global_norm_words",
    "origin_title",
    "collapse_note",
    "describe_node",
    "describe_origin",
    "describe_first_gradient",
    "FIRST_GRADIENT",
    "nonfinite_lines",
    "origin_node_lines",
    "origin_placement",
    "origin_short",
    "origin_output",
    "ORIGIN_LEGEND",
    "ORIGIN_NO_GRAD",
    "ORIGIN_NO_NODE",
    "ORIGIN_IN_PROGRAM",
    "STARTS_HERE",
    "origin_badge",
    "diff_summary",
    "edge_lines",
    "AFTER_HOOK",
    "extreme_text",
    "edge_tooltip",
    "exact_num",
    "grad_detail",
    "fmt_bytes",
    "fmt_num",
    "fmt_ratio",
    "fmt_shape",
    "ghost_lines",
    "graph_summary",
    "layer_name",
    "box_name",
    "group_name",
    "node_lines",
    "node_tooltip",
    "received_lines",
    "received_gradient",
    "node_where",
    "every_op_elsewhere",
    "notebook_full_detail",
    "origin_mark",
    "plural",
    "saved_memory_lines",
    "saved_shade_line",
    "summarize",
    "SAVED_SHADE_NONE",
    "SAVED_SHADE_TITLE",
]

#: Where an op of the model's own (top) layer ran: its forward, outside every sublayer
#: (keys say ``<top>``; people read this).
TOP_LAYER = "the model's own forward"
#: The parameters of the top layer itself (the ``"(self)"`` group of ``layer_grad_norms``).
TOP_PARAMS = "the model's own parameters"
#: A box of the top layer (collapsed to depth 0): the whole model.
WHOLE_MODEL = "the whole model"
#: How an op that no layer ran is placed (the loss function, a user's own code).
OUTSIDE_MODEL = "outside the model"
#: An op whose layer is not known: its forward ran before the capture's layer hooks were in place
#: (``Node.layer_note == "unrecorded"``).
LAYER_UNRECORDED = "layer not recorded (its forward ran before the capture was armed)"
#: An op of a gradient's own graph, made by a backward with ``create_graph=True``
#: (``Node.layer_note == "backward"``): no forward op, so no layer call.
LAYER_BACKWARD = "no layer: made by a backward with create_graph=True (an op of a gradient's graph)"
#: The root of a replayed step's graph: the model's output (the loss ops are outside it).
MODEL_OUTPUT = "model output"
#: What a replayed capture is, against an ordinary one (its graph starts at the model output).
REPLAYED_FROM_OUTPUT = "replayed from the model output"
#: A gradient that flowed but could not be seen (its producer takes no hook).
NOT_OBSERVED = "not observed"
#: an edge whose gradient a gradient hook (``Tensor.register_hook``) changed before
#: its receiver got it: the line saying what the receiver got (``Edge.after_hook``)
AFTER_HOOK = "a hook changed it"
#: Legend row of the red nodes (``BackwardGraph.nonfinite_nodes``).
NONFINITE_LEGEND = "NaN/Inf gradient (passed on, or a parameter's)"
#: Legend row of dashed edges.
DASHED_LEGEND = f"dashed: gradient {NOT_OBSERVED} (the node takes no hook, or as its label says)"
#: A box (a layer) holding where a NaN/Inf starts, said in its header where only boxes show.
NAN_INSIDE = "NaN/Inf starts inside"
#: Legend row of the arrows' direction (a forward graph's arrows point the other way).
FLOW_LEGEND = "arrows: the backward, from the loss toward the parameters"
#: Why a gradient's values were not observed (``GradMeta.note`` codes, see ``graph.UNOBSERVED_REASONS``).
UNOBSERVED_WHY = {
    "overwritten": "not observed: the receiving op's backward overwrote it in place",
    "not_computed": "not computed (paddle.grad did not need it)",
    "unpaired": "not observed: could not be matched with its edge",
}
#: Legend rows of a drawing shaded by memory held for backward (``color_by="saved_memory"``).
SAVED_SHADE_TITLE = "shade: bytes saved for backward"
SAVED_SHADE_NONE = "no saved tensor recorded"
#: Legend row and label line of a grad node that communicates between ranks.
COMMUNICATION_LEGEND = "communication between ranks"

_LIST_LIMIT = 4  # names listed per summary line before "and N more"
_DTYPE_SHORT = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
    "int64": "i64", "int32": "i32", "complex64": "c64", "complex128": "c128",
}


# --------------------------------------------------------------------------
# numbers and small pieces
# --------------------------------------------------------------------------
def fmt_num(v: float | None, digits: int = 3) -> str:
    """Short number text: ``digits`` significant digits, NaN/Inf spelled out.

    Examples:
        >>> fmt_num(0.000123456), fmt_num(float("nan")), fmt_num(None)
        ('0.000123', 'NaN', '-')
    """
    if v is None:
        return "-"
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Inf" if v > 0 else "-Inf"
    return f"{v:.{digits}g}"


def fmt_bytes(n: int | None) -> str:
    """Bytes in decimal units, three significant digits.

    Examples:
        >>> fmt_bytes(760832), fmt_bytes(512), fmt_bytes(None)
        ('761 kB', '512 B', '?')
    """
    if n is None:
        return "?"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def call_name(name: str, inclusive: bool = False) -> str:
    """A layer call ``"path#call"`` as people read it: ``layers.0.self_attn``,
    ``block (call 2)``; ``"?"`` (no layer call) is outside the model.

    ``inclusive``: the call stands with its sublayers (a row of the recompute
    table), so the top layer's call is the whole model, not its own forward.

    Examples:
        >>> call_name("layers.0.self_attn#0"), call_name("block#1"), call_name("#0"), call_name("?")
        ('layers.0.self_attn', 'block (call 2)', "the model's own forward", 'outside the model')
        >>> call_name("#0", inclusive=True)
        'the whole model'
    """
    path, sep, index = name.rpartition("#")
    if not sep or not index.isdigit():
        return OUTSIDE_MODEL
    return (box_name(path) if inclusive else layer_name(path)) + _call_suffix(int(index))


def fmt_ratio(r: float) -> str:
    """A change factor: ``x12.3``; ``from 0`` / ``to 0`` where one side is zero.

    Examples:
        >>> fmt_ratio(12.345), fmt_ratio(math.inf), fmt_ratio(0.0)
        ('x12.3', 'from 0', 'to 0')
    """
    if math.isinf(r):
        return "from 0"
    if r == 0:
        return "to 0"
    if r >= 100:
        return f"x{r:.0f}"
    if r >= 0.01:
        return f"x{r:.3g}"
    return f"x{r:.1e}"


def fmt_shape(shape: Iterable[int] | None) -> str:
    """``[2, 3]``; ``?`` when unknown."""
    if shape is None:
        return "?"
    return "[" + ", ".join(str(s) for s in shape) + "]"


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 node``, ``3 nodes``.

    Examples:
        >>> plural(1, "op"), plural(2, "op")
        ('1 op', '2 ops')
    """
    return f"{n} {word if n == 1 else (many or word + 's')}"


def _names(items: list[str], limit: int = _LIST_LIMIT) -> str:
    shown = ", ".join(items[:limit])
    if len(items) > limit:
        shown += f" and {len(items) - limit} more"
    return shown


def backward_role(info: dict[str, Any] | None) -> str:
    """Which backward of its step a graph is (``graph.meta["backward"]``); "" for a step's only one.

    Examples:
        >>> backward_role({"index": 2, "of": 4, "entry": "backward", "micro_batch": 2, "micro_batches": 4})
        'micro-batch 2 of 4'
        >>> backward_role({"index": 1, "of": 2, "entry": "grad"})
        'paddle.grad (backward 1 of 2)'
        >>> backward_role({"index": 2, "of": 2, "entry": "backward"})
        'backward 2 of 2'
        >>> backward_role({"index": 1, "of": 1, "entry": "backward"})
        ''
        >>> backward_role({"index": 1, "of": None, "entry": "backward"})  # written before its step ended
        ''
        >>> backward_role({"index": 2, "of": None, "entry": "backward"})
        'backward 2'
    """
    if not isinstance(info, dict):
        return ""
    if info.get("nested"):
        return "backward run inside another (its node not found)"
    i, n, k = info.get("index"), info.get("of"), info.get("micro_batches")
    grad = info.get("entry") == "grad"
    if k and info.get("micro_batch"):
        words = f"micro-batch {info['micro_batch']} of {k}"
        return f"paddle.grad in {words}" if grad else words
    order = f"backward {i} of {n}" if n else f"backward {i}"
    if grad:
        return "paddle.grad" + (f" ({order})" if i is not None and n != 1 else "")
    if i is None or n == 1 or (n is None and i == 1):  # the first of an unknown number: maybe the only one
        return ""
    return order


def layer_name(path: str | None) -> str:
    """A layer path as people read it: the top layer and "no layer" spelled out.

    Examples:
        >>> layer_name("encoder.layers.0"), layer_name(""), layer_name(None)
        ('encoder.layers.0', "the model's own forward", 'outside the model')
    """
    if path is None:
        return OUTSIDE_MODEL
    return path or TOP_LAYER


def box_name(path: str | None) -> str:
    """The layer a collapsed box stands for: the top layer's box is the whole model.

    Examples:
        >>> box_name("layer1"), box_name("")
        ('layer1', 'the whole model')
    """
    return WHOLE_MODEL if path == "" else layer_name(path)


def group_name(group: str) -> str:
    """A parameter group of ``BackwardGraph.layer_grad_norms`` as people read it.

    Examples:
        >>> group_name("encoder"), group_name("(self)")
        ('encoder', "the model's own parameters")
    """
    return {"(self)": TOP_PARAMS, "(outside)": OUTSIDE_MODEL}.get(group, group)


def _in_layer(layer: str | None) -> str:
    """`` in layer 'block'``, `` in the model's own forward``, `` outside the model``."""
    if layer is None:
        return f" {OUTSIDE_MODEL}"
    return f" in layer '{layer}'" if layer else f" in {TOP_LAYER}"


def node_where(layer: str | None, call: int = 0, note: str | None = None) -> str:
    """``in encoder.layers.0 (call 2)``, ``outside the model``.

    Args:
        layer: the layer path (None: outside the model, or not known).
        call: the call index, 0 for the first call (then not mentioned).
        note: ``Node.layer_note``: why a node has no layer when it is not
            that it ran outside the model.

    Examples:
        >>> node_where("block", 1), node_where(None)
        ('in block (call 2)', 'outside the model')
        >>> node_where(None, note="unrecorded")
        'with its layer not recorded (its forward ran before the capture was armed)'
    """
    if layer is None:
        return {"unrecorded": "with its " + LAYER_UNRECORDED,
                "backward": "made by a backward with create_graph=True"}.get(note or "", OUTSIDE_MODEL)
    return "in " + layer_name(layer) + _call_suffix(call)


def node_layer(node: Any, calls: int = 1) -> str:
    """An op node's layer, as its tooltips and attributes show it: the layer and call,
    "outside the model", or why it is not known.

    Examples:
        >>> node_layer(Node(0, "op", "MatmulGradNode", "Matmul", layer="fc", call=1), calls=2)
        'fc (call 2 of 2)'
        >>> node_layer(Node(0, "op", "MatmulGradNode", "Matmul", layer_note="unrecorded"))
        'layer not recorded (its forward ran before the capture was armed)'
    """
    if node.layer is None:
        return {"unrecorded": LAYER_UNRECORDED, "backward": LAYER_BACKWARD}.get(node.layer_note or "", OUTSIDE_MODEL)
    where = box_name if node.kind == "layer" else layer_name
    return where(node.layer) + _call_suffix(node.call, calls)


def _call_suffix(call: int, calls: int = 1) -> str:
    """`` (call 2 of 3)`` when the number of calls is known, `` (call 2)``
    otherwise; nothing for the first of a single call."""
    if calls > 1:
        return call_of(call, calls)
    return f" (call {call + 1})" if call else ""


def describe_node(info: Node | dict[str, Any]) -> str:
    """Short readable text for a node, or a node record of a :class:`GraphDiff`.

    Examples:
        >>> describe_node({"kind": "op", "op": "Sqrt", "layer": "block"})
        'Sqrt in block'
        >>> describe_node({"kind": "param", "param": "fc.weight"})
        'param fc.weight'
    """
    get = info.get if isinstance(info, dict) else lambda k, d=None: getattr(info, k, d)
    kind = get("kind")
    if kind == "param":
        return f"param {get('param')}"
    if kind == "root":
        return str(get("op") or "loss")
    if kind == "input":
        return "input leaf"
    if kind == "layer":  # a collapsed layer box
        return ((f"layer {get('layer')}" if get("layer") else WHOLE_MODEL) + f" ({get('name') or '?'})"
                + _call_suffix(get("call") or 0, get("calls") or 1))
    return f"{get('op') or '?'} {node_where(get('layer'), get('call') or 0, get('layer_note'))}"


def _as_origin(origin: NonfiniteOrigin | dict[str, Any]) -> NonfiniteOrigin:
    return origin if isinstance(origin, NonfiniteOrigin) else NonfiniteOrigin.from_dict(origin)


def _at(o: NonfiniteOrigin, sep: str = " at ") -> str:
    return f"{sep}{os.path.basename(str(o.file))}:{o.line}" if o.file else ""


def origin_output(origin: NonfiniteOrigin | dict[str, Any]) -> str:
    """The tensor the origin op made: ``float32 output with 2 NaN``; "" when unknown.

    Examples:
        >>> origin_output({"kind": "forward", "op": "log", "dtype": "float32", "nan": 2, "inf": 0})
        'float32 output with 2 NaN'
    """
    o = _as_origin(origin)
    counts = [f"{v} {name}" for v, name in ((o.nan, "NaN"), (o.inf, "Inf")) if v]
    if not counts:
        return ""
    return f"{o.dtype + ' ' if o.dtype else ''}output with {' and '.join(counts)}"


def origin_placement(origin: NonfiniteOrigin | dict[str, Any]) -> str:
    """Where a forward origin's op ran when that is not an op of the graph's own: inside a
    compiled program, or on data that needs no gradient (so it has no grad node); "" otherwise.

    Examples:
        >>> origin_placement({"kind": "forward", "op": "log", "needs_grad": False})
        'on data that needs no gradient'
    """
    o = _as_origin(origin)
    if o.kind == "forward" and o.in_program:
        return ORIGIN_IN_PROGRAM
    if o.kind != "forward" or o.key:
        return ""
    if o.needs_grad is False:
        return ORIGIN_NO_GRAD
    return ORIGIN_NO_NODE


#: Where a forward origin's op sits when its output needs no gradient (so it has no grad node).
ORIGIN_NO_GRAD = "on data that needs no gradient"
#: ... when it ran inside a compiled program (the graph holds the program's ops).
ORIGIN_IN_PROGRAM = "inside a compiled program"
#: ... and when the graph has no node of it for another reason.
ORIGIN_NO_NODE = "without a grad node in this graph"
#: Legend row of the origin mark, in every drawing.
ORIGIN_LEGEND = "where the NaN/Inf starts"
#: The mark of the first node whose gradient turned non-finite (a fact apart from the origin).
FIRST_GRADIENT = "first non-finite gradient"
#: The badge of a forward origin in lists (report): the op where the NaN/Inf starts.
STARTS_HERE = "starts here"


def origin_badge(origin: NonfiniteOrigin | dict[str, Any]) -> str:
    """The badge naming the record's origin in a list: :data:`STARTS_HERE` for an op of the
    forward, ``cause`` for the other kinds (the input data, the weights, the loss, the backward).

    Examples:
        >>> origin_badge({"kind": "forward", "op": "log"}), origin_badge({"kind": "backward"})
        ('starts here', 'cause')
    """
    return STARTS_HERE if _as_origin(origin).kind == "forward" else "cause"


def describe_origin(origin: NonfiniteOrigin | dict[str, Any]) -> str:
    """Where a NaN/Inf started (the record's ``origin``; kinds in
    :data:`paddleviz_hooks.graph.ORIGIN_KINDS`), in one sentence.

    Examples:
        >>> print(describe_origin({"kind": "forward", "op": "sqrt", "layer": "block", "layer_class": "Block",
        ...                        "file": "/src/model.py", "line": 16, "code": "h = paddle.sqrt(h)",
        ...                        "key": "op:block[0]/Sqrt#abc123", "needs_grad": True}))
        NaN/Inf first produced by op 'sqrt' in layer 'block' (Block) at model.py:16: h = paddle.sqrt(h)
        >>> print(describe_origin({"kind": "forward", "op": "log", "layer": "", "file": "/src/m.py", "line": 3,
        ...                        "needs_grad": False, "dtype": "float32", "nan": 4}))
        NaN/Inf first produced by op 'log', on data that needs no gradient, in the model's own forward at m.py:3
        >>> print(describe_origin({"kind": "input"}))
        NaN/Inf already in the input data (the batch given to the model)
    """
    o = _as_origin(origin)
    kind = o.kind
    if kind == "input":
        return "NaN/Inf already in the input data (the batch given to the model)"
    if kind == "weights":
        cls = f" ({o.layer_class})" if o.layer_class else ""
        first = f"layer '{o.layer}'" if o.layer else TOP_PARAMS
        return f"NaN/Inf already in the weights, first in {first}{cls}: an earlier update wrote it"
    if kind == "forward":
        where = _in_layer(o.layer) + _call_suffix(o.call or 0)
        if o.layer_class:
            where += f" ({o.layer_class})"
        at = _at(o)
        if o.code and at:
            at += f": {o.code}"
        place = origin_placement(o)
        return f"NaN/Inf first produced by op '{o.op}'" + (f", {place}," if place else "") + f"{where}{at}"
    if kind == "outside":
        return f"the model's forward is finite: NaN/Inf made {OUTSIDE_MODEL} (loss function or labels)"
    if kind == "backward":
        return "the forward is finite everywhere: NaN/Inf made in the backward"
    if kind == "not_reproduced":
        return ("the replay of this step did not reproduce its NaN/Inf (the forward depends on more than "
                "its inputs and the random state, e.g. a counter)")
    return "NaN/Inf"


def describe_first_gradient(site: Any) -> str:
    """The first node whose gradient turned non-finite, in words.

    Examples:
        >>> describe_first_gradient({"kind": "op", "op": "Sqrt", "layer": "block"})
        'first non-finite gradient at Sqrt in block'
    """
    get = site.get if isinstance(site, dict) else lambda k, d=None: getattr(site, k, d)
    if get("kind") == "root" and get("op") == MODEL_OUTPUT:  # a replayed step: NaN/Inf reached the model
        return f"{FIRST_GRADIENT} at the {MODEL_OUTPUT}"
    return f"{FIRST_GRADIENT} at {describe_node(site)}"


def nonfinite_lines(record: NonfiniteRecord | None) -> list[str]:
    """The NaN/Inf story of a capture, one fact a line (no line when everything is finite):
    the origin, the first non-finite gradient, weights and buffers holding NaN/Inf.

    Examples:
        >>> from paddleviz_hooks.graph import NonfiniteSite
        >>> rec = NonfiniteRecord(NonfiniteOrigin("backward"), NonfiniteSite("k", "op", "Sqrt", "block"), 3,
        ...                       buffers=("bn._variance",))
        >>> for line in nonfinite_lines(rec): print(line)
        the forward is finite everywhere: NaN/Inf made in the backward;
        NaN/Inf gradients at 3 nodes, first non-finite gradient at Sqrt in block;
        NaN/Inf in 1 buffer the forward writes (running statistics; no update wrote them): bn._variance;
    """
    if record is None:
        return []
    lines = []
    if record.origin is not None:
        lines.append(describe_origin(record.origin) + ";")
    if record.first_gradient is not None:
        lines.append(f"NaN/Inf gradients at {plural(record.gradient_sites, 'node')}, "
                     f"{describe_first_gradient(record.first_gradient)};")
    if record.weights:  # an update already wrote NaN/Inf into them: finite gradients do not mean a healthy model
        lines.append(f"NaN/Inf in the weights of {plural(len(record.weights), 'parameter')}: "
                     f"{_names(list(record.weights))};")
    if record.buffers:
        lines.append(f"NaN/Inf in {plural(len(record.buffers), 'buffer')} the forward writes "
                     f"(running statistics; no update wrote them): {_names(list(record.buffers))};")
    return lines


def origin_title(origin: NonfiniteOrigin | dict[str, Any]) -> str:
    """Where a NaN/Inf started, short enough for a picture's title.

    Examples:
        >>> origin_title({"kind": "forward", "op": "sqrt", "layer": "block", "file": "/src/model.py", "line": 16})
        'NaN/Inf starts at sqrt in block, model.py:16'
        >>> origin_title({"kind": "not_reproduced", "op": "Sqrt"})
        'a replay that did not reproduce the NaN/Inf'
    """
    o = _as_origin(origin)
    if o.kind == "forward":
        where = f" in {layer_name(o.layer)}" if o.layer is not None else f" {OUTSIDE_MODEL}"
        place = origin_placement(o)
        place = f", {place}" if place in (ORIGIN_NO_GRAD, ORIGIN_IN_PROGRAM) else ""
        return f"NaN/Inf starts at {o.op}{where}{_at(o, ', ')}{place}"
    return {
        "input": "NaN/Inf already in the input data",
        "weights": f"NaN/Inf already in the weights ({o.layer or TOP_PARAMS})",
        "outside": f"NaN/Inf made {OUTSIDE_MODEL}",
        "backward": "NaN/Inf made in the backward",
        "not_reproduced": "a replay that did not reproduce the NaN/Inf",
    }.get(o.kind, "NaN/Inf")


#: The added origin node's last line when where its output enters the graph was not found.
ORIGIN_UNLINKED = "not linked: where its output enters the graph was not found"


def origin_mark(origin: NonfiniteOrigin | dict[str, Any]) -> str:
    """The line drawn on the node where a NaN/Inf started (the origin op's node, or the box holding it).

    Examples:
        >>> origin_mark({"kind": "forward", "op": "sqrt", "file": "/src/model.py", "line": 16})
        'NaN/Inf starts here: sqrt, model.py:16'
    """
    o = _as_origin(origin)
    return f"NaN/Inf {STARTS_HERE}: {o.op}{_at(o, ', ')}"


def origin_short(origin: NonfiniteOrigin | dict[str, Any]) -> str:
    """The origin mark without the file (VisualDL's Graphs tab shows a node type only after its last dot).

    Examples:
        >>> origin_short({"kind": "forward", "op": "batch_norm", "file": "/src/model.py", "line": 16})
        'NaN/Inf starts here: batch_norm'
    """
    return f"NaN/Inf {STARTS_HERE}: {_as_origin(origin).op}"


def origin_node_lines(origin: NonfiniteOrigin | dict[str, Any], linked: bool = True) -> list[str]:
    """The label of the node a drawing adds for an origin op that has none in the graph,
    drawn where its output enters the graph (``linked``), or alone when that was not found.

    Examples:
        >>> origin_node_lines({"kind": "forward", "op": "log", "layer": "", "file": "/src/m.py", "line": 18,
        ...                    "needs_grad": False})
        ['log, on data that needs no gradient: NaN/Inf starts here', "in the model's own forward, m.py:18"]
        >>> origin_node_lines({"kind": "forward", "op": "log", "layer": "", "needs_grad": False}, linked=False)[-1]
        'not linked: where its output enters the graph was not found'
    """
    o = _as_origin(origin)
    return [f"{o.op}, {origin_placement(o) or ORIGIN_NO_NODE}: NaN/Inf {STARTS_HERE}",
            f"{_in_layer(o.layer).strip()}{_at(o, ', ')}"] + ([] if linked else [ORIGIN_UNLINKED])


# --------------------------------------------------------------------------
# drawing labels
# --------------------------------------------------------------------------
def edge_lines(meta: GradMeta | None, stats: bool, observed: bool = True, why: str | None = None,
               after_hook: GradMeta | None = None) -> list[str]:
    """Label lines for one gradient: shape and dtype, then norm (and NaN/Inf).

    Args:
        meta: what is known of the gradient (None: nothing).
        stats: show the norm.
        observed: False for a gradient whose shape is known but whose
            values could not be seen (inside a compiled program).
        why: why it was not observed (``Edge.note``), shown under "not observed".
        after_hook: what the receiving node got instead, a gradient hook having
            changed it (``Edge.after_hook``): its own line, :data:`AFTER_HOOK`.

    Examples:
        >>> edge_lines(GradMeta((2, 16), "float32"), True, observed=False)
        ['[2, 16] f32', 'not observed']
        >>> edge_lines(None, True, why="Einsum takes no hook")
        ['not observed', '(Einsum takes no hook)']
        >>> edge_lines(GradMeta((3, 6), "float32", norm=1.331), True, after_hook=GradMeta((3, 6), norm=13.31))
        ['[3, 6] f32', '|g| 1.33', 'a hook changed it: |g| 13.3']
    """
    unseen = [NOT_OBSERVED] + ([f"({why})"] if why else [])
    if meta is None:
        return unseen
    lines = [f"{fmt_shape(meta.shape)} {_DTYPE_SHORT.get(meta.dtype or '', meta.dtype or '')}".strip()]
    if meta.note is not None:
        return lines + [UNOBSERVED_WHY.get(meta.note, NOT_OBSERVED)]
    if not observed:
        return lines + unseen
    if meta.local_shape is not None:  # auto-parallel: this rank's shard
        lines.append(shard_line(meta))
    if stats and meta.norm is not None:
        extra = combined_norm(meta) if meta.parts > 1 else f"|g| {fmt_num(meta.norm)}" + _part_note(meta)
        if meta.nonfinite:
            extra += f" NaN:{meta.nan} Inf:{meta.inf}"
        lines.append(extra)
    if stats and after_hook is not None and after_hook.norm is not None:
        changed = f"{AFTER_HOOK}: |g| {fmt_num(after_hook.norm)}"
        if after_hook.nonfinite:
            changed += f" NaN:{after_hook.nan} Inf:{after_hook.inf}"
        lines.append(changed)
    return lines


def extreme_text(meta: GradMeta, value: float | None) -> str:
    """A gradient's min or max as an attribute shows it: the number in full, or why there is none.

    Examples:
        >>> extreme_text(GradMeta((3,), "float32", norm=1.0, min=-0.5, max=1.0), -0.5)
        '-0.5'
        >>> extreme_text(GradMeta((3,), "complex64", norm=1.0), None)
        'none (complex values have no order)'
        >>> extreme_text(GradMeta((0, 4), "float32", norm=0.0), None)
        'none (no elements)'
    """
    if value is not None:
        return exact_num(value)
    if meta.dtype in ("complex64", "complex128"):
        return "none (complex values have no order)"
    if meta.shape is not None and 0 in meta.shape:
        return "none (no elements)"
    return fmt_num(None)


def combined_norm(meta: GradMeta) -> str:
    """The figure of several different gradients drawn as one edge (a collapsed view):
    said to be combined, never written like one gradient's norm.

    Examples:
        >>> combined_norm(GradMeta((4,), norm=5.0, parts=2))
        '2 gradients, root-sum-square of |g| 5'
    """
    return f"{meta.parts} gradients, root-sum-square of |g| {fmt_num(meta.norm)}"


def _part_note(meta: GradMeta) -> str:
    """What part of a distributed gradient its statistics describe (they are of this rank's local value).

    Examples:
        >>> _part_note(GradMeta((4, 8), local_shape=(4, 8), placements=("Partial(reduce_type=SUM)",)))
        " (this rank's summand)"
        >>> _part_note(GradMeta((8, 16), local_shape=(8, 8), placements=("Shard(dim=1)",))), _part_note(GradMeta((2,)))
        (' (shard)', '')
    """
    if meta.local_shape is None:
        return ""
    if any(p.startswith("Partial") for p in meta.placements or ()):  # the gradient is the sum over ranks
        return " (this rank's summand)"
    return " (shard)" if meta.local_shape != meta.shape else ""


def shard_line(meta: GradMeta) -> str:
    """This rank's shard of a distributed gradient: local shape and placements.

    Examples:
        >>> shard_line(GradMeta((8, 16), "float32", local_shape=(8, 8), placements=("Shard(dim=1)",)))
        'shard [8, 8] Shard(dim=1)'
    """
    return f"shard {fmt_shape(meta.local_shape)} {', '.join(meta.placements or ())}".strip()


def node_lines(node: Node) -> list[str]:
    """The visible label of a node (with what it saved for backward, when recorded).

    Examples:
        >>> node_lines(Node(3, "op", "ReluGradNode", "Relu", saved_bytes=2048))
        ['Relu', 'saved 2.05 kB']
        >>> node_lines(Node(4, "param", "GradNodeAccumulation", param="fc.weight", shape=(8, 3),
        ...                 grad=GradMeta(norm=0.96), local_grad=GradMeta(norm=1.72)))  # data parallel
        ['fc.weight', '[8, 3]', 'all-reduced |g| 0.96']
    """
    if node.kind == "param":
        synced = node.local_grad is not None and node.grad is not None and node.grad != node.local_grad
        shard = [shard_line(node.grad)] if node.grad is not None and node.grad.local_shape is not None else []
        return [node.param or "parameter", fmt_shape(node.shape)] + shard + (
            [f"all-reduced |g| {fmt_num(node.grad.norm)}"] if synced and node.grad.norm is not None else [])
    if node.kind == "root":
        return [node.name, fmt_shape(node.shape)]
    if node.kind == "input":  # a recomputed block's input, held by its PyLayer, is no input of the model
        return ["recompute input", "(held by the PyLayer)"] if node.note == RECOMPUTE_INPUT_NOTE else ["input"]
    if node.kind == "layer":
        return box_lines(node)
    return [node.op] + ([COMMUNICATION_LEGEND] if is_communication(node.op) else []) + (
        [f"saved {fmt_bytes(node.saved_bytes)}"] if node.saved_bytes else [])


def saved_shade_line(lo: int, hi: int, nodes: int) -> str:
    """Legend row of one shade of ``color_by="saved_memory"``: the bytes its nodes saved for backward.

    Examples:
        >>> saved_shade_line(1_200_000, 4_190_000, 3), saved_shade_line(512, 512, 1)
        ('1.2 MB to 4.19 MB (3 nodes)', '512 B (1 node)')
    """
    size = fmt_bytes(lo) if lo == hi else f"{fmt_bytes(lo)} to {fmt_bytes(hi)}"
    return f"{size} ({plural(nodes, 'node')})"


def call_of(call: int, calls: int) -> str:
    """Which call of a layer called several times a box stands for.

    Examples:
        >>> call_of(1, 2), call_of(0, 1)
        (' (call 2 of 2)', '')
    """
    return f" (call {call + 1} of {calls})" if calls > 1 else ""


def ghost_lines(node: Node) -> list[str]:
    """The label of a removed node drawn in a diff (a ghost): what it was, where, ``(removed)``.

    A ghost sits outside the layer frames of the drawing, so an op names its
    layer itself.

    Examples:
        >>> ghost_lines(Node(7, "op", "AddGradNode", "Add", layer=""))
        ['Add', "in the model's own forward", '(removed)']
        >>> ghost_lines(Node(8, "op", "MeanGradNode", "Mean"))
        ['Mean', 'outside the model', '(removed)']
    """
    if node.kind == "op":
        return [node.op or "?", node_where(node.layer, node.call), "(removed)"]
    return node_lines(node) + ["(removed)"]


def box_lines(node: Node) -> list[str]:
    """Label of a collapsed layer box: path (call k of n), class (x N), op and
    parameter count (of one block, for a run of N alike), norm.

    Examples:
        >>> box_lines(Node(0, "box", "Block", layer="layers.0-2", count=3, ops=87, params=48))[:3]
        ['layers.0-2', 'Block x3', '29 ops each, 16 params']
    """
    path = box_name(node.layer) + call_of(node.call, node.calls) if node.layer is not None else ""
    kind = node.name + (f" x{node.count}" if node.count > 1 else "")
    lines = [path, kind] if path else [kind]
    def each(n: int) -> int | None:  # a run of alike blocks: the count of one block
        return n // node.count if node.count > 1 and n % node.count == 0 else None

    per, per_params = each(node.ops), each(node.params)
    size = (plural(per, "op") + " each") if per is not None else (plural(node.ops, "op") if node.ops else "")
    if node.params:
        size += (", " if size else "") + (plural(per_params, "param") + (" each" if per is None else "")
                                          if per_params is not None else plural(node.params, "param"))
    if size:
        lines.append(size)
    if node.norm is not None:
        lines.append(f"|g| params {fmt_num(node.norm)}")
    if node.saved_bytes:
        lines.append(f"saved for backward {fmt_bytes(node.saved_bytes)}")
    if node.nonfinite:
        lines.append(f"{node.nonfinite} NaN/Inf gradient values inside")
    return lines


#: The legend row of a drawing with folded repeats: what "x N" on a box means.
#: Legend row of a layer box (a layer call whose ops a collapsed drawing folds into one node).
LAYER_BOX_LEGEND = "layer box: one layer call's ops folded (|g| params: its parameters' gradients)"
FOLD_LEGEND = "x N on a box: N consecutive layers alike (same ops, edges, parameter shapes), folded"
#: ... and when one layer of each folded run is drawn open beside its box.
FOLD_SHOWN_LEGEND = FOLD_LEGEND + '; "1 of N alike": one more of them, drawn beside the box'


def fold_alike_line(shown: str, count: int) -> str:
    """The line a box of ``count`` folded layers adds when one more layer of their run is
    drawn beside it.

    Examples:
        >>> fold_alike_line("layers.223", 223), fold_alike_line("layer1.2", 1)
        ('each like layers.223 (drawn)', 'like layer1.2 (drawn)')
    """
    return f"{'each like' if count > 1 else 'like'} {layer_name(shown)} (drawn)"


def shown_block_line(run: int, others: str | None = None) -> str:
    """What the layer drawn beside the box of its folded run says about it (``others``: that
    box, named in a frame's label; a box's own label leaves it out, it is drawn next to it).

    Examples:
        >>> shown_block_line(224, "layers.0-222"), shown_block_line(224)
        ('1 of 224 alike (the others: layers.0-222)', '1 of 224 alike')
    """
    return f"1 of {run} alike" + (f" (the others: {layer_name(others)})" if others is not None else "")


#: Why an op has no forward source line (``Node.source_note``), as people read it.
SOURCE_NOTES_TEXT = {
    "static": "no Python line: a to_static program (its ops run compiled)",
    "internal": "no Python line: made inside Paddle, not called from your code",
    "unrecorded": "forward line not recorded: its forward ran before the capture was armed or decided "
                  "(or Paddle kept no stack for this op)",
    "backward": "no forward line: made by a backward with create_graph=True (Paddle keeps no call stack for it)",
}
_SOURCE_SHOWN = 4  # outer frames named after the innermost one


def source_frame(frame: SourceFrame, full: bool = True) -> str:
    """One frame of a forward call stack: ``file:line in function: code``.

    Examples:
        >>> f = SourceFrame("/src/model.py", 16, "forward", "h = paddle.sqrt(h)")
        >>> source_frame(f), source_frame(f, full=False)
        ('/src/model.py:16 in forward: h = paddle.sqrt(h)', 'model.py:16 in forward')
    """
    if not full:
        return f"{os.path.basename(frame.file) or frame.file}:{frame.line} in {frame.function}"
    return f"{frame.file}:{frame.line} in {frame.function}" + (f": {frame.code}" if frame.code else "")


def source_short(node: Node) -> str | None:
    """Where an op's forward was called, short (``model.py:16: h = paddle.sqrt(h)``);
    the reason when that is not known; None for nodes that are no op.

    Examples:
        >>> source_short(Node(1, "op", "SqrtGradNode", "Sqrt",
        ...                   source=(SourceFrame("/src/model.py", 16, "forward", "h = paddle.sqrt(h)"),)))
        'model.py:16: h = paddle.sqrt(h)'
    """
    if node.source:
        f = node.source[-1]
        return f"{os.path.basename(f.file) or f.file}:{f.line}" + (f": {f.code}" if f.code else "")
    return SOURCE_NOTES_TEXT.get(node.source_note or "")


def source_lines(node: Node) -> list[str]:
    """The forward call stack of an op, innermost first: ``line: ...`` then
    ``called from: ...`` (the outermost beyond a few are counted); the reason
    when it is not known; nothing when it was not recorded at all.

    Examples:
        >>> n = Node(1, "op", "TanhGradNode", "Tanh", source=(
        ...     SourceFrame("train.py", 40, "<module>", "loss = net(x).mean()"),
        ...     SourceFrame("model.py", 19, "squash", "h = paddle.tanh(h)")))
        >>> source_lines(n)
        ['line: model.py:19 in squash: h = paddle.tanh(h)', 'called from: train.py:40 in <module>: loss = net(x).mean()']
    """
    if not node.source:
        text = SOURCE_NOTES_TEXT.get(node.source_note or "")
        return [text] if text else []
    frames = list(reversed(node.source))
    lines = ["line: " + source_frame(frames[0])]
    lines += ["called from: " + source_frame(f) for f in frames[1:1 + _SOURCE_SHOWN]]
    if len(frames) > 1 + _SOURCE_SHOWN:
        lines.append(f"called from: {plural(len(frames) - 1 - _SOURCE_SHOWN, 'more frame')}")
    return lines


def source_attrs(node: Node) -> dict[str, str]:
    """Attributes of a node for viewers that list them (Model Explorer, VisualDL's
    Graphs tab): where its forward was called, in full.

    Examples:
        >>> source_attrs(Node(1, "op", "TanhGradNode", "Tanh", source=(
        ...     SourceFrame("/src/train.py", 40, "<module>", "loss = net(x).mean()"),
        ...     SourceFrame("/src/model.py", 19, "squash", "h = paddle.tanh(h)"))))
        {'source': 'model.py:19: h = paddle.tanh(h)', 'source file': '/src/model.py:19 in squash', 'called from': '/src/train.py:40 in <module>: loss = net(x).mean()'}
    """
    if node.kind != "op":
        return {}
    if not node.source:
        text = source_short(node)
        return {"source": text} if text else {}
    f = node.source[-1]
    out = {"source": source_short(node) or "", "source file": f"{f.file}:{f.line} in {f.function}"}
    if len(node.source) > 1:
        out["called from"] = " < ".join(source_frame(x) for x in reversed(node.source[:-1]))
    return out


def exact_num(v: float | None) -> str:
    """A number in full: the shortest text that reads back as the same float (what the JSON
    holds); NaN/Inf spelled out, ``-`` for none.

    Examples:
        >>> exact_num(0.1234567890123), exact_num(float("-inf")), exact_num(None)
        ('0.1234567890123', '-Inf', '-')
    """
    return fmt_num(v) if v is None or not math.isfinite(v) else repr(float(v))


def grad_detail(meta: GradMeta | None, head: str = "gradient", why: str | None = None,
                stats: bool = True) -> list[str]:
    """One gradient in full, for hover and click text: ``head`` with its shape and dtype,
    then its L2 norm, min and max (exact, as the JSON has them) and its NaN and Inf counts;
    or why its values are not known.

    Args:
        meta: what is known of the gradient (None: nothing, it was not observed).
        head: what the gradient is to the reader (``gradient received``...).
        why: why it was not observed, when known (``Edge.note``).
        stats: whether gradient statistics were recorded in this capture.

    Examples:
        >>> grad_detail(GradMeta((2, 3), "float32", norm=0.5, min=-0.25, max=0.125))
        ['gradient [2, 3] float32', 'norm 0.5', 'min -0.25, max 0.125', 'NaN 0, Inf 0']
        >>> grad_detail(None, why="Einsum takes no hook")
        ['gradient not observed (Einsum takes no hook)']
        >>> grad_detail(GradMeta((4,), "float32"), stats=False)
        ['gradient [4] float32', 'values not recorded (gradient statistics off)']
        >>> grad_detail(GradMeta((4,), "float32", norm=5.0, min=-1.0, max=2.0, parts=2))  # a collapsed view's edge
        ['gradient: 2 gradients combined', "root-sum-square of their norms 5.0 (no one tensor's norm)", 'min -1.0, max 2.0 (over all 2)', 'NaN 0, Inf 0']
    """
    if meta is None:
        return [f"{head} {NOT_OBSERVED}" + (f" ({why})" if why else "")]
    if meta.parts > 1:  # several gradients drawn as one (a collapsed view): no one tensor, no one shape
        lines = [f"{head}: {meta.parts} gradients combined"]
    else:
        lines = [f"{head} {fmt_shape(meta.shape)} {meta.dtype or '?'}"]
    if meta.local_shape is not None:  # auto-parallel: the numbers are this rank's shard's
        lines.append(shard_line(meta) + _part_note(meta))
    if meta.note is not None:
        return lines + [UNOBSERVED_WHY.get(meta.note, NOT_OBSERVED)]
    if meta.norm is None:
        if not stats:
            return lines + ["values not recorded (gradient statistics off)"]
        return lines + [f"values {NOT_OBSERVED}" + (f" ({why})" if why else "")]
    if meta.parts > 1:
        lines.append(f"root-sum-square of their norms {exact_num(meta.norm)} (no one tensor's norm)")
        lines.append(f"min {extreme_text(meta, meta.min)}, max {extreme_text(meta, meta.max)} (over all {meta.parts})")
    else:
        lines.append(f"norm {exact_num(meta.norm)}")
        lines.append(f"min {extreme_text(meta, meta.min)}, max {extreme_text(meta, meta.max)}")
    lines.append(f"NaN {meta.nan}, Inf {meta.inf}")
    return lines


_SUM_UNSEEN = f"their sum {NOT_OBSERVED})"  # the end of the head of several gradients whose sum was not read


def received_gradient(node: Node, incoming: Iterable[Edge] = ()) -> tuple[str, GradMeta | None, str | None]:
    """The gradient a node received, the one rule every view follows: ``(what to call it,
    the gradient, why it was not observed)``. A parameter's is what this backward added to
    ``param.grad``; an op's, the sum of what arrived when it was read (``Node.received``),
    else what a gradient hook made of its one incoming gradient, else that gradient, else
    its observed incoming gradients combined (said to be: their sum was not observed). The
    root receives none: ``("", None, None)``.

    Examples:
        >>> received_gradient(Node(2, "op", "ExpGradNode", "Exp"), [Edge(1, 2, note="Einsum takes no hook")])
        ('gradient received', None, 'Einsum takes no hook')
    """
    if node.kind == "root":
        return "", None, None
    if node.kind == "param":
        return "gradient added to param.grad", node.grad, None
    if node.received is not None:
        return "gradient received (the sum of what arrived)", node.received, None
    edges = list(incoming)
    if not edges:
        return "", None, None
    if len(edges) == 1 and edges[0].after_hook is not None:  # a gradient hook changed what was sent
        return f"gradient received ({AFTER_HOOK})", edges[0].after_hook, None
    if len(edges) == 1:
        return "gradient received", edges[0].grad, edges[0].note
    seen = [e.grad for e in edges if e.grad is not None and e.grad.note is None and e.grad.norm is not None]
    return f"{len(edges)} gradients received ({len(seen)} observed; {_SUM_UNSEEN}", merge_grad_metas(seen), None


def received_lines(node: Node, incoming: Iterable[Edge] = (), stats: bool = True) -> list[str]:
    """The gradient a node received (:func:`received_gradient`), in full (:func:`grad_detail`);
    the observed parts of an unobserved sum under their own head.

    Examples:
        >>> received_lines(Node(3, "param", "GradNodeAccumulation", param="fc.bias",
        ...                     grad=GradMeta((2,), "float32", norm=1.0, min=0.6, max=0.8)))
        ['gradient added to param.grad [2] float32', 'norm 1.0', 'min 0.6, max 0.8', 'NaN 0, Inf 0']
        >>> received_lines(Node(2, "op", "AddGradNode", "Add"), [Edge(0, 2, grad=GradMeta((2,), "float32", norm=3.0,
        ...                min=0.0, max=3.0)), Edge(1, 2, grad=GradMeta((2,), "float32", norm=4.0, min=-4.0, max=0.0))])
        ['2 gradients received (2 observed; their sum not observed)', 'the observed ones: 2 gradients combined', "root-sum-square of their norms 5.0 (no one tensor's norm)", 'min -4.0, max 3.0 (over all 2)', 'NaN 0, Inf 0']
    """
    head, meta, why = received_gradient(node, incoming)
    if not head:
        return []
    if not head.endswith(_SUM_UNSEEN):
        return grad_detail(meta, head, why, stats)
    if meta is None:
        return [head]
    return [head] + grad_detail(meta, "the observed ones" if meta.parts > 1 else "the observed one:", stats=stats)


def chart_point_text(layer: str, step: Any, role: str, norm: float) -> str:
    """Hover text of one point of a gradient-norm chart: the layer, the training step (and
    which backward of the step, with micro-batches) and the norm in full.

    Examples:
        >>> chart_point_text("fc.2", 20, "micro-batch 2 of 2", 0.0123456789)
        'fc.2 | step 20 - micro-batch 2 of 2 | gradient L2 norm 0.0123456789'
        >>> chart_point_text("fc", 3, "", float("nan"))
        'fc | step 3 | gradient L2 norm NaN'
    """
    return f"{layer} | {capture_title(step, role=role)} | gradient L2 norm {exact_num(norm)}"


def edge_tooltip(src: Node, dst: Node, edge: Edge, stats: bool = True) -> str:
    """Hover text of an edge: where its gradient flows (from -> to), then the gradient in full
    (:func:`grad_detail`), or why it was not observed.

    Examples:
        >>> edge_tooltip(Node(1, "op", "ReluGradNode", "Relu", layer="fc"), Node(2, "param", "GradNodeAccumulation",
        ...              param="fc.bias"), Edge(1, 2, grad=GradMeta((2,), "float32", norm=1.5, min=0.5, max=1.25)))
        'Relu in fc -> param fc.bias | gradient [2] float32 | norm 1.5 | min 0.5, max 1.25 | NaN 0, Inf 0'
        >>> edge_tooltip(Node(1, "op", "SigmoidGradNode", "Sigmoid"), Node(2, "op", "AddGradNode", "Add"),
        ...              Edge(1, 2, grad=GradMeta((2,), "float32", norm=1.0, min=0.5, max=0.5),
        ...                   after_hook=GradMeta((2,), "float32", norm=10.0, min=5.0, max=5.0))).split(" | ")[5:7]
        ['a hook changed it, received [2] float32', 'norm 10.0']
    """
    changed = grad_detail(edge.after_hook, f"{AFTER_HOOK}, received", stats=stats) if edge.after_hook else []
    return " | ".join([f"{describe_node(src)} -> {describe_node(dst)}",
                       *grad_detail(edge.grad, why=edge.note, stats=stats), *changed])


def node_tooltip(node: Node, incoming: Iterable[Edge] = (), stats: bool = True) -> str:
    """Hover text: Paddle's grad node name, the layer (call) of an op or a layer box, the
    key, why unhooked, the gradient it received (:func:`received_lines`; ``incoming``: the
    edges entering it), what it saved for backward, where its forward was called.

    Examples:
        >>> node_tooltip(Node(3, "param", "GradNodeAccumulation", "param", param="head.weight", key="param:head.weight"))
        'GradNodeAccumulation | key: param:head.weight | gradient added to param.grad not observed'
    """
    tip = [node.name]
    if node.kind in ("op", "layer"):  # a parameter, the root or an input belongs to no layer call
        tip.append("layer: " + node_layer(node, node.calls))
    tip.append(f"key: {node.key}")
    if node.note:
        tip.append(node.note)
    tip.extend(received_lines(node, incoming, stats))  # before the long source lines: kept when shortened
    tip.extend(source_lines(node))
    if node.saved_bytes:
        tip.append(f"saved for backward: {fmt_bytes(node.saved_bytes)}")
    if node.kind == "layer" and node.unhooked:
        tip.append(f"no gradient data at {node.unhooked} of {plural(node.ops, 'op')}")
    if node.local_grad is not None and node.grad is not None:
        tip.append(f"grad norm after all-reduce {fmt_num(node.grad.norm)}, "
                   f"this rank's local {fmt_num(node.local_grad.norm)}")
    return " | ".join(tip)


def run_folder_note(asked: str, used: str) -> str:
    """Said once, when a recorder writes beside the run folder it was given: which folders it
    passed over (``asked``, ``asked_2``... up to the one before ``used``: each held records or
    another live writer's lock when it looked, see ``sinks/files.py``'s ``claim_run_dir``).

    Examples:
        >>> run_folder_note("/logs/backward_graph", "/logs/backward_graph_2")
        ' (backward_graph holds an earlier run or another writer: kept as it is, this run writes beside it)'
        >>> run_folder_note("/logs/backward_graph", "/logs/backward_graph_3")
        ' (backward_graph and backward_graph_2 hold earlier runs or other writers: kept as they are, this run writes beside them)'
        >>> run_folder_note("/logs/run", "/logs/run_12")
        ' (run to run_11, 11 folders, hold earlier runs or other writers: kept as they are, this run writes beside them)'
        >>> run_folder_note("/logs/a", "/logs/a")
        ''
    """
    if asked == used:
        return ""
    name = os.path.basename(asked)
    m = re.fullmatch(re.escape(asked) + r"_(\d+)", used)
    taken = int(m.group(1)) - 1 if m else 0  # the folders passed over: name, name_2, ... name_<taken>
    if taken <= 1:
        return f" ({name} holds an earlier run or another writer: kept as it is, this run writes beside it)"
    last = f"{name}_{taken}"
    folders = f"{name} and {last}" if taken == 2 else f"{name} to {last}, {taken} folders,"
    return f" ({folders} hold earlier runs or other writers: kept as they are, this run writes beside them)"


def step_list(steps: Iterable[int], limit: int = 10) -> str:
    """``1, 4, 8`` (the first ``limit``, then ``...``)."""
    steps = list(steps)
    return ", ".join(map(str, steps[:limit])) + (" ..." if len(steps) > limit else "")


def redraw_command(json_path: str | None, out_path: str, max_px: int = 2000, max_nodes: int | None = None) -> str:
    """How a person draws a saved capture later (or why that cannot be done); a PNG with the
    recorder's ``view_max_px`` and ``view_max_nodes`` when they are not the defaults.

    Examples:
        >>> redraw_command("s.json", "s.png", max_px=1200)
        'draw it with `paddleviz-hooks render s.json -o s.png --max-px 1200`'
    """
    if json_path is None:
        return "its JSON was not kept (add 'json' to formats to keep it)"
    png = out_path.endswith(".png")
    extra = (f" --max-px {max_px}" if png and max_px != 2000 else "") + (
        f" --max-nodes {max_nodes}" if png and max_nodes is not None else "")
    return f"draw it with `paddleviz-hooks render {json_path} -o {out_path}{extra}`"


def lost_line(steps: dict[int, str]) -> str:
    """The captured steps whose data never reached disk, each with why.

    Examples:
        >>> lost_line({3: "no space left on device", 4: "no space left on device", 9: "the run folder was deleted"})
        'steps 3, 4 lost: no space left on device; step 9 lost: the run folder was deleted'
    """
    by_reason: dict[str, list[int]] = {}
    for step, why in sorted(steps.items()):
        by_reason.setdefault(why, []).append(step)
    return "; ".join(f"{'steps' if len(s) > 1 else 'step'} {step_list(s)} lost: {why}" for why, s in by_reason.items())


def undrawn_line(steps: dict[int, str], first: str) -> str:
    """The steps whose data is saved but whose pictures are not, each with why, and
    how to draw them (``first``: :func:`redraw_command` for the first one).

    Examples:
        >>> undrawn_line({4: "closed", 8: "closed"}, "draw it with `paddleviz-hooks render a.json -o a.png`")
        '2 captured steps not drawn (steps 4, 8: closed); their data is saved: each is drawn from its own step_*.json the same way; the first: draw it with `paddleviz-hooks render a.json -o a.png`'
    """
    by_reason: dict[str, list[int]] = {}
    for step, why in sorted(steps.items()):
        by_reason.setdefault(why, []).append(step)
    parts = [f"{'steps' if len(s) > 1 else 'step'} {step_list(s)}: {why}" for why, s in by_reason.items()]
    how = first if len(steps) == 1 else f"each is drawn from its own step_*.json the same way; the first: {first}"
    return f"{plural(len(steps), 'captured step')} not drawn ({'; '.join(parts)}); their data is saved: {how}"


def closing_line(timeout: float) -> str:
    """What the recorder says when ``close()`` starts waiting on pictures still being drawn.

    Examples:
        >>> closing_line(120)
        'drawing the captures still waiting (at most close_timeout=120 s; Ctrl-C leaves them undrawn, with the command that draws them)'
    """
    return (f"drawing the captures still waiting (at most close_timeout={timeout:g} s; "
            "Ctrl-C leaves them undrawn, with the command that draws them)")


def end_line(captured: int, graphs: int, written: int, lost: dict[int, str], drawn: int, undrawn: int,
             folder: str) -> str:
    """The recorder's last line: what was captured, written, drawn, and where it is.

    Captured = written + lost, and written = drawn + left undrawn, always.

    Examples:
        >>> end_line(13, 13, 6, {7: "the run folder was deleted"}, 6, 0, "/gone")
        '13 steps captured: 6 written, 1 lost (step 7 lost: the run folder was deleted); 6 drawn, 0 left undrawn (the run folder /gone does not exist any more)'
    """
    more = f" ({graphs} graphs)" if graphs != captured else ""
    lost_part = f"{len(lost)} lost ({lost_line(lost)})" if lost else "0 lost"
    where = (f"data saved in {folder}" if os.path.isdir(folder)
             else f"the run folder {folder} does not exist" + (" any more" if written else ""))
    return (f"{plural(captured, 'step')} captured{more}: {written} written, {lost_part}; "
            f"{drawn} drawn, {undrawn} left undrawn ({where})")


def capture_title(step: Any, trigger: str | None = None, role: Any = None, index: int | None = None,
                  origin: NonfiniteOrigin | dict[str, Any] | None = None) -> str:
    """The name of one capture (in a list of captures, on its picture): step, backward role,
    trigger, where a NaN/Inf started.

    Args:
        step: the step (text or number), None when unknown.
        trigger: what made the capture (``"scheduled"`` or None is not named).
        role: which backward of the step it was, as :func:`backward_role` words it.
        index: the capture's position (from 1), named when the step is unknown.
        origin: the record's origin (``graph.nonfinite.origin``), worded by :func:`origin_title`.

    Examples:
        >>> capture_title(8, "nonfinite_loss"), capture_title("03", "scheduled", "micro-batch 2 of 2")
        ('step 8 - trigger: nonfinite_loss', 'step 03 - micro-batch 2 of 2')
        >>> capture_title(None, index=2)
        'capture 2'
    """
    title = f"capture {'?' if index is None else index}" if step is None else f"step {step}"
    if role not in (None, "", {}):
        title += f" - {role}"
    if trigger and trigger != "scheduled":
        title += f" - trigger: {trigger}"
    if origin is not None:
        title += f" - {origin_title(origin)}"
    return title


def graph_title(graph: BackwardGraph) -> str | None:
    """The title the recorder gave a recorded graph's picture, from the graph's meta (step,
    trigger, which backward, NaN/Inf origin, what was measured), for drawing a saved step
    again; None for a graph without a step (captured by hand).

    Examples:
        >>> graph_title(BackwardGraph(meta={"step": 3, "trigger": "nonfinite_loss"}))
        'step 3 - trigger: nonfinite_loss'
        >>> graph_title(BackwardGraph()) is None
        True
    """
    meta = graph.meta
    if meta.get("step") is None:
        return None
    return picture_title(graph, meta["step"], meta.get("trigger"))


def picture_title(graph: BackwardGraph, step: Any, trigger: str | None) -> str:
    """The title of a capture's pictures: its name (:func:`capture_title`), then what the
    capture measured (:func:`picture_facts`), when it measured anything.

    Examples:
        >>> g = BackwardGraph([Node(0, "param", "GradNodeAccumulation", param="fc.weight",
        ...                         grad=GradMeta(norm=3.0))], meta={"loss": 2.302585, "grad_stats": True})
        >>> picture_title(g, 20, "scheduled")
        'step 20 - loss 2.303, global grad norm 3'
    """
    role = graph.meta.get("backward")
    title = capture_title(step, trigger, backward_role(role) if isinstance(role, dict) else None,
                          origin=record_of(graph).origin)
    facts = picture_facts(graph)
    return f"{title} - {facts}" if facts else title


def picture_facts(graph: BackwardGraph) -> str:
    """What a capture measured, said under its picture's name: the loss (and, for a replayed
    step, that its drawing starts at the model output), the global gradient norm (as the
    summary words it) and, of several parameters, the one with the largest gradient; empty
    when nothing was measured.

    Examples:
        >>> picture_facts(BackwardGraph(meta={"loss": 0.5}))
        'loss 0.5'
        >>> picture_facts(BackwardGraph(meta={"loss": float("nan"), "replayed": True}))
        "loss NaN, replayed from the model output (the loss's ops are not drawn)"
        >>> w = lambda i, v: Node(i, "param", "GradNodeAccumulation", param=f"w{i}", grad=GradMeta(norm=v))
        >>> picture_facts(BackwardGraph([w(0, 4.7), w(1, float("inf"))]))
        'global grad norm Inf, NaN/Inf gradient: w1'
    """
    parts = []
    loss = graph.meta.get("loss")
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        parts.append(f"loss {fmt_num(loss, 4)}")
    if graph.meta.get("replayed"):  # why the drawing starts at the model output, not at the loss
        parts.append(f"{REPLAYED_FROM_OUTPUT} (the loss's ops are not drawn)")
    norm = global_norm_words(graph)
    if norm:
        parts.append(norm)
    params = graph.params()
    norms = [(name, None if m is None else m.norm) for name, m in params.items()]
    bad = [name for name, v in norms if v is not None and not math.isfinite(v)]
    if bad:  # no largest among NaN/Inf: the first non-finite one is named
        parts.append(f"NaN/Inf gradient: {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else ""))
    elif len(norms) > 1 and all(v is not None for _, v in norms):  # the largest of all, or none named
        name, value = max(norms, key=lambda kv: kv[1])
        parts.append(f"largest: {name} {fmt_num(value)}")
    return ", ".join(parts)


def global_norm_words(graph: BackwardGraph) -> str:
    """``"global grad norm N"``, with ``" (this backward)"`` when the step's accumulated
    ``param.grad`` norm differs (micro-batches); empty when no parameter gradient was measured.

    Examples:
        >>> g = BackwardGraph([Node(0, "param", "GradNodeAccumulation", param="w", grad=GradMeta(norm=3.0))])
        >>> global_norm_words(g), global_norm_words(BackwardGraph())
        ('global grad norm 3', '')
    """
    gn = graph.global_grad_norm()
    if gn is None:
        return ""
    return f"global grad norm {fmt_num(gn, 4)}" + (" (this backward)" if _backward_only(graph, gn) else "")


def _backward_only(graph: BackwardGraph, gn: float | None) -> bool:
    """Whether the global norm ``gn`` of this backward differs from the step's accumulated one."""
    acc = graph.meta.get("accumulated_grad_norm")
    return isinstance(acc, float) and (gn is None or not (
        math.isclose(acc, gn, rel_tol=1e-6) or (math.isnan(acc) and math.isnan(gn))))


def collapse_note(collapsed: BackwardGraph, full: BackwardGraph, full_detail: str = "the SVG has every op") -> str:
    """The title note of a drawing that was collapsed to stay legible.

    ``full_detail`` says where every op can be seen.
    """
    info = collapsed.meta.get("collapse", {})
    folded = ", repeated layers folded" if info.get("fold_repeats") else ""
    if info.get("show_one") and info.get("shown"):
        folded = ", repeated layers folded (one of each run drawn beside them)"
    what = (f"collapsed to layer depth {info.get('depth')}{folded}" if info.get("depth") is not None
            else folded[2:] or "not collapsed")
    return f"{what}: {len(collapsed.nodes)} of {len(full.nodes)} nodes ({full_detail})"


def every_op_elsewhere() -> str:
    """Where every op of a capture too large for an op-by-op SVG can be seen.

    Examples:
        >>> every_op_elsewhere()
        'every op: paddleviz-hooks explore LOG_DIR'
    """
    return "every op: paddleviz-hooks explore LOG_DIR"


def notebook_full_detail(what: str) -> str:
    """Where every op of a drawing collapsed for a notebook cell can be seen.

    Examples:
        >>> notebook_full_detail("graph")
        'every op: show(graph, full=True)'
    """
    return f"every op: show({what}, full=True)"


def svg_file_note(path: str) -> str:
    """Where the full-detail drawing of a step is, for a dashboard that cannot show SVG.

    Examples:
        >>> svg_file_note("/logs/backward_graph/step_000004.svg")
        'every op (SVG, open it in a browser): /logs/backward_graph/step_000004.svg'
    """
    return f"every op (SVG, open it in a browser): {path}"


# --------------------------------------------------------------------------
# summaries
# --------------------------------------------------------------------------
def summary_grad_norms(graph: BackwardGraph) -> dict[str, float]:
    """Gradient L2 norm per top-level layer, a pure container (``LayerList``, ``LayerDict``) not
    counted as a level (as when collapsing): a ``TransformerEncoder``'s groups are its blocks
    ``layers.0``, ``layers.1``..., not one ``layers`` holding every gradient.

    Examples:
        >>> g = BackwardGraph([Node(0, "param", "", "", param=f"layers.{i}.w", grad=GradMeta(norm=n))
        ...                    for i, n in enumerate((3.0, 4.0))] + [Node(2, "param", "", "", param="b",
        ...                    grad=GradMeta(norm=1.0))], layers={"": "Enc", "layers": "LayerList"})
        >>> summary_grad_norms(g)
        {'(self)': 1.0, 'layers.0': 3.0, 'layers.1': 4.0}
    """
    sq: dict[str, float] = {}
    for name, m in graph.params().items():
        if m is None or m.norm is None:
            continue
        parts = name.split(".")[:-1]
        depth = 1
        while depth < len(parts) and graph.layers.get(".".join(parts[:depth])) in CONTAINER_TYPES:
            depth += 1
        group = ".".join(parts[:depth]) if parts else "(self)"
        sq[group] = sq.get(group, 0.0) + m.norm * m.norm
    return {k: math.sqrt(v) for k, v in sorted(sq.items())}


def _group_label(graph: BackwardGraph, group: str) -> str:
    """A group of :func:`summary_grad_norms` as people read it: a bare index (a child of a model
    that is a ``Sequential`` or ``LayerList``) names its class: ``0 (Linear)``."""
    if group.isdigit():
        return f"{group} ({graph.layers[group]})" if graph.layers.get(group) else f"layer {group}"
    return group_name(group)


def _sort_val(v: float) -> float:
    return v if math.isfinite(v) else math.inf


def _unobserved_ops(graph: BackwardGraph) -> list[Node]:
    """Ops without a hook whose outgoing gradients could not be recovered elsewhere
    (ops inside a compiled program are counted apart)."""
    out, stats = graph.out_edges(), bool(graph.meta.get("grad_stats"))
    return [n for n in graph.nodes if n.kind == "op" and not n.hooked and n.note != PROGRAM_OP_NOTE and any(
        e.grad is None or (stats and e.grad.norm is None) for e in out.get(n.id, []))]


def grad_sync_line(graph: BackwardGraph) -> str:
    """Which gradient the norms of a multi-process capture are (``meta["grad_sync"]``); "" otherwise.

    Examples:
        >>> g = BackwardGraph([Node(0, "param", "GradNodeAccumulation", param="w",
        ...                         grad=GradMeta(norm=0.96), local_grad=GradMeta(norm=1.72))],
        ...                   meta={"grad_sync": {"rank": 0, "world_size": 2, "params": 1, "changed": 1}})
        >>> grad_sync_line(g)
        "grad norms are param.grad after all-reduce over 2 ranks; rank 0's own (local) gradients: global norm 1.72;"
    """
    sync = graph.meta.get("grad_sync")
    if not isinstance(sync, dict):
        return ""
    rank, world = sync.get("rank"), sync.get("world_size")
    if not sync.get("changed"):
        return (f"rank {rank} of {world}: param.grad was not synchronised in this backward "
                "(e.g. no_sync()): applied and local gradients are the same;")
    local = graph.global_grad_norm(local=True)
    return (f"grad norms are param.grad after all-reduce over {world} ranks; rank {rank}'s own (local) "
            f"gradients: global norm {fmt_num(local, 4)};")


def rank_comparison_lines(graph: BackwardGraph, base: BackwardGraph, diff: GraphDiff,
                          rank: Any, base_rank: Any = 0) -> list[str]:
    """How one rank's capture of a step compares with another rank's (the report's per-rank view).

    Under data parallel every rank runs the same graph, so a structural
    difference is worth a warning; gradient norms differ by data.

    Args:
        graph: this rank's capture.
        base: the other rank's capture of the same step.
        diff: ``diff_graphs(base, graph)``.
        rank / base_rank: the two ranks.

    Returns:
        Lines, the structural one first.

    Examples:
        >>> from paddleviz_hooks.diff import diff_graphs
        >>> g = BackwardGraph([Node(0, "root", "loss", "loss")])
        >>> g.assign_keys()
        >>> rank_comparison_lines(g, g, diff_graphs(g, g), 1)
        ['same graph structure as rank 0']
    """
    if diff.structure_changed:
        lines = [f"graph structure differs from rank {base_rank}: {len(diff.added_nodes)} nodes only here, "
                 f"{len(diff.removed_nodes)} only on rank {base_rank} (under data parallel every rank "
                 "should run the same graph)"]
    else:
        lines = [f"same graph structure as rank {base_rank}"]
    here, there = graph.global_grad_norm(), base.global_grad_norm()
    if here is not None and there is not None:
        lines.append(f"global grad norm {fmt_num(here, 4)} here, {fmt_num(there, 4)} on rank {base_rank}")
    if isinstance(graph.meta.get("grad_sync"), dict) and isinstance(base.meta.get("grad_sync"), dict):
        lines.append(f"before all-reduce (each rank's own data): {fmt_num(graph.global_grad_norm(local=True), 4)} "
                     f"here, {fmt_num(base.global_grad_norm(local=True), 4)} on rank {base_rank}")
    return lines


RANKS_DIFFER_LEGEND = "not on every rank (data parallel: every rank should run the same graph)"
RANKS_NORM_LEGEND = "|g| r0 a / r1 b: the gradient norm on each rank"
RANKS_SYNC_LEGEND = "edges: each rank's own gradient; parameters: all-reduced"


def rank_values(values: dict[int, float], ranks: Iterable[int], label: str = "|g|", digits: int = 3,
                per_line: int = 4) -> list[str]:
    """One number per rank, ``per_line`` ranks a line: ``|g| r0 0.41 / r1 0.52``.

    A rank without a value (the node is not in its graph, or nothing was
    recorded there) shows ``-``.

    Examples:
        >>> rank_values({0: 0.4123, 1: 0.52}, [0, 1])
        ['|g| r0 0.412 / r1 0.52']
        >>> rank_values({0: 1.0}, [0, 1, 2], per_line=2)
        ['|g| r0 1 / r1 -', 'r2 -']
    """
    parts = [f"r{r} {fmt_num(values.get(r), digits)}" for r in ranks]
    lines = [" / ".join(parts[i:i + per_line]) for i in range(0, len(parts), per_line)]
    if lines and label:
        lines[0] = f"{label} {lines[0]}"
    return lines


def rank_presence(missing: Iterable[int] = (), only: int | None = None) -> str:
    """Where a node of the merged view is: ``not on ranks 1, 3`` or ``only on rank 2``.

    Examples:
        >>> rank_presence([1, 3]), rank_presence(only=2)
        ('not on ranks 1, 3', 'only on rank 2')
    """
    if only is not None:
        return f"only on rank {only}"
    missing = list(missing)
    return f"not on rank{'s' if len(missing) > 1 else ''} {', '.join(str(r) for r in missing)}"


def ranks_title(step: Any, ranks: Iterable[int]) -> str:
    """The title of the merged drawing of one step.

    Examples:
        >>> ranks_title(3, [0, 1])
        'step 3 - ranks 0, 1 merged'
    """
    return f"step {step} - ranks {', '.join(str(r) for r in ranks)} merged"


def rank_view_lines(view: RankView) -> list[str]:
    """What the merged view of one step says in words: structure first, then the global norms per rank.

    Examples:
        >>> from paddleviz_hooks.ranks import compare_ranks
        >>> g = BackwardGraph([Node(0, "root", "loss", "loss")])
        >>> g.assign_keys()
        >>> rank_view_lines(compare_ranks({0: g, 1: g}))
        ['same graph structure on ranks 0, 1']
    """
    names = ", ".join(str(r) for r in view.ranks)
    if view.structure_differs:
        lines = []
        for r, d in view.diffs.items():
            if d.structure_changed:
                lines.append(f"graph structure of rank {r} differs from rank {view.base}: "
                             f"{plural(len(d.added_nodes), 'node')} only on rank {r}, "
                             f"{len(d.removed_nodes)} only on rank {view.base} "
                             "(under data parallel every rank should run the same graph)")
    else:
        lines = [f"same graph structure on ranks {names}"]
    if view.global_norms:
        lines.append(" ".join(rank_values(view.global_norms, view.ranks, "global grad norm", 4, per_line=8)))
    if view.local_global_norms:
        lines.append(" ".join(rank_values(view.local_global_norms, view.ranks,
                                          "before all-reduce (each rank's own data):", 4, per_line=8)))
    return lines


def graph_summary(graph: BackwardGraph, top: int = 5, previous: BackwardGraph | None = None) -> str:
    """A compact multi-line summary of one capture (one fact per line).

    Args:
        graph: the capture.
        top: how many layers the gradient-norm line names.
        previous: the capture before it: facts that have not changed since
            (which ops give no gradient data, unnamed leaves) are not
            repeated.

    Examples:
        >>> from paddleviz_hooks.graph import Edge
        >>> g = BackwardGraph([Node(0, "root", "loss", "loss"), Node(1, "op", "ExpGradNode", "Exp", hooked=True)],
        ...                   [Edge(0, 1)], meta={"step": 3, "grad_stats": True})
        >>> print(graph_summary(g))
        step 3:
        2 nodes (1 ops), 1 edges;
        0 parameters reached;
        no NaN/Inf gradients;
    """
    ops = sum(1 for n in graph.nodes if n.kind == "op")
    params = graph.params()
    role = backward_role(graph.meta.get("backward"))
    lines = [
        (f"step {graph.meta['step']}" if "step" in graph.meta else "backward graph")
        + (f", {role}:" if role else ":"),
        f"{len(graph.nodes)} nodes ({ops} ops), {len(graph.edges)} edges;",
        f"{len(params)} parameters reached;",
    ]
    leaves = sum(1 for n in graph.nodes if n.kind == "input")
    if leaves and not params and not (previous is not None and not previous.params()
                                      and any(n.kind == "input" for n in previous.nodes)):
        if graph.layers:  # a model was given: these leaves are inputs (paddle.grad's), not its parameters
            lines.append(f"{plural(leaves, 'leaf tensor')} reached, none a parameter of the model;")
        else:
            lines.append(f"{leaves} unnamed leaf tensors reached (capture_backward(model) names parameters);")
    nested = graph.meta.get("nested")
    if isinstance(nested, int) and nested:
        lines.append(f"{plural(nested, 'backward')} run inside this one (recompute) drawn at the nodes that ran them;")
    gn = graph.global_grad_norm()
    acc = graph.meta.get("accumulated_grad_norm")
    acc_differs = _backward_only(graph, gn)
    if gn is not None:
        lines.append(global_norm_words(graph) + ";")
    elif (part := graph.global_grad_norm(partial=True)) is not None:  # never an incomplete figure as the whole
        unknown = graph.params_without_norm()
        lines.append(f"no global grad norm: {plural(len(unknown), 'parameter')} without a gradient norm "
                     f"({_names(unknown)}); over the other {len(params) - len(unknown)}: {fmt_num(part, 4)}"
                     + (" (this backward);" if acc_differs else ";"))
    # a step's number, shown on the graphs that reach parameters; param.grad is what the
    # optimizer starts from: its own clipping and weight decay come after (inside its step)
    if acc_differs and params and isinstance(graph.meta.get("applied_grad_norm"), float):
        lines.append(f"applied gradient norm {fmt_num(acc, 4)} (param.grad when the update was called, "
                     f"before the optimizer's own clipping and weight decay);")
    elif acc_differs and params:
        lines.append(f"accumulated param.grad norm {fmt_num(acc, 4)} (after the step's last backward, "
                     f"all parameters; before the optimizer's own clipping and weight decay);")
    sync_line = grad_sync_line(graph)
    if sync_line:
        lines.append(sync_line)
    norms = summary_grad_norms(graph)
    if norms:
        biggest = sorted(norms.items(), key=lambda kv: -_sort_val(kv[1]))[:top]
        lines.append("largest grad norms: " + ", ".join(
            f"{_group_label(graph, k)} {fmt_num(v)}" for k, v in biggest) + ";")
    record = record_of(graph)
    unhooked = _unobserved_ops(graph)
    compiled = sum(1 for n in graph.nodes if n.kind == "op" and n.note == PROGRAM_OP_NOTE)
    bad_params = [name for name, m in params.items() if m is not None and m.nonfinite]
    story = nonfinite_lines(record)
    first = record.first_gradient and next((n for n in graph.nodes if n.key == record.first_gradient.key), None)
    if first is not None and first.source:  # the line of code that made the first non-finite gradient's op
        story = [ln[:-1] + f" ({source_short(first)});" if ln.startswith("NaN/Inf gradients at") else ln
                 for ln in story]
    lines.extend(story[:1] if record.origin is not None else [])
    if record.origin is not None and graph.meta.get("replayed"):
        lines.append("graph replayed from the step's inputs before the update (param.grad untouched);")
    lines.extend(story[1:] if record.origin is not None else story)
    if record.first_gradient is None and graph.nonfinite_count():
        lines.append(f"NaN/Inf in the gradients of {plural(len(bad_params), 'parameter')}: {_names(bad_params)};")
    elif record.first_gradient is None and graph.meta.get("grad_stats"):
        lines.append("no NaN/Inf in the observed gradients;" if unhooked or compiled else "no NaN/Inf gradients;")
    kinds = sorted({n.op for n in unhooked})
    # named once, and again only when the set changes (no repeated boilerplate step after step)
    if unhooked and (previous is None or kinds != sorted({n.op for n in _unobserved_ops(previous)})):
        lines.append(f"gradients {NOT_OBSERVED} at {plural(len(unhooked), 'node')} ({', '.join(kinds)});")
    if compiled:
        lines.append(f"{plural(compiled, 'op')} {PROGRAM_OP_NOTE} (parameter gradients behind them are exact);")
    lines.extend(saved_memory_lines(graph, top))
    return "\n".join(lines)


def saved_memory_lines(graph: BackwardGraph, top: int = 5) -> list[str]:
    """Summary lines on what the forward saved for this backward (none when not recorded).

    Examples:
        >>> g = BackwardGraph(meta={"saved_memory": {"total_bytes": 3_000_000, "saves": 12,
        ...     "by_layer": {"block.conv#0": 2_000_000, "?": 1_000_000}, "by_op": {"Conv2d": 3_000_000},
        ...     "params_bytes": 40_000, "allocated_growth": 3_000_004, "unobserved": []}})
        >>> for line in saved_memory_lines(g): print(line)
        held for backward: 3 MB in 12 saves (activations; parameters apart: 40 kB);
        held most by: block.conv 2 MB, outside the model 1 MB;
        held by op: Conv2d 3 MB;
        allocator growth over the forward: 3 MB (4 B not saved: outputs, the loss);
    """
    m = graph.meta.get("saved_memory")
    if not isinstance(m, dict):
        return []
    total = m.get("total_bytes", 0)
    lines = [f"held for backward: {fmt_bytes(total)} in {plural(m.get('saves', 0), 'save')} "
             f"(activations; parameters apart: {fmt_bytes(m.get('params_bytes'))});"]
    by_layer = list((m.get("by_layer") or {}).items())
    if by_layer and set(k for k, _ in by_layer) != {"?"}:
        lines.append("held most by: " + _names([f"{call_name(k)} {fmt_bytes(v)}" for k, v in by_layer], top) + ";")
    by_op = list((m.get("by_op") or {}).items())
    if by_op:
        lines.append("held by op: " + _names([f"{k} {fmt_bytes(v)}" for k, v in by_op], top) + ";")
    best = [(k, v) for k, v in (m.get("recompute") or {}).items() if k != "#0" and v.get("frees", 0) > 0]
    if best:
        lines.append("recomputing would free most: " + ", ".join(
            f"{call_name(k)} {fmt_bytes(v['frees'])} (keeping {fmt_bytes(v['inputs'])} of inputs)"
            for k, v in best[:3]) + ";")
    growth = m.get("allocated_growth")
    if growth is not None:
        rest = growth - total
        what = ("not saved: outputs, the loss" if rest >= 0 else
                "below the total: tensors made before the forward were saved, or others were freed meanwhile")
        lines.append(f"allocator growth over the forward: {fmt_bytes(growth)} ({fmt_bytes(abs(rest))} {what});")
    for u in m.get("unobserved") or []:
        size = f", allocator grew {fmt_bytes(u['bytes'])} in it" if u.get("bytes") is not None else ""
        lines.append(f"saved tensors {NOT_OBSERVED}: {u.get('what')}{size};")
    return lines


def diff_side(step: Any, role: str = "") -> str:
    """One side of a comparison: ``step 3``, ``step 3 (micro-batch 2 of 2)``, ``step ?``.

    Examples:
        >>> diff_side(3, "micro-batch 2 of 2"), diff_side(None)
        ('step 3 (micro-batch 2 of 2)', 'step ?')
    """
    return f"step {'?' if step is None else step}" + (f" ({role})" if role else "")


def diff_summary(diff: GraphDiff) -> str:
    """Short lines, one fact each, describing what changed between two captures."""
    if diff.older_step is None and diff.newer_step is None:
        lines = ["backward graph diff:"]
    else:
        lines = [f"{diff_side(diff.newer_step, diff.newer_role)} vs {diff_side(diff.older_step, diff.older_role)}:"]

    def describe(key: str) -> str:
        info = diff.node_info.get(key)
        return describe_node(info) if info else key

    if diff.replayed:
        gone = _names(sorted({describe(k) for k in diff.left_out}))
        lines.append(f"{diff.replayed} capture {REPLAYED_FROM_OUTPUT}: compared from there"
                     + (f", the other's ops above it left out ({gone})" if gone else "") + ";")
    if not diff.structure_changed:
        lines.append("same graph structure;")
    else:
        lines.append(
            f"structure changed: {plural(len(diff.added_nodes), 'node')} added, {len(diff.removed_nodes)} removed, "
            f"{plural(len(diff.added_edges), 'edge')} added, {len(diff.removed_edges)} removed;"
        )
        ops_added = [describe(k) for k in diff.added_nodes if diff.node_info.get(k, {}).get("kind") != "param"]
        ops_removed = [describe(k) for k in diff.removed_nodes if diff.node_info.get(k, {}).get("kind") != "param"]
        if ops_added:
            lines.append(f"new ops: {_names(ops_added)};")
        if ops_removed:
            lines.append(f"ops gone: {_names(ops_removed)};")
        if diff.renamed:
            lines.append(f"{plural(len(diff.renamed), 'op')} kept under a new key "
                         "(an input in its layer or its call index changed);")
    if diff.params_started:
        lines.append(f"parameters now receiving gradient: {_names(diff.params_started)};")
    if diff.params_stopped:
        lines.append(f"parameters no longer receiving gradient: {_names(diff.params_stopped)};")
    if diff.first_nonfinite is not None:
        o = diff.first_nonfinite
        verb = "appeared at" if diff.new_nonfinite else "still at"
        where = f"{len(diff.new_nonfinite)} new nodes" if diff.new_nonfinite else "the same nodes"
        lines.append(f"NaN/Inf gradients {verb} {where}, {describe_first_gradient(o)} (node {o['key']});")
    if diff.resolved_nonfinite:
        lines.append(f"NaN/Inf gradients gone from {len(diff.resolved_nonfinite)} nodes;")
    if diff.global_norm_ratio is not None:
        lines.append(f"global grad norm {fmt_ratio(diff.global_norm_ratio)};")
    for name, r in list(diff.large_layer_changes().items())[:3]:
        group = group_name(name) if name in ("(self)", "(outside)") else f"layer {name}"
        lines.append(f"{group} grad norm {fmt_ratio(r)};")
    big_nodes = diff.large_node_changes()
    if big_nodes:
        key, r = next(iter(big_nodes.items()))
        lines.append(
            f"grad norm changed over {diff.threshold:g}x at {len(big_nodes)} nodes, "
            f"most at {describe(key)} ({fmt_ratio(r)});"
        )
    return "\n".join(lines)


def summarize(obj: BackwardGraph | GraphDiff, **options: Any) -> str:
    """The summary of a graph (:func:`graph_summary`) or a diff (:func:`diff_summary`), with
    every control character of a name made visible (an escape sequence in a layer name
    printed to a terminal would run).

    Raises:
        TypeError: ``obj`` is neither.

    Examples:
        >>> from paddleviz_hooks.graph import Edge
        >>> g = BackwardGraph([Node(0, "root", "loss"), Node(1, "param", "GradNodeAccumulation", "param",
        ...                                                   param="blk\x1b[2J.w", grad=GradMeta(norm=2.0))],
        ...                   [Edge(0, 1)])
        >>> summarize(g).splitlines()[-1]
        'largest grad norms: blk\\\\x1b[2J 2;'
    """
    if isinstance(obj, BackwardGraph):
        return visible(graph_summary(obj, **options), lines=True)
    if isinstance(obj, GraphDiff):
        return visible(diff_summary(obj), lines=True)
    raise TypeError(f"summarize takes a BackwardGraph or a GraphDiff, got {type(obj).__name__}")
