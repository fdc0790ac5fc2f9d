#!/usr/bin/env python
"""What forward source lines cost in a captured step, and the dump's share of it.

    .venv/bin/python benchmarks/sources_split.py enc   # 224-layer TransformerEncoder (10,082 nodes)
    .venv/bin/python benchmarks/sources_split.py mb    # mobilenet_v3_small, batch 2, 224x224
    .venv/bin/python benchmarks/sources_split.py enc-clone  # the encoder, its output cloned

Rows, each the median CPU time (``time.process_time``) of interleaved runs:
``plain`` (no capture), ``nosrc`` (``capture_backward(model, sources=False)``),
``all`` (sources on: the default) and ``nodump`` (sources on, Paddle's dump
not injected: ``all - nodump`` is what the dump costs when it is asked for).
"""

import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import paddle  # noqa: E402

from paddleviz_hooks import capture_backward  # noqa: E402
from paddleviz_hooks.capture import source as SRC  # noqa: E402

which = sys.argv[1] if len(sys.argv) > 1 else "enc"
if which in ("enc", "enc-clone"):
    paddle.seed(0)
    model = paddle.nn.TransformerEncoder(paddle.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 224)
    x = paddle.randn([2, 4, 16])
    R = 5
    if which == "enc":
        loss_fn = lambda: model(x).mean()  # noqa: E731
    else:  # x.clone(): a node no wrapped op call sees, so the dump is read
        loss_fn = lambda: model(x).clone().mean()  # noqa: E731
else:
    from benchmarks.run import paddle_vision

    model, loss_fn = paddle_vision("mobilenet_v3_small")
    R = 9
orig_inject = SRC.StackDump.inject


def cap(**kw):
    def run():
        with capture_backward(model, **kw):
            loss_fn().backward()
        model.clear_gradients()
    return run


def nodump():
    SRC.StackDump.inject = lambda self, entry, args: args
    try:
        cap()()
    finally:
        SRC.StackDump.inject = orig_inject


def plain():
    loss_fn().backward()
    model.clear_gradients()


kinds = dict(plain=plain, nosrc=cap(sources=False), all=cap(), nodump=nodump)
for f in kinds.values():
    f()
T = {k: [] for k in kinds}
for _ in range(R):
    for k, f in kinds.items():
        gc.collect()
        c0 = time.process_time()
        f()
        T[k].append(time.process_time() - c0)
p = statistics.median(T["plain"])
for k, v in T.items():
    m = statistics.median(v)
    print(f"{k:8s} {m*1000:7.1f} ms  {m/p:.3f}x  +{(m-p)*1000:.1f}")
