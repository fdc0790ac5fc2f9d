"""Complex gradients (complex64, complex128) told as truthfully as float ones.

A complex gradient's norm is ``sqrt(sum |z|**2)`` (the squares of its real
and imaginary parts, accumulated in float64 on the host), an element with a
NaN real or imaginary part counts once as NaN, one with an infinite part once
as Inf, and it has no min or max (complex numbers have no order). The same
answer is given everywhere: edge statistics (host and queued), where the
first non-finite gradient is, the ``on_nonfinite`` trigger, the global norms.
Each oracle is numpy in float64 or Paddle's own tensor hooks, without a capture.
An empty gradient (no elements) is a gradient with norm 0, not an unpaired one.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import paddle
import paddle.nn as nn
import pytest
from paddle.base.framework import EagerParamBase

from paddleviz_hooks import BackwardGraph, BackwardGraphRecorder, capture_backward, summarize
from paddleviz_hooks.capture import stats
from paddleviz_hooks.graph import GradMeta
from paddleviz_hooks.sinks.explorer import explorer_graph
from paddleviz_hooks.sinks.vdl_graph import vdl_graph
from paddleviz_hooks.text import edge_lines, fmt_num
from paddleviz_hooks.triggers import global_grad_norm, grads_nonfinite

NO_ORDER = "none (complex values have no order)"


def _ref(z: np.ndarray) -> tuple[float, int, int]:
    """Norm sqrt(sum |z|^2) in float64 (scaled: squares of 1e200 overflow), NaN and Inf elements."""
    parts = np.stack([z.real, z.imag]).astype(np.float64)
    with np.errstate(all="ignore"):
        top = float(np.abs(parts).max()) or 1.0
        norm = top * float(np.sqrt(np.square(parts / top).sum()))
    nan = np.isnan(z)
    return norm, int(nan.sum()), int((np.isinf(z) & ~nan).sum())


def _complex(rng, shape, dtype=np.complex64, scale=1.0):
    return ((rng.standard_normal(shape) + 1j * rng.standard_normal(shape)) * scale).astype(dtype)


def _cases() -> dict[str, paddle.Tensor]:
    rng = np.random.default_rng(0)
    big = _complex(rng, 300_000)  # above the zero-copy threshold
    nan_imag = big.copy()
    nan_imag.imag[[5, 70_000]] = np.nan  # the real parts are finite
    nan_imag[9] = complex(np.nan, np.nan)  # counted once
    odd = _complex(rng, (4, 9))
    odd[0, 1] = complex(np.inf, 1.0)
    odd[2, 2] = complex(0.5, -np.inf)
    odd[3, 3] = complex(np.nan, np.inf)  # NaN (once), not Inf
    only_inf = _complex(rng, (4, 9))
    only_inf[1, 1] = complex(2.0, np.inf)
    return {
        "small": paddle.to_tensor(_complex(rng, (3, 5))),
        "big": paddle.to_tensor(big),
        "constant": paddle.to_tensor(np.full(1_000_003, 0.1 + 0.1j, np.complex64)),
        "complex128": paddle.to_tensor(_complex(rng, 50_000, np.complex128)),
        "nan in imag": paddle.to_tensor(nan_imag),
        "nan and inf": paddle.to_tensor(odd),
        "inf in imag": paddle.to_tensor(only_inf),
        "huge": paddle.to_tensor(_complex(rng, 1000, scale=1e21)),  # finite, squares overflow float32
        "huge complex128": paddle.to_tensor(_complex(rng, 10, np.complex128, 1e200)),
        "big huge complex128": paddle.to_tensor(_complex(rng, 20_000, np.complex128, 1e200)),
        "strided": paddle.to_tensor(_complex(rng, (256, 300))).t(),
    }


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "queued"])
def test_complex_statistics_equal_float64_references(on_device):
    q = stats.StatsQueue(on_device=on_device)
    tensors = _cases()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NaN, Inf and overflow never make numpy or Paddle warn
        metas = {k: stats.grad_meta(t, True, q) for k, t in tensors.items()}
        q.resolve()
    for k, t in tensors.items():
        m = metas[k]
        norm, nan, inf = _ref(t.numpy())
        assert (m.dtype, m.min, m.max) == (str(t.numpy().dtype), None, None), k  # no order: no min, no max
        assert (m.nan, m.inf) == (nan, inf), k
        if nan:
            assert math.isnan(m.norm), k
        elif inf:
            assert m.norm == math.inf, k
        else:  # host: float64 accumulation; queued: Paddle's own reduction (float32 on the CPU wheel)
            assert abs(m.norm - norm) <= (1e-5 if on_device else 1e-7) * norm, (k, m.norm, norm)
    assert (metas["nan in imag"].nan, metas["nan and inf"].nan, metas["nan and inf"].inf) == (3, 1, 2)


def test_small_complex_gradients_reduced_with_float_ones_keep_their_own_numbers():
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(7).astype(np.float32), _complex(rng, 5), _complex(rng, 3, np.complex128, 1e200),
              rng.standard_normal(4000).astype(np.float32), _complex(rng, 1)]
    arrays[1][2] = complex(1.0, np.nan)
    q = stats.StatsQueue(on_device=False)
    metas = [stats.grad_meta(paddle.to_tensor(a), True, q) for a in arrays]
    q.resolve()
    for a, m in zip(arrays, metas):
        norm, nan, inf = _ref(a.astype(np.complex128))
        assert (m.nan, m.inf) == (nan, inf)
        assert math.isnan(m.norm) if nan else abs(m.norm - norm) <= 1e-12 * norm
        if a.dtype.kind == "c":
            assert (m.min, m.max) == (None, None)
        else:
            assert (m.min, m.max) == (float(a.min()), float(a.max()))


def test_sum_of_squares_and_trigger_norm_count_both_parts():
    rng = np.random.default_rng(3)
    z, r = _complex(rng, 20_000), rng.standard_normal(30).astype(np.float32)
    want = float(np.sum(np.abs(z.astype(np.complex128)) ** 2) + np.sum(r.astype(np.float64) ** 2))
    assert stats.sum_of_squares([paddle.to_tensor(z), paddle.to_tensor(r)]) == pytest.approx(want, rel=1e-12)
    p = EagerParamBase(shape=[20_000], dtype="complex64")
    p.set_value(z)
    p.grad = paddle.to_tensor(z)  # noqa: the trigger reads param.grad
    assert global_grad_norm([p]) == pytest.approx(math.sqrt(float(np.sum(np.abs(z.astype(np.complex128)) ** 2))),
                                                  rel=1e-12)


# --------------------------------------------------------------------------
# a NaN made in a complex op's backward: blamed on that op (F2)
# --------------------------------------------------------------------------
class _SqrtNet(nn.Layer):
    """sqrt of a complex tensor holding 0: the forward is finite, the backward makes NaN there."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x, taps=None):
        mask = paddle.to_tensor(np.array([1, 1, 1, 0], np.float32)).astype("complex64")
        c = paddle.cast(self.lin(x), "complex64")
        z = c * mask
        s = paddle.sqrt(z)
        if taps is not None:
            for name, t in (("cast", c), ("z", z), ("s", s)):
                t.register_hook(lambda g, name=name: taps.__setitem__(name, g.numpy()))
        return self.head(paddle.real(s) + paddle.imag(s))


def _sqrt_net():
    paddle.seed(0)
    return _SqrtNet(), paddle.abs(paddle.randn([3, 4]))


def test_a_nan_made_in_a_complex_backward_is_found_where_it_is_made():
    oracle_net, x = _sqrt_net()
    taps = {}
    oracle_net(x, taps).sum().backward()  # Paddle's own tensor hooks, no capture
    assert int(np.isnan(taps["s"]).sum()) == 0  # what Sqrt receives is finite
    assert int(np.isnan(taps["z"]).sum()) == 3  # what it passes on is not
    net, x = _sqrt_net()
    with capture_backward(net) as cap:
        net(x).sum().backward()
    g = cap.graph
    for p, q in zip(net.parameters(), oracle_net.parameters()):  # bit-identical with and without capture
        assert p.grad.numpy().tobytes() == q.grad.numpy().tobytes()
    sites = g.nonfinite_sites()
    assert [n.op for n in sites[:3]] == ["Sqrt", "Multiply", "Cast"] and len(sites) == 5
    out_of = {g.nodes[e.src].op: e.grad for e in g.edges if g.nodes[e.src].op in ("Sqrt", "Multiply", "Real", "Imag")}
    assert (out_of["Sqrt"].dtype, out_of["Sqrt"].nan, out_of["Multiply"].nan) == ("complex64", 3, 3)
    assert math.isnan(out_of["Sqrt"].norm)
    # Real passes a real gradient on, Imag an imaginary one: Sqrt receives their sum, norms in quadrature
    assert math.hypot(out_of["Real"].norm, out_of["Imag"].norm) == pytest.approx(
        float(np.linalg.norm(taps["s"].astype(np.complex128))), rel=1e-7)
    text = summarize(g)
    assert "NaN/Inf gradients at 5 nodes, first non-finite gradient at Sqrt" in text
    assert "s = paddle.sqrt(z)" in text  # the line that made it


# --------------------------------------------------------------------------
# on_nonfinite sees a NaN in the imaginary part (F3)
# --------------------------------------------------------------------------
class _ImagNaN(nn.Layer):
    def __init__(self):
        super().__init__()
        self.w = EagerParamBase(shape=[3], dtype="complex64")
        self.w.set_value(np.array([1 + 0j, 2 + 0j, 3 + 1j], np.complex64))
        self.lin = nn.Linear(3, 1)

    def forward(self, x):
        re, im = paddle.real(self.w), paddle.imag(self.w)
        return self.lin(x * re).sum() + paddle.sqrt(im * 0.0).sum()  # d/d im = 0 * inf = NaN


def test_on_nonfinite_fires_on_a_nan_in_the_imaginary_part(tmp_path):
    paddle.seed(0)
    m, x = _ImagNaN(), paddle.randn([2, 3])
    with BackwardGraphRecorder(str(tmp_path), m, every=1000, capture_first=False, on_nonfinite=True,
                               formats=("json",)) as rec:
        with rec.step(1):
            loss = m(x)
            loss.backward()
    g = m.w.grad.numpy()
    assert math.isfinite(float(loss)) and not np.isnan(g.real).any() and np.isnan(g.imag).all()
    assert grads_nonfinite(m.parameters()) is True
    assert rec.triggers == {1: "nonfinite_grad"}
    graph = BackwardGraph.from_json((tmp_path / "backward_graph" / "step_000001.json").read_text())
    assert graph.params()["w"].nan == 3 and graph.params()["w"].min is None


# --------------------------------------------------------------------------
# global norms over a complex parameter (F4)
# --------------------------------------------------------------------------
class _CParam(nn.Layer):
    def __init__(self):
        super().__init__()
        self.w = EagerParamBase(shape=[4, 4], dtype="complex64")
        rs = np.random.RandomState(0)
        self.w.set_value((rs.randn(4, 4) + 1j * rs.randn(4, 4)).astype(np.complex64))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return paddle.abs(paddle.matmul(paddle.cast(self.lin(x), "complex64"), self.w))


def test_global_norms_include_a_complex_parameter(tmp_path):
    paddle.seed(1)
    m, x = _CParam(), paddle.randn([3, 4])
    with BackwardGraphRecorder(str(tmp_path), m, every=1, formats=("json",)) as rec:
        with rec.step(1):
            m(x).sum().backward()
    truth = math.sqrt(sum(float(np.sum(np.abs(p.grad.numpy().astype(np.complex128)) ** 2)) for p in m.parameters()))
    real_only = math.sqrt(sum(float(np.sum(p.grad.numpy().real.astype(np.float64) ** 2)) for p in m.parameters()))
    assert truth > real_only * (1 + 1e-3)  # the imaginary parts matter here
    text = (tmp_path / "backward_graph" / "step_000001.json").read_text()
    g = BackwardGraph.from_json(text)
    assert g.global_grad_norm() == pytest.approx(truth, rel=1e-7)
    assert g.meta["accumulated_grad_norm"] == pytest.approx(truth, rel=1e-7)
    assert g.params()["w"].norm == pytest.approx(float(np.linalg.norm(m.w.grad.numpy().astype(np.complex128))),
                                                 rel=1e-7)
    assert f"global grad norm {fmt_num(truth, 4)};" in summarize(g)
    assert global_grad_norm(m.parameters()) == pytest.approx(truth, rel=1e-7)
    # a graph missing one parameter's norm (as one saved by an older version) has no global norm
    d = json.loads(text)
    for n in d["nodes"]:
        if n.get("param") == "w":
            n["grad"].update(norm=None, min=None, max=None)
    old = BackwardGraph.from_json(json.dumps(d))
    assert old.global_grad_norm() is None and old.params_without_norm() == ["w"]
    assert set(g.layer_grad_norms()) == {"(self)", "lin"} and set(old.layer_grad_norms()) == {"lin"}
    rest = math.sqrt(sum(float(np.sum(p.grad.numpy().astype(np.float64) ** 2)) for p in m.lin.parameters()))
    assert old.global_grad_norm(partial=True) == pytest.approx(rest, rel=1e-7)
    told = summarize(old)
    assert "global grad norm " not in told
    assert f"no global grad norm: 1 parameter without a gradient norm (w); over the other 2: {fmt_num(rest, 4)}" \
        in told


# --------------------------------------------------------------------------
# every complex edge carries its number (F6), and views claim no min/max
# --------------------------------------------------------------------------
class _Spectral(nn.Layer):
    """rfft -> complex weight multiply -> irfft (an FNO-like layer)."""

    def __init__(self, modes=5):
        super().__init__()
        self.modes = modes
        self.inp = nn.Linear(3, 4)
        self.wr = self.create_parameter([4, modes], default_initializer=nn.initializer.Normal(0, 0.5))
        self.wi = self.create_parameter([4, modes], default_initializer=nn.initializer.Normal(0, 0.5))
        self.out = nn.Linear(4, 1)

    def forward(self, x, taps=None):
        h = self.inp(x).transpose([0, 2, 1])
        X = paddle.fft.rfft(h, axis=-1)
        if taps is not None:
            X.register_hook(lambda g: taps.__setitem__("X", g.numpy()))
        Y = X[:, :, :self.modes] * paddle.complex(self.wr, self.wi)
        Y = paddle.concat([Y, paddle.zeros_like(X[:, :, self.modes:])], axis=-1)
        y = paddle.fft.irfft(Y, n=h.shape[-1], axis=-1)
        return self.out(nn.functional.gelu(y + h).transpose([0, 2, 1]))


def test_every_complex_edge_carries_its_norm():
    paddle.seed(1)
    oracle_net, x = _Spectral(), paddle.randn([2, 16, 3])
    paddle.seed(1)
    net = _Spectral()
    taps = {}
    (oracle_net(x, taps) ** 2).mean().backward()
    with capture_backward(net) as cap:
        (net(x) ** 2).mean().backward()
    for p, q in zip(net.parameters(), oracle_net.parameters()):
        assert p.grad.numpy().tobytes() == q.grad.numpy().tobytes()
    g = cap.graph
    complex_edges = [e for e in g.edges if e.grad is not None and e.grad.dtype == "complex64"]
    assert len(complex_edges) >= 4
    assert all(e.grad is not None and e.grad.norm is not None for e in g.edges)  # every edge numbered
    into_rfft = [e.grad for e in g.edges if g.nodes[e.dst].op == "FftR2c"]
    assert len(into_rfft) == 1
    assert into_rfft[0].norm == pytest.approx(float(np.linalg.norm(taps["X"].astype(np.complex128))), rel=1e-7)
    assert all("|g| " in " ".join(edge_lines(e.grad, True)) for e in complex_edges)
    # views: the norm, and no min/max claimed
    e = complex_edges[0]
    ex = explorer_graph(g, "g")
    meta = next(m for n in ex["nodes"] if n["id"] == str(e.src)
                for m in n["outputsMetadata"] if m["id"] == str(e.slot))
    attrs = {a["key"]: a["value"] for a in meta["attrs"]}
    assert (attrs["min"], attrs["max"], attrs["norm"]) == (NO_ORDER, NO_ORDER, repr(e.grad.norm))
    vdl = [n["attrs"] for n in vdl_graph(g)["nodes"] if n.get("attrs", {}).get("dtype") == "complex64"]
    assert vdl and all(a["min"] == NO_ORDER and a["norm"] != "-" for a in vdl)


# --------------------------------------------------------------------------
# empty gradients (F10)
# --------------------------------------------------------------------------
class _Experts(nn.Layer):
    """Two experts; the gate sends every token to the first, so the second gets none."""

    def __init__(self):
        super().__init__()
        self.gate, self.e0, self.e1 = nn.Linear(4, 2), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        p = nn.functional.softmax(self.gate(x) + paddle.to_tensor([0.0, -1e4]), -1)
        out = paddle.zeros_like(x)
        for i, e in enumerate((self.e0, self.e1)):
            tok = paddle.nonzero(paddle.argmax(p, -1) == i).flatten()
            ye = e(paddle.index_select(x, tok)) * paddle.gather(p[:, i], tok).unsqueeze(-1)
            out = paddle.index_add(out, tok, 0, ye)
        return out


def test_an_empty_gradient_is_a_gradient_of_no_elements():
    paddle.seed(0)
    net, x = _Experts(), paddle.randn([5, 4])
    x.stop_gradient = False  # (without, Paddle itself fails in this backward, capture or not)
    with capture_backward(net) as cap:
        (net(x) ** 2).sum().backward()
    g = cap.graph
    empty = [e.grad for e in g.edges if e.grad is not None and e.grad.shape is not None and 0 in e.grad.shape]
    assert len(empty) >= 4
    assert all((m.note, m.norm, m.nan, m.inf, m.min, m.max) == (None, 0.0, 0, 0, None, None) for m in empty)
    assert not [e for e in g.edges if e.grad is not None and e.grad.note == "unpaired"]
    # the expert's weight gradient (all zeros) rides on the same node's other edge
    rows = g.params()
    assert (rows["e1.weight"].norm, rows["e1.bias"].norm) == (0.0, 0.0)


# --------------------------------------------------------------------------
# exact under another BLAS kernel
# --------------------------------------------------------------------------
_KERNEL_CHECK = r"""
import numpy as np, paddle
from paddle.base.framework import EagerParamBase
from paddleviz_hooks.capture import stats
from paddleviz_hooks.triggers import global_grad_norm
worst = 0.0
rs = np.random.RandomState(0)
for z in (np.full(1_000_003, 0.1 + 0.1j, np.complex64), (rs.randn(16_384) + 1j * rs.randn(16_384)).astype(np.complex64),
          (rs.randn(70_001) - 1j * rs.randn(70_001)).astype(np.complex128)):
    want = float(np.sum(np.abs(z.astype(np.complex128)) ** 2))
    bound = 2 * z.size * 2.0 ** -53
    p = EagerParamBase(shape=list(z.shape), dtype=str(z.dtype))
    p.set_value(z)
    p.grad = paddle.to_tensor(z)
    for v in (stats.sum_of_squares([paddle.to_tensor(z)]), stats.grad_meta(paddle.to_tensor(z), True).norm ** 2,
              global_grad_norm([p]) ** 2):
        worst = max(worst, abs(v - want) / want / bound)
print(worst)
"""


def test_complex_statistics_exact_under_another_blas_kernel():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OPENBLAS_CORETYPE="Haswell", OPENBLAS_L2_SIZE="512",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    worst = float(out.stdout.strip().splitlines()[-1])
    assert worst <= 1.0, f"relative error {worst:.3g} x the float64 bound under OPENBLAS_CORETYPE=Haswell"


def test_grad_meta_round_trips_a_complex_gradient():
    m = stats.grad_meta(paddle.to_tensor(np.array([3 + 4j, 1j], np.complex64)), True)
    assert (m.norm, m.min, m.max) == (math.sqrt(26.0), None, None)
    assert GradMeta.from_dict(json.loads(json.dumps(m.to_dict()))) == m


# --------------------------------------------------------------------------
# where a forward NaN starts: complex inputs and weights are looked at too
# --------------------------------------------------------------------------
class _AbsHead(nn.Layer):
    def __init__(self, nan_weight: bool):
        super().__init__()
        self.w = EagerParamBase(shape=[4], dtype="complex64")
        self.w.set_value(np.array([1, 2, 3, complex(1, np.nan) if nan_weight else 4], np.complex64))
        self.lin = nn.Linear(4, 1)

    def forward(self, z):
        return self.lin(paddle.abs(z * self.w))


def test_a_nan_in_a_complex_input_or_weight_is_the_origin():
    from paddleviz_hooks import find_nonfinite_origin

    paddle.seed(0)
    z = paddle.to_tensor(np.array([[1, 2, complex(0, np.nan), 4]], np.complex64))  # NaN in an imaginary part
    assert find_nonfinite_origin(_AbsHead(False), z)["kind"] == "input"  # was: the multiply that read it
    o = find_nonfinite_origin(_AbsHead(True), paddle.ones([1, 4], "complex64"))
    assert (o["kind"], o["op"]) == ("weights", None)
