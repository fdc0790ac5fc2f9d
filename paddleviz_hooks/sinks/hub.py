"""The dashboards a recorder logs to: names, checks, and the set the pipeline hands captures to.

A sink is named (``"visualdl"``, ``"swanlab"``, ``"tensorboard"``, ``"wandb"``) or given
as an object (see :class:`~paddleviz_hooks.sinks.base.Sink`). A named sink's package is
imported only when the first capture reaches it. Each sink is created lazily, and a
failure in one (missing package, a writer that raises) is one warning naming it, while
the other sinks go on.

Examples:
    >>> check_sinks(["visualdl"])
    ('visualdl',)
    >>> check_sinks("tensorbord")
    Traceback (most recent call last):
    ...
    ValueError: sinks: unknown dashboard 'tensorbord'; the names are 'visualdl', 'swanlab', 'tensorboard', 'wandb' (or a Sink object)
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable, Iterable

from .base import CaptureData, CapturePictures, Sink, SinkContext

__all__ = ["BUILTIN", "DEFAULT_SINKS", "SinkSet", "check_sinks", "encode_png", "sink_name"]

#: name -> (module of paddleviz_hooks.sinks, class, package it imports, how to install it)
BUILTIN: dict[str, tuple[str, str, str, str]] = {
    "visualdl": ("visualdl", "VisualDLSink", "visualdl", "pip install visualdl"),
    "swanlab": ("swanlab", "SwanLabSink", "swanlab", "pip install 'paddleviz-hooks[swanlab]'"),
    "tensorboard": ("tensorboard", "TensorBoardSink", "tensorboardX", "pip install 'paddleviz-hooks[tensorboard]'"),
    "wandb": ("wandb", "WandbSink", "wandb", "pip install 'paddleviz-hooks[wandb]'"),
}
DEFAULT_SINKS = ("visualdl",)
_METHODS = ("open", "data", "pictures", "flush", "close")


def _is_sink(obj: Any) -> bool:
    return all(callable(getattr(obj, m, None)) for m in _METHODS)


def sink_name(sink: Any) -> str:
    """A sink's name in warnings: its name, or its object's ``name``, or its class name."""
    if isinstance(sink, str):
        return sink
    name = getattr(sink, "name", None)
    return name if isinstance(name, str) and name and name != "sink" else type(sink).__name__


def check_sinks(value: Any, *, require_installed: bool = False) -> tuple[Any, ...]:
    """Check ``sinks=``: a name, a sink object, or a list of them; returns them as a tuple.

    Args:
        require_installed: also raise ``ImportError`` when a named sink's package is not
            installed (VisualDL, the default, only warns later, so training goes on).

    Raises:
        TypeError: not a name, a sink object or a list of them.
        ValueError: an unknown name, a name given twice, or an empty list.
        ImportError: (with ``require_installed``) a named sink's package is missing; the
            message names the pip extra.
    """
    items = [value] if isinstance(value, str) or _is_sink(value) else value
    if isinstance(items, (bytes, dict)) or not isinstance(items, Iterable):
        raise TypeError(f"sinks must be a dashboard name, a Sink object or a list of them, got {value!r}")
    out: list[Any] = []
    for item in items:
        if isinstance(item, str):
            if item not in BUILTIN:
                names = ", ".join(repr(n) for n in BUILTIN)
                raise ValueError(f"sinks: unknown dashboard {item!r}; the names are {names} (or a Sink object)")
            if item in out:
                raise ValueError(f"sinks: {item!r} is given twice, got {value!r}")
            if require_installed and item != "visualdl" and not _installed(BUILTIN[item][2]):
                raise ImportError(f"sinks={item!r} needs the {BUILTIN[item][2]} package: {BUILTIN[item][3]}")
        elif not _is_sink(item):
            raise TypeError(f"sinks: each must be a dashboard name or an object with "
                            f"{', '.join(_METHODS)} methods (a paddleviz_hooks.Sink), got {item!r}")
        out.append(item)
    return tuple(out)


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules
        return False


class SinkSet:
    """The sinks of one run, each created on first use; every call guarded.

    Args:
        specs: names and sink objects (checked by :func:`check_sinks`).
        context: given to each sink's ``open``.
    """

    def __init__(self, specs: Iterable[Any], context: SinkContext) -> None:
        self.context = context
        self._warn: Callable[[str, str], None] = context.warn
        self._specs = list(specs)
        self._live: dict[int, Any] = {}  # position in specs -> opened sink
        self._dead: set[int] = set()  # could not be created: not tried again in this run

    def __bool__(self) -> bool:
        """Whether any sink may still take records."""
        return len(self._dead) < len(self._specs)

    @property
    def names(self) -> list[str]:
        return [sink_name(s) for s in self._specs]

    def _sinks(self) -> list[tuple[str, Any]]:
        out = []
        for i, spec in enumerate(self._specs):
            if i in self._dead:
                continue
            sink = self._live.get(i)
            if sink is None:
                sink = self._create(i, spec)
                if sink is None:
                    continue
            out.append((sink_name(spec), sink))
        return out

    def _create(self, i: int, spec: Any) -> Any:
        name = sink_name(spec)
        try:
            if isinstance(spec, str):
                module, cls, package, install = BUILTIN[spec]
                try:
                    sink = getattr(importlib.import_module(f"{__package__}.{module}"), cls)()
                    sink.open(self.context)
                except ImportError as exc:
                    self._dead.add(i)
                    what = "VisualDL" if spec == "visualdl" else package
                    self._warn(f"sink-{name}", f"{what} is not importable ({exc}); {name} records are not "
                                               f"written, the step files are kept on disk. {install}")
                    return None
            else:
                sink = spec
                sink.open(self.context)
        except Exception as exc:
            self._dead.add(i)
            self._warn(f"sink-{name}", f"the {name} sink could not start ({exc!r}); it gets no records, "
                                       "the other outputs go on")
            return None
        self._live[i] = sink
        return sink

    def _call(self, name: str, sink: Any, method: str, *args: Any, step: int | None = None) -> Any:
        try:
            return getattr(sink, method)(*args)
        except Exception as exc:
            at = f" (step {step})" if step is not None else ""
            self._warn(f"sink-{name}-{method}", f"the {name} sink failed in {method}{at}: {exc!r}; "
                                                "the other outputs go on")
            return None

    def file_png(self, png: bytes) -> bytes:
        """The PNG file's bytes, as the first sink that re-encodes pictures stores them."""
        for name, sink in self._sinks():
            out = self._call(name, sink, "file_png", png) if hasattr(sink, "file_png") else None
            if isinstance(out, bytes) and out != png:
                return out
        return png

    def png_encoding(self) -> str | None:
        """The :attr:`~paddleviz_hooks.sinks.base.Sink.png_encoding` of the sink whose
        :meth:`file_png` gives the file's bytes (the first that re-encodes), when it has one."""
        for _, sink in self._sinks():
            if type(sink).file_png is not Sink.file_png:
                return getattr(sink, "png_encoding", None)
        return None

    def data(self, record: CaptureData) -> None:
        for name, sink in self._sinks():
            self._call(name, sink, "data", record, step=record.step)
            self._call(name, sink, "flush", step=record.step)

    def drawn_files(self, record: CaptureData) -> dict[str, str]:
        """What the drawing process writes for the sinks (see :meth:`Sink.drawn_files`)."""
        out: dict[str, str] = {}
        for name, sink in self._sinks():
            if hasattr(sink, "drawn_files"):
                out.update(self._call(name, sink, "drawn_files", record, step=record.step) or {})
        return out

    def pictures(self, record: CapturePictures) -> None:
        for name, sink in self._sinks():
            self._call(name, sink, "pictures", record, step=record.step)
            self._call(name, sink, "flush", step=record.step)

    def close(self) -> None:
        """Close every opened sink (each failure one warning); a later use opens them again."""
        live, self._live = self._live, {}
        self._dead.clear()
        for i, sink in sorted(live.items()):
            self._call(sink_name(self._specs[i]), sink, "close")


def encode_png(png: bytes, encoding: str | None) -> bytes:
    """``png`` as the sinks of that ``png_encoding`` store it (what their ``file_png`` gives).

    Examples:
        >>> encode_png(b"\\x89PNG...", None)
        b'\\x89PNG...'
    """
    if encoding is None:
        return png
    if encoding == "visualdl":
        from .visualdl import encode_like_visualdl, png_to_array

        return encode_like_visualdl(png_to_array(png))
    raise ValueError(f"unknown picture encoding {encoding!r}")
