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
