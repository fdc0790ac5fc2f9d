"""The one warn-once helper: every problem becomes one clear warning per cause.

Examples:
    >>> import warnings
    >>> warn = WarnOnce()
    >>> with warnings.catch_warnings(record=True) as got:
    ...     warnings.simplefilter("always")
    ...     warn("disk", "cannot write step 1")
    ...     warn("disk", "cannot write step 2")
    >>> [str(w.message) for w in got]
    ['paddleviz_hooks: cannot write step 1']
    >>> warn.messages
    ['cannot write step 1', 'cannot write step 2']

A message names what the model named (layers, parameters, files); what could
hide or reorder it on a terminal is shown escaped (``escape.visible``):

    >>> with warnings.catch_warnings(record=True) as got:
    ...     warnings.simplefilter("always")
    ...     warn("layer", "layer fc\u202e2 failed")
    >>> print(got[0].message)
    paddleviz_hooks: layer fc\u202e2 failed
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

from .escape import visible

__all__ = ["WarnOnce"]

_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _users_level() -> int:
    """The ``stacklevel`` of :meth:`WarnOnce.__call__`'s ``warnings.warn`` that names the
    user's line that led to the warning (the first frame outside this package and Paddle:
    the ``fit`` call, the ``with rec.step():`` block), not a line of this package; the
    caller's caller when there is none (a background thread's warning)."""
    paddle = sys.modules.get("paddle")
    inside = (_OURS,) + ((os.path.dirname(os.path.abspath(paddle.__file__)) + os.sep,)
                         if getattr(paddle, "__file__", None) else ())
    f, level = sys._getframe(2), 2  # the caller of __call__: stacklevel 2 of its warnings.warn
    while f is not None:
        if not os.path.abspath(f.f_code.co_filename).startswith(inside):
            return level
        f, level = f.f_back, level + 1
    return 3


class WarnOnce:
    """Call it with ``(cause, message)``; warns the first time per cause.

    Every message is kept in ``messages`` (what a later summary can list);
    thread-safe, since the background pipeline warns too.
    """

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self.messages: list[str] = []

    def __call__(self, cause: str, message: str) -> None:
        with self._lock:
            self.messages.append(message)
            if cause in self._seen:
                return
            self._seen.add(cause)
        warnings.warn(f"paddleviz_hooks: {visible(message, lines=True)}", RuntimeWarning,
                      stacklevel=_users_level())

    def seen(self, cause: str) -> bool:
        """Whether ``cause`` has warned already."""
        return cause in self._seen
