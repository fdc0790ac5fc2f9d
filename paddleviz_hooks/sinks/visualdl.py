"""VisualDL records for captured steps, designed around the dashboard's limits.

VisualDL keeps only 10 image and 10 text samples per run and tag (see
``docs/visualdl.md``), so image and text tags are paged, ten captures a page,
each page named by the step it starts at: ``backward_graph/from_step_000001``,
``backward_graph/from_step_000100``... Every capture stays reachable. Scalars
keep 1000 samples and are not paged; their groups start with ``~`` so that
VisualDL, which sorts groups by name, lists them after the user's own curves.
Every capture is also written as an interactive graph for VisualDL's Graphs
tab, one folder per capture under ``graphs/``.
"""

from __future__ import annotations

import os
import re
import time
import zlib
from collections import defaultdict
from typing import Any

from ..escape import vdl_graph_name, vdl_tag, visible
from .base import (LAYER_NORM_GROUP, SAVED_MEMORY_GROUP, SCALAR_GROUP, CaptureData, CapturePictures, Sink, SinkContext,
                   finite_scalars, png_to_array, suffixed)

__all__ = ["VisualDLSink", "TagPages", "png_to_array", "encode_like_visualdl", "graph_dir", "PAGE", "SCALAR_GROUP",
           "LAYER_NORM_GROUP", "SAVED_MEMORY_GROUP"]

PAGE = 10  # VisualDL's per-tag sample budget for images and text


class TagPages:
    """Page tags, ten samples a page, each page named by its first sample's step.

    Pages are given out in capture order (the data thread), so a page's name
    tells the steps it holds even when its pictures are drawn out of order.

    Examples:
        >>> pages = TagPages()
        >>> [pages.tag("backward_graph", s) for s in (1, 10, 20)][-1]
        'backward_graph/from_step_000001'
        >>> [pages.tag("backward_graph", s) for s in range(30, 110, 10)][-1]
        'backward_graph/from_step_000100'
        >>> pages.tag("backward_graph/trigger_grad_spike", 7)
        'backward_graph/trigger_grad_spike_from_step_000007'
    """

    def __init__(self) -> None:
        self._counts: dict[str, int] = defaultdict(int)
        self._current: dict[str, str] = {}

    def tag(self, base: str, step: int) -> str:
        """The tag for the next sample of ``base`` (a group, or ``group/name``) at ``step``."""
        base = vdl_tag(base)
        n = self._counts[base]
        self._counts[base] = n + 1
        if n % PAGE == 0:
            sep = "_" if "/" in base else "/"
            self._current[base] = f"{base}{sep}from_step_{int(step):06d}"
        return self._current[base]


def encode_like_visualdl(array: Any) -> bytes:
    """PNG bytes exactly as VisualDL stores (and later serves) ``array``."""
    from visualdl.component.base_component import imgarray2bytes

    return imgarray2bytes(array)


def graph_dir(directory: str, display_name: str, step: int, trigger: str, suffix: str = "") -> str:
    """The folder of one capture's Graphs-tab file; its name is what VisualDL's
    "Choose a model" list shows (cut to about 30 characters there, hence the step
    first): step, trigger and run, ``step_000008-nonfinite_loss-vdl_log.backward_graph``.

    Examples:
        >>> os.path.basename(graph_dir("/logs/run", "vdl_log/backward_graph", 8, "nonfinite_loss"))
        'step_000008-nonfinite_loss-vdl_log.backward_graph'
    """
    run = ".".join(vdl_graph_name(part, limit=60) for part in display_name.split("/"))
    label = suffixed(f"step_{int(step):06d}", suffix) + ("" if trigger == "scheduled" else f"-{vdl_graph_name(trigger)}")
    return os.path.join(directory, "graphs", f"{label}-{run}")


class VisualDLSink(Sink):
    """Writes image, text and scalar records to one VisualDL run, and Graphs-tab files.

    The run is the recorder's run folder (never shared with another writer: the
    dashboard shows only the newest records file per directory), named by the
    context's ``display_name``. Pages of ten captures per tag; the picture of a
    triggered capture is also under ``backward_graph/trigger_<name>``, a
    structure change's diff picture under ``backward_graph/structure_change``.

    Raises:
        ImportError: (from :meth:`open`) VisualDL is not installed.
    """

    name = "visualdl"
    png_encoding = "visualdl"

    def open(self, context: SinkContext) -> None:
        from visualdl import LogWriter

        self.context = context
        self._writer = LogWriter(logdir=context.directory, display_name=context.display_name)
        self._scalar_tags: dict[str, str] = {}  # raw name -> tag, unique per raw name
        self._tag_owner: dict[str, str] = {}  # tag -> the raw name that has it
        self._pages = TagPages()  # given out in capture order (data), used when drawn (pictures)
        self._image_tags: dict[tuple[int, str], tuple[list[str], str]] = {}
        self.file_name = self._writer.file_name

    # ------------------------------------------------------------ the sink
    def file_png(self, png: bytes) -> bytes:
        """The same encoder VisualDL uses, so the dashboard serves these exact bytes."""
        return encode_like_visualdl(png_to_array(png))

    def data(self, record: CaptureData) -> None:
        step, suffix = record.step, record.suffix
        self.text(self._pages.tag(suffixed("summary", suffix), step), record.text, step)
        self.scalars(record.scalars, step)
        base = suffixed("backward_graph", suffix)
        tags = [self._pages.tag(base, step)]
        if record.trigger != "scheduled":
            tags.append(self._pages.tag(f"{base}/trigger_{record.trigger}", step))
        diff_tag = self._pages.tag(f"{base}/structure_change", step) if record.diff is not None else ""
        self._image_tags[(step, suffix)] = (tags, diff_tag)

    def pictures(self, record: CapturePictures) -> None:
        tags, diff_tag = self._image_tags.pop((record.step, record.suffix), ([], ""))
        encoded = record.encoding == self.png_encoding  # already as VisualDL stores them: written as they are
        if record.picture is not None:
            picture = record.picture if encoded else png_to_array(record.picture)
            for tag in tags:
                (self.encoded_image if encoded else self.image)(tag, picture, record.step)
        if record.diff_picture is not None and diff_tag:
            if encoded:
                self.encoded_image(diff_tag, record.diff_picture, record.step)
            else:
                self.image(diff_tag, png_to_array(record.diff_picture), record.step)

    def encoded_image(self, tag: str, png: bytes, step: int) -> None:
        """One image sample of PNG bytes already encoded as VisualDL encodes (:func:`encode_like_visualdl`):
        the record ``add_image`` writes, without decoding and encoding the picture again."""
        file_writer = getattr(self._writer, "_get_file_writer", None)
        if file_writer is None:  # another VisualDL: its public call (the same bytes, more work)
            self.image(tag, png_to_array(png), step)
            return
        from visualdl.proto.record_pb2 import Record

        walltime = round(time.time() * 1000)
        file_writer().add_record(Record(values=[Record.Value(id=step, tag=tag, timestamp=walltime,
                                                             image=Record.Image(encoded_image_string=png))]))

    def drawn_files(self, record: CaptureData) -> dict[str, str]:
        """The capture's Graphs-tab folder: the drawing process writes its file (:func:`~paddleviz_hooks.sinks.vdl_graph.write_vdl_graph`)."""
        if not self.context.graphs:
            return {}
        directory = self.context.directory
        problem = graphs_path_problem(directory)
        if problem:
            self.context.warn(GRAPHS_PATH_CAUSE, problem)
        return {"vdl_graph": graph_dir(directory, self.context.display_name, record.step, record.trigger,
                                       record.suffix)}

    # --------------------------------------------------------- the records
    def image(self, tag: str, array: Any, step: int) -> None:
        """One image sample under ``tag`` (a :class:`TagPages` tag)."""
        self._writer.add_image(tag=tag, img=array, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        """One text sample under ``tag`` (a :class:`TagPages` tag)."""
        self._writer.add_text(tag=tag, text_string=visible(text, lines=True), step=step)

    def scalars(self, values: dict[str, float | None], step: int) -> None:
        for tag, value in finite_scalars(values).items():  # the chart cannot draw NaN; counts are logged
            self._writer.add_scalar(tag=self.scalar_tag(tag), value=value, step=step)

    def scalar_tag(self, name: str) -> str:
        """The tag for ``name``; two names that clean to the same text
        (``"a b"`` and ``"a_b"``) get different tags, so no chart mixes two layers."""
        tag = self._scalar_tags.get(name)
        if tag is None:
            tag = vdl_tag(name)
            if self._tag_owner.setdefault(tag, name) != name:
                tag = f"{tag[:111]}_{zlib.crc32(name.encode('utf-8')):08x}"
                self._tag_owner.setdefault(tag, name)
            self._scalar_tags[name] = tag
        return tag

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()



_URL_SAFE_PATH = re.compile(r"^[A-Za-z0-9/._~:\\-]*$")
#: the warn-once cause of :func:`graphs_path_problem` (the recorder checks at construction, the sink again)
GRAPHS_PATH_CAUSE = "vdl-graph-path"


def graphs_path_problem(directory: str) -> str | None:
    """Why VisualDL's Graphs tab cannot open graphs under ``directory``; None when it can.

    Examples:
        >>> graphs_path_problem("/runs/exp_1") is None
        True
        >>> graphs_path_problem("/my runs/exp").split(":")[0]
        "VisualDL's Graphs tab cannot open graphs under '/my runs/exp'"
    """
    if _URL_SAFE_PATH.match(directory):
        return None
    return (f"VisualDL's Graphs tab cannot open graphs under {directory!r}: its page puts "
            "the folder path into web addresses unencoded, so a path with spaces or & # + % "
            "breaks it. Use a log_dir whose full path has only letters, digits and / . _ -")
