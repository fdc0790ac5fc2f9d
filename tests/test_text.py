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
