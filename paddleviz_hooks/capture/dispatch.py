"""The backward patch: one dispatcher shared by every active capture.

While at least one capture is active, ``paddle.base.core.eager.run_backward``
and ``run_partial_grad`` are replaced by the dispatcher. ``Tensor.backward``,
``paddle.autograd.backward`` and ``paddle.grad`` look those functions up at
call time, so every entry point is seen. The originals are put back when the
last capture ends, also on exceptions and KeyboardInterrupt.

A backward can start while another runs on the same thread: reentrant
recompute's PyLayer runs a second backward inside its grad node. The
dispatcher keeps, per thread, the sessions of the backwards under way, so
each capture learns that a backward is nested and inside which of its own
sessions (``BackwardCapture._begin(..., nested=True, parent=...)``).

When a session's forward ran with call stacks recorded, its op nodes get
the frames the wrapped op calls noted (``source.py``); only when some node
that needs a source has no such note is the backward given a temporary dump
folder, whose stacks the sessions read when it is over. The folder is removed
on every exit path. The notes (and the grad nodes they hold) are dropped once
the sessions have read them, when the backward starts.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import paddle
from paddle.base import core

from .._interrupts import as_interrupt, held_interrupts, is_wrapped_interrupt, run_all
from . import gcpause
from . import source
from .source import StackDump

__all__ = ["DISPATCHER", "dispatcher_installed"]


class _Frame:
    """The backward under way on a thread: each capture's session of it (None: not observed)."""

    def __init__(self) -> None:
        self.sessions: dict[Any, Any] = {}
        self.held: BaseException | None = None  # an interrupt held by a nested backward


class Dispatcher:
    """Installs the backward patch while any capture is active."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._active: list[Any] = []
        self._orig_backward: Callable | None = None
        self._orig_grad: Callable | None = None
        self._local = threading.local()  # .frames: the backwards under way on this thread

    def activate(self, cap: Any) -> None:
        with self._lock, held_interrupts():
            if not self._active:
                self._orig_backward = core.eager.run_backward
                self._orig_grad = core.eager.run_partial_grad
                core.eager.run_backward = self._run_backward
                core.eager.run_partial_grad = self._run_partial_grad
            self._active.append(cap)

    def deactivate(self, cap: Any) -> None:
        """Stop ``cap``; the last one puts Paddle's functions back (idempotent)."""
        with self._lock, held_interrupts():
            if cap in self._active:
                self._active.remove(cap)
            if not self._active and self._orig_backward is not None:
                core.eager.run_backward = self._orig_backward
                core.eager.run_partial_grad = self._orig_grad
                self._orig_backward = self._orig_grad = None

    def deactivate_all(self) -> int:
        """Remove every active capture and the patch; returns how many were active
        (a safety net for test harnesses: captures remove themselves on exit)."""
        with self._lock:
            caps = list(self._active)
        for cap in caps:
            self.deactivate(cap)
        return len(caps)

    @property
    def installed(self) -> bool:
        return self._orig_backward is not None

    def _run_backward(self, tensors, grad_tensors, retain_graph, *rest):
        return self._run(self._orig_backward, "backward", tensors, retain_graph,
                         (tensors, grad_tensors, retain_graph, *rest))

    def _run_partial_grad(self, outputs, inputs, grad_outputs, retain_graph, *rest):
        return self._run(self._orig_grad, "grad", outputs, retain_graph,
                         (outputs, inputs, grad_outputs, retain_graph, *rest), inputs=inputs)

    def _run(self, original, entry, roots, retain_graph, args, inputs=None):
        # Ctrl-C during a captured backward: held until it is over and every hook of it
        # removed, then raised as KeyboardInterrupt, as Paddle does without hooks (a
        # KeyboardInterrupt raised inside a hook would reach the user as Paddle's
        # OSError, and cut the hooks' removal short)
        with held_interrupts():
            result = self._run_translated(original, entry, roots, retain_graph, args, inputs)
        return result

    def _run_translated(self, original, entry, roots, retain_graph, args, inputs):
        try:
            return self._run_held(original, entry, roots, retain_graph, args, inputs)
        except OSError as exc:
            if is_wrapped_interrupt(exc):  # another thread's, or a user's hook's, interrupt
                raise as_interrupt(exc) from exc
            raise

    def _run_held(self, original, entry, roots, retain_graph, args, inputs=None):
        with self._lock:
            caps = list(self._active)
        frames = self._local.__dict__.setdefault("frames", [])
        outer: _Frame | None = frames[-1] if frames else None
        frame = _Frame()
        grad_was = paddle.is_grad_enabled()
        sessions: list = []
        dump: StackDump | None = None
        pushed = ok = False
        collections = gcpause.Pause()
        try:
            if caps and outer is None:  # collections wait until the graphs are built (gcpause.py)
                collections.start()
            # inside the try: an interrupt while walking still unhooks what was hooked
            for cap in caps:
                if outer is None:
                    s = cap._begin(list(roots), entry, inputs=inputs)
                else:  # inside another backward: the capture's session of that one, if any
                    s = cap._begin(list(roots), entry, nested=True, parent=outer.sessions.get(cap))
                sessions.append((cap, s))
                frame.sessions[cap] = s
            if all(s is None for _, s in sessions):
                collections.end()  # nothing is captured: collections as usual
            wanting = [s for _, s in sessions if s is not None and s.wants_stacks]
            # each session has what it needs of the notes (s.made): those of the nodes walked go
            walked = [s for _, s in sessions if s is not None]
            source.forget([p for s in walked for p in s.ptrs] if walked else None)
            if wanting:
                dump = StackDump()
                if not all(s.whole for s in wanting):  # some node no wrapped op call noted
                    args = dump.inject(entry, args)
            frames.append(frame)
            pushed = True
            result = original(*args)
            if inputs is not None:  # paddle.grad: what it computed for each input (parameter rows)
                for _, s in sessions:
                    if s is not None:
                        s.results = result
            # A KeyboardInterrupt/SystemExit that hit one of our hooks was held
            # back so Paddle could finish the backward (raised inside a hook it
            # would surface as Paddle's OSError); deliver it now, as itself,
            # from the outermost backward (raised inside a PyLayer it would
            # become Paddle's error too).
            held = frame.held or next(
                (s.interrupt for _, s in sessions if s is not None and s.interrupt is not None), None)
            if held is not None:
                if outer is None:
                    raise held
                outer.held = outer.held or held
            ok = True
            return result
        finally:
            if pushed:
                frames.pop()
            # A hook that raised (or a KeyboardInterrupt inside one) leaves
            # Paddle's grad mode off for the rest of the process: restore it.
            ends = [lambda: paddle.is_grad_enabled() != grad_was and paddle.set_grad_enabled(grad_was)]
            if dump is not None:
                ends.append(lambda: _hand_stacks(dump, sessions))
            ends += [functools.partial(cap._end, s, ok=ok, retain_graph=bool(retain_graph)) for cap, s in sessions]
            ends.append(collections.end)  # last: the graphs are built
            run_all(*ends)  # every capture unhooks, whatever another raises


def _hand_stacks(dump: Any, sessions: list) -> None:
    """The forward call stacks of the backward's nodes, to every session that observed it."""
    stacks = dump.collect()
    for _, s in sessions:
        if s is not None:
            stacks = source.with_notes(stacks, s.made)
    for _, s in sessions:
        if s is not None:
            s.stacks = stacks


DISPATCHER = Dispatcher()


def dispatcher_installed() -> bool:
    """True while the backward patch is in place."""
    return DISPATCHER.installed
