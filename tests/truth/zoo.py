"""A zoo of small architectures for the truth oracle (``oracle.py``): each entry builds a
random-weight model and a step that runs its backward (or ``paddle.grad``)."""

from __future__ import annotations

import functools

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from .oracle import Case

ZOO: dict[str, callable] = {}
FAST: list[str] = []  # the subset that runs in `make test`


def entry(name: str, fast: bool = False):
    def deco(fn):
        ZOO[name] = fn
        if fast:
            FAST.append(name)
        return fn

    return deco


def _x(*shape, grad=False):
    t = paddle.to_tensor(np.random.randn(*shape).astype("float32"))
    t.stop_gradient = not grad
    return t


def _backward(model, forward, grad_tensor=None):
    def run(between):
        out = forward()
        between()
        out.backward(grad_tensor)

    return Case(model, run, root=1.0 if grad_tensor is None else float(np.linalg.norm(grad_tensor.numpy())))


def _vision(name, size, **kw):
    import paddle.vision.models as V

    m = getattr(V, name)(num_classes=4, **kw)
    x = _x(1, 3, size, size)
    return _backward(m, lambda: F.cross_entropy(m(x), paddle.to_tensor([[1]])))


# ---- minimal patterns of issue 26 ---------------------------------------------------------
class ConcatRelu(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, a, b):
        return self.fc(paddle.concat([F.relu(a), b * 2], axis=1)).sum()


@entry("concat_relu", fast=True)
def concat_relu():
    m, a, b = ConcatRelu(), _x(2, 3, grad=True), _x(2, 3, grad=True)
    return _backward(m, lambda: m(a, b))


def _root_op(op):
    m = nn.Linear(4, 4)
    x = _x(3, 4)
    return _backward(m, lambda: op(m(x).mean()))


@entry("exp_loss", fast=True)
def exp_loss():
    return _root_op(paddle.exp)


@entry("tanh_sigmoid_silu_loss")
def tsl_loss():
    return _root_op(lambda z: F.silu(F.sigmoid(paddle.tanh(z))))


@entry("mlp_grad_tensor")
def mlp_grad_tensor():
    m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))
    x = _x(5, 4)
    return _backward(m, lambda: m(x), grad_tensor=_x(5, 3))


# ---- paddle.vision families --------------------------------------------------------------------
#: paddle.vision families at small sizes: name -> (keyword arguments, input size, in the fast subset)
VISION = {
    "resnet18": ({}, 32, False),
    "mobilenet_v2": ({"scale": 0.25}, 32, True),
    "mobilenet_v3_small": ({"scale": 0.35}, 32, False),
    "shufflenet_v2_swish": ({}, 32, False),
    "squeezenet1_1": ({}, 48, True),
}
for _name, (_kw, _size, _fast) in VISION.items():
    entry(_name, fast=_fast)(functools.partial(_vision, _name, _size, **_kw))


@entry("lenet")
def lenet():
    import paddle.vision.models as V

    m = V.LeNet(num_classes=4)
    x = _x(2, 1, 28, 28)
    return _backward(m, lambda: m(x).mean())


# ---- hand-built blocks ----------------------------------------------------------------------
class Inception(nn.Layer):
    def __init__(self, c=4):
        super().__init__()
        self.b1 = nn.Sequential(nn.Conv2D(3, c, 1), nn.BatchNorm2D(c), nn.ReLU())
        self.b2 = nn.Sequential(nn.Conv2D(3, c, 3, padding=1), nn.BatchNorm2D(c), nn.ReLU())
        self.b3 = nn.Sequential(nn.MaxPool2D(3, 1, 1), nn.Conv2D(3, c, 1), nn.ReLU())
        self.head = nn.Sequential(nn.Conv2D(3 * c, c, 1), nn.ReLU(), nn.AdaptiveAvgPool2D(1), nn.Flatten(),
                                  nn.Linear(c, 2))

    def forward(self, x):
        return self.head(paddle.concat([self.b1(x), self.b2(x), self.b3(x)], axis=1))


@entry("inception_block", fast=True)
def inception():
    m, x = Inception(), _x(2, 3, 8, 8)
    return _backward(m, lambda: m(x).mean())


class UNet(nn.Layer):
    def __init__(self):
        super().__init__()
        self.d1 = nn.Sequential(nn.Conv2D(1, 4, 3, padding=1), nn.ReLU())
        self.d2 = nn.Sequential(nn.MaxPool2D(2), nn.Conv2D(4, 8, 3, padding=1), nn.ReLU())
        self.up = nn.Conv2DTranspose(8, 4, 2, stride=2)
        self.u1 = nn.Sequential(nn.Conv2D(8, 4, 3, padding=1), nn.ReLU(), nn.Conv2D(4, 1, 1))

    def forward(self, x):
        a = self.d1(x)
        b = self.d2(a)
        return self.u1(paddle.concat([a, self.up(b)], axis=1))


@entry("unet_skips")
def unet():
    m, x = UNet(), _x(1, 1, 8, 8)
    return _backward(m, lambda: (m(x) ** 2).mean())


@entry("lstm")
def lstm():
    m = nn.LSTM(4, 6, num_layers=1)
    x = _x(2, 5, 4)
    return _backward(m, lambda: m(x)[0].tanh().mean())


@entry("gru_head")
def gru():
    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.rnn, self.fc = nn.GRU(4, 6), nn.Linear(6, 2)

        def forward(self, x):
            return self.fc(F.relu(self.rnn(x)[0][:, -1])).sum()

    m, x = Net(), _x(2, 5, 4)
    return _backward(m, lambda: m(x))


@entry("attention")
def attention():
    m = nn.MultiHeadAttention(16, 2)
    x = _x(2, 5, 16)
    return _backward(m, lambda: m(x, x, x).sum())


@entry("transformer_encoder", fast=True)
def encoder():
    m = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 2)
    x = _x(2, 5, 16)
    return _backward(m, lambda: m(x).mean())


class DecoderLM(nn.Layer):
    """A tiny decoder-only LM: token embedding tied to the output head, causal attention, RMS-ish norm."""

    def __init__(self, vocab=32, d=16, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = self.create_parameter([8, d])
        self.blocks = nn.LayerList([nn.TransformerDecoderLayer(d, 2, 32, dropout=0.0) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)

    def forward(self, ids):
        h = self.emb(ids) + self.pos[: ids.shape[1]]
        mask = paddle.triu(paddle.full([ids.shape[1]] * 2, -1e9), 1)
        for blk in self.blocks:
            h = blk(h, h, tgt_mask=mask, memory_mask=mask)
        return paddle.matmul(self.norm(h), self.emb.weight, transpose_y=True)


@entry("decoder_lm_tied")
def decoder_lm():
    m = DecoderLM()
    ids = paddle.to_tensor(np.random.randint(0, 32, (2, 6)).astype("int64"))
    return _backward(m, lambda: F.cross_entropy(m(ids[:, :-1]), ids[:, 1:].unsqueeze(-1)))


class MoE(nn.Layer):
    def __init__(self, d=8, experts=4):
        super().__init__()
        self.gate = nn.Linear(d, experts)
        self.experts = nn.LayerList([nn.Sequential(nn.Linear(d, 16), nn.ReLU(), nn.Linear(16, d))
                                     for _ in range(experts)])

    def forward(self, x):
        w = F.softmax(self.gate(x), -1)
        top = int(paddle.argmax(w.sum(0)))  # one expert for the batch: the others stay idle
        return (self.experts[top](x) * w[:, top:top + 1]).sum()


@entry("moe_idle_experts")
def moe():
    m, x = MoE(), _x(4, 8)
    return _backward(m, lambda: m(x))


class LoRA(nn.Layer):
    def __init__(self, d=8, r=2):
        super().__init__()
        self.base = nn.Linear(d, d)
        for p in self.base.parameters():
            p.stop_gradient = True
        self.a = self.create_parameter([d, r])
        self.b = self.create_parameter([r, d], default_initializer=nn.initializer.Normal())

    def forward(self, x):
        return F.silu(self.base(x) + x @ self.a @ self.b)


@entry("lora_frozen_base", fast=True)
def lora():
    m, x = LoRA(), _x(3, 8)
    return _backward(m, lambda: m(x).mean())


class InPlace(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = F.relu_(self.fc1(x))  # in place
        g = F.tanh_(h * 0.5)  # in place again, then both feed a concat
        return self.fc2(paddle.concat([g, (h * 0.1).exp_()], axis=0)).sum()


@entry("inplace_ops")
def inplace_ops():
    m, x = InPlace(), _x(3, 4)
    return _backward(m, lambda: m(x))


class _RoundSTE(paddle.autograd.PyLayer):
    """Rounding with a straight-through gradient (quantisation-aware training's trick)."""

    @staticmethod
    def forward(ctx, x):
        return paddle.round(x * 4.0) / 4.0

    @staticmethod
    def backward(ctx, g):
        return g * 0.5  # a custom gradient, deliberately not the identity


class PyLayerNet(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.fc2(F.sigmoid(_RoundSTE.apply(self.fc1(x)))).sum()


@entry("pylayer")
def pylayer():
    m, x = PyLayerNet(), _x(3, 4)
    return _backward(m, lambda: m(x))


@entry("weight_norm")
def weight_norm():
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    paddle.nn.utils.weight_norm(m[0])
    x = _x(3, 4)
    return _backward(m, lambda: m(x).mean())


@entry("spectral_norm")
def spectral_norm():
    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.w = self.create_parameter([6, 4])
            self.sn = nn.SpectralNorm([6, 4], dim=0, power_iters=2)
            self.fc = nn.Linear(6, 1)

        def forward(self, x):
            return self.fc(F.leaky_relu(x @ self.sn(self.w).t())).sum()

    m, x = Net(), _x(3, 4)
    return _backward(m, lambda: m(x))


@entry("tied_embedding", fast=True)
def tied():
    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 6)
            self.mix = nn.Linear(6, 6)

        def forward(self, ids):
            h = F.gelu(self.mix(self.emb(ids)))
            return paddle.matmul(h, self.emb.weight, transpose_y=True)

    m = Net()
    ids = paddle.to_tensor(np.random.randint(0, 10, (2, 5)).astype("int64"))
    return _backward(m, lambda: F.cross_entropy(m(ids), ids.unsqueeze(-1)))


def _recompute(reentrant: bool):
    from paddle.distributed.fleet.utils import recompute

    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.blocks = nn.LayerList([nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3)])
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            for b in self.blocks:
                x = recompute(b, x, use_reentrant=reentrant)
            return self.head(x).sum()

    m, x = Net(), _x(4, 8, grad=True)
    return _backward(m, lambda: m(x))


@entry("recompute_reentrant")
def recompute_reentrant():
    return _recompute(True)


@entry("recompute_nonreentrant")
def recompute_nonreentrant():
    return _recompute(False)


@entry("to_static")
def to_static():
    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.body = paddle.jit.to_static(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8)),
                                             full_graph=True)
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(F.relu(self.body(x))).sum()

    m, x = Net(), _x(3, 4)
    return _backward(m, lambda: m(x))


@entry("stack_addn_einsum")
def stack_addn():
    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            s = paddle.stack([F.relu(self.a(x)), F.sigmoid(self.b(x))])
            t = paddle.add_n([paddle.tanh(self.c(x)), F.silu(self.a(x))])
            return paddle.einsum("kij,ij->", s, F.elu(t))

    m, x = Net(), _x(3, 4)
    return _backward(m, lambda: m(x))


@entry("split_multi_output")
def split():
    class Net(nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 8)

        def forward(self, x):
            a, b = paddle.split(self.fc(x), 2, axis=1)
            return (F.relu(a) * paddle.exp(b)).sum() + a.sum()

    m, x = Net(), _x(3, 4)
    return _backward(m, lambda: m(x))


# ---- paddle.grad ---------------------------------------------------------------------------
def _mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


@entry("grad_wrt_one_weight", fast=True)
def grad_weight():
    m, x = _mlp(), _x(3, 4)

    def run(between):
        loss = m(x).mean()
        between()
        (g,) = paddle.grad(loss, [m[4].weight])
        return {"grads": {"4.weight": g}}

    return Case(m, run)


@entry("grad_wrt_input")
def grad_input():
    m, x = _mlp(), _x(3, 4, grad=True)

    def run(between):
        loss = m(x).mean()
        between()
        paddle.grad(loss, [x])
        return {"grads": {}}

    return Case(m, run)


@entry("gradient_penalty")
def gradient_penalty():
    m, x = _mlp(), _x(3, 4, grad=True)

    def run(between):
        out = m(x)
        between()
        paddle.grad(out, x, create_graph=True)
        return {"grads": {}}

    return Case(m, run, root=float(np.sqrt(3)))


@entry("grad_subset_hidden")
def grad_hidden():
    m, x = _mlp(), _x(3, 4)
    keep = {}

    def run(between):
        h = m[1](m[0](x))
        out = m[4](m[3](m[2](h)) + 0.5 * h[:, :8])
        loss = out.mean()
        between()
        hg, wg = paddle.grad(loss, [h, m[2].weight])
        keep["h"] = hg
        return {"grads": {"2.weight": wg}}

    return Case(m, run)
