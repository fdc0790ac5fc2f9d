"""The command line on huge, broken and odd inputs (issue 28 item 7).

The bound: a step JSON over ``--max-input-mb`` (32 MiB by default, about
75,000 nodes) is refused before a byte of it is read, so ``diff``, ``render``
and ``report`` answer in seconds and a few tens of MB whatever the file's
size; a graph of more than ``DRAW_MAX_NODES`` nodes is drawn collapsed.
A malformed file is named in the error (and skipped by ``report`` with a
warning); a FIFO or other non-regular file is refused, never waited on.
The 1-million-node run is ``--runslow``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from _bigstep import write_big_step
from paddleviz_hooks._fileio import MAX_INPUT_BYTES
from paddleviz_hooks.cli import main
from paddleviz_hooks.render.output import DRAW_MAX_NODES


def _run(argv, capsys):
    t0 = time.monotonic()
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err, time.monotonic() - t0


def test_a_file_over_the_limit_is_refused_unread(tmp_path, capsys):
    small = tmp_path / "step_000001.json"
    write_big_step(str(small), 9)
    run = tmp_path / "run"
    run.mkdir()
    huge = run / "step_000002.json"
    with open(huge, "wb") as f:  # sparse: as large as the limit allows, plus one byte, at no cost
        f.truncate(MAX_INPUT_BYTES + 1)
    for argv in (["diff", str(small), str(huge)], ["render", str(huge), "-o", str(tmp_path / "x.svg")],
                 ["report", str(run), "-o", str(tmp_path / "r.html")]):
        code, out, err, took = _run(argv, capsys)
        assert code == 1 and took < 5, (argv, code, took)
        assert str(huge) in err and "32 MiB limit" in err and "--max-input-mb" in err, err
    assert not (tmp_path / "x.svg").exists() and not (tmp_path / "r.html").exists()
    # a real capture-like file over a lowered limit: the same refusal, and it is read when allowed
    big = tmp_path / "big.json"
    write_big_step(str(big), 4000)
    code, out, err, _ = _run(["diff", str(small), str(big), "--max-input-mb", "1"], capsys)
    assert code == 1 and "over the 1 MiB limit" in err, err
    code, out, err, _ = _run(["diff", str(small), str(big)], capsys)
    assert code == 0 and "added" in out.lower(), (out, err)


def test_a_dangling_edge_is_named_and_report_skips_the_file(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    write_big_step(str(run / "step_000001.json"), 9)
    broken = run / "step_000002.json"
    write_big_step(str(broken), 9, dangling=True)
    for argv in (["render", str(broken), "-o", str(tmp_path / "x.dot")], ["diff", str(run / "step_000001.json"),
                                                                             str(broken)]):
        code, out, err, _ = _run(argv, capsys)
        assert code == 1 and str(broken) in err and "points at node 99999999" in err, err
        assert "KeyError" not in err and "unexpected" not in err
    code, out, err, _ = _run(["report", str(run), "-o", str(tmp_path / "r.html")], capsys)
    assert code == 0, err
    warned = [x for x in err.splitlines() if x.startswith("paddleviz-hooks: warning:")]
    assert len(warned) == 1 and str(broken) in warned[0] and "99999999" in warned[0], err
    page = (tmp_path / "r.html").read_text()
    assert "step_000002.json" in page  # listed on the page as skipped, with the good step shown


#: a field of a step file made wrong -> what the error names
MALFORMED = {
    "nonfinite_list": (lambda d: d.__setitem__("nonfinite", [1]), "nonfinite must be an object or null, got [1]"),
    "step_str": (lambda d: d["meta"].__setitem__("step", "abc"), "meta.step must be an int >= 0 or null, got 'abc'"),
    "kind_zzz": (lambda d: d["nodes"][1].__setitem__("kind", "zzz"), "nodes[1].kind must be one of"),
    "shape_str": (lambda d: d["edges"][0]["grad"].__setitem__("shape", "abc"), "edges[0].grad.shape must be a list"),
    "node_shape": (lambda d: d["nodes"][3].__setitem__("shape", [64, "x"]), "nodes[3].shape must be a list of ints"),
    "norm_str": (lambda d: d["edges"][1]["grad"].__setitem__("norm", "big"), "edges[1].grad.norm must be a number"),
    "after_hook_str": (lambda d: d["edges"][1].__setitem__("after_hook", "x10"), "edges[1].after_hook must be an object"),
    "nodes_dict": (lambda d: d.__setitem__("nodes", {}), "nodes must be a list, got {}"),
    "layers_list": (lambda d: d.__setitem__("layers", [1]), "layers must be an object"),
    "meta_str": (lambda d: d.__setitem__("meta", "x"), "meta must be an object"),
    "id_twice": (lambda d: d["nodes"][2].__setitem__("id", 1), "nodes[2].id must be 2 (its place in the list), got 1"),
    "calls_int": (lambda d: d.__setitem__("calls", {"a": 5}), "calls['a'] must be"),
    "frames_int": (lambda d: d.__setitem__("frames", [1]), "frames[0] must be [file, line, function, code]"),
    "source_index": (lambda d: d["nodes"][1].__setitem__("source", [7]), "nodes[1].source must be a list of indices"),
    "origin_list": (lambda d: d.__setitem__("nonfinite", {"origin": [1]}), "nonfinite.origin must be an object"),
}


def test_a_malformed_field_is_named_and_report_skips_the_file(tmp_path, capsys):
    """Each malformed field of a step file is a ValueError naming it (not an AttributeError that
    ends ``report`` with "unexpected", nor a wrong value accepted: a step "abc", a kind "zzz"), so
    ``report`` skips that file with a warning naming it and shows the good ones beside it."""
    import json

    from paddleviz_hooks import BackwardGraph

    run = tmp_path / "run"
    run.mkdir()
    write_big_step(str(run / "step_000001.json"), 9)
    good = json.loads((run / "step_000001.json").read_text())
    BackwardGraph.from_dict(good)  # the unbroken file loads
    for i, (name, (breaks, says)) in enumerate(MALFORMED.items(), start=2):
        d = json.loads(json.dumps(good))
        breaks(d)
        with pytest.raises(ValueError) as err:
            BackwardGraph.from_json(json.dumps(d))
        assert says in str(err.value) and str(err.value).startswith("malformed backward graph JSON: "), (name, err.value)
        (run / f"step_{i:06d}.json").write_text(json.dumps(d))
    code, out, err, _ = _run(["render", str(run / "step_000002.json"), "-o", str(tmp_path / "x.dot")], capsys)
    assert code == 1 and "nonfinite must be an object" in err and "unexpected" not in err, err
    code, out, err, _ = _run(["report", str(run), "-o", str(tmp_path / "r.html")], capsys)
    assert code == 0, err
    warned = [x for x in err.splitlines() if x.startswith("paddleviz-hooks: warning: skipped")]
    assert len(warned) == len(MALFORMED), err
    for i, (name, (_, says)) in enumerate(MALFORMED.items(), start=2):
        line = next(x for x in warned if f"step_{i:06d}.json" in x)
        assert says in line, (name, line)


def test_a_saved_diff_given_as_a_graph_says_what_it_is(tmp_path, capsys):
    """``render``/``diff`` given a ``step_N_diff.json``: said to be a saved diff, with its picture
    beside it and the command that draws a diff (not "missing 'format'")."""
    import json

    write_big_step(str(tmp_path / "step_000004.json"), 9)
    (tmp_path / "step_000004_diff.json").write_text(json.dumps({"format": "paddleviz-hooks/graph-diff", "version": 1}))
    (tmp_path / "step_000004_diff.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    saved = str(tmp_path / "step_000004_diff.json")
    for argv in (["render", saved, "-o", str(tmp_path / "x.png")], ["diff", str(tmp_path / "step_000004.json"), saved]):
        code, out, err, _ = _run(argv, capsys)
        assert code == 1, err
        assert f"{saved} is a saved diff, not a graph: its picture is {tmp_path / 'step_000004_diff.png'}" in err, err
        assert "paddleviz-hooks diff OLD.json NEW.json -o diff.png" in err and "missing" not in err, err
    from paddleviz_hooks import BackwardGraph

    with pytest.raises(ValueError, match="a saved diff .* GraphDiff.from_json"):
        BackwardGraph.from_json((tmp_path / "step_000004_diff.json").read_text())


def test_a_fifo_is_refused_not_waited_on(tmp_path, capsys):
    import threading

    run = tmp_path / "run"
    run.mkdir()
    write_big_step(str(run / "step_000001.json"), 9)
    os.mkfifo(run / "step_000002.json")
    for argv, want in ((["report", str(run), "-o", str(tmp_path / "r.html")], 0),
                       (["render", str(run / "step_000002.json"), "-o", str(tmp_path / "x.svg")], 1)):
        got = []
        t = threading.Thread(target=lambda: got.append(main(argv)), daemon=True)  # a hang fails, not blocks
        t.start()
        t.join(60)
        if t.is_alive():  # unblock the reader so the thread can end
            with open(run / "step_000002.json", "wb"):
                pass
            pytest.fail(f"{argv[0]} waits on a FIFO")
        err = capsys.readouterr().err
        assert got == [want] and "step_000002.json" in err and "not a regular file" in err, err


@pytest.mark.slow
def test_a_graph_bigger_than_the_drawing_bound_is_drawn_collapsed(tmp_path, capsys):
    big = tmp_path / "step_000002.json"
    nodes = write_big_step(str(big), DRAW_MAX_NODES * 2)
    code, out, err, took = _run(["render", str(big), "-o", str(tmp_path / "x.svg")], capsys)
    assert code == 0 and f"{nodes:,} nodes: drawn collapsed to at most {DRAW_MAX_NODES}" in out, (out, err)


def _peak_rss_mb(argv: list[str]) -> tuple[int, float, float | None, str]:
    """(exit status, seconds, peak RSS in MB or None, stderr) of the CLI in a child process.

    The peak comes from GNU time when it is installed (a forked child's own rusage would
    count the pages it shared with this test process before exec).
    """
    gnu_time = "/usr/bin/time" if os.path.exists("/usr/bin/time") else None
    cmd = [sys.executable, "-m", "paddleviz_hooks.cli", *argv]
    t0 = time.monotonic()
    r = subprocess.run(([gnu_time, "-f", "PEAK_KB %M"] if gnu_time else []) + cmd, capture_output=True, text=True,
                       timeout=600)
    took = time.monotonic() - t0
    peaks = [int(x.split()[1]) for x in r.stderr.splitlines() if x.startswith("PEAK_KB ")]
    return r.returncode, took, peaks[0] / 1024 if peaks else None, r.stderr


@pytest.mark.slow
def test_one_million_nodes_stay_within_the_bound(tmp_path):
    """The file of the issue: refused in seconds with a small memory footprint (printed for the notes)."""
    run = tmp_path / "run"
    run.mkdir()
    path = run / "step_000002.json"
    nodes = write_big_step(str(path), 1_000_000)
    assert nodes > 999_000 and path.stat().st_size > 300 * 2**20
    for argv in (["diff", str(path), str(path)], ["render", str(path), "-o", str(tmp_path / "x.svg")],
                 ["report", str(run), "-o", str(tmp_path / "r.html")]):
        code, took, rss, err = _peak_rss_mb(argv)
        print(f"{argv[0]} on {nodes:,} nodes ({path.stat().st_size / 2**20:.0f} MiB): exit {code}, {took:.1f} s, "
              f"peak RSS {'?' if rss is None else f'{rss:.0f}'} MB")
        assert code == 1 and "limit" in err and took < 60 and (rss is None or rss < 200), (argv[0], took, rss, err)
