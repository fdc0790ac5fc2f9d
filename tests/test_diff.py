"""Diffs of real captures: stable keys, structure changes, frozen layers, NaN origins, drawings."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import textwrap

import paddle
import pytest

from paddleviz_hooks import capture_backward
from paddleviz_hooks.diff import GraphDiff, diff_graphs
from paddleviz_hooks.graph import BackwardGraph
from paddleviz_hooks.render import png_size
from paddleviz_hooks.render.diff import diff_to_dot, render_diff, render_diff_png
from paddleviz_hooks.render.engine import find_engine
from paddleviz_hooks import summarize

F = paddle.nn.functional
needs_engine = pytest.mark.skipif(find_engine() is None, reason="no Graphviz layout engine installed")

# The model of the key-stability test, also run in a second process.
ODD_MODEL = textwrap.dedent(
    """
    import paddle
    F = paddle.nn.functional

    class OddNet(paddle.nn.Layer):
        '''fc1 -> relu -> (extra, on odd steps only) -> fc2.'''

        def __init__(self):
            super().__init__()
            self.fc1 = paddle.nn.Linear(4, 8)
            self.extra = paddle.nn.Linear(8, 8)
            self.fc2 = paddle.nn.Linear(8, 2)

        def forward(self, x, step):
            h = F.relu(self.fc1(x))
            if step % 2:
                h = self.extra(h)
            return self.fc2(h)

    def capture_odd(steps):
        from paddleviz_hooks import capture_backward
        paddle.seed(7)
        model = OddNet()
        x = paddle.randn([3, 4])
        with capture_backward(model) as cap:
            for step in range(steps):
                loss = model(x, step).mean()
                loss.backward()
                model.clear_gradients()
        for i, g in enumerate(cap.graphs):
            g.meta["step"] = i
        return cap.graphs
    """
)
_ns: dict = {}
exec(compile(ODD_MODEL, "<odd-model>", "exec"), _ns)
capture_odd = _ns["capture_odd"]

# Keys without their signature suffix (``op:extra[0]/Matmul#df082a`` -> ``op:extra[0]/Matmul``).
EXTRA_NODES = {"op:extra[0]/Matmul", "op:extra[0]/Add", "param:extra.weight", "param:extra.bias"}
EXTRA_EDGES_ADDED = {
    ("op:fc2[0]/Matmul", "op:extra[0]/Add"),
    ("op:extra[0]/Add", "op:extra[0]/Matmul"),
    ("op:extra[0]/Add", "param:extra.bias"),
    ("op:extra[0]/Matmul", "op:<top>[0]/Relu"),
    ("op:extra[0]/Matmul", "param:extra.weight"),
}
EXTRA_EDGES_REMOVED = {("op:fc2[0]/Matmul", "op:<top>[0]/Relu")}


def keys(g: BackwardGraph) -> set[str]:
    return {n.key for n in g.nodes}


def base(key: str) -> str:
    """A key without its signature: ``op:<layer>[call]/<Op>``."""
    return key.split("#")[0]


def bases(items) -> list:
    """``base`` of each key (or of both keys of each edge), sorted: duplicates stay visible."""
    return sorted(tuple(base(k) for k in i) if isinstance(i, tuple) else base(i) for i in items)


def op_key(g: BackwardGraph, prefix: str) -> str:
    """The key of the one op of ``g`` whose key starts with ``prefix`` (``op:block[0]/Sqrt``)."""
    found = [n.key for n in g.nodes if base(n.key) == prefix]
    assert len(found) == 1, (prefix, found)
    return found[0]


def edge_keys(g: BackwardGraph) -> set[tuple[str, str]]:
    return {(g.nodes[e.src].key, g.nodes[e.dst].key) for e in g.edges}


@pytest.fixture(scope="module")
def odd():
    return capture_odd(5)


# ------------------------------------------------------------------ stable keys
def test_same_structure_gives_identical_keys(odd):
    assert len(keys(odd[0])) == len(odd[0].nodes)  # keys are unique
    assert keys(odd[0]) == keys(odd[2]) == keys(odd[4])
    assert keys(odd[1]) == keys(odd[3])
    assert edge_keys(odd[0]) == edge_keys(odd[2])
    assert not any("0x" in k for k in keys(odd[1]))  # no addresses in keys


def test_keys_identical_across_processes(odd):
    script = ODD_MODEL + textwrap.dedent(
        """
        import json
        gs = capture_odd(2)
        print("KEYS=" + json.dumps([sorted(n.key for n in g.nodes) for g in gs]
                                   + [sorted([g.nodes[e.src].key, g.nodes[e.dst].key] for e in g.edges) for g in gs]))
        """
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")  # a different hash seed must not matter
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("KEYS=")][0]
    other = json.loads(line[len("KEYS="):])
    assert other[0] == sorted(keys(odd[0]))
    assert other[1] == sorted(keys(odd[1]))
    assert other[2] == sorted([list(e) for e in edge_keys(odd[0])])
    assert other[3] == sorted([list(e) for e in edge_keys(odd[1])])


def test_keys_stable_when_one_branch_grows():
    """Ops inserted on one branch must not renumber same-named ops on another."""

    class Branches(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.a = paddle.nn.Linear(4, 4)
            self.b = paddle.nn.Linear(4, 4)
            self.extra = paddle.nn.Linear(4, 4)

        def forward(self, x, grow):
            ha = F.relu(self.a(x))
            hb = F.relu(self.b(x))
            if grow:
                ha = self.extra(ha)
            return ha.mean() + hb.mean()

    paddle.seed(1)
    m = Branches()
    x = paddle.randn([2, 4])
    with capture_backward(m) as cap:
        for grow in (False, True):
            m(x, grow).backward()
            m.clear_gradients()
    g0, g1 = cap.graphs
    d = diff_graphs(g0, g1)
    assert bases(d.added_nodes) == sorted(EXTRA_NODES)
    assert d.removed_nodes == []
    # the only edge that went away is the one the extra block was put into
    assert len(d.removed_edges) == 1 and d.removed_edges[0][0].startswith("op:<top>[0]/Mean")
    a_add = op_key(g0, "op:a[0]/Add")
    relu_to_a = {s for s, t in edge_keys(g0) if t == a_add}
    assert relu_to_a == {s for s, t in edge_keys(g1) if t == a_add}


# ------------------------------------------------------------ structure changes
def test_diff_reports_exactly_the_extra_block(odd):
    d = diff_graphs(odd[0], odd[1])
    assert bases(d.added_nodes) == sorted(EXTRA_NODES)
    assert d.removed_nodes == []
    assert bases(d.added_edges) == sorted(EXTRA_EDGES_ADDED)
    assert bases(d.removed_edges) == sorted(EXTRA_EDGES_REMOVED)
    assert set(d.params_started) == {"extra.weight", "extra.bias"}
    assert d.params_stopped == []
    assert d.structure_changed
    s = summarize(d)
    assert s.splitlines()[0] == "step 1 vs step 0:"
    assert "new ops: " in s and "Matmul in extra" in s and "Add in extra" in s
    assert "parameters now receiving gradient:" in s

    back = diff_graphs(odd[1], odd[2])
    assert bases(back.removed_nodes) == sorted(EXTRA_NODES)
    assert back.added_nodes == []
    assert bases(back.removed_edges) == sorted(EXTRA_EDGES_ADDED)
    assert bases(back.added_edges) == sorted(EXTRA_EDGES_REMOVED)
    assert set(back.params_stopped) == {"extra.weight", "extra.bias"}
    assert "ops gone: " in summarize(back)


def test_same_structure_reports_nothing(odd):
    for a, b in ((0, 2), (1, 3), (2, 4)):
        d = diff_graphs(odd[a], odd[b])
        assert not d.structure_changed
        assert (d.added_nodes, d.removed_nodes, d.added_edges, d.removed_edges) == ([], [], [], [])
        assert (d.params_started, d.params_stopped, d.new_nonfinite, d.resolved_nonfinite) == ([], [], [], [])
        assert d.first_nonfinite is None
        assert "same graph structure;" in summarize(d)
        assert set(d.node_norm_ratios) <= keys(odd[b])
        assert all(r > 0 for r in d.node_norm_ratios.values())


def test_diff_json_round_trip(odd, tmp_path):
    d = diff_graphs(odd[0], odd[1])
    again = GraphDiff.from_json(d.to_json())
    assert again == d
    # from saved graph files, as the CLI does
    loaded = [BackwardGraph.from_json(g.to_json()) for g in odd[:2]]
    assert diff_graphs(*loaded) == d
    with pytest.raises(ValueError, match="not a paddleviz-hooks graph diff"):
        GraphDiff.from_json(odd[0].to_json())
    with pytest.raises(ValueError, match="not JSON"):
        GraphDiff.from_json("{nope")


def test_summary_lines_are_short_facts(odd):
    s = summarize(diff_graphs(odd[0], odd[1]))
    for line in s.splitlines():
        assert len(line) <= 160
        assert line.endswith((";", ":"))
    assert "  " not in " ".join(s.splitlines())  # still reads when VisualDL joins lines


def test_bad_arguments(odd):
    with pytest.raises(TypeError, match="older must be a BackwardGraph"):
        diff_graphs("x", odd[0])
    with pytest.raises(ValueError, match="threshold"):
        diff_graphs(odd[0], odd[1], threshold=0.5)


# ----------------------------------------------------------------- frozen layer
def test_frozen_layer_stops_receiving_gradient():
    paddle.seed(3)
    model = paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.ReLU(), paddle.nn.Linear(8, 8),
                                 paddle.nn.ReLU(), paddle.nn.Linear(8, 2))
    x = paddle.randn([3, 4])
    k = 2
    with capture_backward(model) as cap:
        for step in range(4):
            if step == k:
                for p in model[2].parameters():
                    p.stop_gradient = True
            model(x).mean().backward()
            model.clear_gradients()
    g = cap.graphs
    assert not diff_graphs(g[0], g[1]).structure_changed
    d = diff_graphs(g[k - 1], g[k])
    assert set(d.params_stopped) == {"2.weight", "2.bias"}
    assert d.params_started == []
    assert set(d.removed_nodes) == {"param:2.weight", "param:2.bias"}
    assert d.added_nodes == []
    assert d.structure_changed
    assert "parameters no longer receiving gradient:" in summarize(d)
    assert "2.weight" in summarize(d) and "2.bias" in summarize(d)
    assert not diff_graphs(g[k], g[k + 1]).structure_changed


# ------------------------------------------------------------------------ NaN
class Block(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = paddle.nn.Linear(4, 8)

    def forward(self, x, shift):
        return paddle.sqrt(F.relu(self.fc(x)) + 1.0 - shift)


class NanNet(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = paddle.nn.Linear(8, 2)

    def forward(self, x, shift=0.0):
        return self.head(self.block(x, shift))


@pytest.fixture(scope="module")
def nan_graphs():
    paddle.seed(5)
    model = NanNet()
    x = paddle.randn([3, 4])
    with capture_backward(model) as cap:
        for step in range(4):
            # at step 2 the sqrt's argument is driven negative
            model(x, 1000.0 if step == 2 else 0.0).mean().backward()
            model.clear_gradients()
    for i, g in enumerate(cap.graphs):
        g.meta["step"] = i
    return cap.graphs


def test_nan_diff_names_the_sqrt(nan_graphs):
    g = nan_graphs
    assert g[2].nonfinite_count() > 0
    d = diff_graphs(g[1], g[2])
    assert not d.structure_changed
    assert d.first_nonfinite is not None
    sqrt = op_key(g[2], "op:block[0]/Sqrt")
    assert d.first_nonfinite["key"] == sqrt
    assert d.first_nonfinite["op"] == "Sqrt" and d.first_nonfinite["layer"] == "block"
    assert d.new_nonfinite[0] == sqrt
    # the head's Matmul also produced a NaN (its weight gradient, from NaN
    # activations) and comes first in gradient-flow order; it is not the origin
    assert op_key(g[2], "op:head[0]/Matmul") in d.new_nonfinite
    assert g[2].nonfinite_sites()[0].key == sqrt
    s = summarize(d)
    assert "NaN/Inf gradients appeared at" in s
    assert f"first non-finite gradient at Sqrt in block (node {sqrt});" in s
    assert "first non-finite gradient at Sqrt in block" in summarize(g[2])

    healed = diff_graphs(g[2], g[3])
    assert healed.first_nonfinite is None and healed.new_nonfinite == []
    assert set(healed.resolved_nonfinite) == set(d.new_nonfinite)
    assert "NaN/Inf gradients gone from" in summarize(healed)
    assert GraphDiff.from_json(d.to_json()) == d


# ----------------------------------------------------------- gradient norms
def test_norm_ratios_when_the_loss_is_scaled(nan_graphs):
    paddle.seed(5)
    model = NanNet()
    x = paddle.randn([3, 4])
    with capture_backward(model) as cap:
        model(x).mean().backward()
        model.clear_gradients()
        # the same graph, with 1000 times the gradient everywhere
        model(x).mean().backward(paddle.to_tensor(1000.0))
    d = diff_graphs(cap.graphs[0], cap.graphs[1])
    assert not d.structure_changed
    assert set(d.layer_norm_ratios) == {"block.fc", "head"}
    for r in list(d.layer_norm_ratios.values()) + [d.global_norm_ratio]:
        assert math.isclose(r, 1000.0, rel_tol=1e-3)
    big = d.large_node_changes()
    assert "param:head.weight" in big and op_key(cap.graphs[1], "op:block[0]/Sqrt") in big
    assert "global grad norm x1000;" in summarize(d)
    assert "layer head grad norm x1000;" in summarize(d)
    assert d.changed
    src = diff_to_dot(d, cap.graphs[1], cap.graphs[0])
    assert src.count("pvh-ratio-up") >= 5 and "x1000" in src
    down = diff_graphs(cap.graphs[1], cap.graphs[0])
    assert "pvh-ratio-down" in diff_to_dot(down, cap.graphs[0], cap.graphs[1])
    assert math.isclose(down.global_norm_ratio, 1e-3, rel_tol=1e-3)


# -------------------------------------------------------------------- drawings
def test_diff_dot_marks_added_and_ghosts_removed(odd):
    d = diff_graphs(odd[0], odd[1])
    src = diff_to_dot(d, odd[1], odd[0])
    assert src.count('class="pvh-added"') == len(EXTRA_NODES) + len(EXTRA_EDGES_ADDED)
    assert "ghost" not in src.replace("(ghost)", "")  # nothing removed
    assert "diff_legend" in src and "changes from step 0 to step 1" in src

    back = diff_graphs(odd[1], odd[2])
    src = diff_to_dot(back, odd[2], odd[1])
    ghosts = [l for l in src.splitlines() if l.strip().startswith("ghost") and "->" not in l]
    assert len(ghosts) == len(EXTRA_NODES)
    assert all("(removed)" in l and "dashed" in l for l in ghosts)
    # a ghost names what it was and where (never an internal id): "Matmul\nin extra\n(removed)"
    ops = [l for l in ghosts if "extra.weight" not in l and "extra.bias" not in l]
    assert len(ops) == 2 and all(re.search(r'label="(Matmul|Add)\\nin extra\\n\(removed\)"', l) for l in ops), ops
    assert src.count('class="pvh-removed"') == len(EXTRA_NODES) + len(EXTRA_EDGES_ADDED)
    with pytest.raises(TypeError):
        diff_to_dot(odd[0], odd[2], odd[1])


def _legend_lines(src: str) -> dict[str, str]:
    """Legend node name -> its DOT line, for the diff legends of ``src``."""
    return {l.split()[0]: l for l in src.splitlines() if l.strip().startswith("diff_legend")}


def test_diff_legend_lists_only_what_is_drawn(odd):
    """The diff legend names only the marks the drawing has: a structure change without large
    gradient-norm changes lists no norm colours, a norm change alone no added/removed; the norm
    colours have a legend of their own (class pvh-norm-legend) that a viewer can hide with them."""
    d = diff_graphs(odd[0], odd[1])
    src = diff_to_dot(d, odd[1], odd[0])
    assert "pvh-ratio" not in src  # no gradient norm coloured in this diff
    legends = _legend_lines(src)
    assert list(legends) == ["diff_legend"]
    assert "added since step 0" in legends["diff_legend"] and "grad norm" not in src
    assert "diff_legend" not in diff_to_dot(d, odd[1], odd[0], legend=False)

    paddle.seed(0)
    net = paddle.nn.Sequential(paddle.nn.Linear(4, 3), paddle.nn.Tanh(), paddle.nn.Linear(3, 2))
    x = paddle.randn([2, 4])
    with capture_backward(net) as cap:
        for scale in (1.0, 1000.0):
            (net(x).sum() * scale).backward()
    up = diff_graphs(cap.graphs[0], cap.graphs[1])
    legends = _legend_lines(diff_to_dot(up, cap.graphs[1], cap.graphs[0]))
    assert list(legends) == ["diff_legend_norms"], legends
    assert 'class="pvh-norm-legend"' in legends["diff_legend_norms"]
    assert "grad norm up over 10x" in legends["diff_legend_norms"] and "down" not in legends["diff_legend_norms"]


@pytest.mark.skipif(importlib.util.find_spec("paddleviz_hooks.collapse") is None,
                    reason="render/collapse.py not present")
def test_collapsed_diff_marks_the_new_layer_box(odd):
    d = diff_graphs(odd[0], odd[1])
    for opts in ({"depth": 1}, {"max_nodes": 8}):
        src = diff_to_dot(d, odd[1], odd[0], **opts)
        boxes = [l for l in src.splitlines() if "pvh-added" in l and "->" not in l]
        assert len(boxes) == 1 and "key: layer:extra" in boxes[0] and "box3d" in boxes[0], boxes
        assert src.count('class="pvh-added"') == 3  # the box and its two edges
    back = diff_graphs(odd[1], odd[2])
    src = diff_to_dot(back, odd[2], odd[1], depth=1)
    ghosts = [l for l in src.splitlines() if l.strip().startswith("ghost") and "->" not in l]
    assert len(ghosts) == 1 and "extra" in ghosts[0]


@needs_engine
def test_render_diff_files(odd, tmp_path):
    back = diff_graphs(odd[1], odd[2])
    svg = render_diff(back, odd[2], odd[1], format="svg")
    assert isinstance(svg, bytes) and b"<svg" in svg
    assert svg.count(b"pvh&#45;removed") + svg.count(b"pvh-removed") >= len(EXTRA_NODES)
    png = render_diff(diff_graphs(odd[0], odd[1]), odd[1], odd[0], tmp_path / "d.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    out = render_diff(back, odd[2], odd[1], str(tmp_path / "d.json"))
    with open(out) as f:
        assert GraphDiff.from_json(f.read()) == back
    with pytest.raises(ValueError, match="format must be one of"):
        render_diff(back, odd[2], odd[1], str(tmp_path / "d.gif"))
    # what the callback calls: a PNG sized for VisualDL, collapsed to a node budget
    data = render_diff_png(diff_graphs(odd[0], odd[1]), odd[1], odd[0], max_px=400, max_nodes=8)
    assert max(png_size(data)) <= 400
    with pytest.raises(FileNotFoundError):
        render_diff(back, odd[2], odd[1], str(tmp_path / "missing" / "d.svg"))


def test_a_cycle_in_a_collapsed_graph_still_lists_every_removed_node():
    """Layer boxes can form a cycle (a box whose ops run before and after another box):
    the nodes on and after it are still ordered, so a removed one is listed."""
    from paddleviz_hooks.graph import Edge, Node

    def graph(with_tail: bool) -> BackwardGraph:
        nodes = [Node(0, "root", "loss", "loss"), Node(1, "op", "AGradNode", "A", layer="a"),
                 Node(2, "op", "BGradNode", "B", layer="b")]
        edges = [Edge(0, 1), Edge(1, 2), Edge(2, 1)]
        if with_tail:
            nodes.append(Node(3, "op", "CGradNode", "C", layer="c"))
            edges.append(Edge(2, 3))
        g = BackwardGraph(nodes, edges)
        g.assign_keys()
        return g

    old, new = graph(True), graph(False)
    assert old.topo_order() == [0, 1, 2, 3]
    d = diff_graphs(old, new)
    assert [old.node_by_key()[k].op for k in d.removed_nodes] == ["C"]
