"""Layer attribution: forward hooks that tell which layer call made each op."""

from __future__ import annotations

from typing import Any

import paddle

from .gradnode import grad_fn, strip_wrapper_prefix

__all__ = ["LayerAttribution", "tensors_in"]


class LayerAttribution:
    """Forward hooks on every sublayer that attribute op nodes to layers.

    The hooks only record, per layer call, the grad nodes of its outputs and
    of its inputs (cheap enough to run on every step); the walk that claims
    nodes for layers runs lazily, when a backward is actually captured.
    Inner layers finish first, so processing records in order lets the
    innermost layer claim a node before its parents.
    """

    MAX_RECORDS = 20000  # forwards without a backward must not pile up

    def __init__(self, layer: paddle.nn.Layer) -> None:
        self.layer = layer
        self.types: dict[str, str] = {}
        self.owner: dict[int, tuple[str, int]] = {}
        # (path, call, output grad node wrappers, input node addresses); the
        # wrappers keep those nodes alive so their addresses are not reused.
        self._records: list[tuple[str, int, list[Any], set[int]]] = []
        self._stack: list[set[int]] = []
        self._calls: dict[str, int] = {}
        self._handles: list[Any] = []

    def install(self) -> None:
        compiled: list[str] = []  # to_static layers: their sublayers run inside a program
        for path, sub in self.layer.named_sublayers(include_self=True):
            if type(sub).__name__ == "DataParallel":
                continue
            path = strip_wrapper_prefix(path) if path != "_layers" else ""
            self.types[path] = type(sub).__name__
            if any(path.startswith(c + ".") or (c == "" and path) for c in compiled):
                # A hook inside a to_static layer would make SOT fall back to
                # running it eagerly: the capture would change how it runs.
                continue
            if _is_to_static(sub):
                compiled.append(path)
            # with_kwargs: tensors passed by keyword are seen too
            self._handles.append(sub.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(
                sub.register_forward_post_hook(self._make_post(path), with_kwargs=True)
            )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.reset()

    def reset(self) -> None:
        self.owner.clear()
        self._records.clear()
        self._stack.clear()
        self._calls.clear()

    def lookup(self, ptr: int) -> tuple[str, int] | None:
        if self._records:
            self._resolve()
        return self.owner.get(ptr)

    def _pre(self, layer, args, kwargs):
        try:
            stops = set()
            for t in tensors_in((args, kwargs)):
                gf = grad_fn(t)
                if gf is not None:
                    stops.add(gf.node_ptr())
            self._stack.append(stops)
        except Exception:  # never break the forward
            self._stack.append(set())
        return None

    def _make_post(self, path: str):
        def post(layer, args, kwargs, outputs):
            stops = self._stack.pop() if self._stack else set()
            try:
                outs = [grad_fn(t) for t in tensors_in(outputs)]
                outs = [g for g in outs if g is not None]
                if outs:
                    call = self._calls.get(path, 0)
                    self._calls[path] = call + 1
                    if len(self._records) >= self.MAX_RECORDS:
                        del self._records[: self.MAX_RECORDS // 2]
                    self._records.append((path, call, outs, stops))
            except Exception:
                pass
            return None

        return post

    def _resolve(self) -> None:
        for path, call, outs, stops in self._records:
            self._claim(outs, stops, (path, call))
        self._records.clear()

    def _claim(self, todo: list[Any], stops: set[int], where: tuple[str, int]) -> None:
        seen: set[int] = set()
        todo = list(todo)
        while todo:
            gn = todo.pop()
            ptr = gn.node_ptr()
            if ptr in seen or ptr in stops:
                continue
            seen.add(ptr)
            if gn.name() == "GradNodeAccumulation":
                continue
            if ptr not in self.owner:  # inner layers ran first and keep their claim
                self.owner[ptr] = where
            todo.extend(n for n in gn.next_functions if n is not None)


def _is_to_static(layer: paddle.nn.Layer) -> bool:
    """Whether ``layer.forward`` was converted by ``paddle.jit.to_static``."""
    try:
        from paddle.jit.dy2static.program_translator import StaticFunction
    except Exception:
        return False
    return isinstance(getattr(layer, "forward", None), StaticFunction)


def tensors_in(obj: Any) -> list[Any]:
    """Tensors inside nested tuples/lists/dicts (forward inputs or outputs)."""
    found = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, paddle.Tensor):
            found.append(o)
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
    return found


