"""A tiny random-weight Llama trained by PaddleFormers' Trainer on the CPU wheel.

What PaddleFormers 1.2.0 needs to train on the CPU wheel (the library itself
does none of this):

* ``amp_master_grad=False`` (its default True conflicts with fp32 training);
* ``fuse_rms_norm=False`` in the model config (no fused RMSNorm kernel on the CPU);
* with ``gradient_accumulation_steps > 1`` the Trainer calls
  ``paddle.device.synchronize()``, which raises on the CPU: it is made a no-op
  while the Trainer trains (:func:`cpu_synchronize`);
* ``pyarrow`` pinned to a release built for numpy 1.x (the Makefile's venv).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import paddle

VOCAB, HIDDEN, SEQ = 128, 32, 8


@contextlib.contextmanager
def cpu_synchronize():
    real = paddle.device.synchronize
    paddle.device.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        paddle.device.synchronize = real


class Tokens(paddle.io.Dataset):
    def __init__(self, n: int = 8, label: int | None = None) -> None:
        rng = np.random.default_rng(0)
        self.ids = rng.integers(0, VOCAB, size=(n, SEQ)).astype("int64")
        self.labels = self.ids if label is None else np.full_like(self.ids, label)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}

    def __len__(self):
        return len(self.ids)


def tiny_llama(seed: int = 0):
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      fuse_rms_norm=False)
    return LlamaForCausalLM(cfg)


def train(tmp, callbacks=(), *, accumulate: int = 2, recompute: bool = True, steps: int = 3,
          report_to=("none",), model=None, probes=(), label=None):
    """Train; returns (model, trainer, seconds per optimizer step)."""
    from paddleformers.trainer import Trainer, TrainingArguments

    model = model if model is not None else tiny_llama()
    if recompute:
        model.config.recompute_granularity = "full"
        model.config.recompute_method = "uniform"
        model.config.recompute_num_layers = 1
    args = TrainingArguments(
        output_dir=str(tmp / "out"), logging_dir=str(tmp / "vdl"), per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulate, max_steps=steps, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", report_to=list(report_to), seed=0, amp_master_grad=False,
        recompute_granularity="full" if recompute else None, dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(2 * accumulate * steps, label),
                      callbacks=[*probes, *callbacks])
    t0 = time.perf_counter()
    with cpu_synchronize():
        trainer.train()
    return model, trainer, (time.perf_counter() - t0) / steps
