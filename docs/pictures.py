"""Make the pictures the README and the guide show, from real captures (``make docs-pictures``).

Each picture is produced here, never drawn by hand:

* ``lenet_step_000020.png``: step 20 of ``examples/train_lenet.py`` (what ``make demo`` runs);
* ``report.png``: ``paddleviz-hooks report`` of that run, in headless Chromium;
* ``explorer.png``: ``paddleviz-hooks explore`` of a run with a NaN step, in headless Chromium.

The two screenshots need Debian's Chromium (``make test`` installs it) and Playwright; without
them only the first picture is made.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

NAN_RUN = """
import paddle
from paddleviz_hooks import BackwardGraphRecorder

class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.encoder = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.Sigmoid())
        self.head = paddle.nn.Linear(16, 2)
    def forward(self, x):
        return self.head(paddle.log(self.encoder(x)))  # -inf once the sigmoid saturates to 0

paddle.seed(0)
net = Net()
opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=net.parameters())
with BackwardGraphRecorder(LOG_DIR, net, every=2, on_nonfinite=True, verbose=0) as rec:
    for step in range(1, 6):
        x = paddle.randn([4, 8]) * (1e4 if step == 5 else 1)
        with rec.step(step):
            net(x).mean().backward()
        opt.step()
        opt.clear_grad()
"""


def lenet_run(log_dir: str) -> str:
    """Train the demo; return its run folder."""
    subprocess.run([sys.executable, os.path.join(REPO, "examples", "train_lenet.py"), "--log-dir", log_dir],
                   check=True, stdout=subprocess.DEVNULL)
    return os.path.join(log_dir, "backward_graph")


def screenshot(url: str, path: str, wait_text: str | None = None) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 860})
            page.goto(url, timeout=60_000)
            if wait_text:
                page.wait_for_function(f"() => document.body.innerText.includes({wait_text!r})", timeout=60_000)
            page.wait_for_timeout(1000)
            page.screenshot(path=path)
        finally:
            browser.close()


def explorer_shot(log_dir: str, path: str, work: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = os.path.join(work, "explore.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "paddleviz_hooks.cli", "explore", log_dir, "--port", str(port),
                                 "--out", os.path.join(work, "me")],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        urls: list[str] = []
        while time.monotonic() < deadline and not urls:
            time.sleep(0.5)
            urls = [x.strip() for x in open(log).read().split() if x.startswith(f"http://127.0.0.1:{port}")]
        screenshot(urls[0], path, wait_text="LogGradNode")  # the printed address opens the NaN step
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    with tempfile.TemporaryDirectory() as work:
        run = lenet_run(os.path.join(work, "vdl_log"))
        shutil.copy(os.path.join(run, "step_000020.png"), os.path.join(HERE, "lenet_step_000020.png"))
        print("wrote docs/lenet_step_000020.png")
        if not os.path.exists(CHROMIUM):
            print(f"no Chromium at {CHROMIUM}: report.png and explorer.png left as they are")
            return
        from paddleviz_hooks import build_report

        report = build_report(os.path.join(work, "vdl_log"), os.path.join(work, "report.html"))
        screenshot("file://" + report, os.path.join(HERE, "report.png"))
        print("wrote docs/report.png")
        nan_dir = os.path.join(work, "nan_log")
        script = os.path.join(work, "train_nan.py")  # a file, so the origin's line reads train_nan.py:N
        with open(script, "w") as f:
            f.write(f"LOG_DIR = {nan_dir!r}\n" + NAN_RUN)
        subprocess.run([sys.executable, script], check=True)
        explorer_shot(nan_dir, os.path.join(HERE, "explorer.png"), work)
        print("wrote docs/explorer.png")


if __name__ == "__main__":
    main()
