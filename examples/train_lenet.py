"""Train the LeNet-style CNN from the paddleviz README with BackwardGraphCallback.

A synthetic MNIST-sized dataset is built in code (no downloads). Run:

    python examples/train_lenet.py --log-dir vdl_log
    visualdl --logdir vdl_log --host 127.0.0.1 --port 8040 --disable-telemetry
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import paddle

from paddleviz_hooks import BackwardGraphCallback


class LeNet(paddle.nn.Layer):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = paddle.nn.Sequential(
            paddle.nn.Conv2D(1, 6, 3, stride=1, padding=1),
            paddle.nn.ReLU(),
            paddle.nn.MaxPool2D(2, 2),
            paddle.nn.Conv2D(6, 16, 5, stride=1, padding=0),
            paddle.nn.ReLU(),
            paddle.nn.MaxPool2D(2, 2),
        )
        self.fc = paddle.nn.Sequential(
            paddle.nn.Linear(400, 120),
            paddle.nn.Linear(120, 84),
            paddle.nn.Linear(84, num_classes),
        )

    def forward(self, x):
        x = self.features(x)
        x = paddle.flatten(x, 1)
        return self.fc(x)


class SyntheticDigits(paddle.io.Dataset):
    """Random 28x28 images whose label is encoded in their mean brightness."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.labels = rng.integers(0, 10, size=n).astype("int64")
        self.images = (rng.standard_normal((n, 1, 28, 28)) * 0.3 + self.labels[:, None, None, None] / 10).astype("float32")

    def __getitem__(self, i):
        return self.images[i], self.labels[i : i + 1]

    def __len__(self) -> int:
        return len(self.labels)


def describe_folder(folder: str) -> list[str]:
    """One line per captured step (its files by suffix) and one per other entry: every file counted."""
    per_step: dict[str, list[str]] = {}
    others: list[str] = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.startswith("step_") and os.path.isfile(path):
            stem, _, ext = name.partition(".")
            step, _, extra = stem.partition("_")[2].partition("_")
            per_step.setdefault(f"step_{step}", []).append(f"{'_' + extra if extra else ''}.{ext}")
        elif os.path.isdir(path):
            n = sum(len(files) for _, _, files in os.walk(path))
            others.append(f"{name}/ ({n} files)")
        else:
            others.append(name)
    lines = [f"{stem}: {' '.join(exts)}" for stem, exts in per_step.items()]
    total = sum(len(exts) for exts in per_step.values())
    return lines + others + [f"{len(per_step)} steps, {total} step files, {len(others)} other entries"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default="vdl_log")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()

    paddle.seed(0)
    model = paddle.Model(LeNet())
    model.prepare(
        paddle.optimizer.Adam(learning_rate=1e-3, parameters=model.parameters()),
        paddle.nn.CrossEntropyLoss(),
        paddle.metric.Accuracy(),
    )
    callbacks = [
        paddle.callbacks.VisualDL(log_dir=args.log_dir),  # loss curves, same log_dir
        BackwardGraphCallback(args.log_dir, every=args.every, on_nonfinite=True),
    ]
    model.fit(SyntheticDigits(640), SyntheticDigits(128, seed=1), epochs=args.epochs, batch_size=32,
              callbacks=callbacks, verbose=1)
    out = os.path.join(args.log_dir, "backward_graph")
    print(f"\nbackward graphs of {len(callbacks[1].captured_steps)} steps in {out}:")
    for line in describe_folder(out):
        print("  ", line)
    print(f"\nview them with:\n  .venv/bin/visualdl --logdir {args.log_dir} --host 127.0.0.1 --port 8040 --disable-telemetry\n"
          f"or offline:\n  .venv/bin/paddleviz-hooks report {args.log_dir} -o report.html")


if __name__ == "__main__":
    main()
