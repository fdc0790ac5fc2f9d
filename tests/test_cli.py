"""The installed ``paddleviz-hooks`` entry point, run as a subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import paddle
import pytest

from paddleviz_hooks import capture_backward
from paddleviz_hooks.cli import main
from paddleviz_hooks.diff import GraphDiff
from paddleviz_hooks.render.engine import find_engine

F = paddle.nn.functional


def _entry_point() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "paddleviz-hooks")
    found = beside if os.access(beside, os.X_OK) else shutil.which("paddleviz-hooks")
    if not found:
        pytest.fail("the paddleviz-hooks console script is not installed: run `pip install -e .`")
    return found


class Net(paddle.nn.Layer):
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


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two saved graphs (the second has an extra block) and a log dir holding them."""
    root = tmp_path_factory.mktemp("cli")
    paddle.seed(11)
    model = Net()
    x = paddle.randn([3, 4])
    with capture_backward(model) as cap:
        for step in range(2):
            model(x, step).mean().backward()
            model.clear_gradients()
    log = root / "log" / "backward_graphs"
    log.mkdir(parents=True)
    paths = {}
    for i, g in enumerate(cap.graphs):
        g.meta["step"] = i * 100
        text = g.to_json()
        (log / f"step_{i * 100:06d}.json").write_text(text)
        paths["ab"[i]] = root / f"{'ab'[i]}.json"
        paths["ab"[i]].write_text(text)
    (root / "foreign.json").write_text(json.dumps({"nodes": [], "hello": "world"}))
    (root / "garbage.json").write_text("this is not json {")
    (root / "image.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe binary")
    (root / "a_file").write_text("x")
    (root / "adir.png").mkdir()
    (root / "empty_log").mkdir()
    paths.update(root=root, log=root / "log")
    return paths


def run_all(cases: dict[str, list[str]], cwd) -> dict[str, subprocess.CompletedProcess]:
    """Run several command lines at once (each one starts a Python process)."""
    exe = _entry_point()
    results = {}
    names = list(cases)
    for start in range(0, len(names), 4):
        batch = {
            n: subprocess.Popen([exe, *cases[n]], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for n in names[start:start + 4]
        }
        for n, p in batch.items():
            out, err = p.communicate(timeout=180)
            results[n] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    return results


def _noise(line: str) -> bool:
    # Importing paddle (the package's __init__ does) prints this warning.
    return "No ccache found" in line or line.strip() == "warnings.warn(warning_message)"


def error_lines(r: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in r.stderr, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip() and not _noise(l)]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("paddleviz-hooks: error: "), lines
    return lines


needs_engine = pytest.mark.skipif(find_engine() is None, reason="no Graphviz layout engine installed")
has_collapse = importlib.util.find_spec("paddleviz_hooks.collapse") is not None


@needs_engine
def test_entry_point(files):
    """The installed console script: successes and the main error paths, one process each."""
    root = files["root"]
    cases = {
        "png": ["render", "a.json", "-o", "out.png"],
        "diff": ["diff", "a.json", "b.json", "-o", "diff.png"],
        "report": ["report", "log", "-o", "report.html"],
        "missing": ["render", "missing.json", "-o", "x.png"],
        "foreign": ["diff", "a.json", "foreign.json"],
        "bad_option": ["render", "a.json", "-o", "x.png", "--colour"],
        "unwritable": ["render", "a.json", "-o", "a_file/x.png"],
    }
    r = run_all(cases, root)
    for name in ("png", "diff", "report"):
        assert r[name].returncode == 0, (name, r[name].stderr)
        assert "Traceback" not in r[name].stderr
    assert (root / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (root / "diff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = r["diff"].stdout
    assert "step 100 vs step 0:" in out and "structure changed: 4 nodes added" in out
    assert "parameters now receiving gradient:" in out and "wrote diff.png" in out
    assert (root / "report.html").read_text().startswith("<!DOCTYPE html>")
    expected = {
        "missing": (1, "cannot read missing.json: no such file"),
        "foreign": (1, "foreign.json is not a paddleviz-hooks graph"),
        "bad_option": (2, "unrecognized arguments: --colour"),
        "unwritable": (1, "cannot write a_file/x.png"),
    }
    for name, (status, text) in expected.items():
        assert r[name].returncode == status, (name, r[name].returncode, r[name].stderr)
        assert text in error_lines(r[name])[0], (name, r[name].stderr)
    assert not (root / "x.png").exists()


def run_main(argv: list[str], cwd, capsys) -> tuple[int, str, str]:
    """main() in this process: the same code as the script, without starting Python again."""
    old = os.getcwd()
    os.chdir(cwd)
    try:
        status = main(argv)
    finally:
        os.chdir(old)
    out, err = capsys.readouterr()
    return status, out, err


@needs_engine
def test_more_commands(files, capsys):
    root = files["root"]
    status, _, err = run_main(["render", "b.json", "-o", "out.svg", "--rankdir", "LR", "--no-legend",
                               "--title", "my <graph>"], root, capsys)
    assert status == 0, err
    svg = (root / "out.svg").read_text()
    assert "<svg" in svg and "my &lt;graph&gt;" in svg and ">legend<" not in svg
    assert run_main(["render", "a.json", "-o", "out.dot", "--no-stats"], root, capsys)[0] == 0
    dot = (root / "out.dot").read_text()
    assert dot.startswith("digraph") and "|g|" not in dot
    status, out, _ = run_main(["diff", "a.json", "b.json", "-o", "diff.json", "--threshold", "3"], root, capsys)
    assert status == 0
    d = GraphDiff.from_json((root / "diff.json").read_text())
    assert d.threshold == 3 and set(d.params_started) == {"extra.weight", "extra.bias"}
    status, out, _ = run_main(["diff", "a.json", "a.json"], root, capsys)
    assert status == 0 and "same graph structure" in out.splitlines()
    status, out, _ = run_main(["diff", "a.json", "b.json", "-o", "diff.svg", "--no-stats"], root, capsys)
    assert status == 0 and "pvh" in (root / "diff.svg").read_text()
    status, out, _ = run_main(["--help"], root, capsys)
    assert status == 0 and "render" in out and "report" in out
    if not has_collapse:  # pragma: no cover - collapse is written concurrently
        pytest.skip("render/collapse.py not present: collapse options untested")
    status, _, err = run_main(["render", "b.json", "-o", "collapsed.dot", "--depth", "1", "--max-nodes", "40",
                               "--fold-repeats", "--by-type", "Linear"], root, capsys)
    assert status == 0, err
    assert "box3d" in (root / "collapsed.dot").read_text()  # layers drawn as boxes
    status, _, err = run_main(["render", "b.json", "-o", "whole.dot", "--depth", "0"], root, capsys)
    assert status == 0, err
    whole = (root / "whole.dot").read_text()
    assert whole.count("box3d") == 1 and "Matmul" not in whole  # the model is one box


@needs_engine
def test_render_keeps_the_recorders_title(tmp_path, capsys):
    """A recorded step drawn again from its JSON has the title the recorder gave its picture
    ("step 3 - micro-batch 2 of 2"): the DOT equals the recorder's own step file."""
    from paddleviz_hooks import BackwardGraphRecorder

    paddle.seed(12)
    model = Net()
    x = paddle.randn([2, 4])
    with BackwardGraphRecorder(str(tmp_path), model, every=1, verbose=0, formats=("json", "dot"),
                               visualdl=False, visualdl_graphs=False) as rec:
        with rec.step(3, micro_batches=2):
            for _ in range(2):
                model(x, 0).mean().backward()
    run = tmp_path / "backward_graph"
    recorded = (run / "step_000003_b2.dot").read_text()
    title = recorded.split("\n  label=", 1)[1].split("\n", 1)[0]
    assert title.startswith('"step 3 - micro-batch 2 of 2')  # the case this test is about
    assert "global grad norm" in title and "(this backward)" in title  # with what it measured
    status, _, err = run_main(["render", "step_000003_b2.json", "-o", "again.dot"], run, capsys)
    assert status == 0, err
    assert (run / "again.dot").read_text() == recorded
    status, _, err = run_main(["render", "step_000003_b2.json", "-o", "again.svg"], run, capsys)
    assert status == 0 and "step 3 - micro-batch 2 of 2" in (run / "again.svg").read_text().replace("&#45;", "-")
    status, _, err = run_main(["render", "step_000003_b2.json", "-o", "mine.dot", "--title", "mine"], run, capsys)
    assert status == 0 and 'label="mine"' in (run / "mine.dot").read_text()


def test_error_paths(files, capsys):
    root = files["root"]
    cases = {
        # arguments: (exit status, text in the one error line)
        ("render", "garbage.json", "-o", "x.png"): (1, "garbage.json is not a paddleviz-hooks graph: not JSON"),
        ("render", "image.json", "-o", "x.svg"): (1, "not UTF-8"),
        ("render", "log", "-o", "x.svg"): (1, "it is a directory"),
        ("diff", "a.json", "missing.json"): (1, "cannot read missing.json"),
        ("render", "a.json", "-o", "x.gif"): (2, "cannot tell the output format"),
        ("render", "a.json", "-o", "x.png", "--depth", "-3"): (2, "argument --depth"),
        ("render", "a.json"): (2, "-o/--output"),
        (): (2, "a command is required"),
        ("paint", "a.json"): (2, "invalid choice: 'paint'"),
        ("diff", "a.json", "b.json", "--threshold", "0.5"): (2, "argument --threshold"),
        ("diff", "a.json", "b.json", "-o", "adir.png"): (1, "it is a directory"),
        ("report", "log", "-o", "nowhere/r.html"): (1, "does not exist"),
        ("report", "nolog", "-o", "r.html"): (1, "cannot read log directory nolog"),
        ("report", "empty_log", "-o", "r.html"): (1, "no step_*.json files under empty_log"),
    }
    for argv, (expected, text) in cases.items():
        status, out, err = run_main(list(argv), root, capsys)
        assert status == expected, (argv, status, err)
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("paddleviz-hooks: error: "), (argv, err)
        assert text in lines[0], (argv, lines[0])
    assert not (root / "x.png").exists() and not (root / "r.html").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc (a folder no file can be made in)")
def test_a_refused_output_is_named_as_given(files, capsys):
    """A folder that refuses new files (/proc: for root too): the error names the file asked for
    and why, never the temporary file the write goes through."""
    for argv in (["report", "log", "-o", "/proc/x.html"], ["render", "a.json", "-o", "/proc/x.dot"],
                 ["diff", "a.json", "b.json", "-o", "/proc/x.json"]):
        status, _, err = run_main(argv, files["root"], capsys)
        assert status == 1, (argv, err)
        (line,) = err.splitlines()
        assert line.startswith(f"paddleviz-hooks: error: cannot write {argv[-1]}"), line
        assert ".tmp-" not in line and ": " in line.removeprefix("paddleviz-hooks: error: "), line


@needs_engine
def test_max_px_sizes_the_png_like_view_max_px(files, capsys):
    """``render --max-px N`` draws the PNG the recorder draws with ``view_max_px=N``."""
    from paddleviz_hooks.render.draw import png_size

    root = files["root"]
    status, _, err = run_main(["render", "b.json", "-o", "small.png", "--max-px", "200"], root, capsys)
    assert status == 0, err
    data = (root / "small.png").read_bytes()
    assert max(png_size(data)) <= 200
    status, _, err = run_main(["render", "b.json", "-o", "full.png"], root, capsys)
    assert status == 0 and max(png_size((root / "full.png").read_bytes())) > 200, err  # the option made it smaller
    status, _, err = run_main(["diff", "a.json", "b.json", "-o", "small_diff.png", "--max-px", "200"], root, capsys)
    assert status == 0 and max(png_size((root / "small_diff.png").read_bytes())) <= 200, err
    for argv, says in ((["render", "b.json", "-o", "x.svg", "--max-px", "200"], "--max-px sizes a PNG"),
                       (["render", "b.json", "-o", "x.png", "--max-px", "20"], "argument --max-px"),
                       (["diff", "a.json", "b.json", "--max-px", "300"], "give -o")):
        status, _, err = run_main(argv, root, capsys)
        assert status == 2 and says in err, (argv, err)


def test_cli_says_what_it_does(files, capsys):
    """Options that were silently ignored or contradictory are refused, naming what is valid;
    ``report`` has a default output; an empty log dir is worded one way, with where captures go."""
    root = files["root"]
    cases = {
        ("render", "a.json", "-o", "x.dot", "--by-type", "Nope"): "--by-type Nope: no layer of that class in a.json "
                                                                  "(its layer classes: Linear, Net)",
        ("render", "a.json", "-o", "f.svg", "--format", "png"): "--format png contradicts the name 'f.svg'",
        ("diff", "a.json", "b.json", "-o", "d.dot", "--format", "svg"): "--format svg contradicts the name 'd.dot'",
    }
    for argv, says in cases.items():
        status, _, err = run_main(list(argv), root, capsys)
        assert status == 2 and says in err, (argv, err)
    assert not (root / "f.svg").exists() and not (root / "x.dot").exists()
    status, _, err = run_main(["render", "a.json", "-o", "x.dot", "--by-type", "Linear"], root, capsys)
    assert status == 0, err
    status, out, err = run_main(["report", "log"], root, capsys)
    assert status == 0 and (root / "report.html").read_text().startswith("<!DOCTYPE html>"), err
    said = []
    for command in ("report", "explore"):
        status, _, err = run_main([command, "empty_log"], root, capsys)
        assert status == 1, err
        said.append(err)
    assert said[0] == said[1] and "no step_*.json files under empty_log" in said[0]
    assert "LOG_DIR/backward_graph" in said[0]
    status, out, _ = run_main(["diff", "a.json", "b.json"], root, capsys)
    assert status == 0 and "structure changed" in out
    assert not [line for line in out.splitlines() if line.endswith(";")], out
    status, out, _ = run_main(["render", "--help"], root, capsys)
    assert "legibility" in out and "best of TB/LR" not in out and "--max-px" in out


def test_an_integration_without_its_framework_says_what_to_install(tmp_path):
    """``python -m paddleviz_hooks.integrations.paddleformers train x.yaml`` where PaddleFormers is
    not installed: one line naming the pip extra, no traceback."""
    if importlib.util.find_spec("paddleformers") is not None:
        pytest.skip("PaddleFormers is installed here")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "paddleviz_hooks.integrations.paddleformers", "train", "x.yaml"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "needs PaddleFormers, which is not installed: pip install 'paddleviz-hooks[paddleformers]'" in r.stderr
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'paddleviz-hooks\[paddleformers\]'"):
        import paddleviz_hooks.integrations.paddleformers  # noqa: F401
