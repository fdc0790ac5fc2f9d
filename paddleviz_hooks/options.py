"""The recorder's options, checked in one place.

One rule for every option: a value of the wrong *type* raises ``TypeError``,
a value of the right type that is out of range raises ``ValueError``; both
name the option and quote the value received.

Examples:
    >>> RecorderOptions.check(every=0)
    Traceback (most recent call last):
    ...
    ValueError: every must be an int >= 1 or None, got 0
    >>> RecorderOptions.check(every="10")
    Traceback (most recent call last):
    ...
    TypeError: every must be an int >= 1 or None, got '10'
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, fields
from typing import Any, Iterable

from .argcheck import check_path, reject_unknown
from .escape import safe_filename
from .render.dot import check_color_by
from .sinks.hub import DEFAULT_SINKS, check_sinks

__all__ = ["RecorderOptions", "FORMATS"]

#: The longest wait an option may ask for (a year; far below ``threading.TIMEOUT_MAX``).
_MAX_WAIT = min(365 * 86400.0, threading.TIMEOUT_MAX / 4)

#: Files a capture can be written as.
FORMATS = ("png", "svg", "dot", "json")


def _int(name: str, value: Any, minimum: int, allow_none: bool = True, what: str | None = None) -> int | None:
    if value is None and allow_none:
        return None
    text = what or f"{name} must be an int >= {minimum}{' or None' if allow_none else ''}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{text}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{text}, got {value!r}")
    return value


#: The widest picture an option may ask for: PNG drawing (cairo) stops at 32767 pixels a side.
_MAX_PX = 32767


def _px(name: str, value: Any, allow_none: bool = True) -> int | None:
    text = f"{name} must be an int from 64 to {_MAX_PX}{' or None' if allow_none else ''}"
    v = _int(name, value, 64, allow_none, what=text)
    if v is not None and v > _MAX_PX:
        raise ValueError(f"{text}, got {value!r}")
    return v


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _number(name: str, value: Any, text: str, ok) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {text}, got {value!r}")
    if not ok(value):
        raise ValueError(f"{name} must be {text}, got {value!r}")
    return float(value)


def _int_list(name: str, value: Any, minimum: int, nonempty: bool = False) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of ints >= {minimum}, got {value!r}")
    items = list(value)
    if nonempty and not items:
        raise ValueError(f"{name} must be a non-empty list of ints >= {minimum}, got {value!r}")
    ordered = isinstance(value, (list, tuple, range))  # an index means something only there
    for i, v in enumerate(items):
        where = f"{name}[{i}] = {v!r}" if ordered else f"{v!r} in {name}={value!r}"
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be a list of ints >= {minimum}, got {where}")
        if v < minimum:
            raise ValueError(f"{name} must be a list of ints >= {minimum}, got {where}")
    return items


@dataclass(frozen=True)
class RecorderOptions:
    """Checked options of :class:`~paddleviz_hooks.recorder.BackwardGraphRecorder`.

    The meaning of each field is documented there.
    """

    log_dir: str = "vdl_log"
    every: int | None = 100
    steps: frozenset[int] | None = None
    capture_first: bool = True
    max_captures: int | None = None
    grad_stats: bool = True
    saved_memory: bool = False
    sources: bool = True
    color_by: str | None = None
    view_max_nodes: int | None = None
    view_max_px: int = 2000
    viewer_px: int | None = 1280
    formats: tuple[str, ...] = FORMATS
    visualdl: bool = True
    sinks: tuple[Any, ...] = DEFAULT_SINKS  # checked: names and sink objects ("visualdl" dropped by visualdl=False)
    visualdl_graphs: bool = True
    visualdl_diagnostics: bool = False
    scalar_depth: int | None = None
    run_name: str = "backward_graph"
    ranks: frozenset[int] | str | int = 0  # checked: a frozenset of ints, or "all"
    on_nonfinite: bool = False
    on_grad_spike: float | None = None
    on_structure_change: bool = False
    cooldown: int = 100
    queue_size: int = 4
    render_timeout: float = 60.0
    close_timeout: float = 120.0
    verbose: int = 1

    @property
    def watching(self) -> bool:
        """Whether any trigger is on (the backward dispatcher then stays installed)."""
        return self.on_nonfinite or self.on_grad_spike is not None or self.on_structure_change

    @classmethod
    def check(cls, log_dir: Any = "vdl_log", every: Any = None, steps: Any = None, **options: Any) -> "RecorderOptions":
        """Check every option; raises ``TypeError``/``ValueError`` naming the first bad one.

        Options not given take the defaults of the fields above.
        """
        known = {f.name for f in fields(cls)} - {"log_dir", "every", "steps"}
        reject_unknown("RecorderOptions.check", options, known)
        o = {f.name: f.default for f in fields(cls) if f.name in known}
        o.update(options)
        capture_first, max_captures, grad_stats = o["capture_first"], o["max_captures"], o["grad_stats"]
        saved_memory, color_by = o["saved_memory"], o["color_by"]
        view_max_nodes, view_max_px, formats, visualdl = o["view_max_nodes"], o["view_max_px"], o["formats"], o["visualdl"]
        visualdl_graphs, visualdl_diagnostics = o["visualdl_graphs"], o["visualdl_diagnostics"]
        sinks = check_sinks(o["sinks"], require_installed=True)
        if _bool("visualdl", visualdl) is False and "visualdl" in sinks and o["sinks"] is not DEFAULT_SINKS:
            raise ValueError(f"visualdl=False contradicts sinks={o['sinks']!r}: leave 'visualdl' out of sinks, "
                             "or pass visualdl=True")
        viewer_px = o["viewer_px"]
        run_name, ranks, on_nonfinite, on_grad_spike = o["run_name"], o["ranks"], o["on_nonfinite"], o["on_grad_spike"]
        on_structure_change, cooldown, queue_size = o["on_structure_change"], o["cooldown"], o["queue_size"]
        render_timeout, close_timeout, verbose = o["render_timeout"], o["close_timeout"], o["verbose"]
        if _is_layer(every):  # BackwardGraphCallback(log_dir, model): the second place is every's
            raise TypeError(f"every must be an int >= 1 or None, got a {type(every).__name__} layer: "
                            "BackwardGraphCallback takes no model (Model.fit hands it the network); "
                            "the recorder takes it second: BackwardGraphRecorder(log_dir, model, every=...)")
        log_dir = check_path("log_dir", log_dir)
        if every is not None and steps is not None:
            raise ValueError(f"pass either every= or steps=, not both (got every={every!r}, steps={steps!r})")
        _int("every", every, 1)
        # steps=[]: no scheduled capture, only the triggers' (on_nonfinite, on_grad_spike, ...)
        step_set = frozenset(_int_list("steps", steps, 1)) if steps is not None else None
        if steps is None and every is None:
            every = 100
        if isinstance(formats, str):
            formats = (formats,)
        if isinstance(formats, (bytes, type(None))) or not isinstance(formats, Iterable):
            raise TypeError(f"formats must be a non-empty subset of {FORMATS}, got {formats!r}")
        formats = tuple(formats)
        if any(not isinstance(f, str) for f in formats):
            raise TypeError(f"formats must be a non-empty subset of {FORMATS}, got {formats!r}")
        if not formats or any(f not in FORMATS for f in formats):
            raise ValueError(f"formats must be a non-empty subset of {FORMATS}, got {formats!r}")
        if ranks == "all":
            rank_set: frozenset[int] | str = "all"
        elif isinstance(ranks, str):
            raise ValueError(f"ranks must be an int, a list of ints or 'all', got {ranks!r}")
        else:
            if isinstance(ranks, int) and not isinstance(ranks, bool):
                rank_set = frozenset([_int("ranks", ranks, 0, allow_none=False,
                                           what="ranks must be an int >= 0, a list of them or 'all'")])
            else:
                rank_set = frozenset(_int_list("ranks", ranks, 0, nonempty=True))
        if not isinstance(run_name, str):
            raise TypeError(f"run_name must be a str, got {run_name!r}")
        if safe_filename(run_name) != run_name:
            raise ValueError(
                f"run_name must be a plain folder name (letters, digits, . _ -), got {run_name!r}; "
                f"for example {safe_filename(run_name)!r}"
            )
        check_color_by(color_by)
        if color_by == "saved_memory" and saved_memory is not True:
            raise ValueError(f"color_by='saved_memory' needs saved_memory=True (nothing is recorded to shade by), "
                             f"got saved_memory={saved_memory!r}")
        if isinstance(verbose, bool):
            verbose = int(verbose)
        _int("verbose", verbose, 0, allow_none=False, what="verbose must be 0 (silent) or 1 (print notices)")
        if verbose > 1:
            raise ValueError(f"verbose must be 0 (silent) or 1 (print notices), got {verbose!r}")
        return cls(
            log_dir=log_dir,
            every=every,
            steps=step_set,
            capture_first=_bool("capture_first", capture_first),
            max_captures=_int("max_captures", max_captures, 1),
            grad_stats=_bool("grad_stats", grad_stats),
            saved_memory=_bool("saved_memory", saved_memory),
            sources=_bool("sources", o["sources"]),
            color_by=color_by,
            view_max_nodes=_int("view_max_nodes", view_max_nodes, 2),
            view_max_px=_px("view_max_px", view_max_px, allow_none=False),
            viewer_px=_px("viewer_px", viewer_px),
            formats=formats,
            visualdl=_bool("visualdl", visualdl),
            sinks=tuple(s for s in sinks if visualdl or s != "visualdl"),
            visualdl_graphs=_bool("visualdl_graphs", visualdl_graphs),
            visualdl_diagnostics=_bool("visualdl_diagnostics", visualdl_diagnostics),
            scalar_depth=_int("scalar_depth", o["scalar_depth"], 1),
            run_name=run_name,
            ranks=rank_set,
            on_nonfinite=_bool("on_nonfinite", on_nonfinite),
            on_grad_spike=None if on_grad_spike is None else _number(
                "on_grad_spike", on_grad_spike, "a factor > 1 (e.g. 10) or None",
                lambda v: 1 < v < math.inf),  # also rejects NaN, which would never fire
            on_structure_change=_bool("on_structure_change", on_structure_change),
            cooldown=_int("cooldown", cooldown, 0, allow_none=False),
            queue_size=_int("queue_size", queue_size, 1, allow_none=False),
            # threads and subprocesses wait at most threading.TIMEOUT_MAX (OverflowError beyond)
            render_timeout=_number("render_timeout", render_timeout,
                                   f"a positive number of seconds up to {_MAX_WAIT:g}", lambda v: 0 < v <= _MAX_WAIT),
            close_timeout=_number("close_timeout", close_timeout, f"a number of seconds from 0 to {_MAX_WAIT:g}",
                                  lambda v: 0 <= v <= _MAX_WAIT),
            verbose=verbose,
        )

    def scheduled(self, step: int) -> bool:
        """Whether ``step`` is selected by ``capture_first``, ``steps`` or ``every``.

        Examples:
            >>> o = RecorderOptions.check(every=10)
            >>> [s for s in range(1, 31) if o.scheduled(s)]
            [1, 10, 20, 30]
        """
        if self.capture_first and step == 1:
            return True
        if self.steps is not None:
            return step in self.steps
        return self.every is not None and step % self.every == 0


def _is_layer(value: Any) -> bool:
    """Whether ``value`` is a ``paddle.nn.Layer`` (without importing paddle here)."""
    return any(c.__module__.startswith("paddle.") and c.__name__ == "Layer" for c in type(value).__mro__)
