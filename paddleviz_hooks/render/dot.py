"""BackwardGraph -> DOT source. Styling lives here; escaping in ``quoting.py``."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Mapping

from ..graph import BackwardGraph, Edge, GradMeta, Node
from .quoting import dot_label, dot_quote

__all__ = ["to_dot", "dot_parts", "STYLE"]

# Colours chosen to stay distinguishable in greyscale thumbnails too.
STYLE = {
    "root": {"shape": "box", "style": "filled", "fillcolor": "#ffd966"},
    "op": {"shape": "box", "style": "rounded,filled", "fillcolor": "#dae8fc"},
    "param": {"shape": "box", "style": "filled", "fillcolor": "#c9ecc4"},
    "input": {"shape": "ellipse", "style": "filled", "fillcolor": "#e6e6e6"},
    "layer": {"shape": "box3d", "style": "filled", "fillcolor": "#fbe5d6", "margin": "0.14,0.07"},
    "nonfinite": {"fillcolor": "#ff6b6b", "color": "#b00000", "penwidth": "2.5"},
    "unhooked": {"style": "rounded,filled,dashed"},
}

_DTYPE_SHORT = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
    "int64": "i64", "int32": "i32", "complex64": "c64", "complex128": "c128",
}


def _shape(shape: tuple[int, ...] | None) -> str:
    if shape is None:
        return "?"
    return "[" + ", ".join(str(s) for s in shape) + "]"


def fmt_num(v: float | None, digits: int = 3) -> str:
    """Short number text: ``digits`` significant digits, NaN/Inf spelled out."""
    if v is None:
        return "-"
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Inf" if v > 0 else "-Inf"
    return f"{v:.{digits}g}"


def edge_text(meta: GradMeta | None, stats: bool) -> list[str]:
    """Label lines for one gradient: shape and dtype, then norm (and NaN/Inf)."""
    if meta is None:
        return []
    lines = [f"{_shape(meta.shape)} {_DTYPE_SHORT.get(meta.dtype or '', meta.dtype or '')}".strip()]
    if stats and meta.norm is not None:
        extra = f"|g| {fmt_num(meta.norm)}"
        if meta.nonfinite:
            extra += f" NaN:{meta.nan} Inf:{meta.inf}"
        lines.append(extra)
    return lines


def node_lines(node: Node) -> list[str]:
    """The visible label of a node."""
    if node.kind == "param":
        return [node.param or "parameter", _shape(node.shape)]
    if node.kind == "root":
        return [node.name, _shape(node.shape)]
    if node.kind == "input":
        return ["input"]
    if node.kind == "layer":
        return layer_box_lines(node)
    return [node.op]


def layer_box_lines(node: Node) -> list[str]:
    """Label of a collapsed layer box: path, class (x N), op and parameter count, norm."""
    path = "<top>" if node.layer == "" else (node.layer or "")
    kind = node.name + (f" x{node.count}" if node.count > 1 else "")
    lines = [path, kind] if path else [kind]
    size = node.op or ""
    if node.params:
        size += (", " if size else "") + f"{node.params} param" + ("s" if node.params != 1 else "")
    if size:
        lines.append(size)
    if node.norm is not None:
        lines.append(f"|g| params {fmt_num(node.norm)}")
    if node.nonfinite:
        lines.append(f"NaN/Inf inside: {node.nonfinite}")
    return lines


def _attrs(d: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={dot_quote(v)}" for k, v in d.items())


def dot_parts(
    graph: BackwardGraph,
    *,
    stats: bool = True,
    clusters: bool = True,
    legend: bool = True,
    rankdir: str = "TB",
    title: str | None = None,
    node_style: Mapping[str, Mapping[str, str]] | None = None,
    edge_style: Mapping[tuple[str, str], Mapping[str, str]] | None = None,
    extra_body: list[str] | None = None,
) -> tuple[dict[str, str], list[str]]:
    """Graph attributes and body lines of the DOT drawing.

    Args:
        graph: the graph to draw.
        stats: show gradient norms on edges.
        clusters: group op nodes in boxes by the layer that created them.
        legend: add a small legend.
        rankdir: ``"TB"`` (loss on top) or ``"LR"``.
        title: a caption drawn at the top.
        node_style: extra attributes per node key (used by diff drawings).
        edge_style: extra attributes per (src key, dst key).
        extra_body: more DOT lines (e.g. ghost nodes of a diff).

    Returns:
        (graph attributes, body lines), the pieces of a ``graphviz.Digraph``.
    """
    if not isinstance(graph, BackwardGraph):
        raise TypeError(f"graph must be a BackwardGraph (e.g. cap.graph), got {type(graph).__name__}")
    if rankdir not in ("TB", "LR", "BT", "RL"):
        raise ValueError(f"rankdir must be one of TB, LR, BT, RL; got {rankdir!r}")
    node_style = node_style or {}
    edge_style = edge_style or {}
    graph_attr = {
        "rankdir": rankdir,
        "fontname": "Helvetica",
        "fontsize": "12",
        "nodesep": "0.25",
        "ranksep": "0.35",
        "bgcolor": "white",
        "newrank": "true",
    }
    if title:
        graph_attr.update({"label": title, "labelloc": "t", "fontsize": "16"})
    body = [
        f"node [{_attrs({'fontname': 'Helvetica', 'fontsize': '11', 'margin': '0.08,0.03', 'height': '0.3'})}]",
        f"edge [{_attrs({'fontname': 'Helvetica', 'fontsize': '9', 'color': '#555555', 'arrowsize': '0.6'})}]",
    ]
    bad_src = {e.src for e in graph.edges if e.grad is not None and e.grad.nonfinite}
    sites = graph.nonfinite_sites() if bad_src else []
    origin = sites[0].id if sites else None

    def node_stmt(n: Node) -> str:
        attrs = dict(STYLE.get(n.kind, STYLE["op"]))
        lines = node_lines(n)
        if n.kind == "op" and not n.hooked:
            attrs.update(STYLE["unhooked"])
        if n.id in bad_src or (n.kind == "layer" and n.nonfinite):
            attrs.update(STYLE["nonfinite"])
            if n.id == origin:
                lines = lines + ["NaN/Inf origin"]
        where = f"{n.layer or '<top>'}" + (f" (call {n.call})" if n.call else "") if n.layer is not None else "outside any layer"
        tip = [n.name, f"layer: {where}", f"key: {n.key}"]
        if n.note:
            tip.append(n.note)
        attrs["tooltip"] = " | ".join(tip)
        attrs.update(node_style.get(n.key, {}))
        return f"n{n.id} [label={dot_label(*lines)}, {_attrs(attrs)}]"

    by_layer: dict[str | None, list[Node]] = defaultdict(list)
    for n in graph.nodes:
        if clusters and n.kind == "layer":
            # a box sits in the cluster of its parent layer, not in a frame of its own
            parent = n.layer.rsplit(".", 1)[0] if n.layer and "." in n.layer else ("" if n.layer else None)
            by_layer[parent].append(n)
            continue
        by_layer[n.layer if (clusters and n.kind in ("op", "layer")) else None].append(n)
    body.extend(node_stmt(n) for n in by_layer.pop(None, []))
    if by_layer:
        body.extend(_cluster_lines(graph, by_layer, node_stmt))

    keys = {n.id: n.key for n in graph.nodes}
    for e in graph.edges:
        attrs: dict[str, str] = {}
        text = edge_text(e.grad, stats)
        if text:
            attrs["label"] = "\n".join(text)
        if e.grad is not None and e.grad.nonfinite:
            attrs.update({"color": "#d00000", "fontcolor": "#d00000", "penwidth": "2"})
        attrs.update(edge_style.get((keys[e.src], keys[e.dst]), {}))
        label = attrs.pop("label", None)
        rest = _attrs(attrs)
        lbl = f"label={dot_label(*label.split(chr(10)))}" if label else ""
        sep = ", " if lbl and rest else ""
        body.append(f"n{e.src} -> n{e.dst} [{lbl}{sep}{rest}]")
    if extra_body:
        body.extend(extra_body)
    if legend:
        body.append(_legend(stats))
    return graph_attr, body


def _cluster_lines(graph: BackwardGraph, by_layer: dict[str | None, list[Node]], node_stmt) -> list[str]:
    """Nested clusters following the dotted layer paths."""
    children: dict[str, set[str]] = defaultdict(set)
    paths = set(by_layer)
    for p in list(paths):
        parts = p.split(".") if p else []
        # ancestors, up to the top layer ""
        for i in range(len(parts), 0, -1):
            parent = ".".join(parts[: i - 1])
            child = ".".join(parts[:i])
            if child != parent:  # a path with an empty first part ("..", ".x") is its own parent
                children[parent].add(child)
            paths.add(parent)
    lines: list[str] = []
    counter = [0]

    def emit(path: str, indent: str) -> None:
        counter[0] += 1
        kind = graph.layers.get(path, "")
        # `or path`: a layer named "..", "a." has an empty last part
        name = (path.rsplit(".", 1)[-1] or path) if path else (kind or "model")
        label = f"{name} ({kind})" if kind and path else name
        lines.append(f"{indent}subgraph cluster_{counter[0]} {{")
        lines.append(f"{indent}  label={dot_quote(label)}; tooltip={dot_quote(path or '<top>')};")
        lines.append(f"{indent}  style=\"rounded\"; color=\"#9aa7b8\"; fontsize=\"10\"; fontcolor=\"#44546a\";")
        for n in by_layer.get(path, []):
            lines.append(indent + "  " + node_stmt(n))
        for child in sorted(children.get(path, ())):
            emit(child, indent + "  ")
        lines.append(f"{indent}}}")

    if "" in paths:
        emit("", "")
    return lines


def _legend(stats: bool) -> str:
    rows = [
        ("#ffd966", "loss / root"),
        ("#dae8fc", "op (grad node)"),
        ("#c9ecc4", "parameter"),
        ("#e6e6e6", "input leaf"),
        ("#ff6b6b", "NaN/Inf gradient"),
    ]
    cells = "".join(
        f'<TR><TD BGCOLOR="{c}" WIDTH="14"></TD><TD ALIGN="LEFT">{t}</TD></TR>' for c, t in rows
    )
    edge_note = "edge: grad shape dtype" + (", |g| = L2 norm" if stats else "")
    cells += f'<TR><TD COLSPAN="2" ALIGN="LEFT">dashed: no gradient data</TD></TR>'
    cells += f'<TR><TD COLSPAN="2" ALIGN="LEFT">{edge_note}</TD></TR>'
    table = f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="1" CELLPADDING="2"><TR><TD COLSPAN="2"><B>legend</B></TD></TR>{cells}</TABLE>>'
    return f'legend [shape=box, style="rounded", color="#bbbbbb", fontsize="9", label={table}]'


def to_dot(graph: BackwardGraph, **options: Any) -> str:
    """DOT source of a backward graph.

    Args:
        graph: the graph.
        **options: as for :func:`dot_parts` (``stats``, ``clusters``,
            ``legend``, ``rankdir``, ``title`` ...), plus ``dpi``.

    Returns:
        The DOT text, ready for ``dot -Tsvg``.

    Example:
        >>> print(to_dot(cap.graph, legend=False)[:7])
        digraph
    """
    dpi = options.pop("dpi", None)
    graph_attr, body = dot_parts(graph, **options)
    if dpi is not None:
        graph_attr["dpi"] = str(dpi)
    lines = ["digraph backward {", f"  graph [{_attrs(graph_attr)}]"]
    lines.extend("  " + b for b in body)
    lines.append("}")
    return "\n".join(lines) + "\n"
