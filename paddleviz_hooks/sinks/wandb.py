"""Weights & Biases records for captured steps.

Into the user's active W&B run when there is one (``wandb.init`` of their own,
online or offline, or PaddleFormers' ``report_to="wandb"``); otherwise into an
offline run of its own under ``run_name/wandb``, which contacts no server
(``wandb sync`` uploads it later). Per capture, under ``backward_graph/``:
``graph`` (a ``wandb.Image`` of the viewing picture), ``svg`` (a ``wandb.Html``
of the full-detail SVG, every op, zoomable in the browser), ``summary`` (a
``wandb.Html`` of the summary text), ``structure_change`` (the diff picture),
and the scalars under the names every sink uses. Their x axis is
``backward_graph/step``, the training step, declared with
``define_metric``. Each capture is one row: its data waits for its
pictures (which always follow, None when drawing failed), and what is still
waiting at close goes alone. In a run of our own a row is logged when its
pictures come. In the
user's run they are logged when the recorder closes (the end of training),
each a row of its own after the user's: W&B keeps one row counter per run and
its history is not safe to write from two threads (a record logged from our
background thread while the training thread logged was seen to vanish), and a
row of ours during training would move the user's step counter under their
own logging (their next ``wandb.log(..., step=n)`` would be dropped). What
waits is kept as PNG bytes, text and the SVG file's path.
"""

from __future__ import annotations

from typing import Callable

from ..escape import html_escape
from .base import CaptureData, CapturePictures, Sink, SinkContext, finite_scalars, png_to_array, suffixed

__all__ = ["WandbSink", "STEP_KEY"]

#: the x axis of every record of ours
STEP_KEY = "backward_graph/step"



class WandbSink(Sink):
    """Logs images, HTML and scalars to the active W&B run, or an offline one of its own.

    Raises:
        ImportError: (from :meth:`open`) wandb is not installed
            (``pip install 'paddleviz-hooks[wandb]'``).
    """

    name = "wandb"

    def open(self, context: SinkContext) -> None:
        import wandb

        self._wandb = wandb
        #: the run logged to; ``own`` is True when this sink started it (and finishes it)
        self.own = wandb.run is None
        if self.own:
            self.run = wandb.init(mode="offline", dir=context.directory, project="paddleviz-hooks",
                                  name=context.display_name, reinit="create_new")
        else:
            self.run = wandb.run
        self._defined: set[str] = set()
        # records waiting: in the user's run until close() (see the module's docstring)
        self._queue: list[tuple[int, Callable[[], dict]]] = []
        # (step, suffix) -> a capture's data, waiting for its pictures: one row per capture
        self._waiting: dict[tuple[int, str], Callable[[], dict]] = {}
        self.run.define_metric(STEP_KEY, hidden=True)

    def _log(self, step: int, values: Callable[[], dict]) -> None:
        self._queue.append((step, values))
        if self.own:
            self._drain()

    def _drain(self) -> None:
        """Log what is queued, one row per record, against our own step key."""
        run = self.run
        while self._queue:
            step, build = self._queue.pop(0)
            values = build()
            for key in values:
                if key not in self._defined:
                    run.define_metric(key, step_metric=STEP_KEY)
                    self._defined.add(key)
            run.log({STEP_KEY: step, **values}, commit=True)

    def data(self, record: CaptureData) -> None:
        base, text, scalars = suffixed("backward_graph", record.suffix), record.text, finite_scalars(record.scalars)
        self._waiting[(record.step, record.suffix)] = lambda: {
            **scalars, f"{base}/summary": self._wandb.Html(f"<pre>{html_escape(text)}</pre>", inject=False)}

    def pictures(self, record: CapturePictures) -> None:
        base, title = suffixed("backward_graph", record.suffix), record.title
        picture, svg, diff_picture = record.picture, record.svg, record.diff_picture
        data = self._waiting.pop((record.step, record.suffix), None)
        if data is None and picture is None and svg is None and diff_picture is None:
            return
        svg_file = record.paths.get("svg")
        if svg_file is not None:
            svg = None  # read from its file when logged: a waiting record keeps no copy of it

        def values() -> dict:
            wandb, out = self._wandb, data() if data is not None else {}
            if picture is not None:
                out[f"{base}/graph"] = wandb.Image(png_to_array(picture), caption=title)
            if svg is not None or svg_file is not None:
                text = svg
                if text is None:
                    with open(svg_file, encoding="utf-8") as f:
                        text = f.read()
                out[f"{base}/svg"] = wandb.Html(text, inject=False)
            if diff_picture is not None:
                out[f"{base}/structure_change"] = wandb.Image(png_to_array(diff_picture), caption=title)
            return out

        self._log(record.step, values)

    def close(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for (step, _), build in sorted(waiting.items()):  # data whose pictures never came (close_timeout)
            self._queue.append((step, build))
        self._drain()
        if self.own:
            self.run.finish()
            if self._wandb.run is None:  # no run of the user's either: W&B's service process goes too
                self._wandb.teardown()
