"""The package's imports flow one way.

capture/ -> graph model -> transforms (collapse, diff) -> ranks -> presentation (text,
render/) -> sinks/ -> pipeline -> recorder -> callbacks/ (and compat, cli).
Every ``import`` statement counts, at module level and inside functions.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import paddleviz_hooks

PKG_DIR = os.path.dirname(paddleviz_hooks.__file__)

#: Layers, lowest first. A module may import modules of lower layers, and
#: modules of its own layer only inside its own subpackage (never in a cycle).
LAYERS = [
    ("escaping", {"escape"}),  # the one place text from models and users is made safe (warnings too)
    ("foundations", {"_version", "_fileio", "_interrupts", "argcheck", "warn", "hazards", "graph"}),
    ("capture", {"capture"}),
    ("findings", {"findings"}),  # the NaN/Inf record of a capture, read by every view
    ("transforms", {"collapse", "diff"}),
    ("across ranks", {"ranks"}),  # built on diff: one step of several ranks matched
    ("wording", {"text"}),
    ("drawing", {"render"}),
    ("sinks", {"sinks"}),
    ("serving", {"explore"}),
    ("options", {"options"}),
    ("drawing process", {"drawproc", "drawworker"}),  # the drawing process and its client
    ("pipeline", {"pipeline", "triggers"}),
    ("recorder", {"recorder"}),
    ("adapters", {"callbacks", "compat", "cli", "notebook", "attaching"}),
    ("framework adapters", {"integrations"}),  # PaddleFormers, PaddleDetection: built on attach
    ("root", {""}),
]


def _modules() -> dict[str, tuple[str, bool]]:
    mods = {}
    for dirpath, _, files in os.walk(PKG_DIR):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, PKG_DIR)[:-3].replace(os.sep, ".")
                is_pkg = rel.endswith("__init__")
                name = rel[: -len("__init__")].rstrip(".") if is_pkg else rel
                mods[name] = (path, is_pkg)
    return mods


def _imports() -> dict[str, set[str]]:
    """module -> package modules it imports (relative names, "" is the root)."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, (path, is_pkg) in mods.items():
        here = m.split(".") if m else []
        base = here if is_pkg else here[:-1]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = base[: len(base) - (node.level - 1)] if node.level > 1 else list(base)
                    mod = ".".join(parts + ([node.module] if node.module else []))
                elif (node.module or "").startswith("paddleviz_hooks"):
                    mod = node.module[len("paddleviz_hooks"):].lstrip(".")
                else:
                    continue
                # `from .x import y`: y itself when it is a module, else x
                subs = [f"{mod}.{a.name}".lstrip(".") for a in node.names]
                targets = [t for t in subs if t in mods] or [mod]
                if len(targets) < len(subs):
                    targets.append(mod)
            elif isinstance(node, ast.Import):
                targets = [a.name[len("paddleviz_hooks"):].lstrip(".") for a in node.names
                           if a.name.startswith("paddleviz_hooks")]
            edges[m].update(t for t in targets if t in mods and t != m)
    return edges


def _layer(module: str) -> int:
    top = module.split(".")[0] if module else ""
    for i, (_, members) in enumerate(LAYERS):
        if top in members:
            return i
    raise AssertionError(f"module paddleviz_hooks.{module} is in no layer: add it to LAYERS")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(u, stack):
        state[u] = 1
        stack.append(u)
        for v in sorted(edges[u]):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    return found


def test_no_import_cycles():
    assert _cycles(_imports()) == []


def test_imports_follow_the_layers():
    wrong = []
    for m, targets in _imports().items():
        for t in targets:
            lm, lt = _layer(m), _layer(t)
            same_package = m.split(".")[0] == t.split(".")[0]
            if lt > lm or (lt == lm and not same_package):
                wrong.append(f"{m or '<root>'} ({LAYERS[lm][0]}) imports {t or '<root>'} ({LAYERS[lt][0]})")
    assert wrong == []


def test_the_walker_sees_imports_inside_functions():
    """The check above would be worthless if it missed function-level imports."""
    edges = _imports()
    assert "graph" in edges["capture.gradnode"]
    assert "render" in edges["cli"]  # cli imports render inside a function


def test_graph_module_loads_nothing_else():
    code = ("import sys, paddleviz_hooks.graph; "
            "print(sorted(m for m in sys.modules if m.startswith('paddleviz_hooks')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["paddleviz_hooks", "paddleviz_hooks._version", "paddleviz_hooks.graph"]


def test_package_root_is_lazy():
    code = ("import sys, paddleviz_hooks; "
            "print(sorted(m for m in sys.modules if m.startswith(('paddleviz_hooks', 'paddle.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["paddleviz_hooks", "paddleviz_hooks._version"]


def test_every_public_name_resolves():
    for name in paddleviz_hooks.__all__:
        assert getattr(paddleviz_hooks, name) is not None, name
