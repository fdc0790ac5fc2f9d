"""BackwardGraph -> DOT source. Styling lives here; words in ``paddleviz_hooks.text``,
escaping in ``paddleviz_hooks.escape``."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping

import textwrap

from ..escape import dot_attrs, dot_html_table, dot_label, dot_quote
from ..findings import marks, record_of
from ..graph import BackwardGraph, Edge, Node, is_communication
from ..hazards import PROGRAM_OP_NOTE
from ..text import (COMMUNICATION_LEGEND, DASHED_LEGEND, FIRST_GRADIENT, FLOW_LEGEND, FOLD_LEGEND, FOLD_SHOWN_LEGEND, LAYER_BOX_LEGEND, NONFINITE_LEGEND,
                    NOT_OBSERVED, ORIGIN_LEGEND, SAVED_SHADE_NONE, SAVED_SHADE_TITLE, box_name, call_of, edge_lines, edge_tooltip,
                    fold_alike_line, node_lines, node_tooltip, origin_mark, origin_node_lines, saved_shade_line,
                    shown_block_line)

__all__ = ["to_dot", "dot_parts", "STYLE", "COLOR_BY", "SAVED_SHADES", "ORIGIN_NODE_ID", "check_color_by", "saved_shades",
           "title_lines"]

# Colours chosen to stay distinguishable in greyscale thumbnails too.
STYLE = {
    "root": {"shape": "box", "style": "filled", "fillcolor": "#ffd966"},
    "op": {"shape": "box", "style": "rounded,filled", "fillcolor": "#dae8fc"},
    "param": {"shape": "box", "style": "filled", "fillcolor": "#c9ecc4"},
    "input": {"shape": "ellipse", "style": "filled", "fillcolor": "#e6e6e6"},
    "layer": {"shape": "box3d", "style": "filled", "fillcolor": "#fbe5d6", "margin": "0.14,0.07"},
    "nonfinite": {"fillcolor": "#ff6b6b", "color": "#b00000", "penwidth": "2.5"},
    "unhooked": {"style": "rounded,filled,dashed"},
    "communication": {"fillcolor": "#ffe0b2", "color": "#e65100", "penwidth": "1.5"},
    # where the NaN/Inf started (graph.nonfinite.origin): a thick violet double frame
    "origin": {"color": "#7b1fa2", "penwidth": "4", "peripheries": "2", "fontcolor": "#4a0072"},
}

#: What ``color_by`` may shade nodes by.
COLOR_BY = ("saved_memory",)
#: Fills of ``color_by="saved_memory"``, most bytes first (blues, a hue no other node kind uses).
#: Each shade holds down to a quarter of the bytes of the one before (a log scale: sizes
#: span orders of magnitude); the last holds everything smaller. The first two take white text.
SAVED_SHADES = ("#08306b", "#2171b5", "#6baed6", "#9ecae1", "#d2e3f3")
_SHADE_STEP = 4


def check_color_by(color_by: Any) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``color_by`` is None or one of :data:`COLOR_BY`.

    Examples:
        >>> check_color_by("memory")
        Traceback (most recent call last):
        ...
        ValueError: color_by must be None or one of ('saved_memory',), got 'memory'
    """
    if color_by is not None and not isinstance(color_by, str):
        raise TypeError(f"color_by must be None or one of {COLOR_BY}, got {color_by!r}")
    if color_by is not None and color_by not in COLOR_BY:
        raise ValueError(f"color_by must be None or one of {COLOR_BY}, got {color_by!r}")


def saved_shades(graph: BackwardGraph) -> dict[int, int]:
    """Node id -> index into :data:`SAVED_SHADES` for every node with saved bytes.

    The node holding the most gets shade 0; a node holding more than a
    quarter of that, too; then shade 1 down to a sixteenth, and so on.
    A collapsed box carries the sum of its ops' bytes (each storage counted once).

    Examples:
        >>> from paddleviz_hooks.graph import Node
        >>> g = BackwardGraph([Node(0, "op", "A", "A", saved_bytes=4096), Node(1, "op", "B", "B", saved_bytes=1000),
        ...                    Node(2, "op", "C", "C")])
        >>> saved_shades(g)
        {0: 0, 1: 1}
    """
    sizes = {n.id: n.saved_bytes for n in graph.nodes if n.saved_bytes > 0}
    top = max(sizes.values(), default=0)
    shades = {}
    for nid, b in sizes.items():
        i = 0
        while i < len(SAVED_SHADES) - 1 and b * _SHADE_STEP ** (i + 1) <= top:
            i += 1
        shades[nid] = i
    return shades

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
    color_by: str | None = None,
) -> tuple[dict[str, str], list[str]]:
    """Graph attributes and body lines of the DOT drawing.

    Args:
        graph: the graph to draw.
        stats: show gradient norms on edges.
        clusters: group op nodes in boxes by the layer that created them.
        legend: add a small legend.
        rankdir: ``"TB"`` (loss on top) or ``"LR"``.
        title: a caption drawn at the top.
        node_style: extra attributes per node key (used by diff drawings); a
            ``label`` there replaces the node's label (lines split at ``\\n``).
        edge_style: extra attributes per (src key, dst key).
        extra_body: more DOT lines (e.g. ghost nodes of a diff).
        color_by: ``"saved_memory"`` fills ops and layer boxes by the bytes they
            saved for backward (:data:`SAVED_SHADES`, darker = more, on a log
            scale; the legend gives each shade's range in bytes); ops and boxes
            with nothing recorded are white. Needs a graph captured with
            ``saved_memory=True``. None (default): the usual fills.

    Returns:
        (graph attributes, body lines), the pieces of a ``graphviz.Digraph``.
    """
    if not isinstance(graph, BackwardGraph):
        raise TypeError(f"graph must be a BackwardGraph (e.g. cap.graph), got {type(graph).__name__}")
    if rankdir not in ("TB", "LR", "BT", "RL"):
        raise ValueError(f"rankdir must be one of TB, LR, BT, RL; got {rankdir!r}")
    check_color_by(color_by)
    if color_by == "saved_memory" and not isinstance(graph.meta.get("saved_memory"), dict):
        raise ValueError("color_by='saved_memory' needs a graph captured with saved_memory=True "
                         "(capture_backward(model, saved_memory=True) or the recorder's saved_memory=True); "
                         "this graph has no meta['saved_memory']")
    shades = saved_shades(graph) if color_by == "saved_memory" else None
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
        graph_attr.update({"labelloc": "t", "fontsize": "16"})
    body = [f"label={dot_label(*title_lines(title))}"] if title else []
    body += [
        f"node [{dot_attrs({'fontname': 'Helvetica', 'fontsize': '11', 'margin': '0.08,0.03', 'height': '0.3'})}]",
        f"edge [{dot_attrs({'fontname': 'Helvetica', 'fontsize': '9', 'color': '#555555', 'arrowsize': '0.6'})}]",
    ]
    bad = graph.nonfinite_nodes()
    found = record_of(graph).origin
    mark = marks(graph)
    # folded runs with one layer drawn open (collapse_graph's show_one): fold label -> that layer,
    # and that layer -> what it says (which run it is one of)
    folds = graph.meta.get("collapse", {}).get("shown", {})
    shown = {label: v[0] for label, v in folds.items()}
    shown_says = {v[0]: shown_block_line(v[1], label) for label, v in folds.items()}  # in its frame's label
    ins = graph.in_edges()  # the gradients each node received, for its tooltip
    recorded = graph.meta.get("grad_stats") is not False  # statistics were recorded (or not said otherwise)

    # an op without a hook is drawn dashed when a gradient it passes on stays unknown; one
    # whose gradients were all recovered exactly (an AddN's, copied from what it received)
    # is drawn as any other: nothing of it is missing
    seen_edges = {id(e): _observed(graph, e) for e in graph.edges}
    sends = {e.src for e in graph.edges}
    missing = {e.src for e in graph.edges if not seen_edges[id(e)]}

    def node_stmt(n: Node) -> str:
        attrs = dict(STYLE.get(n.kind, STYLE["op"]))
        lines = node_lines(n)
        if n.kind == "op" and not n.hooked and (n.id in missing or n.id not in sends):
            attrs.update(STYLE["unhooked"])
        if n.kind == "op" and is_communication(n.op):
            attrs.update(STYLE["communication"])
        if shades is not None and n.id in shades:
            attrs.update(fillcolor=SAVED_SHADES[shades[n.id]], **({"fontcolor": "white"} if shades[n.id] < 2 else {}))
        elif shades is not None and n.kind in ("op", "layer"):
            attrs["fillcolor"] = "white"
        if n.id in bad:
            attrs.pop("fontcolor", None)
            attrs.update(STYLE["nonfinite"])
        if n.kind == "layer" and n.layer in shown:
            lines = lines + [fold_alike_line(shown[n.layer], n.count)]
        elif n.kind == "layer" and n.layer in shown_says:  # the layer drawn is one box at this depth
            lines = lines + [shown_block_line(next(v[1] for v in folds.values() if v[0] == n.layer))]
        if n.id == mark.first_gradient and n.id != mark.origin:
            lines = lines + [FIRST_GRADIENT]
        if n.id == mark.origin:
            attrs.update(STYLE["origin"])
            lines = lines + [origin_mark(found)]
        attrs["tooltip"] = node_tooltip(n, ins.get(n.id, ()), recorded)
        attrs.update(node_style.get(n.key, {}))
        if "label" in attrs:  # a label from node_style is the whole label, as for edges
            lines = attrs.pop("label").split("\n")
        return f"n{n.id} [label={dot_label(*lines)}, {dot_attrs(attrs)}]"

    # one frame per call of a layer: (layer path, call) -> its nodes
    by_layer: dict[tuple[str, int] | None, list[Node]] = defaultdict(list)
    chains: dict[tuple[str, int], dict[str, int]] = {}
    for n in graph.nodes:
        if not clusters or n.kind not in ("op", "layer") or n.layer is None or (n.kind == "layer" and not n.layer):
            by_layer[None].append(n)
            continue
        chain = chains.get((n.layer, n.call)) or chains.setdefault((n.layer, n.call),
                                                                   graph.call_chain(n.layer, n.call))
        path = n.layer
        if n.kind == "layer":
            # a box sits in the frame of its parent layer, not in a frame of its own
            path = n.layer.rsplit(".", 1)[0] if "." in n.layer else ""
        by_layer[(path, chain.get(path, 0))].append(n)
    body.extend(node_stmt(n) for n in by_layer.pop(None, []))
    if by_layer:
        body.extend(_cluster_lines(graph, by_layer, chains, node_stmt, shown_says))

    keys = {n.id: n.key for n in graph.nodes}
    for e in graph.edges:
        attrs: dict[str, str] = {}
        seen = seen_edges[id(e)]
        text = edge_lines(e.grad, stats, seen, e.note, e.after_hook)
        if text:
            attrs["label"] = "\n".join(text)
        if e.grad is None or not seen:
            attrs.update({"style": "dashed", "fontcolor": "#777777"})
        elif e.grad.nonfinite:
            attrs.update({"color": "#d00000", "fontcolor": "#d00000", "penwidth": "2"})
        attrs["tooltip"] = edge_tooltip(graph.nodes[e.src], graph.nodes[e.dst], e, recorded)
        attrs.update(edge_style.get((keys[e.src], keys[e.dst]), {}))
        label = attrs.pop("label", None)
        rest = dot_attrs(attrs)
        lbl = f"label={dot_label(*label.split(chr(10)))}" if label else ""
        sep = ", " if lbl and rest else ""
        body.append(f"n{e.src} -> n{e.dst} [{lbl}{sep}{rest}]")
    drawn_origin = mark.origin is not None
    if found is not None and found.kind == "forward" and not drawn_origin:
        body.extend(_origin_node(found, mark.entry))
        drawn_origin = True
    if extra_body:
        body.extend(extra_body)
    if legend:
        drawn = {n.kind for n in graph.nodes}
        body.append(_legend(stats, any(n.note == PROGRAM_OP_NOTE for n in graph.nodes), drawn_origin,
                            any(n.kind == "op" and is_communication(n.op) for n in graph.nodes),
                            None if shades is None else _shade_rows(graph, shades),
                            FOLD_SHOWN_LEGEND if shown else FOLD_LEGEND if any(
                                n.kind == "layer" and n.count > 1 for n in graph.nodes) else None,
                            "layer" in drawn, drawn=drawn, nonfinite=bool(bad) or any(
                                e.grad is not None and e.grad.nonfinite for e in graph.edges),
                            dashed=bool(missing) or any(n.kind == "op" and not n.hooked and n.id not in sends
                                                        for n in graph.nodes)))
    return graph_attr, body


def _observed(graph: BackwardGraph, e: Edge) -> bool:
    """False for a gradient with a known shape whose values no hook saw: one
    that leaves or enters an op without a hook (inside a compiled program,
    AddN, Concat...) or a box of such ops only, and carries no statistics."""
    if e.grad is None or e.grad.note is not None:  # a reason it was not observed (GradMeta.note)
        return False
    if e.grad.norm is not None or not graph.meta.get("grad_stats"):
        return True

    def unseen(n: Node) -> bool:  # an op without a hook (AddN, Concat, a program op) or a box of such ops
        return (n.kind == "op" and not n.hooked) or (n.kind == "layer" and 0 < n.ops == n.unhooked)

    return not (unseen(graph.nodes[e.src]) or unseen(graph.nodes[e.dst]))


def _cluster_lines(graph: BackwardGraph, by_layer: dict[tuple[str, int], list[Node]],
                   chains: dict[tuple[str, int], dict[str, int]], node_stmt,
                   says: Mapping[str, str] | None = None) -> list[str]:
    """Nested clusters following the dotted layer paths, one per call of a layer."""
    children: dict[tuple[str, int], set[tuple[str, int]]] = defaultdict(set)
    calls: dict[str, int] = defaultdict(int)  # layer path -> calls drawn
    keys = set(by_layer)
    for p, c in list(keys):
        chain = chains.get((p, c), {})
        parts = p.split(".") if p else []
        # ancestors, up to the top layer "", each in the call this one ran inside
        for i in range(len(parts), 0, -1):
            parent = ".".join(parts[: i - 1])
            child = ".".join(parts[:i])
            if child != parent:  # a path with an empty first part ("..", ".x") is its own parent
                children[(parent, chain.get(parent, 0))].add((child, chain.get(child, 0)))
            keys.add((parent, chain.get(parent, 0)))
    for p, c in keys | {k for ks in children.values() for k in ks}:
        calls[p] = max(calls[p], c + 1)
    lines: list[str] = []
    counter = [0]

    def emit(key: tuple[str, int], indent: str) -> None:
        path, call = key
        counter[0] += 1
        kind = graph.layers.get(path, "")
        # `or path`: a layer named "..", "a." has an empty last part
        name = (path.rsplit(".", 1)[-1] or path) if path else (kind or "model")
        label = (f"{name} ({kind})" if kind and path else name) + call_of(call, calls[path])
        if says and path in says:  # one layer of a folded run, drawn open
            label += " - " + says[path]
        lines.append(f"{indent}subgraph cluster_{counter[0]} {{")
        lines.append(f"{indent}  label={dot_quote(label)}; tooltip={dot_quote(box_name(path))};")
        lines.append(f"{indent}  style=\"rounded\"; color=\"#9aa7b8\"; fontsize=\"10\"; fontcolor=\"#44546a\";")
        for n in by_layer.get(key, []):
            lines.append(indent + "  " + node_stmt(n))
        for child in sorted(children.get(key, ())):
            emit(child, indent + "  ")
        lines.append(f"{indent}}}")

    for top in sorted(k for k in keys if k[0] == ""):
        emit(top, "")
    return lines


#: The id of the node a drawing adds for an origin op that has no node in the graph.
ORIGIN_NODE_ID = "nan_origin"


def _origin_node(origin, entry: int | None) -> list[str]:
    """DOT lines of the node added for an origin op without a grad node, joined (dashed,
    no arrow: no gradient flows into it) to the node where its output enters the graph."""
    attrs = {"shape": "box", "style": "rounded,filled,dashed", "fillcolor": "white", **STYLE["origin"],
             "tooltip": " | ".join(origin_node_lines(origin, entry is not None))}
    lines = [f"{ORIGIN_NODE_ID} [label={dot_label(*origin_node_lines(origin, entry is not None))}, {dot_attrs(attrs)}]"]
    if entry is not None:
        lines.append(f"n{entry} -> {ORIGIN_NODE_ID} "
                     f"[{dot_attrs({'style': 'dashed', 'color': STYLE['origin']['color'], 'arrowhead': 'none'})}]")
    return lines


def title_lines(title: str, width: int = 72) -> list[str]:
    """A title cut into lines of about ``width`` characters, at its `` - `` parts where it can:
    a long title wraps, it is never cut short.

    Examples:
        >>> title_lines("step 13 - trigger: nonfinite_loss - NaN/Inf starts at log in the model's own forward, "
        ...             "run.py:18, on data that needs no gradient - collapsed to layer depth 4", width=60)
        ['step 13 - trigger: nonfinite_loss', "NaN/Inf starts at log in the model's own forward, run.py:18,", 'on data that needs no gradient', 'collapsed to layer depth 4']
    """
    lines: list[str] = []
    joinable = False  # the last line is whole parts (not a wrapped one's tail)
    for part in str(title).split(" - "):
        pieces = textwrap.wrap(part, width, break_long_words=True, break_on_hyphens=False) or [""]
        if len(pieces) == 1 and joinable and len(lines[-1]) + 3 + len(pieces[0]) <= width:
            lines[-1] += " - " + pieces[0]
        else:
            lines.extend(pieces)
        joinable = len(pieces) == 1
    return lines


def _shade_rows(graph: BackwardGraph, shades: dict[int, int]) -> list[tuple[dict[str, str], str]]:
    """Legend rows of ``color_by="saved_memory"``: each shade used, with the bytes of its nodes."""
    members: dict[int, list[int]] = defaultdict(list)
    for n in graph.nodes:
        if n.id in shades:
            members[shades[n.id]].append(n.saved_bytes)
    rows: list[tuple[dict[str, str], str]] = [({}, SAVED_SHADE_TITLE)]
    for i in sorted(members):
        rows.append(({"BGCOLOR": SAVED_SHADES[i]}, saved_shade_line(min(members[i]), max(members[i]), len(members[i]))))
    rows.append(({"BGCOLOR": "white", "BORDER": "1"}, SAVED_SHADE_NONE))
    return rows


def _legend(stats: bool, compiled: bool = False, origin: bool = False, communication: bool = False,
            shade_rows: list[tuple[dict[str, str], str]] | None = None, fold: str | None = None,
            boxes: bool = False, drawn: set[str] | None = None, nonfinite: bool = True,
            dashed: bool = True) -> str:
    """The legend's rows: only what the drawing shows (``drawn``: the node kinds in it, all when
    None; ``nonfinite``: a NaN/Inf is drawn; ``dashed``: something is drawn dashed)."""
    def shown(kind: str) -> bool:
        return nonfinite if kind == "nonfinite" else drawn is None or kind in drawn

    rows = [({"BGCOLOR": c}, t) for c, t, kind in (
        ("#ffd966", "loss / root", "root"),
        ("#dae8fc", "op (grad node)", "op"),
        ("#c9ecc4", "parameter", "param"),
        ("#e6e6e6", "input leaf", "input"),
        (STYLE["nonfinite"]["fillcolor"], NONFINITE_LEGEND, "nonfinite"),
    ) if shown(kind) and not (shade_rows and c == STYLE["op"]["fillcolor"])]  # shaded: ops by bytes or white
    if boxes:
        rows.append(({"BGCOLOR": STYLE["layer"]["fillcolor"]}, LAYER_BOX_LEGEND))
    if origin:
        rows.append(({"BGCOLOR": STYLE["origin"]["color"]}, ORIGIN_LEGEND))
    if communication:
        rows.append(({"BGCOLOR": STYLE["communication"]["fillcolor"]}, COMMUNICATION_LEGEND))
    if dashed:
        rows.append(({}, DASHED_LEGEND))
    if compiled:
        rows.append(({}, f"dashed *_grad op: {PROGRAM_OP_NOTE} (to_static)"))
    rows.append(({}, "edge: grad shape dtype" + (", |g| = L2 norm" if stats else "")))
    rows.append(({}, FLOW_LEGEND))
    if fold:
        rows.append(({}, fold))
    rows.extend(shade_rows or ())
    return f'legend [shape=box, style="rounded", color="#bbbbbb", fontsize="9", label={dot_html_table("legend", rows)}]'


def to_dot(graph: BackwardGraph, **options: Any) -> str:
    """DOT source of a backward graph.

    Args:
        graph: the graph.
        **options: as for :func:`dot_parts` (``stats``, ``clusters``,
            ``legend``, ``rankdir``, ``title`` ...), plus ``dpi``.

    Returns:
        The DOT text, ready for ``dot -Tsvg``.

    Examples:
        >>> import paddle
        >>> from paddleviz_hooks import capture_backward
        >>> net = paddle.nn.Linear(3, 2)
        >>> with capture_backward(net) as cap:
        ...     net(paddle.randn([2, 3])).sum().backward()
        >>> print(to_dot(cap.graph, legend=False)[:16])
        digraph backward
    """
    dpi = options.pop("dpi", None)
    graph_attr, body = dot_parts(graph, **options)
    if dpi is not None:
        graph_attr["dpi"] = str(dpi)
    lines = ["digraph backward {", f"  graph [{dot_attrs(graph_attr)}]"]
    lines.extend("  " + b for b in body)
    lines.append("}")
    return "\n".join(lines) + "\n"
