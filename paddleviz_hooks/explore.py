"""Serving captures in Google's Model Explorer on this machine.

:func:`explore` exports a log directory (or graphs) with
:func:`paddleviz_hooks.sinks.explorer.export_explorer` and starts Model
Explorer's web server in a child process on ``127.0.0.1``; it returns at once
(in Jupyter it also shows the page in an iframe). ``paddleviz-hooks explore
LOGDIR`` does the same in the foreground until Ctrl-C.

The server is confined (:class:`_Confined`, installed on Model Explorer's own
Flask app): only the export's files can be read through it (its endpoints that
read, upload or load any path are refused or limited to those files), a request
whose ``Host`` is not this machine's (a DNS-rebinding page) is refused, and
nothing leaves the machine: the version check on PyPI is switched off, the
page's web font (fonts.gstatic.com) is dropped from the page it serves (a
local font is used), a Content-Security-Policy lets the page load from this
server only, and no browser is opened. Model Explorer is an optional
dependency: ``pip install paddleviz-hooks[explorer]``.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Any

from .argcheck import check_path
from .sinks.explorer import ExplorerExport, export_explorer

__all__ = ["Explorer", "ExplorerMissing", "check_host_port", "explore", "explorer_url", "host_allowed", "serve"]

DEFAULT_HOST = "127.0.0.1"
_START_TIMEOUT = 60.0


class ExplorerMissing(ImportError):
    """Model Explorer is not installed."""


def _require() -> None:
    try:
        import model_explorer  # noqa: F401
    except ImportError:
        raise ExplorerMissing(
            "Model Explorer is not installed: pip install 'paddleviz-hooks[explorer]' "
            "(or pip install ai-edge-model-explorer)"
        ) from None


def check_host_port(host: Any, port: Any) -> None:
    """``TypeError``/``ValueError`` for a host or port no server can listen on."""
    if not isinstance(host, str):
        raise TypeError(f"host must be a non-empty str such as '127.0.0.1', got {host!r}")
    if not host or not host.isprintable() or any(c in host for c in " /?#@"):
        raise ValueError(f"host must be an address or host name such as '127.0.0.1', got {host!r}")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
        raise TypeError(f"port must be an int or None (a free port), got {port!r}")
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"port must be between 0 and 65535 (0 or None: a free port), got {port!r}")


def _free_port(host: str, port: int | None) -> int:
    """``port`` when it is free on ``host`` (a free one for None or 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does: a port in TIME_WAIT is free
        try:
            s.bind((host, port or 0))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                             "(pick another --port, or leave it out for a free one)") from None
        return s.getsockname()[1]


def explorer_url(files: ExplorerExport, host: str, port: int) -> str:
    """The page address that opens every graph and overlay of an export.

    Model Explorer reads the model and node-data paths from the ``data``
    parameter of its address, and the graph and node to open at from its
    ``uiState``: the NaN/Inf origin when a capture has one (``files.start``).
    """
    data: dict[str, Any] = {"models": [{"url": os.path.abspath(files.graphs)}],
                            "nodeData": [os.path.abspath(p) for p in files.overlays.values()],
                            "nodeDataTargets": ["" for _ in files.overlays]}
    if files.start is not None:
        graph_id, node_id = files.start
        data["uiState"] = {"paneStates": [{
            "deepestExpandedGroupNodeIds": [], "selectedNodeId": node_id, "selectedGraphId": graph_id,
            "selectedCollectionLabel": files.label, "widthFraction": 1, "selected": True}]}
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/?data={urllib.parse.quote(json.dumps(data))}"


# the page's @font-face rules load Google Sans from fonts.gstatic.com; without them a local font is used
_REMOTE_FONT = re.compile(r"@font-face\s*\{[^}]*https?://[^}]*\}|<link[^>]*href=\"https?://[^>]*>")
# the browser may load from this server only (inline styles, scripts and data: URLs are the app's own)
_CSP = ("default-src 'self' 'unsafe-inline' 'unsafe-eval' data: blob:; "
        "connect-src 'self'; font-src 'self' data:; frame-ancestors *")
# Model Explorer endpoints the page needs that read no path given by the request
_OPEN_ENDPOINTS = frozenset({"/check_health", "/api/v1/check_new_version", "/api/v1/get_extensions",
                             "/apistream/server_director"})
# Answered here, as Model Explorer answers them when it has nothing to give: graphs held in its
# process (this server gives files; Model Explorer raised IndexError into its log for any index),
# and the page's note of a model path to watch for changes (nothing is watched: the page logged
# a refusal on every load)
_EMPTY_ANSWERS = {"/api/v1/load_graphs_json": {}, "/api/v1/load_node_data": {},
                  "/api/v1/notify_user_provided_model_path": {"status": "ok"}}


def host_allowed(header: str, host: str) -> bool:
    """Whether a request's ``Host`` header names this server: ``localhost``, an IP
    address or the host it was started with (any port: a forwarded port is fine).
    A DNS-rebinding page sends its own host name, which is refused.

    Examples:
        >>> host_allowed("127.0.0.1:8080", "127.0.0.1"), host_allowed("localhost:9000", "127.0.0.1")
        (True, True)
        >>> host_allowed("evil.example:8080", "127.0.0.1"), host_allowed("", "127.0.0.1")
        (False, False)
    """
    header = (header or "").strip().lower()
    name = header[1:header.find("]")] if header.startswith("[") else header.rsplit(":", 1)[0]
    if not name:
        return False
    if name in ("localhost", host.strip("[]").lower()):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class _Confined:
    """The guard installed on Model Explorer's Flask app (see the module's docstring)."""

    def __init__(self, host: str, files: ExplorerExport) -> None:
        self.host = host
        self.readable = {os.path.realpath(p) for p in (files.graphs, *files.overlays.values())}
        self._index: bytes | None = None

    def install(self, app: Any) -> None:
        app.before_request(self.before)
        app.after_request(self.after)

    def index(self) -> bytes:
        """Model Explorer's page without its remote web font."""
        if self._index is None:
            import model_explorer

            path = os.path.join(os.path.dirname(model_explorer.__file__), "web_app", "index.html")
            with open(path, encoding="utf-8") as f:
                self._index = _REMOTE_FONT.sub("", f.read()).encode("utf-8")
        return self._index

    def before(self) -> Any:
        import flask

        req = flask.request
        if not host_allowed(req.host, self.host):
            return flask.Response(f"refused: Host {req.host!r} is not this server", 403, mimetype="text/plain")
        path = req.path
        if path in ("/", "/index.html"):
            return flask.Response(self.index(), 200, mimetype="text/html")
        if path in _OPEN_ENDPOINTS:
            return None
        if path in _EMPTY_ANSWERS:
            return flask.jsonify(_EMPTY_ANSWERS[path])
        if path == "/api/v1/read_text_file":
            asked = req.args.get("path") or ""
            if "\0" not in asked and os.path.realpath(os.path.expanduser(asked)) in self.readable:
                return None
            return flask.Response("refused: only the exported captures can be read", 403, mimetype="text/plain")
        if path.startswith(("/api", "/apipost", "/apistream")):  # upload, send_command, update_config...
            return flask.Response("refused: not available on this server", 403, mimetype="text/plain")
        return None  # the web app's own files (Model Explorer refuses paths outside them)

    def after(self, response: Any) -> Any:
        response.headers["Content-Security-Policy"] = _CSP
        return response


class _ConfinedFlask:
    """``model_explorer.server``'s view of the ``flask`` module, whose apps are confined."""

    def __init__(self, flask: Any, guard: _Confined) -> None:
        self._flask, self._guard = flask, guard

    def __getattr__(self, name: str) -> Any:
        return getattr(self._flask, name)

    def Flask(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 (flask's name)
        app = self._flask.Flask(*args, **kwargs)
        self._guard.install(app)
        return app


def serve(files: ExplorerExport, host: str = DEFAULT_HOST, port: int | None = None) -> None:
    """Run Model Explorer on an export in this process until Ctrl-C (what the CLI does).

    Prints one address: the page that opens every capture, at the NaN/Inf
    origin when a capture has one.

    Args:
        files: what :func:`export_explorer` wrote.
        host: address to listen on.
        port: port (None: a free one).

    Raises:
        ExplorerMissing: Model Explorer is not installed.
        ValueError: the port is taken.
    """
    check_host_port(host, port)
    _require()
    from model_explorer import server
    from model_explorer.config import ModelExplorerConfig

    port = _free_port(host, port)
    # the version check asks pypi.org at start-up and on every page load
    server._check_new_version = lambda print_msg=True: {
        "version": "", "runningVersion": "", "releaseUrl": "", "desktopAppUrl": ""}
    cfg = ModelExplorerConfig()
    cfg.add_model_from_path(files.graphs)
    for path in files.overlays.values():
        cfg.add_node_data_from_path(path)
    print(f"{explorer_url(files, host, port)}\nPress Ctrl+C to stop.", flush=True)
    import flask

    server.flask = _ConfinedFlask(flask, _Confined(host, files))
    server.print = lambda *a, **k: None  # its own banner and second, shorter address
    try:
        server.start(host=host, port=port, config=cfg, no_open_in_browser=True, skip_health_check=True)
    finally:
        server.flask = flask
        del server.print


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    try:
        ip = shell.get_ipython() if shell is not None else None
    except Exception:
        return False
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


class Explorer:
    """A running Model Explorer server (returned by :func:`explore`).

    Attributes:
        url: the page showing every capture and overlay.
        files: the exported files it serves.
    """

    def __init__(self, url: str, files: ExplorerExport, process: subprocess.Popen, log_path: str,
                 temp_dir: str | None = None) -> None:
        self.url = url
        self.files = files
        self._process = process
        self._log_path = log_path
        self._temp_dir = temp_dir  # made by explore(): removed by stop()

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._process.poll() is None

    def stop(self) -> None:
        """Stop the server (its whole process group)."""
        proc = self._process
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def iframe(self, height: int = 800) -> str:
        """HTML of an iframe showing the page."""
        from .escape import html_escape

        return (f'<iframe src="{html_escape(self.url)}" width="100%" height="{int(height)}" '
                'style="border:1px solid #ccc"></iframe>')

    def __enter__(self) -> "Explorer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Explorer({self.url if self.running else 'stopped'})"


def explore(source: Any, *, host: str = DEFAULT_HOST, port: int | None = None, out_dir: str | None = None,
            inline: bool | None = None, height: int = 800) -> Explorer:
    """Open captures in Model Explorer without blocking.

    Args:
        source: a log directory, a :class:`~paddleviz_hooks.graph.BackwardGraph`
            or a list of them.
        host: address the server listens on.
        port: its port (None: a free one).
        out_dir: where the exported files go (None: a new temporary directory).
        inline: show the page in the notebook (None: when running in Jupyter).
        height: iframe height in pixels.

    Returns:
        An :class:`Explorer`: ``.url`` to open, ``.stop()`` to end the server.

    Raises:
        ExplorerMissing: Model Explorer is not installed.
        TypeError / ValueError: bad arguments, an empty log directory, a taken port.
        RuntimeError: the server did not start (its output is quoted).

    Examples:
        >>> explore(42)
        Traceback (most recent call last):
        ...
        TypeError: export_explorer takes a BackwardGraph, a non-empty list of them or a log directory, got int
    """
    check_host_port(host, port)
    out_dir = check_path("out_dir", out_dir, allow_none=True)
    if not isinstance(height, int) or isinstance(height, bool) or height < 100:
        raise ValueError(f"height must be an int of at least 100 pixels, got {height!r}")
    _require()
    temp_dir = None if out_dir else tempfile.mkdtemp(prefix="paddleviz-explorer-")
    try:
        files = export_explorer(source, out_dir or temp_dir)
        port = _free_port(host, port)
        log_path = os.path.join(os.path.dirname(files.graphs), "server.log")
        cmd = [sys.executable, "-m", "paddleviz_hooks.explore", files.graphs, *files.overlays.values(),
               "--host", host, "--port", str(port)]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
    except BaseException:  # a taken port, an interrupt: nothing made is left behind
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    handle = Explorer(explorer_url(files, host, port), files, proc, log_path, temp_dir)
    atexit.register(handle.stop)  # the server and its temporary folder do not outlive this process
    deadline = time.monotonic() + _START_TIMEOUT
    shown = f"[{host}]" if ":" in host else host
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"Model Explorer exited with status {proc.returncode}: {_tail(log_path)}")
            try:
                with urllib.request.urlopen(f"http://{shown}:{port}/check_health", timeout=2) as r:
                    if r.read() == b"model_explorer_ok":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Model Explorer did not answer within {_START_TIMEOUT:.0f} s: {_tail(log_path)}")
            time.sleep(0.2)
    except BaseException:  # not started, or interrupted while starting: stopped and removed
        handle.stop()
        raise
    if inline or (inline is None and _in_notebook()):
        from IPython.display import HTML, display

        display(HTML(handle.iframe(height)))
    return handle


def _tail(path: str) -> str:
    try:
        with open(path, "r", errors="replace") as f:
            return " ".join(f.read()[-1500:].split())
    except OSError:
        return "(no output)"


def _main(argv: list[str]) -> int:
    """``python -m paddleviz_hooks.explore GRAPHS.json [OVERLAY.json ...] --host H --port P`` (used by :func:`explore`)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m paddleviz_hooks.explore")
    p.add_argument("graphs")
    p.add_argument("overlays", nargs="*")
    p.add_argument("--host", default=DEFAULT_HOST)
    p.add_argument("--port", type=int, default=None)
    args = p.parse_args(argv)
    files = ExplorerExport(args.graphs, {os.path.basename(o)[:-5]: o for o in args.overlays})
    serve(files, args.host, args.port)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main(sys.argv[1:]))
