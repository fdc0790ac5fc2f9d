"""Callbacks for ``paddle.Model.fit``."""

from .backward_graph import BackwardGraphCallback

__all__ = ["BackwardGraphCallback"]
