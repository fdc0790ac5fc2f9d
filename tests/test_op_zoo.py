"""A sweep over many differentiable Paddle ops, captured and uncaptured.

For every case: backward succeeds under ``capture_backward``, every gradient is
bit-identical to an uncaptured run, grad mode is enabled afterwards, no hook
failed, the captured graph contains the op's grad node, and where the graph
claims gradient data it is right (shapes and norms at parameter leaves).

This sweep is what proves ``paddleviz_hooks/hazards.py`` sufficient: every
node kind reached here is either hooked (and the gradients stay identical) or
listed there. ``test_hazard_entries_are_necessary`` proves the converse for
the entries reachable on CPU: hooking them really breaks backward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest

from paddleviz_hooks import capture_backward
from paddleviz_hooks import hazards
from paddleviz_hooks.capture import dispatcher_installed

SEED = 2024


# --------------------------------------------------------------------------
# the cases
# --------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    fn: Callable[..., Any]
    expect: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...] = ((2, 3),)
    layer: Callable[[], nn.Layer] | None = None
    dom: str = "normal"  # "pos": strictly positive leaves
    skip: str | None = None
    hooked: tuple[str, ...] = ()  # node kinds that must carry gradient data
    extra: dict = field(default_factory=dict)


CASES: dict[str, Case] = {}


def case(*expect, shapes=((2, 3),), layer=None, dom="normal", skip=None, name=None, hooked=()):
    def deco(fn):
        n = name or fn.__name__.lstrip("_")
        assert n not in CASES, n
        CASES[n] = Case(n, fn, tuple(expect), tuple(tuple(s) for s in shapes), layer, dom, skip,
                        tuple(hooked))
        return fn

    return deco


def _i(data):
    return paddle.to_tensor(np.asarray(data, dtype="int64"))


S2 = ((2, 3), (2, 3))
S3 = ((2, 3), (2, 3), (2, 3))


# ---- elementwise ---------------------------------------------------------
@case("AddGradNode", shapes=S2)
def add(a, b):
    return a + b


@case("SubtractGradNode", shapes=S2)
def subtract(a, b):
    return a - b


@case("MultiplyGradNode", shapes=S2)
def multiply(a, b):
    return a * b


@case("DivideGradNode", shapes=S2, dom="pos")
def divide(a, b):
    return a / b


@case("MaximumGradNode", shapes=S2)
def maximum(a, b):
    return paddle.maximum(a, b)


@case("ElementwisePowGradNode", shapes=S2, dom="pos")
def elementwise_pow(a, b):
    return paddle.pow(a, b)


@case("PowGradNode")
def pow_scalar(a):
    return a ** 3


@case("ExpGradNode")
def exp(a):
    return paddle.exp(a)


@case("LogGradNode", dom="pos")
def log(a):
    return paddle.log(a)


@case("SqrtGradNode", dom="pos")
def sqrt(a):
    return paddle.sqrt(a)


@case("RsqrtGradNode", dom="pos")
def rsqrt(a):
    return paddle.rsqrt(a)


@case("TanhGradNode")
def tanh(a):
    return paddle.tanh(a)


@case("SigmoidGradNode")
def sigmoid(a):
    return F.sigmoid(a)


@case("SinGradNode", "CosGradNode")
def sin_cos(a):
    return paddle.sin(a) * paddle.cos(a)


@case("AbsGradNode")
def abs_(a):
    return paddle.abs(a)


@case("ReluGradNode")
def relu(a):
    return F.relu(a)


@case("GeluGradNode")
def gelu(a):
    return F.gelu(a)


@case("SiluGradNode")
def silu(a):
    return F.silu(a)


@case("LeakyReluGradNode")
def leaky_relu(a):
    return F.leaky_relu(a, 0.1)


@case("EluGradNode")
def elu(a):
    return F.elu(a)


@case("SoftplusGradNode")
def softplus(a):
    return F.softplus(a)


@case("HardswishGradNode")
def hardswish(a):
    return F.hardswish(a)


@case("LogsigmoidGradNode")
def log_sigmoid(a):
    return F.log_sigmoid(a)


@case("PreluGradNode", shapes=((2, 3, 4),), layer=lambda: nn.PReLU(3))
def prelu(m, a):
    return m(a)


@case("SoftmaxGradNode")
def softmax(a):
    return F.softmax(a, axis=-1)


@case("LogSoftmaxGradNode")
def log_softmax(a):
    return F.log_softmax(a, axis=-1)


@case("ClipGradNode")
def clip(a):
    return paddle.clip(a, -0.5, 0.5)


@case("LerpGradNode", shapes=S3)
def lerp(a, b, w):
    return paddle.lerp(a, b, w)


@case("ErfGradNode")
def erf(a):
    return paddle.erf(a)


@case("CastGradNode")
def cast(a):
    return a.astype("float64").sum().astype("float32")


# ---- reductions ------------------------------------------------------------
@case("SumGradNode")
def sum_axis(a):
    return a.sum(axis=0)


@case("MeanGradNode")
def mean_axis(a):
    return a.mean(axis=1)


@case("MaxGradNode")
def max_axis(a):
    return a.max(axis=1)


@case("AmaxGradNode")
def amax(a):
    return paddle.amax(a, axis=0)


@case("ProdGradNode", dom="pos")
def prod(a):
    return paddle.prod(a, axis=1)


@case("LogsumexpGradNode")
def logsumexp(a):
    return paddle.logsumexp(a, axis=1)


@case("PNormGradNode")
def norm(a):
    return paddle.linalg.norm(a, p=2, axis=1)


@case("CumsumGradNode")
def cumsum(a):
    return paddle.cumsum(a, axis=1)


@case("CumprodGradNode", dom="pos")
def cumprod(a):
    return paddle.cumprod(a, dim=1)


@case("SqrtGradNode", "PowGradNode", "MeanGradNode")
def std(a):
    return paddle.std(a, axis=1)


# ---- shapes ------------------------------------------------------------------
@case("ReshapeGradNode")
def reshape(a):
    return a.reshape([3, 2])


@case("TransposeGradNode")
def transpose(a):
    return a.transpose([1, 0])


@case("FlattenGradNode", shapes=((2, 3, 2),))
def flatten(a):
    return paddle.flatten(a)


@case("SqueezeGradNode", "UnsqueezeGradNode")
def squeeze_unsqueeze(a):
    return a.unsqueeze(0).squeeze(0)


@case("ExpandGradNode", shapes=((1, 3),))
def expand(a):
    return a.expand([4, 3])


@case("TileGradNode")
def tile(a):
    return paddle.tile(a, [2, 2])


@case("FlipGradNode")
def flip(a):
    return paddle.flip(a, axis=[1])


@case("RollGradNode")
def roll(a):
    return paddle.roll(a, 1, axis=1)


@case("Pad3dGradNode", shapes=((1, 2, 3, 3),))
def pad(a):
    return F.pad(a, [1, 1, 1, 1])


@case("SliceGradNode", shapes=((4, 5),))
def slice_(a):
    return a[1:3, 2:]


@case("StridedSliceGradNode", shapes=((4, 5),))
def strided_slice(a):
    return a[::2, 1::2]


@case("DiagonalGradNode", shapes=((3, 3),))
def diagonal(a):
    return paddle.diagonal(a)


@case("TrilGradNode", "TriuGradNode", shapes=((3, 3),))
def tril_triu(a):
    return paddle.tril(a) + paddle.triu(a, 1) * 2


@case("KronGradNode", shapes=((2, 2), (2, 3)))
def kron(a, b):
    return paddle.kron(a, b)


@case("CrossGradNode", shapes=((2, 3), (2, 3)))
def cross(a, b):
    return paddle.cross(a, b, axis=1)


@case("RepeatInterleaveGradNode")
def repeat_interleave(a):
    return paddle.repeat_interleave(a, 2, axis=1)


# ---- several tensors in or out -------------------------------------------------------
@case("ConcatGradNode", shapes=S3)
def concat(a, b, c):
    return paddle.concat([a, b, c], axis=1)


@case("StackGradNode", shapes=S3)
def stack(a, b, c):
    return paddle.stack([a, b, c])


@case("AddNGradNodeFinal", shapes=S3)
def add_n(a, b, c):
    return paddle.add_n([a * 2, b, c])


@case("EinsumGradNode", shapes=((2, 3), (3, 4)))
def einsum(a, b):
    return paddle.einsum("ij,jk->ik", a, b)


@case("MultiDotGradNode", shapes=((2, 3), (3, 4), (4, 2)))
def multi_dot(a, b, c):
    return paddle.linalg.multi_dot([a, b, c])


@case("ConcatGradNode", shapes=S2, name="hstack")
def _hstack(a, b):
    return paddle.hstack([a, b])


@case("ConcatGradNode", shapes=((2, 2), (1, 3)), name="block_diag")
def _block_diag(a, b):
    return paddle.block_diag([a, b])


@case("MultiplexGradNode", shapes=S2)
def multiplex(a, b):
    return paddle.multiplex([a, b], paddle.to_tensor([[1], [0]], dtype="int32"))


@case("SplitWithNumGradNode", shapes=((2, 6),))
def split_num(a):
    x, y, z = paddle.split(a, 3, axis=1)
    return x * 1 + y * 2 + z * 3


@case("SplitGradNode", shapes=((2, 6),))
def split_sections(a):
    x, y = paddle.split(a, [2, 4], axis=1)
    return x.sum() + (y * y).sum()


@case("SplitGradNode", shapes=((2, 6),))
def split_one_used(a):
    x, _ = paddle.split(a, [2, 4], axis=1)
    return x * 3


@case("SplitWithNumGradNode", shapes=((2, 6),))
def chunk(a):
    x, y = paddle.chunk(a, 2, axis=1)
    return x * y


@case("UnbindGradNode", shapes=((3, 2),))
def unbind(a):
    x, y, z = paddle.unbind(a, axis=0)
    return x + 2 * y + 3 * z


@case("UnbindGradNode", shapes=((3, 2),))
def unbind_one_used(a):
    x, _, _ = paddle.unbind(a, axis=0)
    return x * 3


@case("UnstackGradNode", shapes=((3, 2),))
def unstack(a):
    x, y, z = paddle.unstack(a, axis=0)  # all outputs used: Paddle crashes otherwise
    return x + 2 * y + 3 * z


@case("MeshgridGradNode", shapes=((3,), (2,)))
def meshgrid(a, b):
    x, y = paddle.meshgrid(a, b)  # both used: Paddle crashes otherwise
    return x * y


@case("BroadcastTensorsGradNode", shapes=((2, 1), (1, 3)))
def broadcast_tensors(a, b):
    x, y = paddle.broadcast_tensors([a, b])  # both used: Paddle crashes otherwise
    return x - 2 * y


@case("SplitGradNode", shapes=((2, 6),))
def tensor_split(a):
    parts = paddle.tensor_split(a, 3, axis=1)
    return sum(p * (i + 1) for i, p in enumerate(parts))


# ---- gather / scatter / index ------------------------------------------------------
@case("GatherGradNode", shapes=((4, 3),))
def gather(a):
    return paddle.gather(a, _i([0, 2, 2]))


@case("GatherNdGradNode", shapes=((4, 3),))
def gather_nd(a):
    return paddle.gather_nd(a, _i([[0, 1], [3, 2]]))


@case("ScatterGradNode", shapes=((4, 3), (2, 3)))
def scatter(a, b):
    return paddle.scatter(a, _i([1, 3]), b)


@case("ScatterNdAddGradNode", shapes=((4, 3), (2, 3)))
def scatter_nd_add(a, b):
    return paddle.scatter_nd_add(a, _i([[1], [1]]), b)


@case("IndexSelectGradNode", shapes=((4, 3),))
def index_select(a):
    return paddle.index_select(a, _i([3, 0]), axis=0)


@case("IndexAddGradNode", shapes=((4, 3), (2, 3)))
def index_add(a, b):
    return paddle.index_add(a, _i([0, 2]), 0, b)


@case("IndexPutGradNode", shapes=((4, 3), (2,)))
def index_put(a, v):
    return paddle.index_put(a, (_i([0, 3]), _i([1, 2])), v)


@case("TakeAlongAxisGradNode", shapes=((3, 4),))
def take_along_axis(a):
    return paddle.take_along_axis(a, _i([[0], [3], [1]]), axis=1)


@case("PutAlongAxisGradNode", shapes=((3, 4), (3, 1)))
def put_along_axis(a, v):
    return paddle.put_along_axis(a, _i([[0], [3], [1]]), v, axis=1)


@case("IndexSampleGradNode", shapes=((2, 4),))
def index_sample(a):
    return paddle.index_sample(a, _i([[0, 3], [1, 1]]))


@case("MaskedSelectGradNode", shapes=((2, 3),))
def masked_select(a):
    return paddle.masked_select(a, a > 0)


@case("WhereGradNode", shapes=S2)
def where(a, b):
    return paddle.where(a > b, a, b * 2)


@case("MaskedFillGradNode", shapes=((2, 3),), name="masked_fill")
def _masked_fill(a):
    return paddle.masked_fill(a, a < 0, 0.5)


@case("IndexElementwiseGetGradNode", shapes=((4, 3),), name="getitem_int_tensor")
def _getitem_tensor(a):
    return a[_i([1, 3])]


@case("TopkGradNode", shapes=((2, 5),))
def topk(a):
    v, _ = paddle.topk(a, 2, axis=1)
    return v


@case("ArgsortGradNode", shapes=((2, 5),))
def sort(a):
    return paddle.sort(a, axis=1)


# ---- linear algebra -----------------------------------------------------------
@case("MatmulGradNode", shapes=((2, 3), (3, 4)))
def matmul(a, b):
    return a @ b


@case("BmmGradNode", shapes=((2, 2, 3), (2, 3, 2)))
def bmm(a, b):
    return paddle.bmm(a, b)


@case("DotGradNode", shapes=((3,), (3,)))
def dot(a, b):
    return paddle.dot(a, b)


@case("InverseGradNode", shapes=((3, 3),))
def inverse(a):
    return paddle.linalg.inv(a + 3 * paddle.eye(3))


@case("DetGradNode", shapes=((3, 3),))
def det(a):
    return paddle.linalg.det(a + 3 * paddle.eye(3))


@case("CholeskyGradNode", shapes=((3, 3),))
def cholesky(a):
    return paddle.linalg.cholesky(a @ a.t() + 3 * paddle.eye(3))


@case("SolveGradNode", shapes=((3, 3), (3, 2)))
def solve(a, b):
    return paddle.linalg.solve(a + 3 * paddle.eye(3), b)


@case("MatmulGradNode", "AddGradNode", shapes=((2, 3), (3, 4), (4,)), name="functional_linear")
def _linear(x, w, b):
    return F.linear(x, w, b)


@case("BilinearGradNode", shapes=((2, 3), (2, 4)), layer=lambda: nn.Bilinear(3, 4, 2))
def bilinear(m, a, b):
    return m(a, b)


# ---- nn layers -----------------------------------------------------------------
@case("Conv2dGradNodeFinal", shapes=((1, 2, 3),), layer=lambda: nn.Conv1D(2, 3, 2))
def conv1d(m, x):
    return m(x)


@case("Conv2dGradNodeFinal", shapes=((1, 2, 5, 5),), layer=lambda: nn.Conv2D(2, 3, 3, padding=1))
def conv2d(m, x):
    return m(x)


@case("DepthwiseConv2dGradNode", shapes=((1, 2, 5, 5),), layer=lambda: nn.Conv2D(2, 4, 3, groups=2))
def conv2d_depthwise(m, x):
    return m(x)


@case("Conv3dGradNode", shapes=((1, 2, 3, 3, 3),), layer=lambda: nn.Conv3D(2, 2, 2))
def conv3d(m, x):
    return m(x)


@case("Conv2dTransposeGradNode", shapes=((1, 2, 3, 3),), layer=lambda: nn.Conv2DTranspose(2, 3, 2, stride=2))
def conv2d_transpose(m, x):
    return m(x)


@case("Pool2dGradNode", shapes=((1, 2, 4, 4),))
def max_pool2d(x):
    return F.max_pool2d(x, 2)


@case("Pool2dGradNode", shapes=((1, 2, 4, 4),))
def avg_pool2d(x):
    return F.avg_pool2d(x, 2)


@case("Pool2dGradNode", shapes=((1, 2, 5, 5),))
def adaptive_avg_pool2d(x):
    return F.adaptive_avg_pool2d(x, 2)


@case("MaxPool2dWithIndexGradNode", shapes=((1, 2, 5, 5),))
def adaptive_max_pool2d(x):
    return F.adaptive_max_pool2d(x, 2)


@case("BatchNormGradNode", shapes=((3, 2, 2, 2),), layer=lambda: nn.BatchNorm2D(2))
def batch_norm(m, x):
    return m(x)


@case("LayerNormGradNode", shapes=((2, 3, 4),), layer=lambda: nn.LayerNorm(4))
def layer_norm(m, x):
    return m(x)


@case("GroupNormGradNode", shapes=((2, 4, 3),), layer=lambda: nn.GroupNorm(2, 4))
def group_norm(m, x):
    return m(x)


@case("InstanceNormGradNode", shapes=((2, 2, 3, 3),), layer=lambda: nn.InstanceNorm2D(2))
def instance_norm(m, x):
    return m(x)


@case("PNormGradNode", shapes=((2, 4),))
def normalize(x):
    return F.normalize(x, axis=1)


@case("EmbeddingGradNode", shapes=(), layer=lambda: nn.Embedding(10, 4))
def embedding(m):
    return m(_i([[1, 3, 3], [9, 0, 1]]))


@case("DropoutGradNode", shapes=((4, 5),))
def dropout(x):
    return F.dropout(x, p=0.5, training=True)


@case("BilinearInterpGradNode", shapes=((1, 1, 2, 3),))
def interpolate(x):
    return F.interpolate(x, scale_factor=2, mode="bilinear")


@case("PixelShuffleGradNode", shapes=((1, 4, 2, 2),))
def pixel_shuffle(x):
    return F.pixel_shuffle(x, 2)


@case("UnfoldGradNode", shapes=((1, 2, 3, 3),))
def unfold(x):
    return F.unfold(x, 2)


@case("GridSampleGradNode", shapes=((1, 1, 3, 3), (1, 2, 2, 2)))
def grid_sample(x, g):
    return F.grid_sample(x, paddle.tanh(g), align_corners=False)


# ---- losses --------------------------------------------------------------------
@case("CrossEntropyWithSoftmaxGradNode", shapes=((3, 5),))
def cross_entropy(x):
    return F.cross_entropy(x, _i([1, 0, 4]))


@case("SquareGradNode", "SubtractGradNode", shapes=S2, name="mse_loss")
def _mse(a, b):
    return F.mse_loss(a, b)


@case("SigmoidCrossEntropyWithLogitsGradNode", shapes=((2, 3),))
def bce_with_logits(x):
    return F.binary_cross_entropy_with_logits(x, paddle.to_tensor(np.eye(2, 3, dtype="float32")))


@case("HuberLossGradNode", shapes=S2)
def smooth_l1(a, b):
    return F.smooth_l1_loss(a, b)


@case("KldivLossGradNode", shapes=S2)
def kl_div(a, b):
    return F.kl_div(F.log_softmax(a, -1), F.softmax(b, -1), reduction="batchmean")


# ---- recurrent and attention --------------------------------------------------------
@case("RnnGradNode", shapes=((2, 3, 4),), layer=lambda: nn.LSTM(4, 5))
def lstm(m, x):
    out, (h, c) = m(x)
    return out


@case("RnnGradNode", shapes=((2, 3, 4),), layer=lambda: nn.GRU(4, 5))
def gru(m, x):
    out, h = m(x)
    return out


@case("RnnGradNode", shapes=((2, 3, 4),), layer=lambda: nn.SimpleRNN(4, 5))
def simple_rnn(m, x):
    out, h = m(x)
    return out


@case("RnnGradNode", shapes=((2, 3, 4),), layer=lambda: nn.LSTM(4, 3, num_layers=2, direction="bidirect"))
def lstm_bidirect_2layers(m, x):
    out, (h, c) = m(x)
    return [out, h]


@case("MatmulGradNode", shapes=((2, 4),), layer=lambda: nn.LSTMCell(4, 3))
def lstm_cell(m, x):
    out, (h, c) = m(x)
    return out


@case("SoftmaxGradNode", "MatmulGradNode", shapes=((2, 3, 8),), layer=lambda: nn.MultiHeadAttention(8, 2))
def multi_head_attention(m, x):
    return m(x, x, x)


@case("SoftmaxGradNode", shapes=((1, 3, 2, 4), (1, 3, 2, 4), (1, 3, 2, 4)))
def scaled_dot_product_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


@case("LayerNormGradNode", "MatmulGradNode", shapes=((2, 3, 8),),
      layer=lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0))
def transformer_encoder_layer(m, x):
    return m(x)


# ---- autograd machinery ---------------------------------------------------------------
class CubeFn(paddle.autograd.PyLayer):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensor()
        return dy * 3 * x * x


@case("GradNodePyLayer_CubeFn", shapes=((2, 3),))
def pylayer(a):
    return CubeFn.apply(paddle.tanh(a)) * 2


@case("AddGradNode", "ReluGradNode", "ScaleGradNode", "ExpGradNode", shapes=S2)
def inplace(a, b):
    y = a * 1.0
    y.add_(b)
    y.scale_(2.0)
    y.exp_()  # exp's backward reads its output: nothing may modify y after this
    z = b * 1.0
    F.relu_(z)
    return [y, z]


@case("SetValueWithTensorGradNode", shapes=((3, 4), (4,)))
def setitem(a, b):
    y = a * 2
    y[1] = b
    return y


@case("MultiplyDoubleGradNode", "TanhDoubleGradNode", shapes=S2)
def grad_create_graph(a, b):
    y = (a * a * b).sum() + paddle.tanh(a * b).sum()
    (ga,) = paddle.grad([y], [a], create_graph=True)
    return ga * b


@case("ConcatDoubleGradNode", shapes=S2)
def concat_double_grad(a, b):
    y = paddle.concat([a * a, b], axis=0)
    (ga,) = paddle.grad([(y * y).sum()], [a], create_graph=True)
    return ga


@case("StackDoubleGradNode", shapes=S2)
def stack_double_grad(a, b):
    y = paddle.stack([a * a, b], axis=0)
    (ga,) = paddle.grad([(y * y).sum()], [a], create_graph=True)
    return ga


@case("TanhDoubleGradNode", "MultiplyDoubleGradNode", shapes=S2)
def add_n_double_grad(a, b):
    y = paddle.add_n([paddle.tanh(a), a * b])
    (ga,) = paddle.grad([y.sum()], [a], create_graph=True)
    return ga


@case("MeshgridGradNode", shapes=((3,), (2,)))
def cartesian_prod(a, b):
    return paddle.cartesian_prod([a, b])


@case("AddNGradNodeFinal", shapes=((2, 3),))
def add_n_single(a):
    return paddle.add_n([a * 2])


@case("WhereGradNode", "IndexElementwiseGetGradNode", shapes=((2, 3), (6,)))
def masked_scatter(a, v):
    return paddle.masked_scatter(a, a > 0, v)


@case("IndexPutGradNode", shapes=((3, 4),))
def index_fill(a):
    return paddle.index_fill(a, _i([0, 2]), 1, 0.5)


@case("IndexSelectGradNode", "FlattenGradNode", shapes=((3, 4),))
def take(a):
    return paddle.take(a, _i([0, 5, 11]))


@case("IndexElementwisePutWithTensorGradNode", shapes=((3, 4), (2,)), name="setitem_tensor_index")
def _setitem_tensor_index(a, v):
    y = a * 1
    y[_i([0, 2]), _i([1, 3])] = v
    return y


@case("RnnGradNode", shapes=((2, 3, 4), (1, 2, 5), (1, 2, 5)), layer=lambda: nn.LSTM(4, 5))
def lstm_initial_states(m, x, h0, c0):
    out, (h, c) = m(x, (h0, c0))
    return [out, h, c]


@case("MatmulGradNode", shapes=((2, 4),), layer=lambda: nn.GRUCell(4, 3))
def gru_cell(m, x):
    out, h = m(x)
    return out


def _recompute(*args, **kw):
    from paddle.distributed.fleet.utils import recompute

    return recompute(*args, **kw)


@case("GradNodePyLayer_RecomputeFunction", shapes=((2, 4),),
      layer=lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)))
def recompute(m, x):
    return _recompute(m, x)


@case("MatmulGradNode", "TanhGradNode", shapes=((2, 4),),
      layer=lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)))
def recompute_no_reentrant(m, x):
    return _recompute(m, x, use_reentrant=False)


@case("Dy2StGradNode", shapes=((2, 3),), layer=lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
def to_static(m, x):
    return paddle.jit.to_static(m, full_graph=True)(x)


_SEGFAULT = ("Paddle 3.3.1 itself segfaults in backward when only one output of {} is used "
             "(with or without hooks; see test_single_output_segfaults_are_paddles)")


@case("UnstackGradNode", shapes=((3, 2),), skip=_SEGFAULT.format("unstack"))
def unstack_one_used(a):
    x, _, _ = paddle.unstack(a, axis=0)
    return x


@case("MeshgridGradNode", shapes=((3,), (2,)), skip=_SEGFAULT.format("meshgrid"))
def meshgrid_one_used(a, b):
    x, _ = paddle.meshgrid(a, b)
    return x


@case("BroadcastTensorsGradNode", shapes=((2, 1), (1, 3)), skip=_SEGFAULT.format("broadcast_tensors"))
def broadcast_tensors_one_used(a, b):
    x, _ = paddle.broadcast_tensors([a, b])
    return x


# --------------------------------------------------------------------------
# running a case
# --------------------------------------------------------------------------
@dataclass
class Run:
    loss: float
    grads: dict[str, np.ndarray | None]
    leaves: dict[str, Any]
    cap: Any = None


def make_leaves(c: Case):
    """The case's layer and input leaves, identical on every call."""
    paddle.seed(SEED)
    rng = np.random.RandomState(SEED)
    m = c.layer() if c.layer is not None else None
    xs = []
    for s in c.shapes:
        v = rng.standard_normal(s).astype("float32")
        if c.dom == "pos":
            v = np.abs(v) + 0.5
        xs.append(paddle.to_tensor(v, stop_gradient=False))
    named = {f"x{i}": x for i, x in enumerate(xs)}
    if m is not None:
        named.update({f"m.{n}": p for n, p in m.named_parameters() if not p.stop_gradient})
    return m, xs, named


def reduce_outputs(out) -> Any:
    """A scalar loss from the outputs, weighting each element differently."""
    outs = out if isinstance(out, (list, tuple)) else [out]
    rng = np.random.RandomState(7)
    loss = None
    for o in outs:
        w = paddle.to_tensor(rng.uniform(0.5, 1.5, o.shape).astype(str(o.dtype).split(".")[-1]))
        term = (o * w).sum()
        loss = term if loss is None else loss + term
    return loss


def run_case(c: Case, capture: bool, grad_stats: bool = True) -> Run:
    m, xs, named = make_leaves(c)
    ctx = capture_backward(params=named, grad_stats=grad_stats) if capture else nullcontext()
    with ctx as cap:
        paddle.seed(SEED + 1)  # same dropout masks in both runs
        out = c.fn(m, *xs) if m is not None else c.fn(*xs)
        loss = reduce_outputs(out)
        loss.backward()
    grads = {n: (None if p.grad is None else p.grad.numpy().copy()) for n, p in named.items()}
    return Run(float(loss), grads, named, cap)


# --------------------------------------------------------------------------
# the sweep
# --------------------------------------------------------------------------
RUNNABLE = [c for c in CASES.values() if c.skip is None]


def _params(cases):
    return [pytest.param(c, id=c.name, marks=[pytest.mark.skip(reason=c.skip)] if c.skip else [])
            for c in cases]


def test_sweep_is_wide():
    assert len(RUNNABLE) >= 60
    expected = {e for c in RUNNABLE for e in c.expect}
    assert len(expected) >= 60
    for kind in ("ConcatGradNode", "StackGradNode", "SplitGradNode", "AddNGradNodeFinal", "EinsumGradNode",
                 "MultiDotGradNode", "GatherGradNode", "ScatterGradNode", "WhereGradNode",
                 "IndexSelectGradNode", "RnnGradNode", "SoftmaxGradNode", "Conv2dGradNodeFinal",
                 "Pool2dGradNode", "BatchNormGradNode", "LayerNormGradNode", "EmbeddingGradNode",
                 "DropoutGradNode", "GradNodePyLayer_CubeFn", "GradNodePyLayer_RecomputeFunction",
                 "MultiplyDoubleGradNode", "Dy2StGradNode"):
        assert kind in expected, kind


def _same_grads(ref: Run, got: Run) -> None:
    assert ref.grads.keys() == got.grads.keys()
    for n, r in ref.grads.items():
        g = got.grads[n]
        assert (r is None) == (g is None), n
        if r is not None:
            assert r.dtype == g.dtype and np.array_equal(r, g, equal_nan=True), n
    assert ref.loss == got.loss or (np.isnan(ref.loss) and np.isnan(got.loss))


def _check_graph_data(g, run: Run, stats: bool) -> None:
    """What the graph claims about gradients is true."""
    inn = g.in_edges()
    out = g.out_edges()
    for n in g.nodes:
        if n.kind != "op":
            continue
        # hooked exactly when hazards.py allows it
        assert n.hooked == (hazards.hook_hazard(n.name) is None), n.name
        assert (n.note is None) == n.hooked, n.name
        if n.hooked and g.meta["entry"] == "backward":
            for e in out.get(n.id, []):
                assert e.grad is not None and e.grad.shape is not None, (n.name, e)
                assert (e.grad.norm is not None) == (stats and e.grad.dtype.startswith("float")), (n.name, e.grad)
    for n in g.nodes:
        if n.kind != "param":
            continue
        leaf = run.leaves[n.param]
        assert n.shape == tuple(leaf.shape)
        edges = inn[n.id]
        for e in edges:
            # a gradient arriving at a leaf has the leaf's shape (or is unknown)
            assert e.grad is not None and e.grad.shape == n.shape, (n.param, g.nodes[e.src].name, e.grad)
        if (g.meta["entry"] == "backward" and len(edges) == 1 and stats
                and g.nodes[edges[0].src].hooked and run.grads[n.param] is not None):
            ref = np.linalg.norm(run.grads[n.param].astype("float64"))
            assert edges[0].grad.norm == pytest.approx(ref, rel=1e-5, abs=1e-12), (n.param, g.nodes[edges[0].src].name)


@pytest.mark.parametrize("c", _params(CASES.values()))
def test_op_under_capture(c: Case):
    ref = run_case(c, capture=False)
    assert paddle.is_grad_enabled()
    got = run_case(c, capture=True)
    assert paddle.is_grad_enabled()
    assert not dispatcher_installed()
    _same_grads(ref, got)
    cap = got.cap
    assert not cap.errors, cap.errors
    assert cap.graphs, "no graph captured"
    names = {n.name for g in cap.graphs for n in g.nodes}
    for e in c.expect:
        assert e in names, (e, sorted(names))
    for g in cap.graphs:
        _check_graph_data(g, got, stats=True)
        assert g.meta["grad_stats"] is True
    # at least one reached leaf got a gradient (the case really exercises backward)
    assert any(v is not None for v in got.grads.values())


STATS_OFF = ["matmul", "concat", "lstm", "pylayer", "grad_create_graph", "conv2d", "split_num", "dropout"]


@pytest.mark.parametrize("name", STATS_OFF)
def test_op_without_grad_stats(name):
    c = CASES[name]
    ref = run_case(c, capture=False)
    got = run_case(c, capture=True, grad_stats=False)
    _same_grads(ref, got)
    assert paddle.is_grad_enabled() and not got.cap.errors
    for g in got.cap.graphs:
        assert g.meta["grad_stats"] is False
        _check_graph_data(g, got, stats=False)
        for e in g.edges:
            if e.grad is not None:
                assert e.grad.norm is None and e.grad.min is None and e.grad.max is None


# --------------------------------------------------------------------------
# the hazard list: sufficient (above), covered and necessary (below)
# --------------------------------------------------------------------------
def test_every_hazard_entry_is_reached_by_the_sweep():
    expected = {e for c in RUNNABLE for e in c.expect}
    for name in hazards.MULTI_TENSOR_INPUT:
        assert name in expected, f"{name} is listed in hazards.py but no zoo case reaches it"
    for prefix in hazards.NEVER_FIRES_PREFIXES:
        assert any(e.startswith(prefix) for e in expected), prefix


def test_formerly_listed_kinds_are_hooked():
    """Kinds once suspected; measured hookable, so the graph keeps gradient data there."""
    for name in ("SplitGradNode", "SplitWithNumGradNode", "UnbindGradNode", "UnstackGradNode",
                 "ConcatDoubleGradNode", "StackDoubleGradNode", "IndexPutGradNode",
                 "FusedRotaryPositionEmbeddingGradNode"):
        assert hazards.hook_hazard(name) is None, name
    assert hazards.hook_hazard("GradNodeAccumulation") is not None
    assert hazards.hook_hazard("GradNodePyLayer_CubeFn_123") is not None
    assert hazards.hook_hazard("CudnnLstmGradNode") is not None


_NECESSITY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    import paddle
    import test_op_zoo as z
    from paddleviz_hooks import hazards
    from paddleviz_hooks.capture import walk_graph

    def hook_only(case_name, kind):
        c = z.CASES[case_name]
        m, xs, named = z.make_leaves(c)
        paddle.seed(z.SEED + 1)
        out = c.fn(m, *xs) if m is not None else c.fn(*xs)
        loss = z.reduce_outputs(out)
        w = walk_graph([loss])
        fired, handles = [], []
        for gn, n in zip(w.wrappers, w.nodes):
            if n.name == kind:
                handles.append(gn._register_post_hook(lambda outs, ins: (fired.append(1), outs)[1]))
        w.wrappers.clear()
        res = {{"case": case_name, "hooked": len(handles), "fired": 0}}
        try:
            loss.backward()
            res["error"] = None
        except Exception as exc:
            res["error"] = type(exc).__name__ + ": " + str(exc)
        res["fired"] = len(fired)
        res["grad_enabled"] = paddle.is_grad_enabled()
        paddle.set_grad_enabled(True)
        return res

    report = {{}}
    for kind in sorted(hazards.MULTI_TENSOR_INPUT) + ["GradNodePyLayer_CubeFn", "GradNodePyLayer_RecomputeFunction",
                                                     "Dy2StGradNode"]:
        case = next(c.name for c in z.RUNNABLE if kind in c.expect and c.name not in ("add_n_single",))
        report[kind] = hook_only(case, kind)
    print("REPORT " + json.dumps(report))
    """
)


def test_hazard_entries_are_necessary():
    """Hook each listed kind alone, with a hook returning its input unchanged: backward breaks.

    Run in a subprocess: a hook on an unsafe node could take the process down.
    """
    script = _NECESSITY_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "GLOG_minloglevel": "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")][-1]
    report = json.loads(line[len("REPORT "):])
    for kind in hazards.MULTI_TENSOR_INPUT:
        r = report[kind]
        assert r["hooked"] >= 1, (kind, r)
        assert r["error"] is not None and "must be list of Tensor" in r["error"], (kind, r)
        assert r["fired"] >= 1  # the hook ran; converting its return value is what fails
    for kind in ("GradNodePyLayer_CubeFn", "GradNodePyLayer_RecomputeFunction", "Dy2StGradNode"):
        r = report[kind]
        assert r["hooked"] == 1 and r["error"] is None and r["fired"] == 0, (kind, r)


@pytest.mark.parametrize("name", ["unstack_one_used", "meshgrid_one_used", "broadcast_tensors_one_used"])
def test_single_output_segfaults_are_paddles(name):
    """The skipped cases crash Paddle without any hook: the skip is Paddle's bug, not ours.

    If this fails, Paddle fixed it: drop the skip from the case.
    """
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import test_op_zoo as z
        c = z.CASES[{name!r}]
        c.skip = None
        z.run_case(c, capture=False)
        print("SURVIVED")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "SURVIVED" not in proc.stdout
    assert "Segmentation fault" in proc.stderr or proc.returncode in (-11, 139)
