"""Source lines from the wrapped op calls' notes, without Paddle's dump when they cover the graph.

While sources are armed every op entry point is wrapped (``capture/opcalls.py``)
and each call notes its caller's frames for the grad nodes it made
(``source._after``). A captured backward whose op nodes all have a note reads
its sources from them and gives Paddle no dump folder; otherwise the dump is
read as before and the notes fill the nodes it leaves empty. Either way every
``Node.source`` and ``source_note`` must be what the dump gives.
"""

from __future__ import annotations

import tempfile

import paddle
import pytest

import _source_cases as C
from paddleviz_hooks import capture_backward
from paddleviz_hooks.capture import opcalls, source


@pytest.fixture()
def dumps(monkeypatch, tmp_path):
    """The dump folders made (``pvh-stacks-*``), in a folder of this test's own."""
    made = []
    real = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def mkdtemp(*a, **k):
        d = real(*a, **k)
        if "pvh-stacks-" in str(k.get("prefix", a[1] if len(a) > 1 else "")):
            made.append(d)
        return d

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    return made


@pytest.mark.parametrize("case", sorted(C.CASES))
def test_the_notes_give_every_node_the_source_the_dump_gives(case, monkeypatch, dumps):
    runs = []
    for force in (False, True):  # one line makes both: their outermost frame is the same
        monkeypatch.setattr(source, "_FORCE_DUMP", force)
        runs.append(C.sources(C.CASES[case]({})))
    noted, dumped = runs
    assert dumps  # the forced run read a dump
    assert [list(g) for g in noted] == [list(g) for g in dumped]  # the same nodes, in the same order
    for g_noted, g_dumped in zip(noted, dumped):
        for key, got in g_noted.items():
            assert got == g_dumped[key], (case, key)
    ops = [v for g in noted for v in g.values()]
    assert ops and any(src for src, _ in ops)
    assert not source._RECORDS and not opcalls.listening()  # nothing held or wrapped after the block


@pytest.mark.parametrize("case", ["mlp", "conv", "encoder", "pylayer", "recompute", "recompute_nonreentrant",
                                  "to_static", "tensors"])
def test_a_model_the_wrapped_calls_cover_gets_no_dump(case, dumps):
    graphs = C.CASES[case]({})
    assert dumps == []
    ops = [n for g in graphs for n in g.nodes if n.kind == "op"]
    assert ops and all(n.source or n.source_note == "static" for n in ops)


def test_an_op_made_outside_the_wrapped_calls_falls_back_to_the_dump(dumps):
    """``x.clone()`` is Tensor's own C method: its Assign node is made with no wrapped
    entry point, so the dump is read; the line that cloned is its source."""
    (g,) = C.CASES["clone"]({})
    assert len(dumps) == 1
    (assign,) = [n for n in g.nodes if n.op == "Assign"]
    assert assign.source[-1].code == "return self.fc2(self.fc1(x).clone())"
    assert all(n.source for n in g.nodes if n.kind == "op")


class _ConvCloned(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.conv = paddle.nn.Conv2D(3, 4, 3)

    def forward(self, x):
        return self.conv(x).clone() * 2.0


def test_a_capture_whose_notes_missed_a_node_notes_only_what_the_dump_lacks(dumps):
    """After a backward that needed the dump, the forwards of the model's captures note
    only the ops Paddle keeps no stack for (conv2d): the sources stay the same."""
    paddle.seed(0)
    net = _ConvCloned()
    x = paddle.randn([1, 3, 6, 6])
    noted = []
    with capture_backward(net) as cap:
        for _ in range(3):
            y = net(x).mean()
            noted.append(sum(1 for _, frames in source._RECORDS.values() if frames is not None))
            y.backward()
    assert len(dumps) == 3
    assert noted[0] >= 3 and noted[1] == noted[2] == 1  # every op's node; then the conv's alone
    first = [(n.key, n.source, n.source_note) for n in cap.graphs[0].nodes]
    assert all(n.source for n in cap.graphs[0].nodes if n.kind == "op")
    assert [(n.key, n.source, n.source_note) for n in cap.graphs[2].nodes] == first
    assert not opcalls._narrow and not opcalls.listening()
    with capture_backward(net) as cap2:  # a later capture of the same model: the same
        y = net(x).mean()
        noted.append(sum(1 for _, frames in source._RECORDS.values() if frames is not None))
        y.backward()
    inner = lambda nodes: [(n.key, n.source and n.source[1:], n.source_note) for n in nodes]  # line 1 differs
    assert noted[3] == 1 and inner(cap2.graph.nodes) == inner(cap.graphs[0].nodes)


def test_paddle_grad_gets_its_lines_from_the_notes(dumps):
    """Paddle's dump of a ``paddle.grad`` names copies of the grad nodes, with no stack: its
    ops had no source ("not recorded"); the notes give them theirs, and no dump is made for
    it. The backward after it, whose graph holds the double-grad nodes that backward made
    (no wrapped call notes them), reads the dump."""
    g1, g2 = C.CASES["grad_penalty"]({})
    assert len(dumps) == 1
    assert all(n.source is not None for n in g1.nodes if n.kind == "op"), [
        (n.op, n.source_note) for n in g1.nodes if n.kind == "op"]
    assert any(n.source for n in g2.nodes if n.kind == "op")


def test_saved_memory_and_sources_share_one_wrapping():
    """Both on at once: one wrapper per op site, the same saved bytes and sources as each alone."""
    def run(**kw):
        paddle.seed(0)
        net = C.MLP()
        x = paddle.randn([3, 6])
        with capture_backward(net, **kw) as cap:
            y = net(x).mean()
            wrapped = [f for o, n, f in opcalls._PATCHED]
            assert len(wrapped) == len({(id(o), n) for o, n, _ in opcalls._PATCHED})  # no site wrapped twice
            y.backward()
        return cap.graph

    both, saved, srcs = run(saved_memory=True), run(saved_memory=True, sources=False), run()
    assert [n.saved_bytes for n in both.nodes] == [n.saved_bytes for n in saved.nodes]
    drop = lambda meta: {k: v for k, v in meta.items() if k != "allocated_growth"}  # the allocator's, run to run
    assert drop(both.meta["saved_memory"]) == drop(saved.meta["saved_memory"])
    assert [(n.source, n.source_note) for n in both.nodes] == [(n.source, n.source_note) for n in srcs.nodes]
    assert not opcalls.listening() and not source._RECORDS
