"""Keys that survive insertions: diffs of real models with one branch, call or layer more or less.

Each case captures the same model (same parameters) without and with the
change and asserts the exact sets of added and removed nodes (keys without
their signature suffix), both ways.
"""

from __future__ import annotations

import re
import time

import paddle
import pytest

from paddleviz_hooks import capture_backward, summarize
from paddleviz_hooks.diff import diff_graphs
from paddleviz_hooks.graph import BackwardGraph, Edge, Node
from paddleviz_hooks.render.diff import diff_to_dot, render_diff, render_diff_png
from paddleviz_hooks.render.engine import find_engine
from paddleviz_hooks.text import collapse_note

F = paddle.nn.functional
nn = paddle.nn
needs_engine = pytest.mark.skipif(find_engine() is None, reason="no Graphviz layout engine installed")


def base(key: str) -> str:
    """A key without its signature: ``op:<layer>[call]/<Op>``."""
    return key.split("#")[0]


def bases(keys) -> list[str]:
    return sorted(base(k) for k in keys)


def capture(model: nn.Layer, x: paddle.Tensor, switch) -> tuple[BackwardGraph, BackwardGraph]:
    """Graphs of one step without and one with ``switch(True)`` (same parameters)."""
    with capture_backward(model) as cap:
        for on in (False, True):
            switch(on)
            model(x).mean().backward()
            model.clear_gradients()
    graphs = cap.graphs
    for i, g in enumerate(graphs):
        g.meta["step"] = i
    return graphs[0], graphs[1]


def check_both_ways(g0: BackwardGraph, g1: BackwardGraph, expected: list[str]) -> None:
    """The change is exactly ``expected`` added (and removed, the other way); nothing else moves."""
    d = diff_graphs(g0, g1)
    assert bases(d.added_nodes) == sorted(expected)
    assert d.removed_nodes == []
    added = set(d.added_nodes)
    assert all(a in added or b in added for a, b in d.added_edges), d.added_edges
    # only edges into the node the branch was put after go away (its consumers now take the join)
    assert len({b for _, b in d.removed_edges}) <= 1
    new_params = sorted(k[len("param:"):] for k in expected if k.startswith("param:"))
    assert sorted(d.params_started) == new_params and d.params_stopped == []

    back = diff_graphs(g1, g0)
    assert bases(back.removed_nodes) == sorted(expected)
    assert back.added_nodes == []
    removed = set(back.removed_nodes)
    assert all(a in removed or b in removed for a, b in back.removed_edges), back.removed_edges
    assert sorted(back.params_stopped) == new_params and back.params_started == []


# --------------------------------------------------------------- a branch put in
class Body(nn.Layer):
    """fc1 + fc0, two residual steps (tanh, relu), fc2, with ``h = h + adapter(h)`` put where ``at`` says.

    The three Adds are ops of the same layer and op as the Add joining the adapter.
    """

    def __init__(self):
        super().__init__()
        self.fc0 = nn.Linear(4, 8)
        self.fc1 = nn.Linear(4, 8)
        self.adapter = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.at = None

    def forward(self, x):
        h = self.fc1(x) + self.fc0(x)
        if self.at == "before":
            h = h + self.adapter(h)
        h = paddle.tanh(h) + h
        if self.at == "between":
            h = h + self.adapter(h)
        h = F.relu(h) + h
        if self.at == "after":
            h = h + self.adapter(h)
        return self.fc2(h)


class Wrapped(nn.Layer):
    """The same body as a sublayer, with a head."""

    def __init__(self):
        super().__init__()
        self.body = Body()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(F.relu(self.body(x)))


def branch(layer: str, adapter: str) -> list[str]:
    """What an adapter branch adds: the adapter's ops and parameters, and the Add joining it."""
    return [f"op:{layer}[0]/Add", f"op:{adapter}[0]/Matmul", f"op:{adapter}[0]/Add",
            f"param:{adapter}.weight", f"param:{adapter}.bias"]


@pytest.mark.parametrize("where", ["top", "sublayer"])
@pytest.mark.parametrize("at", ["before", "between", "after"])
def test_a_branch_put_in_is_exactly_what_changes(where, at):
    paddle.seed(11)
    model = Body() if where == "top" else Wrapped()
    body = model if where == "top" else model.body
    g0, g1 = capture(model, paddle.randn([2, 4]), lambda on: setattr(body, "at", at if on else None))
    if where == "top":
        check_both_ways(g0, g1, branch("<top>", "adapter"))
    else:
        check_both_ways(g0, g1, branch("body", "body.adapter"))


def test_the_op_after_an_insertion_in_its_layer_call_is_the_same_node():
    """Its key names its inputs, so it changes; the diff pairs it by its neighbours."""
    paddle.seed(11)
    model = Body()
    g0, g1 = capture(model, paddle.randn([2, 4]), lambda on: setattr(model, "at", "between" if on else None))
    relu0 = next(n.key for n in g0.nodes if n.op == "Relu")
    relu1 = next(n.key for n in g1.nodes if n.op == "Relu")
    assert relu0 != relu1
    d = diff_graphs(g0, g1)
    assert d.renamed[relu0] == relu1
    assert "2 ops kept under a new key (an input in its layer or its call index changed);" in summarize(d)
    # the residual Add after the Relu too (its signature reaches three ops back)
    assert sorted(base(k) for k in d.renamed) == ["op:<top>[0]/Add", "op:<top>[0]/Relu"]
    assert relu1 in d.node_norm_ratios  # its gradient norm is still compared


# ---------------------------------------------------------- a layer called more
class SharedAct(nn.Layer):
    """One ReLU layer used after fc1 and after fc2; ``extra`` uses it once more."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 2)
        self.act = nn.ReLU()
        self.extra = None

    def forward(self, x):
        a = self.act(self.fc1(x))
        if self.extra == "between":
            a = self.act(a)  # a call between the others: the last call's index goes from 1 to 2
        out = self.fc3(self.act(self.fc2(a)))
        if self.extra == "end":
            out = self.act(out)
        return out


@pytest.mark.parametrize("extra, new_call", [("between", 1), ("end", 2)])
def test_a_layer_called_once_more(extra, new_call):
    paddle.seed(12)
    model = SharedAct()
    g0, g1 = capture(model, paddle.randn([2, 4]), lambda on: setattr(model, "extra", extra if on else None))
    check_both_ways(g0, g1, [f"op:act[{new_call}]/Relu"])
    shifted = {base(k): base(v) for k, v in diff_graphs(g0, g1).renamed.items()}
    if extra == "between":  # the call after fc2 was call 1 and is call 2 now: the same node
        assert shifted == {"op:act[1]/Relu": "op:act[2]/Relu"}
    else:  # no call shifts; the loss's Mean takes act's output now instead of fc3's: the same node
        assert shifted == {"op:?[0]/Mean": "op:?[0]/Mean"}


# ------------------------------------------------------------- a layer removed
class Optional(nn.Layer):
    """A residual LayerNorm step between two other Adds of the same layer; it can be left out."""

    def __init__(self):
        super().__init__()
        self.fc0 = nn.Linear(4, 8)
        self.fc1 = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.fc2 = nn.Linear(8, 2)
        self.use_norm = True

    def forward(self, x):
        h = self.fc1(x) + self.fc0(x)
        if self.use_norm:
            h = h + self.norm(h)
        h = h + F.gelu(h)
        return self.fc2(h)


def test_a_layer_removed():
    paddle.seed(13)
    model = Optional()
    g_with, g_without = capture(model, paddle.randn([2, 4]), lambda on: setattr(model, "use_norm", not on))
    norm = ["op:<top>[0]/Add", "op:norm[0]/LayerNorm", "param:norm.bias", "param:norm.weight"]
    d = diff_graphs(g_with, g_without)
    assert bases(d.removed_nodes) == norm and d.added_nodes == []
    assert sorted(d.params_stopped) == ["norm.bias", "norm.weight"]
    check_both_ways(g_without, g_with, norm)


# ------------------------------------------------- embedding + position + adapter
class AdapterNet(nn.Layer):
    """``x = emb(ids) + pos(ids)``, then ``x = x + adapter(x)`` when switched on, an encoder, a head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.pos = nn.Embedding(50, 16)
        self.adapter = nn.Sequential(nn.Linear(16, 4), nn.ReLU(), nn.Linear(4, 16))
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 2)
        self.head = nn.Linear(16, 3)
        self.use_adapter = False

    def forward(self, ids):
        x = self.emb(ids) + self.pos(ids)
        if self.use_adapter:
            x = x + self.adapter(x)
        return self.head(self.encoder(x))


ADAPTER = ["op:<top>[0]/Add", "op:adapter.0[0]/Matmul", "op:adapter.0[0]/Add", "op:adapter.1[0]/Relu",
           "op:adapter.2[0]/Matmul", "op:adapter.2[0]/Add", "param:adapter.0.weight", "param:adapter.0.bias",
           "param:adapter.2.weight", "param:adapter.2.bias"]


@pytest.fixture(scope="module")
def adapter_graphs():
    paddle.seed(14)
    model = AdapterNet()
    ids = paddle.randint(0, 50, [2, 5])
    return capture(model, ids, lambda on: setattr(model, "use_adapter", on))


def test_adapter_after_embedding_and_position(adapter_graphs):
    g0, g1 = adapter_graphs
    check_both_ways(g0, g1, ADAPTER)
    # the embedding + position Add is the same node in both
    emb_add = [n.key for n in g0.nodes if n.op == "Add" and n.layer == ""]
    assert len(emb_add) == 1 and emb_add[0] in {n.key for n in g1.nodes}


def _declared_and_used(src: str) -> tuple[set[str], set[str]]:
    declared = set(re.findall(r"^\s*(\w+) \[label=", src, flags=re.M))
    used = {a for pair in re.findall(r"^\s*(\w+) -> (\w+) \[", src, flags=re.M) for a in pair}
    return declared, used


def test_collapsed_adapter_diff_marks_the_adapter_box_and_the_join(adapter_graphs):
    g0, g1 = adapter_graphs
    src = diff_to_dot(diff_graphs(g0, g1), g1, g0, depth=1)
    marked = [l for l in src.splitlines() if "pvh-added" in l and "->" not in l]
    tips = sorted(re.search(r"key: ([^\"|]+?) ?[\"|]", l).group(1) for l in marked)
    assert [base(k) for k in tips] == ["layer:adapter", "op:<top>[0]/Add"]
    assert not re.search(r"^\s*ghost", src, flags=re.M)
    # the other way: the adapter is a ghost box named as a layer, the join a ghost op with its layer
    src = diff_to_dot(diff_graphs(g1, g0), g0, g1, depth=1)
    ghosts = [l for l in src.splitlines() if re.match(r"\s*ghost\d+ \[label=", l)]
    labels = sorted(re.search(r'label="([^"]*)"', l).group(1) for l in ghosts)
    assert labels == ["Add\\nin the model's own forward\\n(removed)", "adapter\\nSequential\\n5 ops, 4 params\\n|g| params "
                      + labels[1].split("|g| params ")[1]]
    declared, used = _declared_and_used(src)
    assert used <= declared  # every edge ends at a drawn node: Graphviz invents none


@needs_engine
@pytest.mark.parametrize("way", ["added", "removed"])
def test_viewing_png_of_a_diff_marks_what_it_draws(adapter_graphs, way):
    """The viewing PNG collapses a graph too large to read; the diff is marked on what is drawn.

    Before, the marks named ops the collapsed drawing no longer had: the adapter boxes
    stayed unmarked and removed edges drew nodes Graphviz named after internal ids.
    """
    old, new = adapter_graphs if way == "added" else adapter_graphs[::-1]
    info: dict = {}
    d = diff_graphs(old, new)
    png = render_diff_png(d, new, old, max_px=900, info=info)
    assert info["collapsed_depth"] is not None  # the case this test is about
    collapse = {"depth": info["collapsed_depth"], "fold_repeats": info["folded"]}
    src = diff_to_dot(d, new, old, **collapse)
    declared, used = _declared_and_used(src)
    assert used <= declared
    if way == "added":
        assert re.search(r"key: layer:adapter[^\"]*\", [^\n]*pvh-added", src)
    else:
        assert re.search(r"ghost\d+ \[label=\"adapter", src)
    from paddleviz_hooks.collapse import collapse_graph

    title = "changes from step {} to step {} - ".format(old.meta["step"], new.meta["step"]) + collapse_note(
        collapse_graph(new, **collapse), new)
    same = render_diff(d, new, old, format="png", max_px=900, auto_collapse=False, title=title, **collapse)
    assert png == same


# ------------------------------------- collapsed alike: a box opened in one step only
class TwoWay(nn.Layer):
    """``p(x)``, and ``q(x)`` as a second output when ``both``."""

    def __init__(self):
        super().__init__()
        self.p, self.q = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, both):
        return self.p(x), (self.q(x) if both else None)


class SecondHead(nn.Layer):
    """emb -> blk -> h1, and blk's second output -> h2 when switched on.

    Alone, the graph with both outputs opens the ``blk`` box (h1's gradient reaches
    ``blk.p`` but not ``blk.q``: one box would draw a path that does not exist); the
    graph with one output keeps it closed.
    """

    def __init__(self):
        super().__init__()
        self.emb, self.blk, self.h1, self.h2 = nn.Linear(4, 4), TwoWay(), nn.Linear(4, 2), nn.Linear(4, 2)
        self.both = False

    def forward(self, x):
        a, b = self.blk(self.emb(x), self.both)
        y = self.h1(a)
        return y + self.h2(b) if self.both else y


def _marked(src: str) -> tuple[list[str], list[str]]:
    """The nodes a diff's DOT marks: keys (without signature) of the added, first label
    lines of the ghosts."""
    added = [base(re.search(r'key: ([^"|]+?)(?: \||")', l).group(1)) for l in src.splitlines()
             if re.match(r"\s*n\d+ \[", l) and "pvh-added" in l]
    ghosts = re.findall(r'^\s*ghost\d+ \[label="([^"\\]+)', src, flags=re.M)
    return sorted(added), sorted(ghosts)


def test_collapsed_diff_opens_a_box_in_both_steps():
    """A box the honesty check opens in one step is opened in the other too: the collapsed
    diff marks only the real change (h2, blk.q, the join Add), never blk as removed and
    blk.p as added."""
    from paddleviz_hooks.collapse import collapse_graph

    paddle.seed(16)
    model = SecondHead()
    g0, g1 = capture(model, paddle.randn([2, 4]), lambda on: setattr(model, "both", on))
    alone = [[n.layer for n in collapse_graph(g, depth=1).nodes if n.kind == "layer"] for g in (g0, g1)]
    assert "blk" in alone[0] and "blk" not in alone[1]  # the case this test is about
    new = ["layer:blk.q", "layer:h2", "op:<top>[0]/Add"]
    assert _marked(diff_to_dot(diff_graphs(g0, g1), g1, g0, depth=1)) == (new, [])
    assert _marked(diff_to_dot(diff_graphs(g1, g0), g0, g1, depth=1)) == ([], ["Add", "blk.q", "h2"])


@pytest.mark.parametrize("model", ["resnet18", "encoder"])
def test_collapsed_diff_of_two_steps_of_one_structure_marks_nothing(model):
    """Two steps with different inputs (same structure, other values): the collapsed diff has no
    added or removed node or edge at any depth, folded or not."""
    from paddleviz_hooks.collapse import layer_depths
    from paddleviz_hooks.render.diff import _collapsed

    paddle.seed(17)
    if model == "resnet18":
        net, shape = paddle.vision.models.resnet18(num_classes=4), [2, 3, 32, 32]
    else:
        net, shape = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 3), [2, 5, 16]
    with capture_backward(net) as cap:
        for _ in range(2):
            net(paddle.randn(shape)).mean().backward()
            net.clear_gradients()
    g0, g1 = cap.graphs
    for depth in range(max(layer_depths(g1).values()) + 1):
        for fold in (False, True):
            d, _, _ = _collapsed(diff_graphs(g0, g1), g1, g0, {"depth": depth, "fold_repeats": fold})
            assert not (d.added_nodes or d.removed_nodes or d.added_edges or d.removed_edges), (depth, fold)


# ------------------------------------------------------------------- keys
def test_keys_of_sibling_blocks_match_and_are_unique():
    """Signatures name parameters relative to their layer: ``layers.0`` and ``layers.1`` agree."""
    paddle.seed(15)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 3)
    with capture_backward(enc) as cap:
        enc(paddle.randn([2, 5, 16])).mean().backward()
    g = cap.graph
    assert len({n.key for n in g.nodes}) == len(g.nodes)
    per_block = [sorted(n.key.replace(f"layers.{i}", "~") for n in g.nodes
                        if n.kind == "op" and (n.layer or "").startswith(f"layers.{i}"))
                 for i in range(3)]
    assert per_block[1] == per_block[2] and len(per_block[1]) > 20
    # layers.0 takes the input tensor (no gradient) where the others take the previous block:
    # inputs from outside a layer are not part of its keys
    assert per_block[0] == per_block[1]


def test_assign_keys_is_cheap_on_10000_nodes():
    """A chain of 40-op blocks with parameters: 10,000 nodes keyed in well under a second."""
    nodes = [Node(0, "root", "loss", "loss")]
    edges = []
    ops = ["Add", "Matmul", "Relu", "LayerNorm", "Softmax", "Reshape", "Transpose", "Scale"]
    prev = 0
    while len(nodes) < 10_000:
        i = len(nodes)
        block = f"layers.{i // 40}.sub{(i // 5) % 8}"
        nodes.append(Node(i, "op", "", ops[i % len(ops)], layer=block))
        edges.append(Edge(prev, i, 0))
        if i % 4 == 0:
            nodes.append(Node(i + 1, "param", "", "Parameter", param=f"{block}.w{i}"))
            edges.append(Edge(i, i + 1, 1))
        prev = i
    g = BackwardGraph(nodes, edges)
    t = time.perf_counter()
    g.assign_keys()
    took = time.perf_counter() - t
    assert len({n.key for n in g.nodes}) == len(g.nodes)
    assert took < 1.0, f"assign_keys took {took:.2f} s for {len(g.nodes)} nodes"


def test_graphs_saved_with_old_keys_are_keyed_again():
    """A graph saved before keys had signatures (``#0``) compares with a new capture."""
    paddle.seed(16)
    model = Body()
    g0, g1 = capture(model, paddle.randn([2, 4]), lambda on: None)
    old = BackwardGraph.from_json(g0.to_json())
    counts: dict = {}
    for n in old.nodes:
        if n.kind == "op":
            b = base(n.key)
            n.key = f"{b}#{counts.setdefault(b, 0)}"
            counts[b] += 1
    assert not old.keys_current() and g1.keys_current()
    d = diff_graphs(old, g1)
    assert not d.structure_changed and d.renamed == {}
    assert [n.key for n in old.nodes] == [n.key for n in g0.nodes]
