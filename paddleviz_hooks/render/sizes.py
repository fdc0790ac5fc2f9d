"""A cheap model of how large Graphviz ``dot`` lays out a DOT drawing, without running it.

The planner (``render/plan.py``) uses it to pick the detail and arrangement
of a viewing picture before the first engine run, so a new structure costs
at most a few runs instead of one per arrangement and depth tried. It reads
the DOT text the drawing code writes (``render/dot.py``): node and edge
labels (their lines and longest line), fonts, cluster nesting, the title.
Ranks are the longest path from a source (what ``dot`` does up to its
balancing); each rank is as long as its tallest node, each gap between
ranks as long as ``ranksep`` plus its tallest edge label, and the drawing
as wide as its widest rank. Two factors calibrated once against ``dot``
2.43 on backward graphs of LeNet, a small CNN, resnet18 and 2- and 6-layer
encoders at every collapse depth, both directions (48 layouts; ``docs/graphviz.md``)
turn that into inches. The planner corrects
them per structure with what each engine run measures.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["DotSizes", "read_dot", "ALONG_FACTOR", "ACROSS_FACTOR"]

#: Calibrated once (see the module docstring): layout length along the ranks and
#: across them, as measured by ``dot -Tplain``, divided by the raw model's.
ALONG_FACTOR = 0.86
ACROSS_FACTOR = {"TB": 1.12, "BT": 1.12, "LR": 1.36, "RL": 1.36}
_CHAR_EM = 0.56  # Helvetica's mean advance per character, in ems (digits 0.556, lower case ~0.5)
_LINE_EM = 1.2
_CLUSTER_PAD = 16 / 72  # Graphviz's cluster margin, both sides
_NODE = re.compile(r'^\s*("?[\w.]+"?) \[(.*)\]\s*;?$')
_EDGE = re.compile(r'^\s*("?[\w.]+"?) -> ("?[\w.]+"?)(?: \[(.*)\])?\s*;?$')
_ATTR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|<.*>|[^,\s\]]+)')
_TAG = re.compile(r"<[^>]*>")


@dataclass
class DotSizes:
    """What the size model needs of one DOT drawing."""

    rankdir: str = "TB"
    nodesep: float = 0.25
    ranksep: float = 0.5
    #: name -> (width, height) in inches, as ``dot`` sizes the node
    nodes: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: (tail, head, label width, label height, constrains ranks)
    edges: list[tuple[str, str, float, float, bool]] = field(default_factory=list)
    depth: dict[str, int] = field(default_factory=dict)  # cluster nesting of each node
    clusters: list[set[str]] = field(default_factory=list)  # members of each cluster (nested ones included)
    title: tuple[float, float] = (0.0, 0.0)
    boxes: set[str] = field(default_factory=set)  # collapsed layers (``box3d`` nodes)

    def ranks(self) -> dict[str, int]:
        """Longest-path rank of every node (edges with ``constraint=false`` do not count)."""
        succ: dict[str, list[str]] = defaultdict(list)
        indeg = {n: 0 for n in self.nodes}
        for t, h, _w, _h, constrains in self.edges:
            if constrains and t in indeg and h in indeg and t != h:
                succ[t].append(h)
                indeg[h] += 1
        rank = {n: 0 for n in self.nodes}
        ready = [n for n, d in indeg.items() if d == 0]
        seen = 0
        while ready:
            n = ready.pop()
            seen += 1
            for m in succ[n]:
                rank[m] = max(rank[m], rank[n] + 1)
                indeg[m] -= 1
                if indeg[m] == 0:
                    ready.append(m)
        return rank  # a cycle (never in a backward graph) leaves its nodes at their partial ranks

    def positions(self, rankdir: str | None = None) -> dict[str, float]:
        """Predicted distance (inches) of every node from the start of the rank axis, unwrapped."""
        rd = rankdir or self.rankdir
        tb = rd in ("TB", "BT")
        rank = self.ranks()
        ext: dict[int, float] = defaultdict(float)
        for n, (w, h) in self.nodes.items():
            ext[rank[n]] = max(ext[rank[n]], h if tb else w)
        gap: dict[int, float] = defaultdict(float)
        for t, hd, lw, lh, _c in self.edges:
            if t in rank and (lw or lh):
                gap[rank[t]] = max(gap[rank[t]], lh if tb else lw)
        start, at = {}, 0.0
        for r in sorted(ext):
            start[r] = at
            at += ext[r] + self.ranksep + (gap[r] + self.ranksep if gap[r] else 0.0)
        return {n: start[rank[n]] for n in self.nodes}

    def min_area(self) -> float:
        """Square inches no layout of this drawing can be smaller than, in any direction or
        rows: every node with the least separation ``dot`` keeps from its neighbours
        (``nodesep`` within a rank, ``ranksep`` between ranks)."""
        sep = min(self.nodesep, self.ranksep)
        return sum((w + sep) * (h + sep) for w, h in self.nodes.values())

    def estimate(self, rankdir: str | None = None, bands: dict[str, int] | None = None) -> tuple[float, float]:
        """Predicted (width, height) in inches, laid out in ``rankdir`` (default the source's),
        optionally wrapped into ``bands`` (node -> band; bands stacked across the ranks)."""
        rd = rankdir or self.rankdir
        tb = rd in ("TB", "BT")
        rank = self.ranks()
        if bands:
            rank = _restart(rank, bands)
        band_of = bands or {}
        # along: the extent of a node along the rank axis; across: its extent across it
        along: dict[tuple[int, int], float] = defaultdict(float)
        across: dict[tuple[int, int], float] = defaultdict(float)
        counts: dict[tuple[int, int], int] = defaultdict(int)
        deep: dict[tuple[int, int], int] = defaultdict(int)
        for n, (w, h) in self.nodes.items():
            key = (band_of.get(n, 0), rank.get(n, 0))
            a, c = (h, w) if tb else (w, h)
            along[key] = max(along[key], a)
            across[key] += c
            counts[key] += 1
            deep[key] = max(deep[key], self.depth.get(n, 0))
        gap: dict[tuple[int, int], float] = defaultdict(float)  # the tallest edge label after a rank
        gap_across: dict[tuple[int, int], float] = defaultdict(float)
        for t, hd, lw, lh, constrains in self.edges:
            if t not in self.nodes or hd not in self.nodes or (lw == 0 and lh == 0):
                continue
            if band_of.get(t, 0) != band_of.get(hd, 0):
                continue
            key = (band_of.get(t, 0), rank.get(t, 0))
            a, c = (lh, lw) if tb else (lw, lh)
            gap[key] = max(gap[key], a)
            gap_across[key] += c + self.nodesep
        nbands = max(band_of.values(), default=0) + 1
        lengths, widths = [], []
        for b in range(nbands):
            rs = sorted(r for (bb, r) in along if bb == b)
            if not rs:
                continue
            length = sum(along[(b, r)] for r in rs) + self.ranksep * (len(rs) - 1)
            length += sum(gap[(b, r)] + (self.ranksep if gap[(b, r)] else 0) for r in rs[:-1])
            width = max(
                max(across[(b, r)] + self.nodesep * (counts[(b, r)] - 1) + 2 * _CLUSTER_PAD * deep[(b, r)]
                    for r in rs),
                max((gap_across[(b, r)] for r in rs), default=0.0),
            )
            lengths.append(length)
            widths.append(width)
        length = max(lengths, default=0.0) * ALONG_FACTOR
        width = (sum(widths) + self.nodesep * 2 * (len(widths) - 1)) * ACROSS_FACTOR.get(rd, 1.2)
        tw, th = self.title
        if tb:
            return max(width, tw), length + th
        return max(length, tw), width + th


def _restart(rank: dict[str, int], bands: dict[str, int]) -> dict[str, int]:
    """Ranks inside each band, counted from the band's first rank."""
    first: dict[int, int] = {}
    for n, b in bands.items():
        if n in rank:
            first[b] = min(first.get(b, rank[n]), rank[n])
    return {n: r - first.get(bands.get(n, 0), 0) for n, r in rank.items()}


def _attrs(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in _ATTR.finditer(text)}


def _label_lines(raw: str | None) -> list[str]:
    if raw is None:
        return []
    if raw.startswith("<"):  # an HTML-like label: one line per table row or <BR/>
        body = re.sub(r"(?i)<BR\s*/?>|</TR>", "\n", raw[1:-1])
        return [t for t in (_TAG.sub("", ln).strip() for ln in body.split("\n")) if t] or [""]
    s = raw[1:-1] if raw.startswith('"') else raw
    s = re.sub(r"\\[lr]", "\\n", s).replace('\\"', '"').replace("\\\\", "\\")
    return s.split("\\n")


def _text_size(lines: list[str], fontsize: float) -> tuple[float, float]:
    if not lines:
        return 0.0, 0.0
    em = fontsize / 72
    return max(len(ln) for ln in lines) * _CHAR_EM * em, len(lines) * _LINE_EM * em


def _num(v: str | None, default: float) -> float:
    try:
        return float(v.strip('"')) if v is not None else default
    except ValueError:
        return default


def read_dot(source: str) -> DotSizes:
    """The node and label sizes of DOT ``source`` as written by ``render/dot.py``.

    Examples:
        >>> s = read_dot('digraph {\\n  a [label="Conv2d"]\\n  b [label="x"]\\n  a -> b [label="[2, 3]"]\\n}')
        >>> sorted(s.nodes), s.ranks()
        (['a', 'b'], {'a': 0, 'b': 1})
    """
    out = DotSizes()
    node_font, edge_font, node_margin, node_h = 14.0, 14.0, (0.11, 0.055), 0.5
    stack: list[int] = []
    for line in source.split("\n"):
        s = line.strip()
        if s.startswith("subgraph cluster"):
            out.clusters.append(set())
            stack.append(len(out.clusters) - 1)
            continue
        if s == "}" and stack:
            stack.pop()
            continue
        if s.startswith(("graph [", "node [", "edge [")):
            a = _attrs(s[s.index("[") + 1:-1])
            if s.startswith("graph"):
                out.rankdir = a.get("rankdir", '"TB"').strip('"')
                out.nodesep = _num(a.get("nodesep"), 0.25)
                out.ranksep = _num(a.get("ranksep"), 0.5)
                if "label" in a:
                    out.title = _text_size(_label_lines(a["label"]), _num(a.get("fontsize"), 14.0))
            elif s.startswith("node"):
                node_font = _num(a.get("fontsize"), node_font)
                node_h = _num(a.get("height"), node_h)
                if "margin" in a:
                    m = a["margin"].strip('"').split(",")
                    node_margin = (float(m[0]), float(m[-1]))
            else:
                edge_font = _num(a.get("fontsize"), edge_font)
            continue
        if stack and s.startswith("label="):  # a cluster's own label adds a line along the ranks
            continue
        m = _EDGE.match(line)
        if m:
            a = _attrs(m.group(3) or "")
            lw, lh = _text_size(_label_lines(a.get("label")), _num(a.get("fontsize"), edge_font))
            out.edges.append((m.group(1).strip('"'), m.group(2).strip('"'), lw, lh,
                              a.get("constraint", "true").strip('"') != "false"))
            continue
        m = _NODE.match(line)
        if m and m.group(1) not in ("graph", "node", "edge"):
            a = _attrs(m.group(2))
            if a.get("style", "").strip('"') == "invis" and "label" not in a:
                continue
            fs = _num(a.get("fontsize"), node_font)
            tw, th = _text_size(_label_lines(a.get("label", '"x"')), fs)
            mx, my = node_margin
            if "margin" in a:
                mm = a["margin"].strip('"').split(",")
                mx, my = float(mm[0]), float(mm[-1])
            shape = a.get("shape", "").strip('"')
            w, h = tw + 2 * mx, max(node_h, th + 2 * my)
            if shape == "ellipse" or not shape:
                w, h = w * 1.42, h * 1.42
            if shape == "box3d":
                w, h = w + 0.06, h + 0.06
                out.boxes.add(m.group(1).strip('"'))
            name = m.group(1).strip('"')
            out.nodes[name] = (max(w, 0.75 if shape != "point" else 0.05), h)
            out.depth[name] = len(stack)
            for c in stack:
                out.clusters[c].add(name)
    return out
