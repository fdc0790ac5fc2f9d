"""The two runs of issue 27, as a new user would write them.

* ``cnn_run``: a small CNN with BatchNorm under ``Model.fit`` whose learning
  rate jumps to 1e30 from step 30 on;
* ``encoder_run``: a tiny Transformer encoder in a hand-written loop whose
  step-13 batch goes through ``paddle.log`` of a negative value.

Both record, with forward hooks of their own on every layer, where the first
non-finite value appeared (the first layer call whose inputs are finite and
whose outputs are not): an oracle independent of the recorder's replay.
"""

from __future__ import annotations

import os

import numpy as np
import paddle
import paddle.nn as nn

from paddleviz_hooks import BackwardGraphCallback, BackwardGraphRecorder

ENCODER_BAD_STEP = 13


def _finite(obj) -> bool:
    ts = [obj] if isinstance(obj, paddle.Tensor) else [t for t in (obj if isinstance(obj, (list, tuple)) else [])
                                                       if isinstance(t, paddle.Tensor) and t._is_initialized()]
    return all(bool(paddle.isfinite(t).all()) for t in ts if t.is_floating_point())


class FirstBadLayer:
    """Forward post-hooks on every layer: per step, the first layer call (innermost first,
    as calls end) whose inputs are finite and whose outputs, or the statistics it keeps
    (BatchNorm's running mean and variance), are not."""

    def __init__(self, model: nn.Layer) -> None:
        self.step = 0
        self.found: dict[int, str] = {}
        self._handles = [sub.register_forward_post_hook(self._hook(path))
                         for path, sub in model.named_sublayers(include_self=True)]

    def _hook(self, path: str):
        def hook(layer, inputs, outputs):
            if self.step in self.found or not _finite(inputs):
                return
            kept = [p for p in layer.parameters(include_sublayers=False) if p.stop_gradient]
            kept += [b for b in layer.buffers(include_sublayers=False) if b is not None]
            if not _finite(outputs) or not _finite(kept):
                self.found[self.step] = path
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class SmallCNN(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.block1 = nn.Sequential(nn.Conv2D(1, 4, 3, padding=1), nn.BatchNorm2D(4), nn.ReLU(), nn.MaxPool2D(2))
        self.block2 = nn.Sequential(nn.Conv2D(4, 8, 3, padding=1), nn.BatchNorm2D(8), nn.ReLU(), nn.MaxPool2D(2))
        self.head = nn.Linear(8 * 2 * 2, 10)

    def forward(self, x):
        h = self.block1(x)  # origin:cnn
        return self.head(paddle.flatten(self.block2(h), 1))


class Digits(paddle.io.Dataset):
    def __init__(self, n: int) -> None:
        rng = np.random.RandomState(0)
        self.y = rng.randint(0, 10, (n, 1)).astype("int64")
        self.x = (rng.randn(n, 1, 8, 8) * 0.3 + self.y[:, :, None, None] / 10).astype("float32")

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class _LrJump(paddle.callbacks.Callback):
    def __init__(self, oracle_of) -> None:
        super().__init__()
        self.oracle_of = oracle_of
        self.oracle = None

    def on_train_begin(self, logs=None):
        self.oracle = FirstBadLayer(self.model.network)

    def on_train_batch_begin(self, step, logs=None):
        self.oracle.step = step + 1  # the recorder's step numbers start at 1
        if step >= 30:
            self.model._optimizer.set_lr(1e30)

    def on_train_end(self, logs=None):
        self.oracle.remove()
        self.oracle_of.update(self.oracle.found)


def cnn_run(log_dir: str) -> tuple[BackwardGraphCallback, dict[int, str]]:
    """34 steps of 4 images; returns the callback and the oracle (step -> first bad layer)."""
    paddle.seed(0)
    model = paddle.Model(SmallCNN())
    model.prepare(paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters()), nn.CrossEntropyLoss())
    cb = BackwardGraphCallback(log_dir, every=10, on_nonfinite=True, verbose=0, formats=("json", "dot", "svg", "png"))
    oracle: dict[int, str] = {}
    model.fit(Digits(4 * 34), epochs=1, batch_size=4, callbacks=[_LrJump(oracle), cb], verbose=0, shuffle=False)
    return cb, oracle


class TinyEncoder(nn.Layer):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0), 2)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        x = paddle.log(x)  # origin:encoder
        return self.head(self.encoder(self.embed(x)).mean(axis=1))


def encoder_run(log_dir: str, steps: int = 15) -> tuple[BackwardGraphRecorder, dict[int, str]]:
    """A hand-written loop; the batch of step 13 holds a negative value."""
    paddle.seed(0)
    net = TinyEncoder()
    opt = paddle.optimizer.Adam(1e-3, parameters=net.parameters())
    rng = np.random.RandomState(1)
    oracle = FirstBadLayer(net)
    rec = BackwardGraphRecorder(log_dir, net, every=5, on_nonfinite=True, verbose=0,
                                formats=("json", "dot", "svg", "png"))
    with rec:
        for step in range(1, steps + 1):
            x = rng.rand(4, 5, 8).astype("float32") + 0.5
            if step == ENCODER_BAD_STEP:
                x[0, 0, 0] = -1.0
            y = paddle.to_tensor(rng.randint(0, 3, (4,)).astype("int64"))
            oracle.step = step
            with rec.step(step):
                loss = nn.functional.cross_entropy(net(paddle.to_tensor(x)), y)
                loss.backward()
            opt.step()
            opt.clear_grad()
    oracle.remove()
    return rec, oracle.found


def tagged_line(path: str, tag: str) -> int:
    """The line of ``path`` marked ``# origin:<tag>`` (exactly one)."""
    with open(path, encoding="utf-8") as f:
        hits = [i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# origin:{tag}")]
    assert len(hits) == 1, tag
    return hits[0]


def line_of(tag: str) -> int:
    return tagged_line(__file__, tag)


HERE = os.path.basename(__file__)
