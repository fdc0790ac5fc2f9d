"""VisualDL records for captured steps, designed around the dashboard's limits.

VisualDL keeps only 10 image and 10 text samples per run and tag (see
``docs/visualdl.md``), so image and text tags are paged, ten captures a page,
each page named by the step it starts at: ``backward_graph/from_step_000001``,
``backward_graph/from_step_000100``... Every capture stays reachable. Scalars
keep 1000 samples and are not paged; their groups start with ``~`` so that
VisualDL, which sorts groups by name, lists them after the user's own curves.
"""

from __future__ import annotations

import io
import math
import zlib
from collections import defaultdict
from typing import Any

from ..escape import vdl_tag, visible

__all__ = ["VisualDLSink", "TagPages", "png_to_array", "encode_like_visualdl", "PAGE", "SCALAR_GROUP",
           "LAYER_NORM_GROUP"]

PAGE = 10  # VisualDL's per-tag sample budget for images and text
#: Scalar groups: '~' sorts after letters, digits and '_' in VisualDL's group order
SCALAR_GROUP = "~backward_graph"
LAYER_NORM_GROUP = "~grad_norm"
SAVED_MEMORY_GROUP = "~saved_memory"  # MB held for backward, with saved_memory=True


class TagPages:
    """Page tags, ten samples a page, each page named by its first sample's step.

    Pages are given out in capture order (the data thread), so a page's name
    tells the steps it holds even when its pictures are drawn out of order.

    Example:
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


def png_to_array(png: bytes) -> Any:
    """Decode PNG bytes to a uint8 HWC RGB array."""
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8).copy()


def encode_like_visualdl(array: Any) -> bytes:
    """PNG bytes exactly as VisualDL stores (and later serves) ``array``."""
    from visualdl.component.base_component import imgarray2bytes

    return imgarray2bytes(array)


class VisualDLSink:
    """Writes image, text and scalar records to one VisualDL run.

    Args:
        run_dir: the run's own directory (never shared with another writer:
            the dashboard shows only the newest records file per directory).
        display_name: the run's name in the dashboard.

    Raises:
        ImportError: VisualDL is not installed.
    """

    def __init__(self, run_dir: str, display_name: str = "") -> None:
        from visualdl import LogWriter

        self._writer = LogWriter(logdir=run_dir, display_name=display_name)
        self._scalar_tags: dict[str, str] = {}  # raw name -> tag, unique per raw name
        self._tag_owner: dict[str, str] = {}  # tag -> the raw name that has it
        self.file_name = self._writer.file_name

    def image(self, tag: str, array: Any, step: int) -> None:
        """One image sample under ``tag`` (a :class:`TagPages` tag)."""
        self._writer.add_image(tag=tag, img=array, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        """One text sample under ``tag`` (a :class:`TagPages` tag)."""
        self._writer.add_text(tag=tag, text_string=visible(text, lines=True), step=step)

    def scalars(self, values: dict[str, float | None], step: int) -> None:
        for tag, value in values.items():
            if value is None or not math.isfinite(value):
                continue  # the chart cannot draw NaN; counts are logged instead
            self._writer.add_scalar(tag=self.scalar_tag(tag), value=float(value), step=step)

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
