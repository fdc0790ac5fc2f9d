"""What a dashboard sink receives, and the interface every sink implements.

The pipeline hands each capture to its sinks twice: once when its data is
written (:class:`CaptureData`: the summary text, the scalars, the graph
record, the files written so far) and once when its pictures are drawn
(:class:`CapturePictures`: the viewing picture, the diff picture, the
full-detail SVG and the picture files). A sink decides how its dashboard
shows them: tags, paging, keys, media types. Every sink keeps the scalar
names given here, so a curve is called the same on every dashboard.

Examples:
    A sink that prints what it gets (any object with these methods will do;
    subclassing :class:`Sink` gives harmless defaults)::

        class PrintSink(Sink):
            name = "print"

            def data(self, record):
                print(record.step, sorted(record.scalars))

        BackwardGraphRecorder("vdl_log", model, sinks=["visualdl", PrintSink()])
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ..diff import GraphDiff
from ..graph import BackwardGraph

__all__ = ["Sink", "SinkContext", "CaptureData", "CapturePictures", "capture_scalars", "finite_scalars",
           "png_to_array", "suffixed", "scalar_depth", "SCALAR_GROUP",
           "LAYER_NORM_GROUP", "LAYER_SCALARS", "SAVED_MEMORY_GROUP"]

#: Scalar groups: '~' sorts after letters, digits and '_', so dashboards that order groups
#: by name (VisualDL, TensorBoard) list them after the user's own curves
SCALAR_GROUP = "~backward_graph"
LAYER_NORM_GROUP = "~grad_norm"
SAVED_MEMORY_GROUP = "~saved_memory"  # MB held for backward, with saved_memory=True
#: the most ``~grad_norm/...`` scalars the default layer depth gives (see :func:`scalar_depth`)
LAYER_SCALARS = 30


@dataclass(frozen=True)
class SinkContext:
    """Where and for whom a sink writes, given to :meth:`Sink.open`.

    Attributes:
        directory: the recorder's run folder (``log_dir/run_name``, ``.../rank_K``):
            a sink that needs a folder of its own makes it under this one.
        log_dir: the recorder's ``log_dir``.
        display_name: the run's name on a dashboard (``"<log dir>/<run_name>"``).
        graphs: whether interactive graph files are wanted where a dashboard can open them
            (the recorder's ``visualdl_graphs``).
        warn: the recorder's warn-once function ``warn(cause, message)``.
    """

    directory: str
    log_dir: str
    display_name: str
    graphs: bool = True
    warn: Callable[[str, str], None] = print


@dataclass
class CaptureData:
    """One capture's data, handed to sinks as soon as it is written.

    Attributes:
        step: the training step; ``suffix`` tells a step's backwards apart
            (``"b2"`` for the second; ``""`` for the first).
        trigger: ``"scheduled"`` or the trigger that captured it.
        graph: the captured graph (read only).
        diff: its comparison with the previous capture of the same backward, when
            the structure changed (else None).
        text: the summary, plain text, one fact per line.
        scalars: name -> value, names as :func:`capture_scalars` gives them
            (a value may be None or NaN: a sink skips what its charts cannot draw).
        paths: ext -> file written so far (``"json"``, ``"diff.json"``).
    """

    step: int
    trigger: str
    suffix: str
    graph: BackwardGraph
    diff: GraphDiff | None
    text: str
    scalars: dict[str, float | None]
    paths: dict[str, str] = field(default_factory=dict)


@dataclass
class CapturePictures:
    """One capture's pictures, handed to sinks when they are drawn.

    Attributes:
        step, trigger, suffix: as in :class:`CaptureData`.
        title: the pictures' title line.
        picture: the viewing picture (PNG bytes): drawn for a dashboard's image viewer
            (landscape, labels legible when fitted to a window) when the recorder's
            ``viewer_px`` allows, else the PNG file's picture. None when drawing failed
            (the record still comes, so a sink can let go of what it kept for the capture).
        diff_picture: the structure-change picture (PNG bytes) or None.
        svg: the full-detail SVG text (every op), or None when ``svg`` is not among the formats.
        paths: ext -> picture file written (``"png"``, ``"svg"``, ``"diff.png"``, ``"dot"``).
        encoding: the :attr:`Sink.png_encoding` the picture bytes are already in (the
            drawing process encoded them), else None.
    """

    step: int
    trigger: str
    suffix: str
    title: str
    picture: bytes | None
    diff_picture: bytes | None = None
    svg: str | None = None
    paths: dict[str, str] = field(default_factory=dict)
    encoding: str | None = None


class Sink:
    """A dashboard that shows captures. Override what the dashboard needs.

    The recorder calls :meth:`open` once, lazily, before the first record of a
    run (again after the recorder is reopened), then :meth:`data` and
    :meth:`pictures` per capture (from background threads, never two calls at
    once), :meth:`flush` after each, and :meth:`close` when the recorder
    closes. An exception in any call becomes one warning naming the sink; the
    other sinks and training go on.
    """

    #: the sink's name in warnings
    name = "sink"
    #: what :meth:`file_png` does, by name, so that the drawing process can do it instead
    #: (:func:`paddleviz_hooks.sinks.hub.encode_png`); None: nothing, or only this sink knows
    png_encoding: str | None = None

    def open(self, context: SinkContext) -> None:
        """Start writing for ``context`` (create writers, find the user's run)."""

    def file_png(self, png: bytes) -> bytes:
        """The bytes to keep as the step's PNG file (a sink may re-encode them, so the
        file is byte for byte what its dashboard serves)."""
        return png

    def data(self, record: CaptureData) -> None:
        """One capture's summary text and scalars."""

    def drawn_files(self, record: CaptureData) -> dict[str, str]:
        """Files of this capture the drawing process writes for this sink, from the capture's
        JSON (called after :meth:`data`): kind -> where. The kind: ``"vdl_graph"`` (a
        folder: :func:`paddleviz_hooks.sinks.vdl_graph.write_vdl_graph`)."""
        return {}

    def pictures(self, record: CapturePictures) -> None:
        """One capture's pictures."""

    def flush(self) -> None:
        """Make what was written so far visible to the dashboard."""

    def close(self) -> None:
        """Stop writing; a later :meth:`open` starts again."""


def scalar_depth(graph: BackwardGraph, depth: int | None = None) -> int:
    """How many components of a dotted layer path name a ``~grad_norm/...`` scalar.

    ``depth`` when given; else the deepest level of the model's layer tree
    that gives at most :data:`LAYER_SCALARS` groups (at least 1: the top-level
    layers). A layer shallower than the depth is a group of its own
    (``head`` beside ``encoder.layers.0``).

    Examples:
        >>> from paddleviz_hooks.graph import GradMeta, Node
        >>> g = BackwardGraph(nodes=[Node(i, "param", "GradNodeAccumulation", param=p, grad=GradMeta(norm=1.0))
        ...                          for i, p in enumerate(["enc.0.w", "enc.1.w", "head.w"])])
        >>> scalar_depth(g), sorted(g.layer_grad_norms(scalar_depth(g)))
        (2, ['enc.0', 'enc.1', 'head'])
    """
    if depth is not None:
        return depth
    deepest = max((name.count(".") for name in graph.params()), default=1)
    best = 1
    for d in range(2, deepest + 1):
        if len(graph.layer_grad_norms(d)) > LAYER_SCALARS:
            break
        best = d
    return best


def capture_scalars(graph: BackwardGraph, suffix: str = "", diagnostics: bool = False,
                    depth: int | None = None) -> dict[str, float | None]:
    """The scalars of one capture, named as every sink logs them.

    ``~backward_graph/global_grad_norm`` and ``nonfinite_grads`` (with several ranks also
    ``local_grad_norm``, this rank's own before the all-reduce), ``~grad_norm/<layer>`` per
    layer down to ``depth`` components of its dotted path (None: see :func:`scalar_depth`),
    ``~saved_memory/<layer>`` in MB when recorded; with ``diagnostics`` also node and
    edge counts, capture time and the accumulated ``param.grad`` norm. A step's later backwards
    get series of their own (``~backward_graph_b2/...``).
    """
    g = SCALAR_GROUP
    scalars: dict[str, float | None] = {
        f"{g}/global_grad_norm": graph.global_grad_norm(), f"{g}/nonfinite_grads": graph.nonfinite_count()}
    if isinstance(graph.meta.get("grad_sync"), dict):  # several ranks: this rank's own, before all-reduce
        scalars[f"{g}/local_grad_norm"] = graph.global_grad_norm(local=True)
    if diagnostics:
        scalars.update({
            f"{g}/nodes": len(graph.nodes),
            f"{g}/edges": len(graph.edges),
            f"{g}/capture_ms": graph.meta.get("capture_ms"),
            f"{g}/accumulated_grad_norm": graph.meta.get("accumulated_grad_norm"),
        })
    for layer, norm in graph.layer_grad_norms(scalar_depth(graph, depth)).items():
        scalars[f"{LAYER_NORM_GROUP}/{'top_layer_params' if layer == '(self)' else layer}"] = norm
    saved = graph.meta.get("saved_memory")
    if isinstance(saved, dict):  # in MB
        scalars[f"{SAVED_MEMORY_GROUP}/total"] = saved.get("total_bytes", 0) / 1e6
        for layer, nbytes in graph.saved_bytes_by_layer().items():
            name = {"(self)": "top_layer", "(outside)": "outside_the_model"}.get(layer, layer)
            scalars[f"{SAVED_MEMORY_GROUP}/{name}"] = nbytes / 1e6
    if suffix:  # a step's later backwards: their own series (~backward_graph_b2/...)
        scalars = {suffixed(k.split("/", 1)[0], suffix) + "/" + k.split("/", 1)[1]: v for k, v in scalars.items()}
    return scalars


def suffixed(name: str, suffix: str) -> str:
    """``name`` for a step's first backward, ``name_b2`` for its second (tags, keys, file names).

    Examples:
        >>> suffixed("backward_graph", ""), suffixed("backward_graph", "b2")
        ('backward_graph', 'backward_graph_b2')
    """
    return f"{name}_{suffix}" if suffix else name


def finite_scalars(scalars: dict[str, float | None]) -> dict[str, float]:
    """The scalars a chart can draw: None and NaN/Inf values are left out (the NaN/Inf
    count is a scalar of its own).

    Examples:
        >>> finite_scalars({"a": 1, "b": None, "c": float("nan")})
        {'a': 1.0}
    """
    return {k: float(v) for k, v in scalars.items() if v is not None and math.isfinite(v)}


def png_to_array(png: bytes) -> Any:
    """Decode PNG bytes to a uint8 HWC RGB array."""
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()
