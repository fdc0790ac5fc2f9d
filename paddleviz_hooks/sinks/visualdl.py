"""VisualDL records for captured steps, designed around the dashboard's limits.

VisualDL keeps only 10 image and 10 text samples per run and tag (see
``docs/visualdl.md``), so image and text tags are paged: captures
1-10 go to ``.../p000``, 11-20 to ``.../p001`` and so on, and every capture
stays reachable. Scalars keep 1000 samples and are not paged.
"""

from __future__ import annotations

import io
import math
import zlib
from collections import defaultdict
from typing import Any

from ..escape import vdl_tag

__all__ = ["VisualDLSink", "png_to_array", "encode_like_visualdl", "PAGE"]

PAGE = 10  # VisualDL's per-tag sample budget for images and text


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
        self._counts: dict[str, int] = defaultdict(int)
        self._scalar_tags: dict[str, str] = {}  # raw name -> tag, unique per raw name
        self._tag_owner: dict[str, str] = {}  # tag -> the raw name that has it
        self.file_name = self._writer.file_name

    def paged_tag(self, base: str) -> str:
        """The tag for the next sample of ``base``, turning pages every 10."""
        base = vdl_tag(base)
        n = self._counts[base]
        self._counts[base] = n + 1
        return f"{base}/p{n // PAGE:03d}"

    def image(self, base: str, array: Any, step: int) -> str:
        tag = self.paged_tag(base)
        self._writer.add_image(tag=tag, img=array, step=step)
        return tag

    def text(self, base: str, text: str, step: int) -> str:
        tag = self.paged_tag(base)
        self._writer.add_text(tag=tag, text_string=text, step=step)
        return tag

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
