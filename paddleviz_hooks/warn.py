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

import threading
import warnings

from .escape import visible

__all__ = ["WarnOnce"]


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
        warnings.warn(f"paddleviz_hooks: {visible(message, lines=True)}", RuntimeWarning, stacklevel=3)

    def seen(self, cause: str) -> bool:
        """Whether ``cause`` has warned already."""
        return cause in self._seen
