"""The external layout engine, behind one function.

Order of preference: the system Graphviz ``dot``; else the static binary of
the pip package ``graphviz-pure`` (a Rust port with the same command line).
Both run as a subprocess with a timeout, so a huge graph can never hang the
caller: the process is killed and :class:`RenderTimeout` raised.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["Engine", "EngineNotFound", "RenderTimeout", "find_engine", "run_engine", "run_engine_formats",
           "INSTALL_HINT", "engine_choice", "pinned_engine"]

INSTALL_HINT = (
    "install Graphviz's `dot` (Debian/Ubuntu: `sudo apt-get install -y graphviz`) "
    "or the pip-only engine (`pip install 'paddleviz-hooks[pure]'`, i.e. `pip install graphviz-pure`)"
)

FORMATS = ("png", "svg", "plain", "json", "xdot", "dot")


class EngineNotFound(RuntimeError):
    """No layout engine is installed; DOT and JSON output still work."""


class RenderTimeout(RuntimeError):
    """The layout engine ran past its timeout and was killed."""


@dataclass(frozen=True)
class Engine:
    """A usable layout program: its name and executable path."""

    name: str
    path: str


def find_engine(prefer: str | None = None) -> Engine | None:
    """The layout engine to use, or None.

    Args:
        prefer: ``"dot"`` or ``"graphviz-pure"`` to pick one when both exist;
            the environment variable ``PADDLEVIZ_ENGINE`` sets the default.

    Returns:
        The :class:`Engine`, or None when neither is installed.
    """
    named = "engine"
    if not prefer and os.environ.get("PADDLEVIZ_ENGINE"):
        prefer, named = os.environ["PADDLEVIZ_ENGINE"], "the environment variable PADDLEVIZ_ENGINE"
    prefer = prefer or None
    candidates = []
    dot = shutil.which("dot")
    if dot:
        candidates.append(Engine("dot", dot))
    pure = shutil.which("graphviz-pure") or _beside_python("graphviz-pure")
    if pure:
        candidates.append(Engine("graphviz-pure", pure))
    if prefer is not None:
        if prefer not in ("dot", "graphviz-pure"):
            raise ValueError(f"{named} must be 'dot' or 'graphviz-pure', got {prefer!r}")
        chosen = [c for c in candidates if c.name == prefer]
        return chosen[0] if chosen else None
    return candidates[0] if candidates else None


def _beside_python(name: str) -> str | None:
    # A venv's scripts are not on PATH unless it is activated.
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


#: the choice every run takes while set (see :func:`pinned_engine`)
_PINNED: list[dict[str, str]] = []


def engine_choice() -> dict[str, str]:
    """The engine :func:`require_engine` finds here, as plain data: ``{"name", "path"}``, or
    ``{"error", "type"}`` saying why none (``EngineNotFound`` or ``ValueError``). The drawing
    process draws with the choice of the process that sends it the job (its ``PATH``,
    ``PADDLEVIZ_ENGINE`` and interpreter), passed with :func:`pinned_engine`.

    Examples:
        >>> sorted(engine_choice()) in (["name", "path"], ["error", "type"])
        True
    """
    try:
        engine = require_engine()
    except (EngineNotFound, ValueError) as exc:
        return {"error": str(exc), "type": type(exc).__name__}
    return {"name": engine.name, "path": engine.path}


class pinned_engine:
    """Within the block, every engine run takes ``choice`` (from :func:`engine_choice`).

    Examples:
        >>> with pinned_engine({"error": "none here", "type": "EngineNotFound"}):
        ...     run_engine("digraph { a }", "svg")
        Traceback (most recent call last):
        ...
        paddleviz_hooks.render.engine.EngineNotFound: none here
    """

    def __init__(self, choice: dict[str, str]) -> None:
        self.choice = choice

    def __enter__(self) -> None:
        _PINNED.append(self.choice)

    def __exit__(self, *exc: object) -> None:
        _PINNED.pop()


def require_engine(prefer: str | None = None) -> Engine:
    """Like :func:`find_engine` but raises :class:`EngineNotFound` with the fix."""
    if _PINNED and prefer is None:
        choice = _PINNED[-1]
        if "error" in choice:
            raise (ValueError if choice.get("type") == "ValueError" else EngineNotFound)(choice["error"])
        return Engine(choice["name"], choice["path"])
    engine = find_engine(prefer)
    if engine is None:
        which = f"the layout engine {prefer!r} is not" if prefer else "no Graphviz layout engine is"
        raise EngineNotFound(f"{which} installed, so PNG/SVG cannot be drawn: {INSTALL_HINT}. "
                             "DOT and JSON output work without an engine.")
    return engine


def run_engine(
    source: str,
    fmt: str,
    *,
    args: tuple[str, ...] = (),
    timeout: float | None = 120.0,
    engine: Engine | None = None,
) -> bytes:
    """Lay out DOT ``source`` and return the output bytes.

    Args:
        source: DOT text.
        fmt: output format, e.g. ``"png"``, ``"svg"``, ``"plain"``.
        args: extra command-line arguments such as ``"-Gdpi=72"``.
        timeout: seconds before the engine is killed; None waits forever.
        engine: the engine to use; found with :func:`require_engine` if None.

    Raises:
        EngineNotFound: no engine installed.
        RenderTimeout: the engine ran past ``timeout``.
        RuntimeError: the engine failed (its message is included).
    """
    _check_timeout(timeout)
    engine = engine or require_engine()
    return _execute([engine.path, f"-T{fmt}", *args], source, fmt, timeout, engine)


def run_engine_formats(
    source: str,
    formats: tuple[str, ...],
    *,
    args: tuple[str, ...] = (),
    timeout: float | None = 120.0,
    engine: Engine | None = None,
) -> dict[str, bytes]:
    """Lay out DOT ``source`` once and write it in several formats.

    One engine run (``dot -Tpng -o a.png -Tsvg -o a.svg``): the layout is
    done once, whatever the number of formats. ``args`` apply to every output.

    Args:
        source: DOT text.
        formats: output formats, e.g. ``("png", "svg")``.
        args, timeout, engine: as for :func:`run_engine`.

    Returns:
        format -> output bytes.

    Raises:
        EngineNotFound, RenderTimeout, RuntimeError: as for :func:`run_engine`.

    Examples:
        >>> out = run_engine_formats("digraph { a -> b }", ("png", "svg"))
        >>> out["png"][:4], b"<svg" in out["svg"]
        (b'\\x89PNG', True)
    """
    if len(formats) == 1:
        return {formats[0]: run_engine(source, formats[0], args=args, timeout=timeout, engine=engine)}
    _check_timeout(timeout)
    engine = engine or require_engine()
    with tempfile.TemporaryDirectory(prefix="paddleviz-") as tmp:
        paths = {f: os.path.join(tmp, f"out.{f}") for f in formats}
        cmd = [engine.path, *args]
        for f, path in paths.items():
            cmd += [f"-T{f}", "-o", path]
        _execute(cmd, source, "+".join(formats), timeout, engine, stdout_expected=False)
        out = {}
        for f, path in paths.items():
            with open(path, "rb") as fh:
                out[f] = fh.read()
            if not out[f]:
                raise RuntimeError(f"{engine.name} wrote no {f} output")
        return out


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Linux: this process gets ``sig`` when the thread that started it ends (its process
    killed included), through ``prctl(PR_SET_PDEATHSIG)``. False where that is not available;
    never raises."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


_ENGINE_SETUP: list[Callable[[], Any]] = []  # run in each engine's process before it starts (see below)


def engines_die_with_this_process() -> None:
    """Linux: every engine started from now on is killed when this process dies, whatever
    kills it (SIGKILL included). The set-up runs between fork and exec, which is safe only
    in a process without other threads: the drawing process calls it, nothing else."""
    if sys.platform.startswith("linux") and not _ENGINE_SETUP:
        _ENGINE_SETUP.append(die_with_parent)


def _execute(cmd: list[str], source: str, what: str, timeout: float | None, engine: Engine,
             stdout_expected: bool = True) -> bytes:
    """Run the engine command, killing it after ``timeout``; its stdout.

    The engine runs in a process group of its own, and on a timeout (or an
    interrupt while waiting) the whole group is killed: an engine that is a
    wrapper script leaves none of its children behind.
    """
    group = os.name == "posix"
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=group, preexec_fn=_ENGINE_SETUP[0] if _ENGINE_SETUP else None)
    except OSError as exc:
        raise RuntimeError(f"could not run {engine.path}: {exc}") from None
    with proc:
        try:
            out, err = proc.communicate(source.encode("utf-8"), timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc, group)  # before the engine is reaped: its group id is still its own
            proc.communicate()
            raise RenderTimeout(
                f"{engine.name} did not finish a {what} drawing within {timeout:g} s and was stopped; "
                "draw fewer nodes (depth=..., max_nodes=...) or raise the timeout"
            ) from None
        except BaseException:  # Ctrl-C, or anything else: no engine process outlives the call
            _kill_group(proc, group)
            raise
    if proc.returncode != 0 or (stdout_expected and not out):
        text = err.decode("utf-8", "replace").strip()[-800:]
        raise RuntimeError(f"{engine.name} failed (exit {proc.returncode}) drawing {what}: {text}")
    return out


def _kill_group(proc: subprocess.Popen, group: bool) -> None:
    """Kill the engine and everything it started (its process group); never raises."""
    try:
        if group:
            os.killpg(proc.pid, signal.SIGKILL)  # the group id is the engine's pid (a new session)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError, OSError):
        pass
