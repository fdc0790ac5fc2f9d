"""Every public option checked completely (issue 28 item 4, issue 33 item 6 keywords).

A table of hostile values is tried on every option of the recorder, the
callback, ``capture_backward``, the report, the export and the command line.
The one rule: a wrong *type* raises ``TypeError``, a wrong value of the right
type ``ValueError``, both naming the option; nothing else escapes, and a value
is accepted only where it is meaningful.
"""

from __future__ import annotations

import math
import os

import pytest

from paddleviz_hooks import BackwardGraphCallback, BackwardGraphRecorder, capture_backward
from paddleviz_hooks.cli import main
from paddleviz_hooks.graph import BackwardGraph, Edge, Node
from paddleviz_hooks.recorder import option_names
from paddleviz_hooks.sinks.explorer import export_explorer
from paddleviz_hooks.sinks.report import build_report

HOSTILE = {"None": None, "''": "", "NUL": "\0", "a NUL b": "a\0b", "-1": -1, "0": 0, "1": 1, "2": 2,
           "2**70": 2 ** 70, "1.5": 1.5, "nan": math.nan, "inf": math.inf, "True": True, "False": False,
           "[]": [], "[None]": [None], "{}": {}, "object()": object(), "b'x'": b"x"}
BOOL = {"True", "False"}
#: option -> the hostile values it accepts (every other one must be refused)
ACCEPTED = {
    "log_dir": set(),
    "every": {"None", "1", "2", "2**70"},
    "steps": {"None", "[]", "{}"},  # empty: no scheduled step, the triggers' captures only
    "capture_first": BOOL, "grad_stats": BOOL, "saved_memory": BOOL, "sources": BOOL, "visualdl": BOOL,
    "visualdl_graphs": BOOL,
    "visualdl_diagnostics": BOOL, "on_nonfinite": BOOL, "on_structure_change": BOOL,
    "max_captures": {"None", "1", "2", "2**70"},
    "color_by": {"None"},
    "view_max_nodes": {"None", "2", "2**70"},
    "view_max_px": set(),  # 64 to 32767
    "viewer_px": {"None"},
    "formats": set(),
    "run_name": set(),
    "ranks": {"0", "1", "2", "2**70"},
    "on_grad_spike": {"None", "2", "2**70", "1.5"},
    "cooldown": {"0", "1", "2", "2**70"},
    "queue_size": {"1", "2", "2**70"},
    "render_timeout": {"1", "2", "1.5"},
    "close_timeout": {"0", "1", "2", "1.5"},
    "verbose": {"0", "1", "True", "False"},
    "scalar_depth": {"None", "1", "2", "2**70"},
    "sinks": {"[]"},  # no dashboard: files only
}


def test_the_table_covers_every_option():
    assert set(ACCEPTED) | {"model"} == set(option_names())


@pytest.mark.parametrize("option", sorted(ACCEPTED))
def test_every_recorder_option_against_hostile_values(tmp_path, option):
    wrong = []
    for label, value in HOSTILE.items():
        try:
            if option == "log_dir":
                BackwardGraphRecorder(value)
            else:
                BackwardGraphRecorder(str(tmp_path), **{option: value})
        except (TypeError, ValueError) as exc:
            if label in ACCEPTED[option]:
                wrong.append(f"{label}: refused ({exc})")
            elif option not in str(exc):
                wrong.append(f"{label}: the error does not name {option}: {exc}")
            elif isinstance(exc, ValueError) != _right_type(option, value):
                wrong.append(f"{label}: {type(exc).__name__} ({exc})")
        except Exception as exc:  # noqa: BLE001 - anything else breaks the rule
            wrong.append(f"{label}: {type(exc).__name__}: {exc}")
        else:
            if label not in ACCEPTED[option]:
                wrong.append(f"{label}: accepted")
    assert not wrong, wrong
    assert os.listdir(tmp_path) == []  # nothing is made when the recorder is made


def _right_type(option: str, value) -> bool:
    """Whether ``value`` has the type ``option`` takes (so a refusal must be ValueError)."""
    if option == "log_dir":
        return isinstance(value, str)
    if option == "sinks":
        return isinstance(value, str) or isinstance(value, list) and all(isinstance(v, str) for v in value)
    if option in ("every", "max_captures", "scalar_depth", "view_max_nodes", "view_max_px", "viewer_px", "cooldown", "queue_size",
                  "verbose", "ranks"):
        ok = isinstance(value, int) and (option == "verbose" or not isinstance(value, bool))
        many = isinstance(value, (list, dict)) and all(isinstance(v, int) for v in value)
        return ok or (option == "ranks" and (many or isinstance(value, str)))
    if option in ("on_grad_spike", "render_timeout", "close_timeout"):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if option in ("color_by", "run_name"):
        return isinstance(value, str)
    if option == "formats":
        return isinstance(value, (str, list, dict)) and all(isinstance(v, str) for v in value)
    if option == "steps":  # iterables of ints
        return isinstance(value, (list, dict)) and all(isinstance(v, int) for v in value)
    return isinstance(value, bool)


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(log_dir=""), ValueError, ["log_dir", "''"]),
    (dict(log_dir="runs\0/x"), ValueError, ["log_dir", "NUL"]),
    (dict(ranks=[]), ValueError, ["ranks", "[]"]),
    (dict(verbose=2), ValueError, ["verbose", "0 (silent) or 1", "2"]),
    (dict(close_timeout=1e300), ValueError, ["close_timeout", "1e+300"]),
    (dict(view_max_px=10 ** 9), ValueError, ["view_max_px", "32767", "1000000000"]),
], ids=["empty log_dir", "NUL in log_dir", "ranks=[]", "verbose=2", "huge close_timeout",
        "huge view_max_px"])
def test_refused_at_construction(tmp_path, kwargs, exc, words):
    log_dir = kwargs.pop("log_dir", str(tmp_path))
    for make in (BackwardGraphRecorder, BackwardGraphCallback):
        with pytest.raises(exc) as info:
            make(log_dir, **kwargs)
        for w in words:
            assert w in str(info.value), info.value


@pytest.mark.parametrize("call,typo,fix", [
    (lambda: BackwardGraphCallback("x", evry=5), "evry", "every"),
    (lambda: BackwardGraphRecorder("x", evry=5), "evry", "every"),
    (lambda: BackwardGraphCallback("x", on_nan=True), "on_nan", None),
    (lambda: BackwardGraphRecorder("x", colour_by="grad_norm"), "colour_by", "color_by"),
    (lambda: capture_backward(None, grad_stat=False), "grad_stat", "grad_stats"),
], ids=["callback evry", "recorder evry", "callback on_nan", "recorder colour_by", "capture_backward grad_stat"])
def test_wrong_keywords_name_the_class_called_and_the_closest_option(call, typo, fix):
    with pytest.raises(TypeError) as info:
        call()
    msg = str(info.value)
    called = {"BackwardGraphCallback", "BackwardGraphRecorder", "capture_backward"}
    named = [c for c in called if msg.startswith(c + "()")]
    assert len(named) == 1, msg
    assert repr(typo) in msg and (f"did you mean {fix!r}?" in msg if fix else "on_nonfinite" in msg), msg
    if "Callback" in named[0]:
        assert "BackwardGraphRecorder" not in msg


def _graph():
    return BackwardGraph([Node(0, "root", "loss"), Node(1, "op", "ExpGradNode", "Exp")], [Edge(0, 1)],
                         meta={"step": 1})


@pytest.mark.parametrize("call", [
    lambda d: build_report("", os.path.join(d, "r.html")),
    lambda d: build_report(d, ""),
    lambda d: build_report(d, os.path.join(d, "r\0.html")),
    lambda d: export_explorer(_graph(), ""),
    lambda d: export_explorer(_graph(), d + "/a\0b"),
    lambda d: __import__("paddleviz_hooks").render_to_file(_graph(), ""),
    lambda d: __import__("paddleviz_hooks").render_to_file(_graph(), d + "/a\0.svg"),
], ids=["report log_dir ''", "report out ''", "report out NUL", "export out_dir ''", "export out_dir NUL",
        "render path ''", "render path NUL"])
def test_other_paths_refused_with_value_error(tmp_path, call):
    with pytest.raises(ValueError, match="non-empty path without NUL bytes"):
        call(str(tmp_path))


CLI_PATHS = ["", "a\0b", "x" * 5000]
CLI_VALUES = ["", "a\0b", "-1", "99999999999999999999999", "nan", "inf", "1e309", "x" * 5000]


def _cli_cases(step: str, d: str) -> list[list[str]]:
    out = os.path.join(d, "o.dot")  # accepted values write DOT: no layout engine run
    cases = []
    for v in CLI_PATHS:
        cases += [["render", v, "-o", out], ["render", step, "-o", v], ["diff", v, step], ["diff", step, v],
                  ["diff", step, step, "-o", v], ["report", v, "-o", os.path.join(d, "r.html")],
                  ["report", d, "-o", v], ["explore", v], ["explore", d, "--out", v]]
    for v in CLI_VALUES:
        cases += [["render", step, "-o", out, "--depth", v], ["render", step, "-o", out, "--max-nodes", v],
                  ["render", step, "-o", out, "--format", v], ["render", step, "-o", out, "--rankdir", v],
                  ["render", step, "-o", out, "--max-input-mb", v], ["diff", step, step, "--threshold", v],
                  ["explore", d, "--port", v]]
    for v in ["", "a\0b", "a b", "a/b", "x" * 5000]:  # no name that would need a DNS look-up
        cases.append(["explore", d, "--host", v])
    return cases


def test_command_line_hostile_values(tmp_path, capsys, monkeypatch):
    """Every option of every command with hostile values: refused with exit 1 or 2 and one error line
    (or, for an output name such as ``-1``, accepted), never an unexpected error or a traceback, and
    no temporary folder left behind."""
    monkeypatch.chdir(tmp_path)  # outputs named "nan", "-1"... land here
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    step = str(tmp_path / "step_000001.json")
    with open(step, "w") as f:
        f.write(_graph().to_json())
    wrong = []
    for argv in _cli_cases(step, str(tmp_path)):
        code = main(argv)
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("paddleviz-hooks: error:")]
        refused = code in (1, 2) and len(lines) == 1
        if not (refused or code == 0 and not err) or "unexpected" in err or "Traceback" in err:
            wrong.append((argv[:1] + [a[:20] for a in argv[1:]], code, err[-300:]))
        if code == 0 and argv[-1] != "99999999999999999999999":  # a huge depth, threshold...: harmless
            wrong.append((argv[:1] + [a[:20] for a in argv[1:]], "accepted"))
    assert not wrong, wrong[:5]
    assert os.listdir(tmp_path / "tmp") == []


@pytest.mark.parametrize("option,accepted", [("layer", {"None"}), ("grad_stats", BOOL), ("saved_memory", BOOL),
                                             ("sources", BOOL), ("params", {"None", "{}"})])
def test_capture_backward_options_against_hostile_values(option, accepted):
    wrong = []
    for label, value in HOSTILE.items():
        try:
            capture_backward(**{option: value})
        except (TypeError, ValueError) as exc:
            if label in accepted or option not in str(exc):
                wrong.append(f"{label}: {exc}")
        except Exception as exc:  # noqa: BLE001
            wrong.append(f"{label}: {type(exc).__name__}: {exc}")
        else:
            if label not in accepted:
                wrong.append(f"{label}: accepted")
    assert not wrong, wrong
