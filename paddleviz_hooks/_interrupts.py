"""Set-up and tear-down that a Ctrl-C (or any exception) cannot cut in half.

Two tools, used by every place that installs or removes hooks and patches:

* :func:`held_interrupts`: while the block runs (on the main thread), a
  SIGINT is held instead of raising ``KeyboardInterrupt`` in the middle of
  it; when the block is over, the previous handler is put back and the
  signal raised again, so the user's own handler (or Python's, raising
  ``KeyboardInterrupt``) sees it exactly once, after the block. Paddle runs
  the backward in C++ and raises a Python ``KeyboardInterrupt`` that hits a
  hook as its own ``OSError: (External) KeyboardInterrupt``; holding the
  signal over the backward delivers it as ``KeyboardInterrupt``, as without
  the library.
* :func:`run_all`: runs every undo step even when one of them raises, then
  raises the first exception (Paddle's wrapped interrupt as
  ``KeyboardInterrupt``).

Example:
    >>> done = []
    >>> def bad():
    ...     raise KeyboardInterrupt
    >>> try:
    ...     run_all(lambda: done.append(1), bad, lambda: done.append(3))
    ... except KeyboardInterrupt:
    ...     done
    [1, 3]
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Iterator

__all__ = ["held_interrupts", "run_all", "as_interrupt", "is_wrapped_interrupt", "pop_each"]

_held = {"depth": 0, "signals": 0}


def _hold(signum: int, frame: Any) -> None:
    _held["signals"] += 1


@contextlib.contextmanager
def held_interrupts() -> Iterator[None]:
    """Hold SIGINT for the block; deliver it, once, when the block is over.

    Only the main thread receives signals; elsewhere (or where the handler
    cannot be swapped, e.g. a handler installed from C) the block runs as is.
    Nested blocks hold until the outermost one ends.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # no signal reaches another thread
        return
    if _held["depth"]:
        _held["depth"] += 1
        try:
            yield
        finally:
            _held["depth"] -= 1
        return
    try:
        prev = signal.getsignal(signal.SIGINT)
        if prev is not None:
            signal.signal(signal.SIGINT, _hold)
    except (ValueError, OSError, TypeError):
        prev = None
    if prev is None:
        yield
        return
    _held["depth"] = 1
    try:
        yield
    finally:
        _held["depth"] = 0
        signal.signal(signal.SIGINT, prev)
        if _held["signals"]:
            _held["signals"] = 0
            signal.raise_signal(signal.SIGINT)  # the user's handler runs now, once


def is_wrapped_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` is Paddle's ``OSError`` wrapping a ``KeyboardInterrupt``
    (a Ctrl-C that landed in Python code Paddle called from C++)."""
    return isinstance(exc, OSError) and "KeyboardInterrupt" in str(exc)


def as_interrupt(exc: BaseException) -> BaseException:
    """``exc``, or a ``KeyboardInterrupt`` when it is Paddle's wrapped one."""
    if is_wrapped_interrupt(exc):
        out = KeyboardInterrupt()
        out.__cause__ = exc
        return out
    return exc


def run_all(*steps: Callable[[], Any]) -> None:
    """Run every undo step; then raise the first exception any of them raised.

    A step that raised is run once more (every undo step is idempotent: a
    second run finishes what an interrupt cut short).
    """
    first: BaseException | None = None
    for step in steps:
        for _ in range(2):
            try:
                step()
                break
            except BaseException as exc:  # the next undo steps run all the same
                if first is None:
                    first = exc
    if first is not None:
        raise as_interrupt(first)


def pop_each(items: list[Any], undo: Callable[[Any], Any]) -> None:
    """Undo every item of ``items`` (emptied as it goes), whatever one of them raises.

    An item is taken off the list only once it is undone (undoing one twice
    must be harmless), so a second call after an interrupt finishes the job;
    the first exception is raised at the end.
    """
    first: BaseException | None = None
    i = len(items)
    while i > 0:
        i -= 1
        try:
            undo(items[i])
        except BaseException as exc:
            if first is None:
                first = exc
            continue
        del items[i]
    if first is not None:
        raise as_interrupt(first)
