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

import gc

__all__ = ["Pause"]


class Pause:
    """Collections held off from :meth:`start` to :meth:`end`, then as they were.

    Both are idempotent, so an undo list (``_interrupts.run_all``) that runs
    :meth:`end` again after an interrupt finishes it; a user who had turned
    collection off keeps it off.

    Examples:
        >>> was = gc.isenabled()
        >>> p = Pause()
        >>> p.start(); gc.isenabled()
        False
        >>> p.end(); p.end(); gc.isenabled() == was
        True
    """

    def __init__(self) -> None:
        self.held = False

    def start(self) -> None:
        if gc.isenabled():
            self.held = True  # first: whatever stops this call now, end() puts collection back
            gc.disable()

    def end(self) -> None:
        if self.held:
            gc.enable()
            self.held = False
