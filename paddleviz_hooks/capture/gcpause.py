"""Python's cyclic garbage collection held off while a capture makes many small objects at once.

Walking, hooking and recording a backward graph makes a few objects per node
(nodes, edges, hooks, gradient records). Each collection they set off walks
the whole heap, Paddle's many objects included: on a 10,000-node graph that
cost more than the capture's own work. While a captured backward runs and
while a capture installs or removes its forward hooks, collections wait; they
resume as they were afterwards, on every exit path. The user's own code (the
forward) runs with collection as it was.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["pause", "resume", "paused"]


def pause() -> bool:
    """Hold off collections; True when this call did (then :func:`resume` must follow).

    Examples:
        >>> was = gc.isenabled()
        >>> p = pause(); gc.isenabled()
        False
        >>> resume(p); gc.isenabled() == was
        True
    """
    if gc.isenabled():
        gc.disable()
        return True
    return False


def resume(paused_here: bool) -> None:
    """End a :func:`pause` that held collections off (one that found them off changes nothing)."""
    if paused_here:
        gc.enable()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Collections held off inside the block, as they were after it."""
    p = pause()
    try:
        yield
    finally:
        resume(p)
