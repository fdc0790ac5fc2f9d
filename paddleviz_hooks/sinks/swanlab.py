"""SwanLab records for captured steps.

Into the user's active SwanLab run when there is one (``swanlab.init`` of
their own, or PaddleFormers' ``report_to="swanlab"``); otherwise into a local
run of its own, ``swanlab.init(mode="local")`` under ``log_dir/swanlog``,
which contacts no server (``swanlab watch log_dir/swanlog`` shows it). Per
capture: the viewing picture as a ``swanlab.Image`` under
``backward_graph/graph`` (an image card with a step slider, the summary as its
caption: the local dashboard draws text cards empty), the summary as
``swanlab.Text`` under ``backward_graph/summary``, a
structure change's diff picture under ``backward_graph/structure_change``,
and the scalars under the names every sink uses, all at the training step.
"""

from __future__ import annotations

import os

from .base import CaptureData, CapturePictures, Sink, SinkContext, finite_scalars, png_to_array, suffixed

__all__ = ["SwanLabSink"]



class SwanLabSink(Sink):
    """Logs images, text and scalars to the active SwanLab run, or a local one of its own.

    Raises:
        ImportError: (from :meth:`open`) SwanLab is not installed
            (``pip install 'paddleviz-hooks[swanlab]'``).
    """

    name = "swanlab"

    def open(self, context: SinkContext) -> None:
        import swanlab

        self._swanlab = swanlab
        #: the run logged to; ``own`` is True when this sink started it (and finishes it)
        self.own = not swanlab.has_run()
        if self.own:
            log_dir = os.path.join(os.path.abspath(context.log_dir), "swanlog")
            os.makedirs(log_dir, exist_ok=True)
            # terminal proxy off: a run of ours does not copy the user's console into its folder
            self.run = swanlab.init(mode="local", log_dir=log_dir, project="paddleviz-hooks",
                                    name=context.display_name,
                                    settings=swanlab.Settings(terminal={"proxy_type": "none"}))
        else:
            self.run = swanlab.get_run()
        self._captions: dict[tuple[int, str], str] = {}  # the summary, shown under the picture too

    def data(self, record: CaptureData) -> None:
        base = suffixed("backward_graph", record.suffix)
        values: dict = dict(finite_scalars(record.scalars))
        values[f"{base}/summary"] = self._swanlab.Text(record.text)
        self.run.log(values, step=record.step)
        self._captions[(record.step, record.suffix)] = record.text

    def pictures(self, record: CapturePictures) -> None:
        base = suffixed("backward_graph", record.suffix)
        values = {}
        caption = self._captions.pop((record.step, record.suffix), record.title)
        if record.picture is not None:
            values[f"{base}/graph"] = self._swanlab.Image(png_to_array(record.picture), caption=caption)
        if record.diff_picture is not None:
            values[f"{base}/structure_change"] = self._swanlab.Image(png_to_array(record.diff_picture),
                                                                     caption=record.title)
        if values:
            self.run.log(values, step=record.step)

    def close(self) -> None:
        if self.own and self._swanlab.has_run() and self._swanlab.get_run() is self.run:
            self._swanlab.finish()
