"""TensorBoard records for captured steps (tensorboardX event files).

The event files go into the recorder's run folder (``log_dir/run_name``), so
``tensorboard --logdir log_dir`` shows them as their own run beside the
user's. Per capture: the viewing picture under ``backward_graph`` (Images tab,
with a step slider), the summary under ``backward_graph/summary`` (Text tab,
as a literal block), a structure change's diff picture under
``backward_graph/structure_change``, and the scalars under the names every
sink uses, at the training step (the step of the user's own scalars).
TensorBoard's text tab strips SVG and data addresses, so the full-detail SVG
cannot be shown there: its file is named under ``backward_graph/full_detail``.
"""

from __future__ import annotations

from ..escape import markdown_literal
from ..text import svg_file_note
from .base import CaptureData, CapturePictures, Sink, SinkContext, finite_scalars, png_to_array, suffixed

__all__ = ["TensorBoardSink"]



class TensorBoardSink(Sink):
    """Writes image, text and scalar summaries with tensorboardX.

    Raises:
        ImportError: (from :meth:`open`) tensorboardX is not installed
            (``pip install 'paddleviz-hooks[tensorboard]'``).
    """

    name = "tensorboard"

    def open(self, context: SinkContext) -> None:
        from tensorboardX import SummaryWriter
        from tensorboardX.proto.summary_pb2 import Summary

        self._Summary = Summary
        self._writer = SummaryWriter(logdir=context.directory, flush_secs=10)

    def data(self, record: CaptureData) -> None:
        base = suffixed("backward_graph", record.suffix)
        self._writer.add_text(f"{base}/summary", markdown_literal(record.text), record.step)
        # as summaries of our own: add_scalar would rewrite '~' to '_' and the names would differ
        # from the other dashboards' (and sort before the user's curves)
        values = [self._Summary.Value(tag=tag, simple_value=value)
                  for tag, value in finite_scalars(record.scalars).items()]
        if values:
            self._writer.file_writer.add_summary(self._Summary(value=values), record.step)

    def pictures(self, record: CapturePictures) -> None:
        base = suffixed("backward_graph", record.suffix)
        if record.picture is not None:
            self._writer.add_image(base, png_to_array(record.picture), record.step, dataformats="HWC")
        if record.diff_picture is not None:
            self._writer.add_image(f"{base}/structure_change", png_to_array(record.diff_picture), record.step,
                                   dataformats="HWC")
        if "svg" in record.paths:
            self._writer.add_text(f"{base}/full_detail", markdown_literal(svg_file_note(record.paths["svg"])),
                                  record.step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
