"""One step of several ranks matched and drawn merged (compare_ranks, render_ranks), in one process.

Each "rank" is a real capture of LeNet (random weights) on its own batch; a
rank whose forward runs one more op stands for a structural difference.
The 2-process run and the report page are tested in test_distributed_grads.py.
"""

from __future__ import annotations

import re

import paddle
import pytest

from paddleviz_hooks import capture_backward, compare_ranks, render_ranks
from paddleviz_hooks.diff import edge_metas
from paddleviz_hooks.render import ranks_to_dot
from paddleviz_hooks.text import fmt_num


@pytest.fixture(scope="module")
def captures():
    paddle.seed(0)
    net = paddle.vision.models.LeNet()
    graphs = []
    with capture_backward(net) as cap:
        for rank in range(3):
            x = paddle.randn([2, 1, 28, 28])
            out = net(x)
            (out.exp() if rank == 2 else out).mean().backward()  # rank 2 runs one more op
            graphs.append(cap.graphs[-1])
    return graphs


def test_norms_per_rank_are_each_ranks_own(captures):
    g0, g1, _ = captures
    view = compare_ranks({0: g0, 1: g1})
    assert view.ranks == [0, 1] and not view.structure_differs
    assert view.missing == {} and view.only_on == {} and view.local_param_norms == {}
    for r, g in ((0, g0), (1, g1)):
        for pair, meta in edge_metas(g).items():
            if meta is not None and meta.norm is not None:
                assert view.edge_norms[pair][r] == meta.norm
        assert {n: v[r] for n, v in view.param_norms.items()} == {n: m.norm for n, m in g.params().items()}
        assert view.global_norms[r] == g.global_grad_norm()
    assert view.param_norms["fc.0.weight"][0] != view.param_norms["fc.0.weight"][1]  # different data


def test_merged_drawing_shows_every_ranks_value(captures):
    g0, g1, _ = captures
    dot = ranks_to_dot({0: g0, 1: g1})
    assert dot.splitlines()[2].startswith("  label=\"step") and "ranks 0, 1 merged" in dot  # the title (wrapped)
    w0, w1 = (g.params()["fc.0.weight"].norm for g in (g0, g1))
    assert f"|g| r0 {fmt_num(w0)} / r1 {fmt_num(w1)}" in dot
    assert "pvh-rank-differs" not in dot and "pvh-rank-only" not in dot
    assert "all-reduced" not in dot  # no local gradients recorded: one number per rank


def test_extra_op_on_one_rank_is_flagged(captures):
    g0, g1, g2 = captures
    view = compare_ranks({0: g0, 1: g1, 2: g2})
    assert view.differing_ranks() == [2]
    (extra,) = view.only_on[2]
    assert re.fullmatch(r"op:\?\[0\]/Exp#\w+", extra)
    assert view.missing == {}
    (pair,) = view.missing_edges  # on ranks 0 and 1 the mean took the logits directly
    assert view.missing_edges[pair] == [2]
    dot = ranks_to_dot({0: g0, 1: g1, 2: g2})
    ghost = next(line for line in dot.splitlines() if "pvh-rank-only" in line)
    assert "Exp" in ghost and "only on rank 2" in ghost
    assert "not on rank 2" in dot and dot.count("pvh-rank-differs") >= 2  # the edge rank 2 lacks, the legend
    assert f"r2 {fmt_num(g2.params()['fc.0.weight'].norm)}" in dot


def test_collapsed_alike(captures):
    g0, g1, _ = captures
    dot = ranks_to_dot({0: g0, 1: g1}, depth=1)
    box = next(line for line in dot.splitlines() if "key: layer:features" in line)
    assert "box3d" in box and "pvh-rank-" not in dot.split("ranks_legend")[0]
    f0, f1 = ({n: m.norm for n, m in g.params().items() if n.startswith("features.")} for g in (g0, g1))
    want = [sum(v * v for v in f.values()) ** 0.5 for f in (f0, f1)]  # the box: its 4 parameters, per rank
    assert f"|g| params r0 {fmt_num(want[0])} / r1 {fmt_num(want[1])}" in box, box


def test_svg_and_png(captures, tmp_path):
    g0, g1, _ = captures
    svg = render_ranks({0: g0, 1: g1})
    assert svg.startswith(b"<?xml") and b"r1 " in svg
    out = render_ranks({0: g0, 1: g1}, tmp_path / "merged.png", max_px=900)
    assert out == str(tmp_path / "merged.png") and (tmp_path / "merged.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_input(captures):
    g0, g1, _ = captures
    with pytest.raises(TypeError, match="dict rank -> BackwardGraph, got list"):
        compare_ranks([g0, g1])
    with pytest.raises(ValueError, match="at least 2 ranks"):
        compare_ranks({0: g0})
    with pytest.raises(ValueError, match=r"ranks must be ints >= 0, got '1'"):
        compare_ranks({0: g0, "1": g1})
    with pytest.raises(TypeError, match=r"graphs\[1\] must be a BackwardGraph, got str"):
        compare_ranks({0: g0, 1: "g1"})
    with pytest.raises(ValueError, match="format must be one of"):
        render_ranks({0: g0, 1: g1}, format="gif")
    with pytest.raises(TypeError, match="node_style is set by the merged drawing"):
        ranks_to_dot({0: g0, 1: g1}, node_style={})
