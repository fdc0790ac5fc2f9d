"""The explore server confined and clean (issue 28 item 5, issue 33 item 5).

Model Explorer's real server, started by ``paddleviz-hooks explore`` in its own
process, probed over HTTP on 127.0.0.1: only the export's files can be read,
a foreign ``Host`` is refused, the page names nothing outside the machine, the
temporary folder goes on every exit path and one address is printed.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse

import pytest

from paddleviz_hooks.graph import BackwardGraph, Edge, GradMeta, Node

pytest.importorskip("model_explorer")


def _log_dir(tmp_path, nan: bool = True):
    log = tmp_path / "log"
    log.mkdir()
    ok = GradMeta(shape=(2,), dtype="float32", norm=1.0, min=0.0, max=1.0)
    bad = GradMeta(shape=(2,), dtype="float32", norm=float("nan"), min=0.0, max=1.0, nan=2)
    for step in (1, 2):
        g = BackwardGraph([Node(0, "root", "loss", "loss"), Node(1, "op", "ExpGradNode", "Exp", layer="fc"),
                           Node(2, "op", "LogGradNode", "Log", layer="fc")],
                          [Edge(0, 1, 0, ok), Edge(1, 2, 0, bad if nan and step == 2 else ok)],
                          layers={"": "Net", "fc": "Linear"}, meta={"step": step})
        (log / f"step_{step:06d}.json").write_text(g.to_json())
    return log


def _start(tmp_path, *extra):
    """``paddleviz-hooks explore`` with TMPDIR in tmp_path; returns (process, port, temp root, output file)."""
    temp_root = tmp_path / "tmp"
    temp_root.mkdir(exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out.txt"
    env = dict(os.environ, TMPDIR=str(temp_root))
    with open(out, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "paddleviz_hooks.cli", "explore", str(tmp_path / "log"),
                                 "--port", str(port), *extra], stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, out.read_text()
        try:
            if _get(port, "/check_health")[0] == 200 and "Press Ctrl+C" in out.read_text():
                return proc, port, temp_root, out
        except OSError:
            pass
        time.sleep(0.2)
    _stop(proc, signal.SIGKILL)
    raise AssertionError(out.read_text())


def _stop(proc, sig) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    try:
        return proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        raise


def _get(port: int, path: str, host: str | None = None, method: str = "GET", body: bytes | None = None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request(method, path, body=body, headers={"Host": host or f"127.0.0.1:{port}"})
        r = c.getresponse()
        return r.status, r.read(), dict(r.getheaders())
    finally:
        c.close()


def test_only_the_exports_files_are_readable_and_foreign_hosts_are_refused(tmp_path):
    _log_dir(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("do not serve me")
    proc, port, temp_root, out = _start(tmp_path)
    try:
        (export_dir,) = [temp_root / d for d in os.listdir(temp_root)]
        graphs = export_dir / "backward_graphs.json"
        q = urllib.parse.quote
        # the export's own files: served
        status, body, _ = _get(port, f"/api/v1/read_text_file?path={q(str(graphs))}")
        assert status == 200 and "step 2" in json.loads(body)["content"]
        # anything else the user can read, by any spelling: refused
        for path in ["/etc/passwd", str(secret), f"{export_dir}/../secret.txt", "~/.bashrc", str(export_dir),
                     f"{graphs}\0", ""]:
            status, body, _ = _get(port, f"/api/v1/read_text_file?path={q(path)}")
            assert status == 403 and b"do not serve" not in body and b"root:" not in body, (path, status, body)
        # the other endpoints that take a path or change what is served
        cmd = json.dumps({"extensionId": "builtin_json", "cmdId": "convert", "modelPath": "/etc/passwd",
                          "settings": {}})
        for method, path, body in [("GET", f"/api/v1/send_command?json={q(cmd)}", None),
                                   ("POST", "/apipost/v1/send_command", cmd.encode()),
                                   ("POST", "/apipost/v1/update_config", b'{"models": [{"url": "/etc/passwd"}]}'),
                                   ("POST", "/apipost/v1/upload", b"x")]:
            status, got, _ = _get(port, path, method=method, body=body)
            assert status == 403 and b"root:" not in got, (path, status, got[:200])
        # asked by the page or anyone: answered as Model Explorer answers with nothing to give, quietly
        # (Model Explorer logged an IndexError traceback per call; the page logged a 403 per load)
        for path, want in [("/api/v1/load_graphs_json?graph_index=0", {}),
                           ("/api/v1/load_node_data?node_data_index=3", {}),
                           (f"/api/v1/notify_user_provided_model_path?path={q('/etc')}", {"status": "ok"})]:
            status, got, _ = _get(port, path)
            assert status == 200 and json.loads(got) == want, (path, status, got[:200])
        assert "Traceback" not in out.read_text()
        # DNS rebinding: a page on evil.example that resolves to 127.0.0.1 sends its own Host
        for host in ["evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil.example"]:
            assert _get(port, "/", host=host)[0] in (400, 403), host
            assert _get(port, f"/api/v1/read_text_file?path={q(str(graphs))}", host=host)[0] in (400, 403), host
        for host in [f"localhost:{port}", f"127.0.0.1:{port}", "localhost:9000"]:  # a forwarded port too
            assert _get(port, "/check_health", host=host)[0] == 200, host
        # the page asks nothing of the web: no address outside this server in it, and the browser is told so
        status, page, headers = _get(port, "/")
        assert status == 200 and b"<app-root" in page
        assert b"fonts.gstatic.com" not in page and b"https://fonts" not in page
        assert "connect-src 'self'" in headers["Content-Security-Policy"]
    finally:
        assert _stop(proc, signal.SIGINT) in (0, 130)
    assert os.listdir(temp_root) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_temporary_folder_goes_on_every_exit_and_one_url_is_printed(tmp_path, sig):
    _log_dir(tmp_path)
    proc, port, temp_root, out = _start(tmp_path)
    assert len(os.listdir(temp_root)) == 1  # the export, while it serves
    _stop(proc, sig)
    assert os.listdir(temp_root) == []
    printed = out.read_text()
    urls = [w for w in printed.split() if "://" in w]
    assert len(urls) == 1, printed
    data = json.loads(urllib.parse.unquote(urls[0].split("data=", 1)[1]))
    pane = data["uiState"]["paneStates"][0]  # it opens the NaN step at the node that made the NaN
    assert pane["selectedGraphId"] == "step 2" and pane["selectedNodeId"] == "1"


def test_a_rejected_port_leaves_no_temporary_folder(tmp_path, monkeypatch, capsys):
    import tempfile

    from paddleviz_hooks.cli import main

    _log_dir(tmp_path)
    temp_root = tmp_path / "tmp"
    temp_root.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp_root))
    monkeypatch.setattr(tempfile, "tempdir", None)
    for port in ["99999", "-1"]:
        assert main(["explore", str(tmp_path / "log"), "--port", port]) == 2
        assert "port" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["explore", str(tmp_path / "log"), "--port", str(taken.getsockname()[1])]) != 0
    assert "cannot listen" in capsys.readouterr().err
    assert os.listdir(temp_root) == []


def test_a_link_to_a_capture_outside_the_log_dir_is_skipped_with_a_warning(tmp_path):
    """The explorer and the report read the same files: a file link leading out of the log
    dir is left out by both and named (the explorer used to export and serve it, silently)."""
    from paddleviz_hooks.sinks.explorer import export_explorer
    from paddleviz_hooks.sinks.report import build_report

    log = _log_dir(tmp_path, nan=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "step_000079.json").write_text((log / "step_000001.json").read_text())
    (log / "evil").mkdir()
    os.symlink(elsewhere / "step_000079.json", log / "evil" / "step_000079.json")
    os.symlink("/etc/hostname", log / "step_000003.json")
    os.symlink(log / "step_000001.json", log / "step_000004.json")  # inside: read as any file
    with pytest.warns(RuntimeWarning, match="outside the log directory") as seen:
        files = export_explorer(str(log), str(tmp_path / "out"))
    assert len([w for w in seen if "outside the log directory" in str(w.message)]) == 2
    assert len(files.graph_ids) == 3 and not any("evil" in g or "79" in g for g in files.graph_ids)
    with pytest.warns(RuntimeWarning, match="outside the log directory"):
        page = build_report(str(log), str(tmp_path / "r.html"))
    with open(page, encoding="utf-8") as fh:
        html = fh.read()
    assert "evil" in html and "step_000003.json" in html  # listed under the skipped files
