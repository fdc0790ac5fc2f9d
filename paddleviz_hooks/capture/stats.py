"""Gradient statistics: shape, dtype, L2 norm, min, max, NaN/Inf counts.

One :class:`StatsQueue` serves a whole backward. How a gradient is read
depends on where it lives:

* **On the host** (the CPU wheel, CPU tensors): the gradient already is host
  memory, so numpy reduces it: a small one (under 8,192 elements) is copied
  when it arrives and reduced with the other small ones of the backward in
  float64 (a few numpy calls for thousands of gradients, each gradient its
  own segment); a larger one where it lies, through a zero-copy DLPack view, its sum of squares
  accumulated in float64 (chunks converted to float64, dot products over
  blocks of 2,048 elements): within ``n * 2**-53`` of the exact sum whatever
  BLAS kernel the machine picks. There is nothing to transfer and nothing to
  synchronise.
* **On an accelerator**: the reductions (sum of squares, min, max, NaN and
  Inf counts) are queued as 0-d tensors on the device, and
  :meth:`StatsQueue.resolve` brings every queued number to the host in one
  transfer when the backward is over: one device synchronisation per
  backward, not one per gradient. A gradient whose squares overflow
  (float32 elements beyond about 1.8e19) gets its norm from a second sum
  taken at a power-of-two scale, which is exact in binary floating point.

A complex gradient (complex64, complex128) is read as its real and imaginary
parts (a float view of the same memory on the host, ``paddle.as_real`` on a
device): its norm is ``sqrt(sum |z|**2)``, the sum of the squares of both
parts, accumulated as a float gradient's is; an element whose real or
imaginary part is NaN counts once as NaN, one with an infinite part (and no
NaN) once as Inf. Complex numbers have no order: ``min`` and ``max`` stay
None. A gradient of no elements (shape ``[0, ...]``) has norm 0 (the sum of no
squares), no NaN/Inf, and no min or max.

Metadata is filled in place: a queued :class:`~paddleviz_hooks.graph.GradMeta`
has its shape and dtype at once and its numbers after :meth:`StatsQueue.resolve`.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Iterable

import numpy as np
import paddle

from ..graph import GradMeta
from .gradnode import dtype_name

__all__ = ["StatsQueue", "grad_meta", "sum_of_squares", "flat_tensors", "float_parts", "is_dist", "local_value"]

_FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64"}
_COMPLEX_DTYPES = {"complex64", "complex128"}
_STAT_DTYPES = _FLOAT_DTYPES | _COMPLEX_DTYPES  # gradients that get statistics (one answer everywhere)
_EXACT_DTYPES = ("float32", "float64", "complex64", "complex128")  # read as they are; others as float32
_VIEW_MIN = 1 << 13  # elements from which a zero-copy view beats a float64 copy (docs/performance.md)
_BLOCK = 2048  # elements per float64 dot product (a batched matmul: no BLAS threads, docs/performance.md)
_CHUNK = 1 << 16  # elements converted to float64 at a time (512 KB, reused): no full-size copy of a large gradient
_SMALL_BATCH = 1 << 20  # elements of small host gradients held for one batched reduction (4-8 MB)
_SCALE = {"float32": 2.0 ** -64, "float64": 2.0 ** -512}  # exact rescaling when squares overflow


def _sum_squares(a: np.ndarray) -> float:
    """Sum of the squares of a float array, accumulated in float64 whatever BLAS kernel runs.

    The array is read in chunks of ``_CHUNK`` elements converted to float64
    (a float32 element's square is exact there) into a buffer that stays in
    the core's cache (:func:`_chunk_buffer`); each chunk's squares are summed
    as float64 dot products over blocks of ``_BLOCK`` elements. Every
    product and addition is a float64 operation, so in any order a kernel
    may pick the relative error is at most ``n * 2**-53`` (under 3e-9 for 25M
    elements; measured 2e-13 for 1M equal elements, with and without
    ``OPENBLAS_CORETYPE=Haswell``). A float32 dot product's error depends on
    the kernel OpenBLAS picks (docs/performance.md).
    """
    a = np.ascontiguousarray(a).reshape(-1)  # a copy only when the view is strided
    buf = _chunk_buffer()
    total = 0.0
    for i in range(0, a.size, _CHUNK):
        part = a[i: i + _CHUNK]
        c = buf[: part.size]
        c[...] = part  # float32 -> float64, exact
        rows = c.size // _BLOCK
        blocks = c[: rows * _BLOCK].reshape(rows, 1, _BLOCK)
        total += float(np.matmul(blocks, blocks.transpose(0, 2, 1)).sum())
        rest = c[rows * _BLOCK:]
        total += float(np.dot(rest, rest))
    return total


_BUFFERS = threading.local()


def _chunk_buffer() -> np.ndarray:
    """This thread's float64 buffer of ``_CHUNK`` elements (512 KB: one core's cache holds it;
    a fresh one per call would be fresh pages to fault in every time)."""
    buf = getattr(_BUFFERS, "buf", None)
    if buf is None:
        buf = _BUFFERS.buf = np.empty(_CHUNK, dtype=np.float64)
    return buf


def float_parts(a: np.ndarray) -> np.ndarray:
    """A float array's elements; a complex array's real and imaginary parts, interleaved, as a
    float view of the same memory (a copy only when ``a`` is strided). Their squares sum to
    ``sum |z|**2``.

    Examples:
        >>> float_parts(np.array([3 + 4j, 1j], np.complex64)).tolist()
        [3.0, 4.0, 0.0, 1.0]
    """
    if a.dtype.kind != "c":
        return a
    return np.ascontiguousarray(a).reshape(-1).view(a.real.dtype)


def _host_stats(meta: GradMeta, f: Any) -> None:
    """Fill ``meta`` from a large host tensor, reading its memory in place (a zero-copy view)."""
    a = np.from_dlpack(f if f.stop_gradient else f.detach())
    parts = float_parts(a)
    with np.errstate(all="ignore"):
        sq = _sum_squares(parts)
    if parts is a:  # complex values have no order: no min, no max
        meta.min, meta.max = float(np.minimum.reduce(a, axis=None)), float(np.maximum.reduce(a, axis=None))
    _fill_norm(meta, a, sq)


def segment_reductions(arrays: list[np.ndarray]) -> tuple[list[float], list[float], list[float]]:
    """Sums of squares, minima and maxima of many small float arrays, each its own segment of
    one float64 array (a float32 element's square is exact there and cannot overflow):
    a few numpy calls for them all."""
    sizes = [a.size for a in arrays]
    starts = np.zeros(len(sizes), dtype=np.intp)
    np.cumsum(sizes[:-1], out=starts[1:])
    flat = np.concatenate(arrays, axis=None).astype(np.float64, copy=False)
    with np.errstate(all="ignore"):  # NaN and Inf pass through quietly
        sqs = np.add.reduceat(flat * flat, starts).tolist()
    return sqs, np.minimum.reduceat(flat, starts).tolist(), np.maximum.reduceat(flat, starts).tolist()


def _small_stats(items: list[tuple[GradMeta, np.ndarray]]) -> None:
    """Fill the metadata of many small gradients (host copies) with a few numpy calls.

    The copies are joined into one float64 array (a float32 element's square is
    exact there, and cannot overflow), and each gradient's sum of squares, min
    and max are reductions over its own segment: the numbers are those of one
    gradient at a time, at a fraction of the calls (a 10,000-node graph has
    about 11,000 gradients, most of them small).
    """
    parts = [float_parts(a) for _, a in items]  # a complex gradient: its real and imaginary parts
    sqs, mins, maxs = segment_reductions(parts)
    for (meta, a), p, sq, lo, hi in zip(items, parts, sqs, mins, maxs):
        if p is a:  # complex values have no order: no min, no max
            meta.min, meta.max = lo, hi
        _fill_norm(meta, a, sq)


def _fill_norm(meta: GradMeta, a: np.ndarray, sq: float) -> None:
    """The norm from the sum of squares ``sq`` of ``a`` (of a float ``a``, min and max set);
    NaN and Inf counted, once per element (a complex one with a NaN part is NaN, else with
    an infinite part Inf)."""
    if math.isfinite(sq):
        meta.norm = math.sqrt(sq)
        return
    nan = np.isnan(a)
    meta.nan = int(nan.sum())
    meta.inf = int((np.isinf(a) & ~nan).sum()) if meta.nan and a.dtype.kind == "c" else int(np.isinf(a).sum())
    if meta.nan or meta.inf:
        meta.norm = math.nan if meta.nan else math.inf
    else:  # finite elements whose squares overflow: rescale by the largest
        parts = float_parts(a)
        top = max(-meta.min, meta.max) if meta.min is not None else float(np.abs(parts).max())
        with np.errstate(all="ignore"):
            meta.norm = top * math.sqrt(float(np.square(parts / top, dtype=np.float64).sum()))


_HOST_ONLY: list[bool] = []


def _host_only() -> bool:
    """Whether this Paddle was built for the host alone (no CUDA, XPU or custom
    device): every tensor is then a host tensor, and none needs its place asked."""
    if not _HOST_ONLY:
        try:
            devices = (paddle.is_compiled_with_cuda() or paddle.is_compiled_with_xpu()
                       or paddle.is_compiled_with_rocm() or bool(paddle.device.get_all_custom_device_type()))
        except Exception:
            devices = True  # cannot tell: ask each tensor
        _HOST_ONLY.append(not devices)
    return _HOST_ONLY[0]


class StatsQueue:
    """The statistics of one backward's gradients, read with at most one device synchronisation.

    :meth:`add` fills a large host gradient's metadata at once, keeps a copy
    of a small one (reduced with the others in a few numpy calls) and queues
    an accelerator gradient's reductions; :meth:`resolve` (when the backward
    is over) fills the rest, reading every queued device number in one
    transfer. A queued device gradient itself is not kept: only its 0-d
    results are.

    Examples:
        >>> q = StatsQueue()
        >>> m = grad_meta(paddle.to_tensor([3.0, -4.0]), True, q)
        >>> m.norm is None  # a small host gradient: copied, reduced with the others
        True
        >>> q.resolve()
        >>> m.norm, m.min, m.max
        (5.0, -4.0, 3.0)
    """

    def __init__(self, *, on_device: bool | None = None) -> None:
        # on_device: None decides by each tensor's place (a Paddle built for the
        # host alone has only host tensors); True queues every gradient (the
        # accelerator's way, testable on the CPU wheel).
        if on_device is None and _host_only():
            on_device = False
        self._on_device = on_device
        self._metas: list[tuple[GradMeta, str, int, int, bool]] = []  # meta, float group, its index, count index, complex
        self._groups: dict[str, list[Any]] = {"float32": [], "float64": [], "int64": []}  # 0-d tensors by dtype
        self._small: list[tuple[GradMeta, np.ndarray]] = []  # small host gradients: copies, reduced together
        self._small_size = 0

    def add(self, meta: GradMeta, f: Any, numel: int) -> None:
        """Statistics of ``f`` (float32, float64, complex64 or complex128, ``numel`` elements) into ``meta``."""
        on_device = self._on_device
        if on_device is None:
            on_device = not f.place.is_cpu_place()
        if not on_device:
            if numel >= _VIEW_MIN:
                _host_stats(meta, f)
                return
            self._small.append((meta, f.numpy()))  # a copy: the buffer may be reused
            self._small_size += numel
            if self._small_size >= _SMALL_BATCH:
                self._reduce_small()
            return
        cplx = f.is_complex()
        if cplx:  # its real and imaginary parts, [..., 2]: one element's NaN/Inf counted once
            f = paddle.as_real(f)
            nan, inf = paddle.isnan(f).any(axis=-1), paddle.isinf(f).any(axis=-1)
            nans, infs = nan.sum(), (inf & ~nan).sum()
        else:
            nans, infs = paddle.isnan(f).sum(), paddle.isinf(f).sum()
        key = "float32" if f.dtype == paddle.float32 else "float64"
        floats, counts = self._groups[key], self._groups["int64"]
        self._metas.append((meta, key, len(floats), len(counts), cplx))
        sq = paddle.square(f).sum()
        floats += (sq, sq, sq) if cplx else (sq, f.min(), f.max())  # complex values have no order
        floats.append(paddle.square(f * _SCALE[key]).sum())
        counts += (nans, infs)

    def _reduce_small(self) -> None:
        items, self._small, self._small_size = self._small, [], 0
        if items:
            _small_stats(items)

    def resolve(self) -> None:
        """Read every queued number in one transfer and fill the queued metadata."""
        self._reduce_small()
        if not self._metas:
            return
        keys = [k for k, v in self._groups.items() if v]
        stacked = [paddle.stack(self._groups[k]).astype("float64") for k in keys]
        flat = (paddle.concat(stacked) if len(stacked) > 1 else stacked[0]).numpy().tolist()
        rows, at = {}, 0
        for k in keys:
            rows[k], at = flat[at: at + len(self._groups[k])], at + len(self._groups[k])
        for meta, key, i, j, cplx in self._metas:
            sq, meta.min, meta.max = rows[key][i: i + 3]
            if cplx:
                meta.min = meta.max = None
            meta.nan, meta.inf = int(rows["int64"][j]), int(rows["int64"][j + 1])
            if meta.nan or meta.inf:
                meta.norm = math.nan if meta.nan else math.inf
            elif math.isfinite(sq):
                meta.norm = math.sqrt(sq)
            else:  # finite elements whose squares overflow
                meta.norm = math.sqrt(rows[key][i + 3]) / _SCALE[key]
        self.clear()

    def clear(self) -> None:
        """Forget what is queued (a backward that failed)."""
        self._small, self._small_size = [], 0
        self._metas.clear()
        for v in self._groups.values():
            v.clear()


def grad_meta(t: Any, stats: bool, queue: StatsQueue | None = None) -> GradMeta:
    """Shape, dtype and (optionally) cheap statistics of one gradient tensor.

    With ``queue``, statistics of a gradient on an accelerator are filled
    when the queue is resolved; without, at once.
    """
    if t.is_selected_rows():
        return _sparse_rows_meta(t, stats)
    shape = tuple(t.shape)
    meta = GradMeta(shape=shape, dtype=dtype_name(t.dtype))
    if is_dist(t):  # auto-parallel: statistics of this rank's shard; the whole would need communication
        meta.placements = tuple(str(p) for p in t.placements)
        t = t._local_value()
        shape = meta.local_shape = tuple(int(s) for s in t.shape)
    numel = math.prod(shape)
    if not stats or meta.dtype not in _STAT_DTYPES:
        return meta
    if numel == 0:  # no elements: the sum of no squares, nothing non-finite, no min or max
        meta.norm = 0.0
        return meta
    f = t if meta.dtype in _EXACT_DTYPES else t.astype("float32")
    if queue is not None:
        queue.add(meta, f, numel)
        return meta
    own = StatsQueue()
    own.add(meta, f, numel)
    own.resolve()
    return meta


def _sparse_rows_meta(t: Any, stats: bool) -> GradMeta:
    """Metadata of a sparse-rows gradient (``Embedding(sparse=True)``): the numbers of the
    dense gradient it stands for, ``[height, ...]``, whose row ``r`` is the sum of the values
    listed for ``r`` (an index used several times is listed once per use) and zero where no
    value is listed. Read on the host, in float64."""
    sr = t.get_selected_rows()
    values = np.asarray(t.numpy())
    rows = np.asarray(sr.rows(), dtype=np.int64)
    height = int(sr.height())
    meta = GradMeta(shape=(height, *values.shape[1:]), dtype=dtype_name(t.dtype))
    if not stats or meta.dtype not in _FLOAT_DTYPES or values.size == 0:
        return meta
    listed, where = np.unique(rows, return_inverse=True)
    dense = np.zeros((len(listed), *values.shape[1:]), dtype=np.float64)
    np.add.at(dense, where, values.astype(np.float64))  # the rows as the dense gradient has them
    flat = dense.reshape(-1)
    with np.errstate(all="ignore"):
        sq = float(np.dot(flat, flat))
    lo, hi = float(np.min(flat)), float(np.max(flat))
    if len(listed) < height:  # rows listed nowhere are zeros of the dense gradient
        lo, hi = (lo if math.isnan(lo) else min(lo, 0.0)), (hi if math.isnan(hi) else max(hi, 0.0))
    meta.min, meta.max = lo, hi
    _fill_norm(meta, flat, sq)
    return meta


def sum_of_squares(tensors: Iterable[Any]) -> float:
    """Sum of the squares of every element of ``tensors`` (float64; NaN when any element is NaN);
    of a complex element, ``|z|**2`` (the squares of its real and imaginary parts).

    Host tensors are read in place as :class:`StatsQueue` reads them; the
    device tensors' sums are added on the device and read in one transfer.

    Examples:
        >>> sum_of_squares([paddle.to_tensor([3.0]), paddle.to_tensor([[4.0, 0.0]])])
        25.0
    """
    total, device = 0.0, []
    for t in tensors:
        f = t if dtype_name(t.dtype) in _EXACT_DTYPES else t.astype("float32")
        if not f.place.is_cpu_place():  # a complex tensor: the squares of its real and imaginary parts
            device.append(paddle.square(paddle.as_real(f) if f.is_complex() else f).sum().astype("float64"))
            continue
        numel = math.prod(f.shape)
        if numel:
            a = np.from_dlpack(f if f.stop_gradient else f.detach()) if numel >= _VIEW_MIN else f.numpy()
            with np.errstate(all="ignore"):
                total += _sum_squares(float_parts(a))
    if device:
        total += float(paddle.add_n(device)) if len(device) > 1 else float(device[0])
    return total


def is_dist(t: Any) -> bool:
    """Whether ``t`` is an auto-parallel distributed tensor (its values spread over ranks)."""
    f = getattr(t, "is_dist", None)
    return bool(f()) if callable(f) else False


def local_value(t: Any) -> Any:
    """This rank's shard of a distributed tensor, the tensor itself otherwise (never communicates)."""
    return t._local_value() if is_dist(t) else t


def flat_tensors(slots: Iterable[Any]) -> list[Any]:
    """The gradients of a hook's slots, in order: initialized tensors, and empty ones.

    A gradient of no elements (shape ``[0, ...]``: an expert that got no
    tokens) holds no memory, so Paddle reports it uninitialized; it is a
    gradient all the same. A slot holding no gradient (a hole: no tensor, or
    an uninitialized one with elements to hold, ``[]``) is left out.
    """
    flat = []
    for slot in slots:
        for t in slot if isinstance(slot, (list, tuple)) else (slot,):
            if t is not None and (t._is_initialized() or _empty(t)):
                flat.append(t)
    return flat


def _empty(t: Any) -> bool:
    """Whether ``t`` has a shape with no elements (``[0, 4]``; not ``[]``, one element)."""
    shape = t.shape
    return len(shape) > 0 and 0 in shape


