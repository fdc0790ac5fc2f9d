"""A captured graph as a VisualDL Graphs-tab file (interactive, one per capture).

VisualDL's **Graphs** tab shows any directory under ``--logdir`` that holds
a file named ``vdlgraph.*`` (the JSON model format of its own ``add_graph``)
as one entry of its "Choose a model" list, labelled by the directory's last
path component. Layers become collapsible boxes (``/`` in node names), an
edge is drawn where one node's output variable is another's input, and a
click on a node lists its attributes. See ``docs/visualdl.md``.

Here every layer is a box (its first view shows the top-level layers), every
call of a layer that ran more than once is a box of its own, parameters sit
in their layer, the loss is the graph's input, edges are labelled with the
gradient's shape and norm, and each node carries the gradient it received.
Where the NaN/Inf starts (``graph.nonfinite``) is named in the type of its
op's node, or of a node added where its output enters the graph when the op
has none; the first node with a non-finite gradient carries an attribute.

Examples:
    >>> from paddleviz_hooks.graph import BackwardGraph, Edge, GradMeta, Node
    >>> g = BackwardGraph(
    ...     nodes=[Node(0, "root", "loss", "loss"),
    ...            Node(1, "op", "MatmulGradNode", "Matmul", layer="fc", hooked=True),
    ...            Node(2, "param", "GradNodeAccumulation", "Parameter", param="fc.weight")],
    ...     edges=[Edge(0, 1, grad=GradMeta((), "float32", norm=1.0)),
    ...            Edge(1, 2, grad=GradMeta((3, 2), "float32", norm=2.0))],
    ...     layers={"": "Net", "fc": "Linear"})
    >>> data = vdl_graph(g)
    >>> sorted(n["name"] for n in data["nodes"])
    ['/', '/fc', '/fc/Matmul', '/fc/weight', '/loss']
    >>> [v["shape"] for v in data["vars"]]
    [['[] f32 |g| 1'], ['[3, 2] f32 |g| 2']]
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from typing import Any

from .._fileio import atomic_write
from ..collapse import call_paths
from ..escape import vdl_graph_name, visible_data
from ..graph import BackwardGraph, GradMeta, Node
from ..findings import marks, record_of
from ..text import (FIRST_GRADIENT, NAN_INSIDE, node_layer, NOT_OBSERVED, describe_origin, edge_lines, exact_num, extreme_text, layer_name, origin_short,
                    source_attrs)

__all__ = ["vdl_graph", "write_vdl_graph", "VDL_GRAPH_VERSION"]

VDL_GRAPH_VERSION = "1.0.0"  # the version string VisualDL's own add_graph writes


def _op_type(op: str) -> str:
    """The type an op node shows: its name as every other view writes it (``Matmul``,
    ``CrossEntropyWithSoftmax``); the tab shows a type after its last dot, so none is kept."""
    return op.replace(".", "_")


class _Tree:
    """Node paths: every name URL-safe and unique among its siblings."""

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self._taken: dict[str, set[str]] = defaultdict(set)
        self._made: dict[tuple[str, Any], str] = {}
        self.add("/", None, "backward graph", "backward_graph", leaf=False)

    def child(self, parent: str, key: Any, text: str, type_: str, *, leaf: bool, show: str = "") -> str:
        """The path of ``parent``'s child ``key`` (made on first use, named after ``text``;
        ``show``: the title of an opened box, default ``text``)."""
        made = self._made.get((parent, key))
        if made is not None:
            return made
        base = vdl_graph_name(text)
        name, k = base, 1
        while name in self._taken[parent]:
            k += 1
            name = f"{base}_{k}"
        self._taken[parent].add(name)
        path = ("" if parent == "/" else parent) + "/" + name
        self._made[(parent, key)] = path
        self.add(path, parent, show or text, type_, leaf=leaf)
        return path

    def add(self, path: str, parent: str | None, show: str, type_: str, *, leaf: bool) -> None:
        self.nodes[path] = {
            "name": path, "show_name": show, "type": type_, "attrs": {}, "attr_types": {},
            "input_vars": {}, "output_vars": {}, "children_node": [], "is_leaf_node": leaf,
            "parent_node": parent or "", "input_nodes": [], "output_nodes": [],
            "edge_input_nodes": [], "edge_output_nodes": [],
        }
        if parent is not None:
            self.nodes[parent]["children_node"].append(path)

    def ancestors(self, path: str) -> list[str]:
        """Boxes holding ``path``, innermost first, without the root."""
        out = []
        parent = self.nodes[path]["parent_node"]
        while parent and parent != "/":
            out.append(parent)
            parent = self.nodes[parent]["parent_node"]
        return out


def _set(node: dict[str, Any], key: str, value: Any) -> None:
    node["attrs"][key] = str(value)
    node["attr_types"][key] = "STRING"


def _grad_attrs(node: dict[str, Any], metas: list[GradMeta | None]) -> None:
    """The gradient a node received (one value per incoming gradient, ``; ``-separated)."""
    if not metas:
        return
    if len(metas) > 1:
        _set(node, "grads in", f"{len(metas)} (values listed in that order)")

    def each(fn) -> str:
        return "; ".join(NOT_OBSERVED if m is None else fn(m) for m in metas)

    _set(node, "shape", each(lambda m: "?" if m.shape is None else "[" + ", ".join(map(str, m.shape)) + "]"))
    _set(node, "dtype", each(lambda m: m.dtype or "?"))
    if any(m is not None and m.norm is not None for m in metas):
        _set(node, "norm", each(lambda m: exact_num(m.norm)))
        _set(node, "min", each(lambda m: extreme_text(m, m.min)))
        _set(node, "max", each(lambda m: extreme_text(m, m.max)))
        _set(node, "NaN", each(lambda m: str(m.nan)))
        _set(node, "Inf", each(lambda m: str(m.inf)))


def _layer_of(graph: BackwardGraph, n: Node) -> str | None:
    """Dotted layer path a node belongs in; a parameter goes to the layer that owns it."""
    if n.kind == "param" and n.param is not None:
        owner = n.param.rpartition(".")[0]
        return owner if owner in graph.layers else (None if graph.layers else owner)
    return n.layer if n.kind == "op" else None


def _levels(layer: str | None, skip: int = 0) -> list[tuple[str, None]]:
    """The layer boxes down to ``layer`` (not one call of any), without the first ``skip``.

    Examples:
        >>> _levels("encoder.layers.0", 1)
        [('encoder.layers', None), ('encoder.layers.0', None)]
    """
    parts = layer.split(".") if layer else []
    return [(".".join(parts[:i]), None) for i in range(skip + 1, len(parts) + 1)]


def vdl_graph(graph: BackwardGraph) -> dict[str, Any]:
    """VisualDL's graph JSON (``{"version", "nodes", "vars", "edges"}``) for one capture.

    Args:
        graph: a full captured graph (not collapsed).

    Returns:
        A dict that VisualDL's ``visualdl.component.graph.Model`` loads.
    """
    tree = _Tree()
    paths = call_paths(graph)  # the layer calls each node lies in, outermost first
    calls: dict[str, int] = defaultdict(int)  # layer path -> calls the graph shows
    for pairs in paths:
        for layer, call in pairs:
            calls[layer] = max(calls[layer], call + 1)
    norms: dict[str, list[float]] = defaultdict(list)  # box path -> its parameters' gradient norms

    def layer_box(pairs: list[tuple[str, int | None]]) -> str:
        """The box of a node inside these layer calls (``None``: the layer, not one call of it);
        a layer the graph shows called several times holds one box per call."""
        path = "/"
        for dotted, call in pairs:
            part = dotted.rsplit(".", 1)[-1]
            cls = graph.layers.get(dotted, "Layer")
            # the type holds the dotted name so that the tab's search (names and types) finds
            # ``features.3``; its box header shows only the text after the type's last dot
            path = tree.child(path, ("layer", part), part, f"{dotted} ({cls})", leaf=False,
                              show=f"{dotted} ({cls})")
            box = tree.nodes[path]
            if "layer" not in box["attrs"]:
                _set(box, "layer", dotted)
                _set(box, "class", graph.layers.get(dotted, "?"))
            if call is not None and calls[dotted] > 1:
                n_calls = calls[dotted]
                path = tree.child(path, ("call", call), f"call{call + 1}", f"call {call + 1} of {n_calls} ({cls})",
                                  leaf=False, show=f"{layer_name(dotted)} call {call + 1} of {n_calls}")
                _set(tree.nodes[path], "call", f"{call + 1} of {n_calls}")
        return path

    # leaves
    leaf: dict[int, str] = {}
    for n in graph.nodes:
        if n.kind == "root":
            path = tree.child("/", ("node", n.id), n.name or "loss", "feed", leaf=True)
        elif n.kind == "param":
            layer = _layer_of(graph, n)
            # in the calls that used it (call_paths); a weight shared by several calls of its
            # layer sits in that layer's box, beside the boxes of the calls
            box = layer_box(list(paths[n.id]) + _levels(layer, len(paths[n.id])))
            short = (n.param or "parameter").rpartition(".")[2] if layer is not None else (n.param or "parameter")
            path = tree.child(box, ("node", n.id), short, f"{n.param or short} (parameter)", leaf=True)
            _set(tree.nodes[path], "param", n.param or "?")
            if n.grad is not None and n.grad.norm is not None:
                for b in [box] + tree.ancestors(box) if box != "/" else []:
                    norms[b].append(n.grad.norm)
        elif n.kind == "op":
            box = layer_box(list(paths[n.id]))
            path = tree.child(box, ("node", n.id), n.op or n.name, _op_type(n.op or n.name), leaf=True)
            where = layer_name(n.layer) if n.layer is not None else node_layer(n)
            if n.layer is not None and calls[n.layer] > 1:
                where += f" (call {n.call + 1})"
            node = tree.nodes[path]
            _set(node, "op", n.op)
            _set(node, "paddle", n.name)
            _set(node, "layer", where)
            if not n.hooked:
                _set(node, "observed", "no" + (f": {n.note}" if n.note else ""))
        else:  # an input leaf, or a node kind this version does not know
            path = tree.child("/", ("node", n.id), n.kind, n.kind, leaf=True)
        leaf[n.id] = path
        _set(tree.nodes[path], "key", n.key or n.id)

    # gradients: one variable per edge; boxes list those crossing their border
    inn: dict[int, list[GradMeta | None]] = defaultdict(list)
    variables, edges = [], []
    stats = any(e.grad is not None and e.grad.norm is not None for e in graph.edges)
    names = _Tree()  # variable names: the loss's gradient is named after the loss (the graph's input)
    for i, e in enumerate(graph.edges):
        first = graph.nodes[e.src]
        var = names.child("/", i, first.name or "loss", "", leaf=True)[1:] if first.kind == "root" else f"grad_{i}"
        src, dst = leaf[e.src], leaf[e.dst]
        label = " ".join(edge_lines(e.grad, stats, why=e.note, after_hook=e.after_hook))
        variables.append({
            "name": var, "shape": [label], "type": "gradient",
            "dtype": (e.grad.dtype if e.grad is not None else None) or "?", "value": [],
            "persistable": False, "attrs": {}, "from_node": src, "to_nodes": [dst],
        })
        edges.append({"from_node": src, "to_node": dst, "vars": [var], "label": label})
        inn[e.dst].append(e.grad)
        s, d = tree.nodes[src], tree.nodes[dst]
        s["output_vars"].setdefault("grad_out", []).append(var)
        d["input_vars"].setdefault("grad_in", []).append(var)
        s["output_nodes"].append(dst)
        d["input_nodes"].append(src)
        s["edge_output_nodes"].append(dst)
        d["edge_input_nodes"].append(src)
        up_s, up_d = tree.ancestors(src), tree.ancestors(dst)
        for box in set(up_s) - set(up_d):
            tree.nodes[box]["output_vars"].setdefault("Y", []).append(var)
            tree.nodes[box]["output_nodes"].append(dst)
        for box in set(up_d) - set(up_s):
            tree.nodes[box]["input_vars"].setdefault("X", []).append(var)
            tree.nodes[box]["input_nodes"].append(src)

    for n in graph.nodes:
        node = tree.nodes[leaf[n.id]]
        if n.kind == "param" and n.grad is not None:
            _grad_attrs(node, [n.grad])  # what this backward added to param.grad
        elif n.kind != "root":
            _grad_attrs(node, inn.get(n.id, []))
        for k, v in source_attrs(n).items():
            _set(node, k, v)
    for box, values in norms.items():
        _set(tree.nodes[box], "param |g|", exact_num(math.sqrt(sum(v * v for v in values))))

    rec, mark = record_of(graph), marks(graph)
    if mark.first_gradient is not None:
        _set(tree.nodes[leaf[mark.first_gradient]], FIRST_GRADIENT, "yes: it received finite gradients "
                                                                    "and passed a non-finite one on")
    if rec.origin is not None:
        story = describe_origin(rec.origin)
        _set(tree.nodes["/"], "NaN/Inf origin", story)
        target = None
        if mark.origin is not None:
            target = leaf[mark.origin]
        elif rec.origin.kind == "forward":
            # the origin's op has no node here: one is added where its output enters the graph
            o = rec.origin
            box = layer_box(_levels(o.layer)) if o.layer else "/"
            target = tree.child(box, ("origin", 0), o.op or "origin", "", leaf=True)
            if mark.entry is not None:
                src = leaf[mark.entry]
                edges.append({"from_node": src, "to_node": target, "vars": [], "label": ""})
                tree.nodes[src]["output_nodes"].append(target)
                tree.nodes[target]["input_nodes"].append(src)
                tree.nodes[src]["edge_output_nodes"].append(target)
                tree.nodes[target]["edge_input_nodes"].append(src)
        if target is not None:
            node = tree.nodes[target]
            node["type"] = origin_short(rec.origin)  # the file is in the attribute (a type shows after its last dot)
            _set(node, "NaN/Inf origin", story)
            for box in tree.ancestors(target):  # the boxes on the way there say so too, in their headers
                _set(tree.nodes[box], "NaN/Inf origin", "inside: " + story)
                tree.nodes[box]["show_name"] += f" - {NAN_INSIDE}"
                tree.nodes[box]["type"] += f" - {NAN_INSIDE}"

    return {"version": VDL_GRAPH_VERSION, "nodes": list(tree.nodes.values()), "vars": variables, "edges": edges}


def write_vdl_graph(directory: str, graph: BackwardGraph) -> str:
    """Write one capture's Graphs-tab file into ``directory`` (its own: one graph per directory).

    The file appears whole or not at all (written under a temporary name
    VisualDL ignores, then renamed).

    Args:
        directory: created if missing; its last path component is the
            capture's label in VisualDL's "Choose a model" list.
        graph: the captured graph.

    Returns:
        The path of the ``vdlgraph.<unix seconds>.log`` file written.

    Raises:
        OSError: the directory cannot be written.
    """
    os.makedirs(directory, exist_ok=True)
    text = json.dumps(visible_data(vdl_graph(graph)), allow_nan=False, separators=(",", ":"))
    return atomic_write(os.path.join(directory, f"vdlgraph.{int(time.time()):010d}.log"), text)
