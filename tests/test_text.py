"""Wording rules of the summaries (text.py), on plain graphs."""

from paddleviz_hooks.graph import BackwardGraph, Edge, GradMeta, Node
from paddleviz_hooks.text import graph_summary


def _graph(op: str) -> BackwardGraph:
    g = BackwardGraph(
        nodes=[Node(0, "root", "loss", "loss"), Node(1, "op", op + "GradNode", op, layer="rnn"),
               Node(2, "param", "GradNodeAccumulation", "Parameter", param="rnn.w", shape=(2,))],
        edges=[Edge(0, 1, grad=GradMeta((), "float32", norm=1.0)), Edge(1, 2)],  # 1 -> 2 not observed
        layers={"": "Net", "rnn": "LSTM"}, meta={"grad_stats": True})
    g.assign_keys()
    return g


def test_not_observed_nodes_are_named_once_and_again_only_when_they_change():
    first = graph_summary(_graph("Rnn"))
    assert "not observed at 1 node (Rnn)" in first
    assert "not observed" not in graph_summary(_graph("Rnn"), previous=_graph("Rnn")).replace(
        "no NaN/Inf in the observed gradients", "")
    assert "not observed at 1 node (Concat)" in graph_summary(_graph("Concat"), previous=_graph("Rnn"))


def test_the_top_layer_is_named_in_words_never_by_its_internal_key():
    """A new user read "Add / in <top> / (removed)" and "NaN/Inf starts at sqrt in <top>": what
    people read names the model's own forward, parameters or the whole model; ``<top>`` stays in keys."""
    import re

    import paddle

    from paddleviz_hooks import capture_backward, collapse_graph, summarize
    from paddleviz_hooks.diff import diff_graphs
    from paddleviz_hooks.render.diff import diff_to_dot
    from paddleviz_hooks.text import box_lines, describe_origin, ghost_lines, origin_title

    class Net(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = paddle.nn.Linear(4, 4)
            self.gain = self.create_parameter([4], default_initializer=paddle.nn.initializer.Constant(50.0))
            self.extra = False

        def forward(self, x):
            h = self.fc(x) * self.gain
            return h + paddle.tanh(h) if self.extra else h

    paddle.seed(18)
    net, x = Net(), paddle.randn([2, 4])
    with capture_backward(net) as cap:
        for extra, scale in ((True, 1.0), (False, 1000.0)):
            net.extra = extra
            (net(x).mean() * scale).backward()
            net.clear_gradients()
    g0, g1 = cap.graphs
    d = diff_graphs(g0, g1)
    texts = [summarize(g0), summarize(d)]
    assert re.search(r"largest grad norms: .*the model's own parameters \d", texts[0]), texts[0]
    assert "the model's own parameters grad norm x" in texts[1], texts[1]
    add = next(n for n in g0.nodes if n.op == "Add" and n.layer == "")
    assert ghost_lines(add) == ["Add", "in the model's own forward", "(removed)"]
    src = diff_to_dot(d, g1, g0)
    labels = re.findall(r'label="((?:[^"\\]|\\.)*)"', src)
    assert "Add\\nin the model's own forward\\n(removed)" in labels
    whole = next(n for n in collapse_graph(g0, depth=0).nodes if n.kind == "layer")
    assert box_lines(whole)[:2] == ["the whole model", "Net"]
    origin = {"kind": "forward", "op": "sqrt", "layer": "", "layer_class": "Net", "file": "/m.py", "line": 3}
    texts += ghost_lines(add) + box_lines(whole) + labels + [
        describe_origin(origin), origin_title(origin),
        describe_origin({**origin, "kind": "weights"}), origin_title({**origin, "kind": "weights"}),
        describe_origin({**origin, "kind": "backward", "op": "Sqrt"})]
    assert origin_title(origin) == "NaN/Inf starts at sqrt in the model's own forward, m.py:3"
    assert all("<top>" not in t and "(self)" not in t for t in texts), [t for t in texts if "<top>" in t]


def test_a_nan_global_norm_is_spelled_as_every_other_nan_and_not_repeated():
    nan = float("nan")
    g = BackwardGraph(
        nodes=[Node(0, "root", "loss", "loss"), Node(1, "param", "GradNodeAccumulation", "Parameter", param="w",
                                                     grad=GradMeta(shape=(2,), dtype="float32", norm=nan, nan=2))],
        edges=[Edge(0, 1, 0, GradMeta(shape=(2,), dtype="float32", norm=nan, nan=2))],
        meta={"accumulated_grad_norm": nan})
    text = graph_summary(g)
    assert "global grad norm NaN;" in text and "accumulated param.grad norm" not in text, text


def _params_graph(layers: dict[str, str], norms: dict[str, float]) -> BackwardGraph:
    nodes = [Node(0, "root", "loss", "loss")] + [
        Node(i, "param", "GradNodeAccumulation", "Parameter", param=name, grad=GradMeta((2,), "float32", norm=v))
        for i, (name, v) in enumerate(norms.items(), start=1)]
    return BackwardGraph(nodes=nodes, edges=[Edge(0, i) for i in range(1, len(nodes))], layers=layers,
                         meta={"grad_stats": True})


def _largest(g: BackwardGraph) -> str:
    return next(line for line in graph_summary(g).splitlines() if line.startswith("largest grad norms"))


def test_largest_grad_norms_name_blocks_not_their_container():
    """A container (LayerList) is not a level: a TransformerEncoder's line names its blocks, not
    one ``layers`` group holding every gradient (which is the global norm again); a bare index
    (children of a model that is a Sequential) names the class; NaN is spelled as everywhere."""
    enc = _params_graph({"": "TransformerEncoder", "layers": "LayerList", "layers.0": "TransformerEncoderLayer",
                         "layers.0.linear1": "Linear", "layers.1": "TransformerEncoderLayer",
                         "layers.1.linear1": "Linear"},
                        {"layers.0.linear1.weight": 3.0, "layers.1.linear1.weight": 4.0})
    assert _largest(enc) == "largest grad norms: layers.1 4, layers.0 3;"
    seq = _params_graph({"": "Sequential", "0": "Linear", "2": "Linear"}, {"0.weight": 1.75, "2.weight": float("nan")})
    assert _largest(seq) == "largest grad norms: 2 (Linear) NaN, 0 (Linear) 1.75;"
    lenet = _params_graph({"": "LeNet", "features": "Sequential", "features.0": "Conv2D", "fc": "Sequential",
                           "fc.0": "Linear"}, {"features.0.weight": 2.0, "fc.0.weight": 1.0})
    assert _largest(lenet) == "largest grad norms: features 2, fc 1;"  # a Sequential of its own is a level


def test_one_edge_added_is_singular():
    from paddleviz_hooks.diff import diff_graphs
    from paddleviz_hooks.text import diff_summary

    older = _params_graph({"": "Net", "a": "Linear"}, {"a.w": 1.0})
    newer = _params_graph({"": "Net", "a": "Linear"}, {"a.w": 1.0, "a.b": 1.0})
    older.assign_keys(), newer.assign_keys()
    assert "structure changed: 1 node added, 0 removed, 1 edge added, 0 removed;" in diff_summary(diff_graphs(older, newer))
