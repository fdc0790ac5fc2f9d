"""Captures as Google's Model Explorer graphs, with node-data overlays.

Model Explorer (``pip install paddleviz-hooks[explorer]``) draws graphs of
any size with layers collapsed into boxes that open on a click, and colours
nodes by values read from separate "node data" files. This module builds
both as plain JSON-ready data (no server, no import of ``model_explorer``):

* one graph collection, one graph per capture (its id names the step, the
  backward and the trigger, see :func:`paddleviz_hooks.text.capture_title`);
* op nodes in the namespace of their layer calls (``layers/0/linear1``; a
  layer called several times gets one box per call, ``relu (call 2 of 2)``,
  see :func:`paddleviz_hooks.collapse.call_paths`), parameters inside their
  layers, the loss and ops outside the model at the top;
* edges point the way gradients flow (from the node that produced a
  gradient to the node that received it), and each node's outputs carry the
  metadata of the gradients it produced (shape, dtype, norm, min, max, NaN,
  Inf), or ``not observed``;
* overlays, one file each, holding one entry per graph: NaN/Inf elements
  (red where the NaN/Inf starts), the log10 of the gradient norm, the change of
  that norm since the previous capture of the same run, the ops new since
  that capture, and saved-for-backward bytes when the capture recorded them.

Only what was observed is coloured: a node without a value is left white.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from .._fileio import atomic_write
from ..argcheck import check_path
from ..collapse import call_paths
from ..diff import GraphDiff, diff_graphs, node_norms
from ..escape import safe_filename, visible, visible_data
from ..graph import BackwardGraph, GradMeta, Node
from ..findings import marks, record_of
from ..text import (AFTER_HOOK, FIRST_GRADIENT, node_layer, NOT_OBSERVED, UNOBSERVED_WHY, backward_role, combined_norm, box_name, call_of, capture_title, describe_node, extreme_text,
                    describe_origin, fmt_shape, graph_summary, layer_name, origin_mark, origin_node_lines,
                    received_gradient, source_attrs)

__all__ = ["ExplorerExport", "explorer_graph", "explorer_overlays", "export_explorer", "GRAPHS_FILE"]

GRAPHS_FILE = "backward_graphs.json"
#: The id of the node added for an origin op that has no node in the graph.
ORIGIN_NODE = "nan_origin"

#: Overlay file stems, most useful first (the order the viewer lists them in).
NONFINITE = "nan_inf_elements"
GRAD_NORM = "grad_norm_log10"
NORM_CHANGE = "grad_norm_change_log10"
ADDED = "new_since_previous_capture"
SAVED = "saved_for_backward_bytes"

_ORIGIN_RED = "#d62728"
_BAD_ORANGE = "#fdae6b"
_CLEAN_GREEN = "#e5f5e0"
_ADDED_GREEN = "#74c476"
# low to high: blue, white, red (a diverging scale for changes); blue to yellow for sizes
_DIVERGING = [{"stop": 0, "bgColor": "#2166ac"}, {"stop": 0.5, "bgColor": "#f7f7f7"},
              {"stop": 1, "bgColor": "#b2182b"}]
_SEQUENTIAL = [{"stop": 0, "bgColor": "#deebf7"}, {"stop": 0.5, "bgColor": "#6baed6"},
               {"stop": 1, "bgColor": "#08306b", "textColor": "#ffffff"}]


# --------------------------------------------------------------------------
# one graph
# --------------------------------------------------------------------------
def _kv(key: str, value: Any) -> dict[str, str]:
    return {"key": key, "value": str(value)}


def _grad_attrs(meta: GradMeta | None, prefix: str = "") -> list[dict[str, str]]:
    """Attributes of one gradient: shape, dtype, norm, min, max, NaN, Inf."""
    if meta is None:
        return [_kv(prefix + "gradient", NOT_OBSERVED)]
    out = [_kv(prefix + "shape", fmt_shape(meta.shape)), _kv(prefix + "dtype", meta.dtype or "?")]
    if meta.note is not None:
        out.append(_kv(prefix + "statistics", UNOBSERVED_WHY.get(meta.note, NOT_OBSERVED)))
    elif meta.norm is not None:
        norm = repr(meta.norm) if meta.parts == 1 else combined_norm(meta)
        out += [_kv(prefix + "norm", norm), _kv(prefix + "min", extreme_text(meta, meta.min)),
                _kv(prefix + "max", extreme_text(meta, meta.max)), _kv(prefix + "NaN", meta.nan),
                _kv(prefix + "Inf", meta.inf)]
    else:
        out.append(_kv(prefix + "statistics", NOT_OBSERVED))
    return out


def _call_counts(paths: list[tuple[tuple[str, int], ...]]) -> dict[str, int]:
    """Layer path -> how many calls of it the graph shows (up to the last one seen)."""
    calls: dict[str, int] = {}
    for p in paths:
        for layer, call in p:
            calls[layer] = max(calls.get(layer, 0), call + 1)
    return calls


def _namespace(path: tuple[tuple[str, int], ...], calls: dict[str, int]) -> str:
    """Layer calls joined by ``/`` (``layers/0/relu (call 2 of 2)``): a call named when its layer has several."""
    return "/".join(layer.rsplit(".", 1)[-1] + call_of(call, calls[layer]) for layer, call in path)


def _label(node: Node, path: tuple[tuple[str, int], ...], out_edges: list) -> str:
    if node.kind == "param":
        name = node.param or "parameter"
        inside = path[-1][0] + "." if path else ""
        return name[len(inside):] if inside and name.startswith(inside) else name
    if node.kind == "root":
        return node.name or "loss"
    if node.kind == "input":
        return "input"
    if node.kind == "layer":
        return box_name(node.layer) + f" x{node.count}" * (node.count > 1)
    if out_edges and all(e.grad is None for e in out_edges):
        return f"{node.op} ({NOT_OBSERVED})"
    return node.op or node.name


def explorer_graph(graph: BackwardGraph, graph_id: str) -> dict[str, Any]:
    """One capture as a Model Explorer graph (``model_explorer.graph_builder.Graph`` as a dict).

    Args:
        graph: a captured graph.
        graph_id: its id in the collection (unique there; shown in the graph list).

    Returns:
        JSON-ready data. Node ids are the graph's node ids as text.

    Examples:
        >>> from paddleviz_hooks.graph import Edge
        >>> g = BackwardGraph([Node(0, "root", "loss"), Node(1, "op", "ExpGradNode", "Exp", layer="f")],
        ...                   [Edge(0, 1)], layers={"": "Net", "f": "Act"})
        >>> n = explorer_graph(g, "step 1")["nodes"][1]
        >>> n["label"], n["namespace"], n["incomingEdges"]
        ('Exp', 'f', [{'sourceNodeId': '0', 'sourceNodeOutputId': '0', 'targetNodeInputId': '0'}])
    """
    ins, outs = graph.in_edges(), graph.out_edges()
    paths = call_paths(graph)
    calls = _call_counts(paths)
    spaces = [_namespace(p, calls) for p in paths]
    rec, mark = record_of(graph), marks(graph)
    saved_recorded = isinstance(graph.meta.get("saved_memory"), dict)
    nodes = []
    for n in graph.nodes:
        inn = sorted(ins.get(n.id, []), key=lambda e: (e.src, e.slot))
        out = sorted(outs.get(n.id, []), key=lambda e: e.slot)
        attrs = [_kv("node", describe_node(n)), _kv("kind", n.kind)]
        if n.kind in ("op", "layer"):
            attrs.append(_kv("grad node", n.name))
            calls_of = max(n.calls, calls.get(n.layer or "", 1), n.call + 1)
            attrs.append(_kv("layer", layer_name(n.layer) + call_of(n.call, calls_of) if n.layer is not None
                             else node_layer(n)))
            if n.layer is not None and n.layer in graph.layers:
                attrs.append(_kv("layer class", graph.layers[n.layer]))
        if n.kind == "param":
            attrs.append(_kv("parameter", n.param))
        if n.shape is not None:
            attrs += [_kv("shape", fmt_shape(n.shape)), _kv("dtype", n.dtype or "?")]
        head, received, _ = received_gradient(n, inn)  # as every view gives it
        if head:
            attrs.append(_kv("grad", head))
            attrs += _grad_attrs(received, "grad ")
        if n.id == mark.origin:
            attrs.append(_kv("NaN/Inf origin", describe_origin(rec.origin)))
        if n.id == mark.first_gradient:
            attrs.append(_kv(FIRST_GRADIENT, "yes: it received finite gradients and passed a non-finite one on"))
        if n.note:
            attrs.append(_kv("note", n.note))
        attrs += [_kv(k, v) for k, v in source_attrs(n).items()]
        if saved_recorded:
            attrs.append(_kv("saved for backward (bytes)", n.saved_bytes))
        attrs.append(_kv("key", n.key))
        label = _label(n, paths[n.id], out)
        if n.id == mark.origin:  # found by searching the op's name as Paddle's checker gave it
            label = f"{label}: {origin_mark(rec.origin)}"
        nodes.append({
            "id": str(n.id),
            "label": label,
            "namespace": spaces[n.id],
            "attrs": attrs,
            "incomingEdges": [{"sourceNodeId": str(e.src), "sourceNodeOutputId": str(e.slot),
                               "targetNodeInputId": str(k)} for k, e in enumerate(inn)],
            "outputsMetadata": [{"id": str(e.slot), "attrs": [_kv("to", describe_node(graph.nodes[e.dst]))]
                                 + _grad_attrs(e.grad)
                                 + ([_kv("why not observed", e.note)] if e.note else [])
                                 + (_grad_attrs(e.after_hook, AFTER_HOOK + ": ") if e.after_hook else [])}
                                for e in out],
        })
    if origin_node_id(graph) == ORIGIN_NODE:
        # the origin's op has no node in the graph: one is added where its output enters it
        entry = mark.entry
        nodes.append({
            "id": ORIGIN_NODE, "label": " ".join(origin_node_lines(rec.origin, entry is not None)),
            # in its layer's box: the entry's, unless the origin ran in the model's own forward
            "namespace": spaces[entry] if entry is not None and rec.origin.layer else "",
            "attrs": [_kv("node", " ".join(origin_node_lines(rec.origin, entry is not None)[::2])), _kv("NaN/Inf origin", describe_origin(rec.origin))],
            "incomingEdges": ([{"sourceNodeId": str(entry), "sourceNodeOutputId": "origin", "targetNodeInputId": "0"}]
                              if entry is not None else []),
        })
    return {"id": graph_id, "nodes": nodes, "groupNodeAttributes": _group_attrs(graph, paths, spaces),
            "layoutConfigs": {"keepLayersWithASingleChild": True}}


def _group_attrs(graph: BackwardGraph, paths: list, spaces: list[str]) -> dict[str, dict[str, str]]:
    """What the side panel shows for each layer box, and for the whole graph (namespace ``""``)."""
    groups: dict[str, dict[str, str]] = {}
    calls = _call_counts(paths)
    for p, space in zip(paths, spaces):
        parts = space.split("/")
        for k, (layer, call) in enumerate(p):
            ns = "/".join(parts[: k + 1])
            if ns not in groups:
                groups[ns] = {"layer": layer_name(layer), "call": f"{call + 1} of {calls[layer]}",
                              "class": graph.layers.get(layer, "?")}
    top = {"summary": graph_summary(graph).replace("\n", " ")}
    for k in ("step", "entry", "trigger", "loss", "accumulated_grad_norm", "trigger_note"):
        if k in graph.meta:
            top[k] = str(graph.meta[k])
    origin = record_of(graph).origin
    if origin is not None:
        top["NaN/Inf origin"] = describe_origin(origin)
    if graph.layers.get(""):
        top["model"] = graph.layers[""]
    groups[""] = top
    return groups


# --------------------------------------------------------------------------
# overlays
# --------------------------------------------------------------------------
def _produced_nonfinite(graph: BackwardGraph) -> dict[int, int]:
    """NaN/Inf elements per node: in the gradients it produced; a parameter's in its param.grad addition."""
    count: dict[int, int] = {}
    for e in graph.edges:
        if e.grad is not None and e.grad.norm is not None:
            count[e.src] = count.get(e.src, 0) + e.grad.nonfinite
    for n in graph.nodes:
        if n.kind == "param" and n.grad is not None and n.grad.norm is not None:
            count[n.id] = n.grad.nonfinite
    return count


def origin_node_id(graph: BackwardGraph) -> str | None:
    """The explorer node id where the NaN/Inf starts: the origin op's node, the node added for
    an origin op without one (:data:`ORIGIN_NODE`), else the first non-finite gradient's."""
    rec, mark = record_of(graph), marks(graph)
    if mark.origin is not None:
        return str(mark.origin)
    if rec.origin is not None and rec.origin.kind == "forward":
        return ORIGIN_NODE
    return str(mark.first_gradient) if mark.first_gradient is not None else None


def _nonfinite_data(graph: BackwardGraph) -> dict[str, Any]:
    origin = origin_node_id(graph)
    results: dict[str, Any] = {}
    for nid, c in _produced_nonfinite(graph).items():
        results[str(nid)] = {"value": c}
    if origin == ORIGIN_NODE:  # the node added for an origin op: the NaN/Inf elements the op made
        o = record_of(graph).origin
        results[origin] = {"value": (o.nan or 0) + (o.inf or 0)}
    if origin is not None:
        results.setdefault(origin, {"value": 0}).update(bgColor=_ORIGIN_RED, textColor="#ffffff")
    return {"name": "NaN/Inf elements (red: where it starts)", "results": results,
            "thresholds": [{"value": 0, "bgColor": _CLEAN_GREEN}, {"value": 1e300, "bgColor": _BAD_ORANGE}],
            # the viewer's per-layer table shows shares of the total: "NaN" (0/0) for a clean graph
            "hideInChildrenStatsTable": True}


def _log10_overlay(graph: BackwardGraph, values: dict[str, float], name: str, gradient: Any) -> dict[str, Any]:
    """A node-data overlay of log10 of positive finite values given by node key."""
    by_key = {n.key: n.id for n in graph.nodes}
    results = {str(by_key[k]): {"value": math.log10(v)} for k, v in values.items()
               if k in by_key and v > 0 and math.isfinite(v)}
    return {"name": name, "results": results, "gradient": gradient, "hideAggregatedStats": ["sum"],
            "hideInChildrenStatsTable": True}


def _norm_data(graph: BackwardGraph) -> dict[str, Any]:
    return _log10_overlay(graph, node_norms(graph), "log10 grad norm", _SEQUENTIAL)


def _change_data(graph: BackwardGraph, diff: GraphDiff | None) -> dict[str, Any]:
    ratios = diff.node_norm_ratios if diff is not None else {}
    return _log10_overlay(graph, ratios, "log10 norm change since previous", _DIVERGING)


def _added_data(graph: BackwardGraph, diff: GraphDiff | None) -> dict[str, Any]:
    by_key = {n.key: n.id for n in graph.nodes}
    results = {}
    if diff is not None:
        for key in diff.added_nodes:
            if key in by_key:
                results[str(by_key[key])] = {"value": 1, "bgColor": _ADDED_GREEN}
    return {"name": "new since previous capture", "results": results}


def _saved_data(graph: BackwardGraph) -> dict[str, Any] | None:
    if not isinstance(graph.meta.get("saved_memory"), dict):
        return None  # not recorded for this capture
    results = {str(n.id): {"value": n.saved_bytes} for n in graph.nodes if n.saved_bytes}
    return {"name": "saved for backward (bytes)", "results": results, "gradient": _SEQUENTIAL}


def explorer_overlays(series: Iterable[tuple[str, BackwardGraph, BackwardGraph | None]]) -> dict[str, dict]:
    """Node-data overlays for several graphs.

    Args:
        series: ``(graph id, graph, previous capture of the same run or None)``.

    Returns:
        overlay file stem -> ``{graph id: GraphNodeData as a dict}`` (Model
        Explorer's ``ModelNodeData`` JSON), most useful first: NaN/Inf first
        when any capture has one, else the gradient norm. The saved-bytes
        overlay is there only when some capture recorded saved bytes; the
        change overlays only for graphs with a previous capture.
    """
    out: dict[str, dict] = {NONFINITE: {}, GRAD_NORM: {}, NORM_CHANGE: {}, ADDED: {}, SAVED: {}}
    any_bad = False
    for gid, g, prev in series:
        diff = diff_graphs(prev, g) if prev is not None else None
        out[NONFINITE][gid] = _nonfinite_data(g)
        any_bad = any_bad or any(r["value"] for r in out[NONFINITE][gid]["results"].values())
        out[GRAD_NORM][gid] = _norm_data(g)
        if diff is not None:
            out[NORM_CHANGE][gid] = _change_data(g, diff)
            out[ADDED][gid] = _added_data(g, diff)
        saved = _saved_data(g)
        if saved is not None:
            out[SAVED][gid] = saved
    order = [NONFINITE, GRAD_NORM] if any_bad else [GRAD_NORM, NONFINITE]
    order += [NORM_CHANGE, ADDED, SAVED]
    return {k: out[k] for k in order if out[k]}


# --------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------
@dataclass
class ExplorerExport:
    """Files written by :func:`export_explorer`.

    Attributes:
        graphs: the graph collection file.
        overlays: overlay name -> node-data file, most useful first.
        graph_ids: the graph ids, in the collection's order.
        label: the collection's label.
        start: ``(graph id, node id)`` the page should open at: where the
            NaN/Inf starts (:func:`origin_node_id`) in the first capture
            that has one, captures taken in the order of the graph list (by
            run, then step, then which backward of the step:
            :func:`~paddleviz_hooks.sinks.report.capture_order`); None
            when no capture has one.
    """

    graphs: str
    overlays: dict[str, str] = field(default_factory=dict)
    graph_ids: list[str] = field(default_factory=list)
    label: str = ""
    start: tuple[str, str] | None = None


def _series(source: Any) -> tuple[str, list[tuple[str, BackwardGraph, BackwardGraph | None]]]:
    """(collection label, [(graph id, graph, previous)]) from a graph, a list of graphs or a log directory."""
    from .report import capture_order

    if isinstance(source, BackwardGraph):
        source = [source]
    if isinstance(source, (str, os.PathLike)):
        return _series_of_dir(os.fspath(source))
    if isinstance(source, (list, tuple)) and source and all(isinstance(g, BackwardGraph) for g in source):
        items, seen = [], {}
        for g in source:  # a step's second (third...) graph in the list: its second backward
            step = g.meta.get("step")
            k = seen[step] = seen.get(step, 0) + 1
            items.append(("", step, f"b{k}" if _is_step(step) and k > 1 else "", g))
        if all(_is_step(step) for _, step, _, _ in items):  # listed as every other view lists them
            items.sort(key=lambda item: capture_order(item[1], item[2]))
        return "captures", _name(items)
    raise TypeError(
        "export_explorer takes a BackwardGraph, a non-empty list of them or a log directory, "
        f"got {type(source).__name__}"
    )


def _is_step(step: Any) -> bool:
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0


def _series_of_dir(log_dir: str) -> tuple[str, list]:
    from .report import _NotAGraph, _read_graph, capture_order, find_step_files, no_steps_error, run_suffix, skip_file

    if not os.path.isdir(log_dir):
        raise ValueError(f"log directory {log_dir!r} does not exist (pass the directory the recorder wrote to)")
    runs: dict[tuple[str, str], list] = {}  # one run per folder and file suffix, a step's backwards in it
    skipped: list[tuple[str, str]] = []
    for (directory, suffix), files in find_step_files(log_dir, skipped).items():
        captures = runs.setdefault((directory, run_suffix(suffix)), [])
        for number, path in files:
            try:
                g = _read_graph(path)
            except _NotAGraph:
                continue
            except (OSError, ValueError) as exc:  # said as the report says it
                skipped.append((os.path.relpath(path, log_dir), skip_file(path, exc)))
                continue
            step = g.meta.get("step")
            step = step if isinstance(step, int) and not isinstance(step, bool) else number
            captures.append((step, suffix if run_suffix(suffix) != suffix else "", g))
    runs = {key: captures for key, captures in runs.items() if captures}
    items = []
    for (directory, own), captures in runs.items():
        rel = os.path.relpath(directory, log_dir)
        run = "" if rel == "." and len(runs) == 1 else (rel if rel != "." else os.path.basename(log_dir))
        run += f" [{own}]" if own else ""
        captures.sort(key=lambda c: capture_order(c[0], c[1]))  # by step, then which backward of it
        items += [(run, step, suffix, g) for step, suffix, g in captures]
    if not items:
        raise no_steps_error(log_dir, skipped)
    return os.path.basename(os.path.abspath(log_dir)), _name(items)


def _role(meta: dict) -> Any:
    role = meta.get("backward")
    return backward_role(role) if isinstance(role, dict) else role


def _name(items: list[tuple[str, Any, str, BackwardGraph]]) -> list[tuple[str, BackwardGraph, BackwardGraph | None]]:
    """Unique ids for ``(run, step, backward suffix, graph)`` in the order given, each graph with the
    previous capture of the same backward in its run (replayed captures included: ``diff_graphs``
    aligns them).

    The page lists graphs sorted by id as text (``localeCompare``), so an id sorts by run, step and
    backward: steps are padded to one width, and a step's further backwards are named as their files
    are (``step 06 b2``, ``b02`` when a step has ten or more), so ``micro-batch 10 of 12`` does not
    come before ``micro-batch 2 of 12``.
    """
    from .report import BACKWARD_SUFFIX

    width = max((len(str(s)) for _, s, _, _ in items if _is_step(s)), default=1)
    numbers = [int(m.group(2)) for _, _, b, _ in items if (m := BACKWARD_SUFFIX.match(b))]
    b_width = len(str(max(numbers, default=1)))
    out, seen, last = [], set(), {}
    for i, (run, step, suffix, g) in enumerate(items):
        shown = str(step).zfill(width) if _is_step(step) else step
        m = BACKWARD_SUFFIX.match(suffix)
        if m and _is_step(step):
            shown += f" {m.group(1)}{m.group(2).zfill(b_width)}"
        index = str(i + 1).zfill(len(str(len(items))))
        gid = (f"{run}: " if run else "") + capture_title(shown, g.meta.get("trigger"), _role(g.meta), index)
        base, k = gid, 2
        while gid in seen:
            gid, k = f"{base} #{k}", k + 1
        seen.add(gid)
        # a recorded step is compared with the same backward of an earlier step (as in the
        # report and the recorder's diffs); captures without a step (by hand) with the one before
        same = (run, suffix) if g.meta.get("step") is not None else (run,)
        out.append((gid, g, last.get(same)))
        last[same] = g
    return out


def export_explorer(source: Any, out_dir: str) -> ExplorerExport:
    """Write the captures and their overlays as Model Explorer files.

    Args:
        source: a :class:`~paddleviz_hooks.graph.BackwardGraph`, a list of
            them (in capture order; listed by step when every one has a
            step), or a log directory (every ``step_*.json`` under it; one
            run per folder and file suffix, a step's further backwards,
            ``step_N_b2.json``..., in the run of its first).
        out_dir: directory for ``backward_graphs.json`` and one
            ``<overlay>.json`` per overlay (created if missing).

    Returns:
        An :class:`ExplorerExport` naming the files.

    Raises:
        TypeError: ``source`` or ``out_dir`` is of another type.
        ValueError: the log directory does not exist or holds no capture; ``out_dir`` is empty or has a NUL byte.

    Examples:
        >>> import tempfile
        >>> from paddleviz_hooks.graph import Edge
        >>> g = BackwardGraph([Node(0, "root", "loss"), Node(1, "op", "ExpGradNode", "Exp")], [Edge(0, 1)],
        ...                   meta={"step": 3})
        >>> files = export_explorer(g, tempfile.mkdtemp())
        >>> files.graph_ids, list(files.overlays)
        (['step 3'], ['grad_norm_log10', 'nan_inf_elements'])
    """
    out_dir = check_path("out_dir", out_dir)
    label, series = _series(source)
    # names that could hide or reorder text are shown escaped, the same way in every file
    label, series = visible(label), [(visible(gid), g, prev) for gid, g, prev in series]
    os.makedirs(out_dir, exist_ok=True)
    collection = {"label": label, "graphs": [explorer_graph(g, gid) for gid, g, _ in series],
                  "graphSorting": "name_asc"}
    graphs_path = atomic_write(os.path.join(out_dir, GRAPHS_FILE), json.dumps(visible_data(collection), allow_nan=False))
    overlays = {}
    for stem, data in explorer_overlays(series).items():
        overlays[stem] = atomic_write(os.path.join(out_dir, safe_filename(stem) + ".json"),
                                      json.dumps(visible_data(data), allow_nan=False))
    start = next(((gid, node) for gid, g, _ in series if (node := origin_node_id(g)) is not None), None)
    return ExplorerExport(graphs_path, overlays, [gid for gid, _, _ in series], label, start)
