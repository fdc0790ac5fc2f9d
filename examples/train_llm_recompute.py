"""Capture an LLM-style training loop: recompute on every block, gradient accumulation 2.

A small decoder-only transformer written with ``paddle.nn`` (RMSNorm, rotary
positions, causal attention, SwiGLU MLP), trained on random tokens in a
hand-written loop. Every block runs under reentrant recompute
(``paddle.distributed.fleet.utils.recompute``, the usual LLM setting) and each
optimizer step accumulates the gradients of 2 micro-batches.
``BackwardGraphRecorder`` records selected steps: one graph per micro-batch
(``step_000001.*`` and ``step_000001_b2.*``), each showing the recomputed
blocks' ops and every parameter, plus the norm of the accumulated gradient the
optimizer applies. Nothing is downloaded. Run:

    python examples/train_llm_recompute.py --log-dir vdl_log
    visualdl --logdir vdl_log --host 127.0.0.1 --port 8040 --disable-telemetry
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
from paddle.distributed.fleet.utils import recompute

from paddleviz_hooks import BackwardGraphRecorder


class RMSNorm(nn.Layer):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))
        self.eps = eps

    def forward(self, x):
        return x * paddle.rsqrt((x * x).mean(axis=-1, keepdim=True) + self.eps) * self.weight


def rotary(x, base: float = 10000.0):
    """Rotary position embedding of ``x`` [batch, heads, seq, head_dim]."""
    seq, half = x.shape[2], x.shape[3] // 2
    freq = base ** (-paddle.arange(half, dtype="float32") / half)
    angle = paddle.arange(seq, dtype="float32").unsqueeze(1) * freq.unsqueeze(0)  # [seq, half]
    cos, sin = paddle.cos(angle), paddle.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return paddle.concat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class Attention(nn.Layer):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias_attr=False)
        self.out = nn.Linear(dim, dim, bias_attr=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).reshape([b, s, 3, self.heads, d // self.heads]).transpose([2, 0, 3, 1, 4])
        q, k = rotary(q), rotary(k)
        mask = paddle.triu(paddle.full([s, s], float("-inf")), diagonal=1)
        att = F.softmax(q @ k.transpose([0, 1, 3, 2]) / (d // self.heads) ** 0.5 + mask, axis=-1)
        return self.out((att @ v).transpose([0, 2, 1, 3]).reshape([b, s, d]))


class MLP(nn.Layer):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, 2 * dim, bias_attr=False)
        self.up = nn.Linear(dim, 2 * dim, bias_attr=False)
        self.down = nn.Linear(2 * dim, dim, bias_attr=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Layer):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, heads)
        self.mlp_norm, self.mlp = RMSNorm(dim), MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Layer):
    """Decoder-only language model; ``recompute=True`` recomputes each block in backward."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 2,
                 recompute: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.LayerList([Block(dim, heads) for _ in range(layers)])
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias_attr=False)
        self.recompute = recompute

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = recompute(block, h) if self.recompute and self.training else block(h)
        return self.lm_head(self.norm(h))


def train(steps: int = 4, log_dir: str | None = "vdl_log", every: int = 2, accumulate: int = 2,
          batch: int = 2, seq: int = 8, vocab: int = 64, dim: int = 32, layers: int = 2,
          seed: int = 0, verbose: int = 1) -> tuple[list[float], dict[str, np.ndarray], BackwardGraphRecorder | None]:
    """Train ``steps`` optimizer steps; record every ``every``-th (and the first) unless ``log_dir`` is None.

    Returns:
        (the loss of every micro-batch, the final weights, the recorder or None)
    """
    paddle.seed(seed)
    model = TinyLM(vocab, dim, layers)
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    rng = np.random.default_rng(seed)
    data = rng.integers(0, vocab, size=(steps * accumulate, batch, seq + 1)).astype("int64")
    rec = (BackwardGraphRecorder(log_dir, model, every=every, verbose=verbose)
           if log_dir is not None else None)
    losses = []
    for step in range(1, steps + 1):
        # every micro-batch of the optimizer step inside one recorder step
        with (rec.step(step, micro_batches=accumulate) if rec is not None else _nothing()):
            for micro in range(accumulate):
                tokens = paddle.to_tensor(data[(step - 1) * accumulate + micro])
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape([-1, vocab]), tokens[:, 1:].reshape([-1, 1]))
                (loss / accumulate).backward()
                losses.append(float(loss))
        opt.step()
        opt.clear_grad()
    if rec is not None:
        rec.close()
    weights = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    return losses, weights, rec


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log-dir", default="vdl_log")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    args = parser.parse_args()
    losses, _, rec = train(args.steps, args.log_dir, args.every, layers=args.layers, dim=args.dim)
    print(f"micro-batch losses: {', '.join(f'{v:.3f}' for v in losses)}")
    out = os.path.join(args.log_dir, "backward_graph")
    print(f"backward graphs of steps {rec.captured_steps} in {out}:")
    for name in sorted(os.listdir(out)):
        if name.endswith(".png"):
            print("  ", name)


if __name__ == "__main__":
    main()
