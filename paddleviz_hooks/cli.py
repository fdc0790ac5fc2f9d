"""The ``paddleviz-hooks`` command line: render, diff and report saved graphs.

Everything works from the JSON files a capture wrote; no model or training
run is needed.

    paddleviz-hooks render GRAPH.json -o out.png [--depth N] [--max-nodes N] [--max-px N] [--fold-repeats] [--by-type TYPE]
    paddleviz-hooks diff OLD.json NEW.json [-o diff.png]
    paddleviz-hooks report LOG_DIR [-o report.html]
    paddleviz-hooks explore LOG_DIR [--host H] [--port P] [--out DIR]

Errors are one line on stderr (``paddleviz-hooks: error: ...``); the exit
status is 2 for bad usage, 1 for files that cannot be read or written, 0 on
success. Set ``PADDLEVIZ_DEBUG=1`` to see a traceback for unexpected errors.

Inputs are bounded: a step JSON over ``--max-input-mb`` (32 MiB, about
75,000 nodes) is refused before it is read, anything but a regular file is
refused, and a graph of more than ``DRAW_MAX_NODES`` nodes is drawn collapsed
to that many unless ``--max-nodes`` or ``--depth`` says otherwise. ``report``
skips unreadable or malformed files with a warning naming each.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Sequence

from ._fileio import MAX_INPUT_BYTES, read_input
from .escape import visible
from .render.output import DRAW_MAX_NODES

__all__ = ["main"]

PROG = "paddleviz-hooks"


class UsageError(Exception):
    """Bad command-line usage (exit 2)."""


class FileError(Exception):
    """An input that cannot be read or an output that cannot be written (exit 1)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _int_at_least(minimum: int, what: str):
    """An argparse type: a whole number >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = minimum - 1
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    return parse


_positive_int = _int_at_least(1, "a positive whole number")
_nonnegative_int = _int_at_least(0, "a whole number >= 0")


def _port(text: str) -> int:
    v = _nonnegative_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535 (0: a free one), got {text!r}")
    return v


def _path(text: str) -> str:
    """An argparse type: a path, never empty, without NUL bytes."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return text


def _megabytes(text: str) -> int:
    v = _positive_int(text)
    if v > 1 << 20:  # a terabyte: more is a typo
        raise argparse.ArgumentTypeError(f"expected a number of MiB from 1 to {1 << 20}, got {text!r}")
    return v << 20


def _max_px(text: str) -> int:
    v = _int_at_least(64, "a number of pixels from 64 to 32767")(text)
    if v > 32767:  # PNG drawing (cairo) stops there, as for view_max_px
        raise argparse.ArgumentTypeError(f"expected a number of pixels from 64 to 32767, got {text!r}")
    return v


def _ratio_threshold(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number above 1, got {text!r}") from None
    if not v > 1 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number above 1, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    p = _Parser(
        prog=PROG,
        description="Render, compare and report backward graphs saved by paddleviz-hooks (JSON files).",
    )
    from ._version import __version__

    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    r = sub.add_parser("render", help="draw one saved graph as png, svg or dot",
                       description="Draw one saved backward graph (step_*.json) as PNG, SVG or DOT.")
    r.add_argument("graph", metavar="GRAPH.json", type=_path, help="a graph saved by paddleviz-hooks")
    r.add_argument("-o", "--output", required=True, metavar="OUT", type=_path,
                   help="output file; .png, .svg, .dot or .json picks the format")
    r.add_argument("--format", choices=("png", "svg", "dot", "json"), help="output format (default: from OUT's suffix)")
    r.add_argument("--depth", type=_nonnegative_int, metavar="N",
                   help="draw layers at depth N as single boxes (1: top-level layers, 0: the whole model)")
    r.add_argument("--max-nodes", type=_positive_int, metavar="N",
                   help="collapse layers, deepest first, until at most N nodes remain (default: a PNG "
                        "collapses itself as far as legibility within --max-px needs, as the recorder's "
                        f"does; an SVG or DOT of more than {DRAW_MAX_NODES} nodes is collapsed to {DRAW_MAX_NODES})")
    _max_px_option(r)
    r.add_argument("--fold-repeats", action="store_true",
                   help="fold runs of identical sibling layers into one box marked x N")
    r.add_argument("--by-type", action="append", metavar="TYPE",
                   help="collapse every layer of this class (e.g. TransformerEncoderLayer); repeatable")
    _drawing_options(r)
    _input_limit(r)

    d = sub.add_parser("diff", help="compare two saved graphs",
                       description="Compare two saved graphs: print what changed and optionally draw it.")
    d.add_argument("old", metavar="OLD.json", type=_path, help="the earlier graph")
    d.add_argument("new", metavar="NEW.json", type=_path, help="the later graph")
    d.add_argument("-o", "--output", metavar="OUT", type=_path,
                   help="draw the newer graph with the changes marked (.png, .svg, .dot) or save the diff (.json)")
    d.add_argument("--format", choices=("png", "svg", "dot", "json"), help="output format (default: from OUT's suffix)")
    d.add_argument("--threshold", type=_ratio_threshold, default=10.0, metavar="X",
                   help="gradient-norm ratio counted as a large change (default 10)")
    _max_px_option(d)
    _drawing_options(d)
    _input_limit(d)

    rep = sub.add_parser("report", help="one self-contained HTML page of every captured step",
                         description="Write one self-contained HTML file (no network needed) showing "
                                     "every step_*.json found under LOG_DIR.")
    rep.add_argument("log_dir", metavar="LOG_DIR", type=_path, help="the log directory (searched recursively)")
    rep.add_argument("-o", "--output", default="report.html", metavar="REPORT.html", type=_path,
                     help="the HTML file to write (default: report.html in the current folder)")
    rep.add_argument("--title", help="page title")
    _input_limit(rep)

    ex = sub.add_parser("explore", help="open every captured step in Model Explorer (needs the explorer extra)",
                        description="Serve every step_*.json under LOG_DIR, with gradient-norm, NaN/Inf, "
                                    "change and memory overlays, in Google's Model Explorer on this machine "
                                    "until Ctrl-C (pip install 'paddleviz-hooks[explorer]').")
    ex.add_argument("log_dir", metavar="LOG_DIR", type=_path, help="the log directory (searched recursively)")
    ex.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ex.add_argument("--port", type=_port, metavar="N", help="port (default: a free one)")
    ex.add_argument("--out", metavar="DIR", type=_path,
                    help="write the Model Explorer files here (default: a temporary directory, removed at exit)")
    return p


def _input_limit(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-input-mb", type=_megabytes, default=MAX_INPUT_BYTES, metavar="N", dest="max_input",
                   help=f"refuse step files over N MiB unread (default {MAX_INPUT_BYTES >> 20})")


def _max_px_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-px", type=_max_px, metavar="N",
                   help="PNG only: the longest side in pixels, as the recorder's view_max_px (default 2000)")


def _drawing_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rankdir", choices=("TB", "LR", "BT", "RL"),
                   help="layout direction: TB top to bottom, LR left to right... (default: TB for SVG and DOT; "
                        "a PNG takes whichever of TB and LR draws its labels larger)")
    p.add_argument("--no-stats", action="store_true", help="leave gradient norms off the edges")
    p.add_argument("--no-legend", action="store_true", help="leave the legend out")
    p.add_argument("--title", help="caption drawn at the top")


def _draw_opts(args: argparse.Namespace) -> dict:
    opts: dict = {}
    if args.rankdir:
        opts["rankdir"] = args.rankdir
    if args.no_stats:
        opts["stats"] = False
    if args.no_legend:
        opts["legend"] = False
    if args.title:
        opts["title"] = args.title
    return opts


def _out_format(args: argparse.Namespace, allowed: tuple[str, ...]) -> str:
    suffix = os.path.splitext(args.output)[1].lstrip(".").lower()
    if args.format and suffix in allowed and suffix != args.format:
        raise UsageError(f"--format {args.format} contradicts the name {args.output!r} ({suffix.upper()}): "
                         f"name the file .{args.format}, or leave --format out")
    fmt = args.format or suffix
    if getattr(args, "max_px", None) is not None and fmt != "png":
        raise UsageError(f"--max-px sizes a PNG; {args.output!r} is {fmt.upper()}")
    if fmt not in allowed:
        raise UsageError(
            f"cannot tell the output format from {args.output!r}: use a name ending in "
            f"{', '.join('.' + a for a in allowed)} or --format"
        )
    return fmt


def _check_output(path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise FileError(f"cannot write {path}: it is a directory")
    if not os.path.isdir(directory):
        raise FileError(f"cannot write {path}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK):
        raise FileError(f"cannot write {path}: directory {directory} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise FileError(f"cannot write {path}: the file is not writable")


def load_graph(path: str, max_bytes: int = MAX_INPUT_BYTES):
    """Read a saved graph; raises :class:`FileError` with a readable reason.

    Only a regular file of at most ``max_bytes`` is read (checked first).
    """
    from .diff import DIFF_FORMAT
    from .graph import BackwardGraph, parse_json

    try:
        data = read_input(path, max_bytes)
    except FileNotFoundError:
        raise FileError(f"cannot read {path}: no such file") from None
    except OSError as exc:
        raise FileError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # over the size limit
        raise FileError(str(exc)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise FileError(f"{path} is not a paddleviz-hooks graph (not UTF-8 text, perhaps an image?)") from None
    try:
        d = parse_json(text)
        if isinstance(d, dict) and d.get("format") == DIFF_FORMAT:
            picture = os.path.splitext(path)[0] + ".png"
            shown = f"its picture is {picture}; " if os.path.isfile(picture) else ""
            raise FileError(f"{path} is a saved diff, not a graph: {shown}draw a diff from the two graphs it "
                            "compares with `paddleviz-hooks diff OLD.json NEW.json -o diff.png`")
        graph = BackwardGraph.from_dict(d)
    except ValueError as exc:
        raise FileError(f"{path} is not a paddleviz-hooks graph: {exc}") from None
    if any(not n.key for n in graph.nodes):
        graph.assign_keys()
    return graph


def _cmd_render(args: argparse.Namespace) -> int:
    fmt = _out_format(args, ("png", "svg", "dot", "json"))
    graph = load_graph(args.graph, args.max_input)
    _check_output(args.output)
    _check_by_type(args, graph)
    opts = _draw_opts(args)
    if args.max_px is not None:
        opts["max_px"] = args.max_px
    if args.depth is not None:
        opts["depth"] = args.depth
    if args.max_nodes is not None:
        opts["max_nodes"] = args.max_nodes
    elif args.depth is None and fmt == "png":
        pass  # the recorder's viewing PNG: collapsed and folded as far as legibility needs
    elif args.depth is None and fmt != "json" and len(graph.nodes) > DRAW_MAX_NODES:
        opts["max_nodes"] = DRAW_MAX_NODES
        print(f"{args.graph} has {len(graph.nodes):,} nodes: drawn collapsed to at most {DRAW_MAX_NODES} "
              "(choose with --max-nodes N or --depth N)", flush=True)
    if args.fold_repeats:
        opts["fold_repeats"] = True
    if args.by_type:
        opts["by_type"] = tuple(args.by_type)
    if "title" not in opts and fmt != "json":
        from .text import graph_title

        title = graph_title(graph)  # the recorder's title ("step 8 - trigger: ...")
        if title is not None:
            opts["title"] = title
    from .render import render_to_file

    render_to_file(graph, args.output, format=fmt, **opts)
    print(f"wrote {args.output}")
    return 0


def _check_by_type(args: argparse.Namespace, graph) -> None:
    """Each --by-type names a layer class of the graph (a typo would draw nothing collapsed)."""
    classes = sorted(set(graph.layers.values()))
    unknown = [t for t in args.by_type or () if t not in classes]
    if unknown:
        have = ", ".join(classes) if classes else "none: it was captured without a model"
        raise UsageError(f"--by-type {unknown[0]}: no layer of that class in {args.graph} (its layer classes: {have})")


def _cmd_diff(args: argparse.Namespace) -> int:
    from .diff import diff_graphs
    from .text import diff_summary

    if args.max_px is not None and not args.output:
        raise UsageError("--max-px sizes the drawing -o writes: give -o DIFF.png")
    fmt = _out_format(args, ("png", "svg", "dot", "json")) if args.output else None
    older = load_graph(args.old, args.max_input)
    newer = load_graph(args.new, args.max_input)
    if args.output:
        _check_output(args.output)
    d = diff_graphs(older, newer, threshold=args.threshold)
    # one fact a line; the ';' that keeps them apart where VisualDL joins lines is not needed here
    print(visible("\n".join(line.removesuffix(";") for line in diff_summary(d).splitlines()), lines=True))
    if args.output:
        from .render.diff import render_diff

        opts = _draw_opts(args)
        if args.max_px is not None:
            opts["max_px"] = args.max_px
        if fmt != "json" and max(len(older.nodes), len(newer.nodes)) > DRAW_MAX_NODES:
            opts["max_nodes"] = DRAW_MAX_NODES
        render_diff(d, newer, older, args.output, format=fmt, **opts)
        print(f"wrote {args.output}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .sinks.report import ReportError, build_report

    if not os.path.isdir(args.log_dir):
        what = "no such directory" if not os.path.exists(args.log_dir) else "not a directory"
        raise FileError(f"cannot read log directory {args.log_dir}: {what}")
    _check_output(args.output)
    try:
        with warnings.catch_warnings(record=True) as skipped:
            warnings.simplefilter("always", RuntimeWarning)
            path = build_report(args.log_dir, args.output, title=args.title, max_input_bytes=args.max_input)
    except ReportError as exc:
        raise FileError(str(exc)) from None
    finally:
        for w in skipped:  # malformed, unreadable, too large or not regular files: each named
            print(f"{PROG}: warning: {visible(' '.join(str(w.message).split()))}", file=sys.stderr)
    print(f"wrote {path}")
    return 0


def _cmd_explore(args: argparse.Namespace) -> int:
    import shutil
    import signal
    import tempfile

    from .explore import ExplorerMissing, check_host_port, serve
    from .sinks.explorer import export_explorer
    from .sinks.report import ReportError

    check_host_port(args.host, args.port)  # before anything is made
    if not os.path.isdir(args.log_dir):
        what = "no such directory" if not os.path.exists(args.log_dir) else "not a directory"
        raise FileError(f"cannot read log directory {args.log_dir}: {what}")
    # SIGTERM ends the server like Ctrl-C does, so the temporary folder is removed on every exit
    previous = signal.signal(signal.SIGTERM, _terminate)
    temp_dir = None if args.out else tempfile.mkdtemp(prefix="paddleviz-explorer-")
    try:
        try:
            files = export_explorer(args.log_dir, args.out or temp_dir)
        except ReportError as exc:
            raise FileError(str(exc)) from None
        print(f"{len(files.graph_ids)} captures, overlays: {', '.join(files.overlays)}", flush=True)
        try:
            serve(files, args.host, args.port)
        except ExplorerMissing as exc:
            raise FileError(str(exc)) from None
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    return 0


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through the server's loop and every finally


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (never raises for bad input).

    Examples:
        >>> main(["render", "no_such_step.json", "-o", "x.png"])
        1
    """
    from .render.engine import EngineNotFound, RenderTimeout

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not args.command:
            raise UsageError(f"a command is required: render, diff, report or explore (see '{PROG} --help')")
        handler = {"render": _cmd_render, "diff": _cmd_diff, "report": _cmd_report,
                   "explore": _cmd_explore}[args.command]
        return handler(args)
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else 0
    except UsageError as exc:
        _error(str(exc))
        return 2
    except FileError as exc:
        _error(str(exc))
        return 1
    except (EngineNotFound, RenderTimeout) as exc:
        _error(str(exc))
        return 1
    except RuntimeError as exc:  # the layout engine failed
        _error(str(exc))
        return 1
    except (ValueError, TypeError) as exc:  # option values the drawing code refused
        _error(str(exc))
        return 2
    except OSError as exc:
        name = f" {exc.filename}" if exc.filename else ""
        _error(f"cannot write{name}: {exc.strerror or exc}")
        return 1
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except Exception as exc:  # never a traceback for users
        if os.environ.get("PADDLEVIZ_DEBUG"):
            raise
        _error(f"unexpected {type(exc).__name__}: {exc} (set PADDLEVIZ_DEBUG=1 for a traceback)")
        return 1


def _error(message: str) -> None:
    message = visible(" ".join(str(message).split()))  # one line, nothing hidden
    print(f"{PROG}: error: {message}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
