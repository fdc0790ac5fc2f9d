"""Shared helpers for the robustness tests: tiny seeded ``Model.fit`` runs.

Everything here is real Paddle: a synthetic dataset, a tiny network, a
recording callback that keeps every step's loss, and comparisons that demand
bit-identical losses and parameters between a run with our callback and a
run without it.
"""

from __future__ import annotations

import os
import sys
import re
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
import paddle
import paddle.nn as nn

D_IN, HIDDEN, CLASSES = 8, 16, 3


class Synthetic(paddle.io.Dataset):
    """Fixed random features and labels (the same for every run)."""

    def __init__(self, n: int, d_in: int = D_IN, classes: int = CLASSES, seed: int = 0) -> None:
        rng = np.random.RandomState(seed)
        self.x = rng.randn(n, d_in).astype("float32")
        self.y = rng.randint(0, classes, (n, 1)).astype("int64")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def mlp(d_in: int = D_IN, hidden: int = HIDDEN, classes: int = CLASSES) -> nn.Layer:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, classes))


class PatchProbe(nn.Layer):
    """An identity layer that records, *during each backward*, whether the
    backward patch is installed: the state an unselected step really runs in."""

    def __init__(self) -> None:
        super().__init__()
        from paddle.autograd import PyLayer

        from paddleviz_hooks.capture import dispatcher_installed

        seen = self.seen = []

        class _Probe(PyLayer):
            @staticmethod
            def forward(ctx, x):
                return x * 1.0

            @staticmethod
            def backward(ctx, g):
                seen.append(dispatcher_installed())
                return g

        self._op = _Probe

    def forward(self, x):
        return self._op.apply(x)


def probed_mlp() -> nn.Layer:
    """``mlp()`` with a :class:`PatchProbe` (``net[1]``) between its layers."""
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), PatchProbe(), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


class Recorder(paddle.callbacks.Callback):
    """Keeps the loss of every training step (and calls ``on_step`` if given)."""

    def __init__(self, on_step: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.losses: list[float] = []
        self.on_step = on_step

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        loss = (logs or {}).get("loss")
        self.losses.append(float(np.asarray(loss).reshape(-1)[0]))
        if self.on_step is not None:
            self.on_step(len(self.losses))


@dataclass
class FitResult:
    losses: np.ndarray
    params: dict[str, np.ndarray]
    model: Any = None
    net: Any = None
    error: BaseException | None = None
    extra: dict = field(default_factory=dict)


def run_fit(
    make_net: Callable[[], nn.Layer] = mlp,
    callbacks: Iterable[Any] = (),
    *,
    steps: int = 12,
    batch_size: int = 4,
    epochs: int = 1,
    seed: int = 0,
    loss: Any = None,
    lr: float = 0.1,
    dataset: Any = None,
    catch: tuple[type[BaseException], ...] = (),
    recorder: Recorder | None = None,
) -> FitResult:
    """A seeded ``Model.fit`` of ``steps`` batches per epoch; returns losses and final parameters."""
    paddle.seed(seed)
    np.random.seed(seed)
    net = make_net()
    model = paddle.Model(net)
    model.prepare(paddle.optimizer.SGD(learning_rate=lr, parameters=net.parameters()),
                  loss if loss is not None else nn.CrossEntropyLoss())
    rec = recorder or Recorder()
    ds = dataset if dataset is not None else Synthetic(steps * batch_size)
    error = None
    try:
        model.fit(ds, epochs=epochs, batch_size=batch_size, shuffle=False, verbose=0,
                  callbacks=[*callbacks, rec])
    except catch as exc:  # noqa: B030 - the tuple may be empty
        error = exc
    return FitResult(
        losses=np.asarray(rec.losses, dtype=np.float64),
        params={n: p.numpy().copy() for n, p in net.named_parameters()},
        model=model,
        net=net,
        error=error,
    )


def assert_same_run(a: FitResult, b: FitResult) -> None:
    """Bit-identical per-step losses and final parameters (NaN included)."""
    assert len(a.losses) == len(b.losses), (len(a.losses), len(b.losses))
    assert a.losses.tobytes() == b.losses.tobytes(), (a.losses, b.losses)
    assert a.params.keys() == b.params.keys()
    for name in a.params:
        assert a.params[name].tobytes() == b.params[name].tobytes(), name


def without_engine(tmp_path, monkeypatch) -> None:
    """No layout engine for the rest of the test: an empty PATH, and none beside the interpreter."""
    from paddleviz_hooks.render.engine import find_engine

    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    monkeypatch.delenv("PADDLEVIZ_ENGINE", raising=False)
    # graphviz-pure is also looked for beside the interpreter (an unactivated venv)
    monkeypatch.setattr(sys, "executable", str(empty_bin / "python"))
    assert find_engine() is None


@contextmanager
def recorded_warnings():
    """Record every warning (from any thread) raised inside the block."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        yield got


def ours(got: list) -> list[str]:
    """Messages of the paddleviz_hooks warnings among recorded ones."""
    return [str(w.message) for w in got if "paddleviz_hooks" in str(w.message)]


def files_under(root: str | os.PathLike) -> list[str]:
    """Every file below ``root``, as paths relative to it."""
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            out.append(os.path.relpath(os.path.join(d, n), root))
    return sorted(out)


def step_files(run_dir: str | os.PathLike, ext: str) -> list[int]:
    """Steps that have a ``step_NNNNNN.<ext>`` file in ``run_dir``."""
    steps = []
    for n in os.listdir(run_dir):
        if n.startswith("step_") and n.endswith("." + ext) and n.count("_") == 1:
            steps.append(int(n[5:-len(ext) - 1]))
    return sorted(steps)


def vdl_records(run_dir: str | os.PathLike):
    """A VisualDL LogReader over the single records file of ``run_dir``."""
    from visualdl import LogReader

    files = [n for n in os.listdir(run_dir) if n.startswith("vdlrecords")]
    assert len(files) == 1, files
    return LogReader(file_path=os.path.join(run_dir, files[0]))


def page_tags(tags, base: str) -> list[str]:
    """The pages of ``base`` (``backward_graph/from_step_000001``, or with a name,
    ``backward_graph/trigger_x_from_step_000001``), in step order."""
    sep = "_" if "/" in base else "/"
    return sorted(t for t in tags if re.fullmatch(re.escape(base + sep) + r"from_step_\d{6}", t))


def image_steps(reader, base: str) -> list[int]:
    """Steps logged under every page of an image tag, in order."""
    tags = page_tags(reader.get_tags().get("image", []), base)
    steps = []
    for t in tags:
        steps.extend(r.id for r in reader.get_data("image", t))
    return steps


def text_records(reader, base: str) -> dict[int, str]:
    tags = page_tags(reader.get_tags().get("text", []), base)
    out = {}
    for t in tags:
        for r in reader.get_data("text", t):
            out[r.id] = r.text.encoded_text_string
    return out


def thread_names() -> list[str]:
    return sorted(t.name for t in threading.enumerate())


def no_leftover_hooks(net: nn.Layer) -> bool:
    """No forward hook on any sublayer of ``net``, and ``Layer.__call__`` not wrapped."""
    from paddleviz_hooks.capture.attribution import _LAYER_CALLS

    return not _LAYER_CALLS.installed() and all(not sub._forward_pre_hooks and not sub._forward_post_hooks
                                                for _, sub in net.named_sublayers(include_self=True))


def children(pid: int) -> dict[int, str]:
    """pid -> command line of every descendant of ``pid``, from /proc."""
    parent, cmd = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    parent[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                pass
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        for c, pp in parent.items():
            if pp == p and c not in found:
                found[c] = cmd.get(c, "")
                todo.append(c)
    return found
