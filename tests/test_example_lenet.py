"""examples/train_lenet.py (what `make demo` runs): it lists every file it wrote, counted."""

from __future__ import annotations

import os
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "train_lenet.py")


def test_demo_lists_every_step_file_it_wrote(tmp_path):
    log_dir = tmp_path / "vdl_log"
    out = subprocess.run([sys.executable, EXAMPLE, "--log-dir", str(log_dir), "--epochs", "1", "--every", "5"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    listing = out.split("backward graphs of", 1)[1].split("view them with", 1)[0]
    run = log_dir / "backward_graph"
    step_files = sorted(p.name for p in run.iterdir() if p.name.startswith("step_") and p.is_file())
    steps = sorted({name.split(".")[0][:11] for name in step_files})
    assert steps == ["step_000001", "step_000005", "step_000010", "step_000015", "step_000020"]
    for stem in steps:
        line = next(ln.strip() for ln in listing.splitlines() if ln.strip().startswith(stem + ":"))
        exts = line.split(":", 1)[1].split()
        assert sorted(stem + e for e in exts) == sorted(n for n in step_files if n.startswith(stem))
    assert f"{len(steps)} steps, {len(step_files)} step files" in listing
