"""Shared pytest set-up.

* ``--runslow`` runs the tests marked ``@pytest.mark.slow`` (skipped otherwise).
* Every test is checked for leaking Paddle state: a backward patch or the
  layer-call patch still installed after the test, an op entry point still
  wrapped, or Paddle's call-stack flag left changed, is a
  capture that did not clean up, which fails the test; grad mode left off (what a raising node hook does to Paddle) is
  restored so one broken test cannot break every later one, with a warning.
"""

from __future__ import annotations

import warnings

import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _paddle_state_guard():
    import paddle

    stack_flag = paddle.get_flags("FLAGS_call_stack_level")["FLAGS_call_stack_level"]
    layer_call = paddle.nn.Layer.__dict__["__call__"]
    yield
    from paddleviz_hooks.capture import dispatcher_installed
    from paddleviz_hooks.capture.dispatch import DISPATCHER

    leaked = dispatcher_installed()
    if leaked:
        DISPATCHER.deactivate_all()
    if not paddle.is_grad_enabled():
        paddle.set_grad_enabled(True)
        warnings.warn("a test left Paddle's grad mode disabled; re-enabled", RuntimeWarning)
    if leaked:
        pytest.fail("the backward patch was still installed after the test: a capture leaked")
    if paddle.nn.Layer.__dict__["__call__"] is not layer_call:
        paddle.nn.Layer.__call__ = layer_call
        pytest.fail("Layer.__call__ was still wrapped after the test: a layer attribution leaked")
    from paddleviz_hooks.capture import opcalls

    if opcalls.listening():
        opcalls.unlisten(saved=True, sources=True)
        pytest.fail("Paddle's op entry points were still wrapped after the test: a capture leaked them")
    now = paddle.get_flags("FLAGS_call_stack_level")["FLAGS_call_stack_level"]
    if now != stack_flag:  # source lines are recorded with it on, for captured forwards only
        paddle.set_flags({"FLAGS_call_stack_level": stack_flag})
        pytest.fail(f"FLAGS_call_stack_level was left at {now} (was {stack_flag}): a capture leaked it")


@pytest.fixture()
def dot_shim(tmp_path, monkeypatch):
    """``install(body)``: a ``dot`` first on ``PATH`` running the shell ``body`` (``{real}`` in it:
    the real ``dot``, and the test skips without one); the layout engine every drawing uses then."""
    import os
    import shutil

    def install(body: str):
        if "{real}" in body:
            real = shutil.which("dot")
            if real is None:
                pytest.skip("needs Graphviz dot")
            body = body.replace("{real}", real)
        shim_dir = tmp_path / "dot-shim"
        shim_dir.mkdir(exist_ok=True)
        shim = shim_dir / "dot"
        shim.write_text("#!/bin/sh\n" + body)
        shim.chmod(0o755)
        monkeypatch.setenv("PATH", f"{shim_dir}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("PADDLEVIZ_ENGINE", "dot")
        return shim

    return install


@pytest.fixture()
def engine_run_count(tmp_path, dot_shim):
    """Layout-engine runs so far, counted by a ``dot`` shim first on ``PATH`` (each run
    appends a line to a file, then hands over to the real ``dot``); skips without ``dot``."""
    counter = tmp_path / "dot-runs.txt"
    dot_shim(f"echo run >> {counter}\nexec {{real}} \"$@\"\n")
    return lambda: len(counter.read_text().splitlines()) if counter.exists() else 0
