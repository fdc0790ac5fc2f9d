"""Forward source lines: where in the user's code each op of a captured graph was made.

Paddle records the Python stack of a forward op call on the grad node it
creates while ``FLAGS_call_stack_level`` is 3, and writes those stacks, keyed
by the node's address (``grad_fn.node_ptr()``), when a backward is given a
``dump_backward_graph_path``. So, on captured steps only:

* :func:`arm` sets the flag for the forward (the capture arms it when its
  block is entered or its step starts, and again when the layer's next
  forward begins after a ``backward()``, at once after ``paddle.grad``, with
  ``retain_graph=True`` or without a layer: an optimizer's update between a
  backward and the next forward runs without it); :func:`disarm` puts the
  previous value back when the backward starts. Arming is counted: the flag returns to the user's value when the
  last capture disarms, on every exit path.
* Paddle formats each stack with ``traceback.format_stack``, which in Python
  3.11 parses every frame's line to place ``^^^`` markers: about 0.9 ms per op
  call 30 frames deep. While armed, ``traceback.format_stack`` is a version
  that gives the same frames and code lines without the markers, each frame's
  text formatted once (:func:`_format_stack`); the original is put back with
  the flag. Paddle's own calls get only the frames :func:`user_frames` can keep
  (Paddle's and the standard library's are most of a stack, and of the dump),
  as one string (:func:`_kept_text`); a Python caller still gets every frame.
  Paddle only prints the text it stores (in its NaN/Inf and backward error
  messages) and writes it in the dump: nothing there parses it.
* While armed, every op entry point is wrapped (``opcalls.py``, the wrapping
  saved-memory observing uses too): each call that made grad nodes notes,
  for every node it made (its outputs' and those between them and its
  inputs' nodes), the stack Paddle was given inside the call
  (:func:`_after`; the frames are walked once, in :func:`_format_stack`),
  by the node's address. The notes hold the grad nodes, so no address is
  reused while one can be read, until the next backward starts
  (:func:`forget`) or the last holder disarms.
* When a captured backward starts, :func:`noted` tells whether every op
  node that gets a source has a note. Then the sources come from the notes
  and the backward gets no dump (Paddle's DOT files are most of what sources
  cost). Otherwise (a node made with no wrapped entry point: ``x.clone()``,
  the double-grad nodes of ``create_graph``) :class:`StackDump` gives the
  backward a temporary dump folder, reads the stacks of the nodes the capture
  walked and removes the folder; the notes fill the nodes Paddle keeps no
  stack for (``Conv2dGradNodeFinal``, ``AddNGradNodeFinal``: hand-written
  Paddle code), :func:`with_notes`. Paddle still keeps each node's stack: a
  later backward over a retained graph reads it from the dump. A model whose
  notes missed a node is noted no more than the dump needs (``conv2d`` and
  ``add_n`` calls): ``arm(notes=False)``, ``session._NOTES_MISSED``.
* :func:`user_frames` keeps the frames of the user's code, outermost first:
  frames inside Paddle, the standard library and this package are left out,
  and so are the launcher frames (pytest, a notebook kernel, ``paddle.distributed.launch``)
  installed packages run before the first frame of the user's own files.

Nothing here runs on a step that is not captured.
"""

from __future__ import annotations

import _thread
import linecache
import os
import re
import shutil
import site
import sys
import sysconfig
import tempfile
import threading
import traceback
from typing import Any, Iterable

import paddle

from .._interrupts import held_interrupts
from ..graph import Node, SourceFrame
from . import opcalls
from . import attribution
from .attribution import tensors_in
from .gradnode import grad_fn, made_by_backward

__all__ = ["arm", "disarm", "armed", "StackDump", "parse_call_stacks", "user_frames", "apply_stacks", "prefix_recomputed"]

FLAG = "FLAGS_call_stack_level"
_LOCK = threading.Lock()
_ARMED = 0  # captures holding the flag on
_NOTERS = 0  # those of them that want every op call noted
_PREVIOUS: int | None = None  # the user's value, put back when the last one disarms
_ORIGINAL_FORMAT = traceback.format_stack
# (id of the code object, instruction) -> (the code object, its frame's text, whether
# user_frames can keep the frame); emptied on disarm
_FRAME_TEXT: dict[tuple[int, int], tuple[Any, str, bool]] = {}
# id of a code object -> (the code object, whether it names format_stack: a Python caller)
_CALLERS: dict[int, tuple[Any, bool]] = {}
# Paddle 3.3.1 never releases the list format_stack returns to it (one reference leaks per op
# while the flag is on: about 200 KB per captured step of a 60-layer MLP). So Paddle gets the
# same list object for the same stack every time: a leaked reference then costs no memory.
# Kept across captures (the same stacks come back), up to _SHARED_MAX stacks.
_SHARED: dict[str, list[str]] = {}
_SHARED_MAX = 20000
_NOTHING: list[str] = []  # what Paddle gets when a stack could not be formatted
_TENSOR = paddle.Tensor


def _format_stack(f: Any = None, limit: int | None = None) -> list[str]:
    """``traceback.format_stack`` without the column markers: one string per frame,
    outermost first, ``  File "...", line N, in fn\n    code\n``.

    Paddle calls it from C++ for every op while the call-stack flag is on, and
    crashes (SIGSEGV) when it raises: a Ctrl-C landing in it is handed back to
    the main thread a moment later (landing then in the user's code), and any
    other error gives no stack for that op.

    Called by Paddle (no arguments, from no Python code naming ``format_stack``),
    it gives only the frames :func:`user_frames` can keep (:func:`_kept_text`);
    called from Python, every frame.
    """
    try:
        if f is None and limit is None:
            caller = sys._getframe(1)
            co = caller.f_code
            if co is _CALL_CODE or co is _OP_CODE:  # an op called through opcalls' wrapper: _after notes them
                text, frames = _kept(caller)
                _PENDING[0] = (id(caller), frames)
                return text
            named = _CALLERS.get(id(co))
            if named is None or named[0] is not co:
                named = _CALLERS[id(co)] = (co, "format_stack" in co.co_names)
            if not named[1]:
                return _kept_text(caller)
        return _frames_text(f if f is not None else sys._getframe(1), limit)
    except KeyboardInterrupt:
        timer = threading.Timer(0.01, _thread.interrupt_main)
        timer.daemon = True
        timer.start()
        return _NOTHING
    except BaseException:
        return _NOTHING


def _text(f: Any) -> tuple[Any, str, bool, SourceFrame]:
    """(code object, text, kept, the frame as :func:`parse_call_stacks` reads that text)
    of frame ``f``, each code object and instruction worked out once. Kept: a frame
    :func:`user_frames` can keep, other than an op wrapper's (``opcalls.py``) or a layer
    call's (``attribution.py``): this package's frames inside the user's forward are never
    a source line, nor where a recomputed forward's stack begins (:func:`user_frames`)."""
    co = f.f_code
    key = (id(co), f.f_lasti)  # f_lineno is worked out from the line table on each read: slower
    hit = _FRAME_TEXT.get(key)
    if hit is None or hit[0] is not co:
        file, line = co.co_filename, linecache.getline(co.co_filename, f.f_lineno).strip()
        hit = _FRAME_TEXT[key] = (co, f'  File "{file}", line {f.f_lineno}, in {co.co_name}\n' + (
            f"    {line}\n" if line else ""), _kind(file) != _NOT_USER and file not in _INSIDE_FILES,
            SourceFrame(file, f.f_lineno, co.co_name, "" if _CARETS.match(line) else line))
    return hit


def _frames_text(f: Any, limit: int | None) -> list[str]:
    out = []
    while f is not None:
        out.append(_text(f)[1])
        f = f.f_back
    if limit is not None:
        out = out[:limit] if limit >= 0 else out[limit:]  # as traceback counts: innermost first
    out.reverse()
    return out


def _kept_text(f: Any) -> list[str]:
    """The stack from frame ``f`` outwards as Paddle keeps it, outermost first, as one
    string (Paddle joins the list it is given): the frames :func:`user_frames` can keep
    (the user's, installed packages', this package's), Paddle's, the standard library's
    and frozen modules' left out; the innermost frame alone when none is kept
    (user_frames then finds it internal, as it would the whole stack).
    """
    return _shared("".join([h[1] for h in _kept_frames(f)]))


def _kept(f: Any) -> tuple[list[str], tuple[SourceFrame, ...]]:
    """:func:`_kept_text` of ``f``, and the same frames as :func:`parse_call_stacks`
    reads them back from the dump; one walk."""
    hits = _kept_frames(f)
    return _shared("".join([h[1] for h in hits])), tuple([h[3] for h in hits])


def _kept_frames(f: Any) -> list[tuple[Any, str, bool, SourceFrame]]:
    """:func:`_text` of the frames from ``f`` outwards that a stack keeps, outermost first.

    Every frame is walked on every call: keeping the previous call's frames to stop
    the walk where the stacks meet would keep the locals of the frames that have
    returned since (tensors) alive until the next op, or the backward.
    """
    texts = _FRAME_TEXT
    out = []
    g = f
    while g is not None:
        co = g.f_code
        hit = texts.get((id(co), g.f_lasti))
        if hit is None or hit[0] is not co:
            hit = _text(g)
        if hit[2]:
            out.append(hit)
        g = g.f_back
    if not out:
        out.append(_text(f))
    out.reverse()
    return out


def _shared(text: str) -> list[str]:
    """The one list holding ``text`` that Paddle is handed (see :data:`_SHARED`)."""
    shared = _SHARED.get(text)
    if shared is None:
        shared = [text]
        if len(_SHARED) < _SHARED_MAX:
            _SHARED[text] = shared
    return shared


#: True: the dump is read on every captured backward, what :func:`_after` noted
#: filling only the nodes it leaves without a stack (for tests)
_FORCE_DUMP = False
_CALL_CODE, _OP_CODE = opcalls.CALL_CODES
# (id of the wrapper's frame, the frames) of the last stack Paddle asked for from inside a
# wrapped op call; the wrapper empties it before each call, _after reads it
_PENDING = opcalls.pending
# node address -> (its grad node, the frames that made it; None: a node that was there
# before the call that met it, a parameter's or an input's). Noted by the wrapped op
# calls while armed; the grad nodes are held (so no address is reused while a note can
# be read) until the next backward starts (forget) or the last holder disarms.
_RECORDS: dict[int, tuple[Any, tuple[SourceFrame, ...] | None]] = {}
_ACCUMULATION = "GradNodeAccumulation"
_MAX_MADE = 64  # grad nodes one op call may be found to make (linear: 2; amp casts a few more)


def _input_nodes(args: tuple, kwargs: dict) -> dict[int, Any]:
    """Address -> grad node of the tensors among an op call's arguments."""
    out = {}
    for t in tensors_in((args, kwargs)):
        gn = grad_fn(t)
        if gn is not None:
            out[gn.node_ptr()] = gn
    return out


def _before(args: tuple, kwargs: dict) -> dict[int, Any]:
    """Before an in-place op: its inputs' nodes, which the call replaces on them."""
    try:
        return _input_nodes(args, kwargs)
    except Exception:
        return {}


def _after(out: Any, args: tuple, kwargs: dict, known: dict[int, Any] | None, frame: Any) -> None:
    """An op call returned ``out``: note the stack from ``frame`` (its caller) outwards,
    as :func:`_kept` gives it, for every grad node the call made. Those are its
    outputs' nodes and the nodes between them and its inputs' nodes (``linear``
    makes Matmul and Add; amp adds casts), a parameter's accumulation node excluded.
    A node noted already, or met before as an input or a parameter's, was there
    before the call. ``known``: the inputs' nodes before an in-place call (which
    gives its input a new node). Never raises (the forward goes on)."""
    try:
        records = _RECORDS
        if out is None and known is not None and args:  # x[i] = v: the new node is x's
            out = args[0]
        if type(out) is _TENSOR:  # most ops: one output
            gn = grad_fn(out)
            if gn is None:
                return
            p = gn.node_ptr()
            if p in records:
                return
            if known is None:
                for a in args:
                    if a is out:  # an input given back as it is
                        return
            elif p in known:
                return
            new = [(p, gn)]
            seen = {p}
        else:
            new = []
            seen = set()
            for t in tensors_in(out):
                gn = grad_fn(t)
                if gn is None:
                    continue
                p = gn.node_ptr()
                if p in seen or p in records or p in (known or ()):
                    continue
                if known is None and any(t is a for a in args):
                    continue
                seen.add(p)
                new.append((p, gn))
            if not new:
                return
        head = 0
        while head < len(new) and len(new) < _MAX_MADE:
            for nxt in new[head][1].next_functions:
                if nxt is None:
                    continue
                p = nxt.node_ptr()
                if p in seen or p in records:
                    continue
                if known is None:
                    known = _input_nodes(args, kwargs)
                if p in known or nxt.name() == _ACCUMULATION:
                    records[p] = (nxt, None)  # there before the call: looked at once
                    continue
                seen.add(p)
                new.append((p, nxt))
            head += 1
        pending = _PENDING[0]
        if pending is not None and pending[0] == id(sys._getframe(1)):
            frames = pending[1]  # what Paddle was given inside the call
        else:
            frames = _kept(frame)[1]
        for p, gn in new:
            records[p] = (gn, frames)
    except Exception:  # never break the forward
        pass


def noted(nodes: list[Node], ptrs: list[int | None], program_note: str) -> tuple[dict[int, tuple], bool]:
    """What the wrapped op calls noted for the op nodes of a walk (address -> frames),
    and whether every node :func:`apply_stacks` would look up has a note (then no
    dump is needed). False as well with :data:`_FORCE_DUMP`."""
    records = _RECORDS
    made: dict[int, tuple] = {}
    whole = not _FORCE_DUMP
    for n, p in zip(nodes, ptrs):
        if n.kind != "op" or n.source is not None:
            continue
        r = records.get(p) if p is not None else None
        if r is not None and r[1] is not None:
            made[p] = r[1]
        elif not (n.note == program_note or n.op == "Dy2St"):
            whole = False
    return made, whole


def drop_notes() -> None:
    """A capture ended: when no holder is left, every note goes (and the grad nodes it holds)."""
    with _LOCK:
        if _ARMED == 0:
            _RECORDS.clear()


def has_notes() -> bool:
    """Whether notes wait for their backward (a forward noted while the flag was held)."""
    return bool(_RECORDS)


def forget(ptrs: Iterable[int | None] | None = None) -> None:
    """A backward starts: the notes (and the grad nodes they hold) of the nodes it walked
    (``ptrs``) go, those of graphs still waiting for their backward stay (two forwards,
    then two backwards); every note goes when the walked nodes are not known (None)."""
    if ptrs is None:
        _RECORDS.clear()
        return
    for p in ptrs:
        _RECORDS.pop(p, None)


def with_notes(stacks: dict[int, list[SourceFrame]] | None,
               made: dict[int, tuple] | None) -> dict[int, Any] | None:
    """The dump's stacks (None: no dump read), the nodes it left without one given
    what the wrapped op calls noted for them."""
    if not made:
        return stacks
    if stacks is None:
        return dict(made)
    for p, frames in made.items():
        if not stacks.get(p):
            stacks[p] = frames
    return stacks


def arm(notes: bool = True) -> bool:
    """Record forward call stacks from now on (one more holder); False when it could not.

    ``notes``: this holder wants every op call noted (:func:`_after`); with no
    such holder only ``conv2d`` and ``add_n`` calls are (a capture whose notes
    missed a node reads the dump anyway). Its :func:`disarm` says the same.

    Whatever raises on the way (a Ctrl-C included), nothing stays patched
    unless the holder was counted (its :func:`disarm` then puts it back).
    """
    global _NOTERS
    with _LOCK, held_interrupts():
        ok = _arm_locked()
        if ok and notes:
            _NOTERS += 1
        if ok:
            opcalls.set_narrow(_NOTERS == 0)
    return ok


def _arm_locked() -> bool:
    global _ARMED, _PREVIOUS
    try:
        if _ARMED == 0:
            _PREVIOUS = int(paddle.get_flags(FLAG)[FLAG])
            if _PREVIOUS < 3:
                paddle.set_flags({FLAG: 3})
            if traceback.format_stack is _ORIGINAL_FORMAT:
                traceback.format_stack = _format_stack
            _RECORDS.clear()
            opcalls.listen(sources=(_before, _after))
        _ARMED += 1
        return True
    except BaseException as exc:
        if _ARMED == 0:
            _release()
        if isinstance(exc, Exception):
            return False
        raise


def disarm(notes: bool = True) -> None:
    """One holder less (``notes`` as it was armed); the last one puts the user's flag
    value back.

    Safe to call again after an interrupt cut it short: what is still
    patched when no holder is left is put back then.
    """
    global _ARMED, _NOTERS
    with _LOCK, held_interrupts():
        if _ARMED > 0:
            _ARMED -= 1
            if notes and _NOTERS > 0:
                _NOTERS -= 1
            opcalls.set_narrow(_NOTERS == 0)
        if _ARMED == 0:
            _release()


def _release() -> None:
    """No holder is left: put back everything :func:`arm` changed (idempotent)."""
    global _PREVIOUS, _NOTERS
    if traceback.format_stack is _format_stack:
        traceback.format_stack = _ORIGINAL_FORMAT
    _NOTERS = 0
    opcalls.unlisten(sources=True)
    opcalls.set_narrow(False)
    # the notes stay: a forward noted before the flag went (two forwards, then two
    # backwards) keeps them for its backward (forget drops each as its backward starts;
    # the next first arm drops what is left)
    _FRAME_TEXT.clear()
    _CALLERS.clear()
    if _PREVIOUS is not None:
        if _PREVIOUS < 3:
            paddle.set_flags({FLAG: _PREVIOUS})
        _PREVIOUS = None  # after: a second call puts it back if this one was cut short


def armed() -> bool:
    """Whether some capture holds the flag on now."""
    return _ARMED > 0


# the dump path's position in the arguments of run_backward and run_partial_grad
_DUMP_ARG = {"backward": 3, "grad": 8}


class StackDump:
    """A temporary folder for Paddle's dump of one backward, and the stacks read from it."""

    def __init__(self) -> None:
        self.dir: str | None = None

    def inject(self, entry: str, args: tuple) -> tuple:
        """``args`` of the backward call with the dump folder in place; unchanged
        when the user gave a dump path of their own (then nothing is read)."""
        at = _DUMP_ARG.get(entry)
        if at is None:
            return args
        if len(args) > at and args[at]:
            return args  # the user's own dump: theirs alone
        self.dir = tempfile.mkdtemp(prefix="pvh-stacks-")
        if len(args) > at:
            return args[:at] + (self.dir,) + args[at + 1:]
        return args + (None,) * (at - len(args)) + (self.dir,)

    def read(self) -> dict[int, list[SourceFrame]] | None:
        """Node address -> its forward stack as Paddle recorded it (every frame); None without a dump."""
        if self.dir is None:
            return None
        names = [f for f in os.listdir(self.dir) if f.endswith("_call_stack.log")]
        if not names:
            return None
        stacks: dict[int, list[SourceFrame]] = {}
        for name in names:
            with open(os.path.join(self.dir, name), encoding="utf-8", errors="replace") as fh:
                stacks.update(parse_call_stacks(fh.read()))
        return stacks

    def collect(self) -> dict[int, list[SourceFrame]] | None:
        """:meth:`read`, then the folder removed; None (never an error) when nothing
        could be read (or no dump was made)."""
        try:
            return self.read()
        except Exception:
            return None
        finally:
            d, self.dir = self.dir, None
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)


_HEADER = re.compile(r"\S+ ptr : (0x[0-9a-fA-F]+) call stack:")
_FIRST = re.compile(r'(.*)", line (\d+), in (.*)$')
_CARETS = re.compile(r"^\s*[\^~]+\s*$")


def parse_call_stacks(text: str) -> dict[int, list[SourceFrame]]:
    """Paddle's ``*_call_stack.log``: node address -> frames (outermost first), each with its code line.

    Each node is ``GradNodeBase <Name> ptr : 0x<address> call stack:`` then
    ``traceback.format_stack`` text; a stack's text, repeated by every node
    made by the same line (a layer's ops in every block of a stack of blocks),
    and a frame's, repeated by every node made under it, are parsed once.

    Examples:
        >>> log = "\\n".join(["GradNodeBase TanhGradNode ptr : 0x1f call stack: ",
        ...     '  File "/src/train.py", line 40, in <module>', "    loss = net(x)",
        ...     '  File "/src/model.py", line 19, in squash', "    h = paddle.tanh(h)", ""])
        >>> parse_call_stacks(log)[0x1f][-1]
        SourceFrame(file='/src/model.py', line=19, function='squash', code='h = paddle.tanh(h)')
    """
    stacks: dict[int, list[SourceFrame]] = {}
    parsed: dict[str, SourceFrame | None] = {}
    bodies: dict[str, list[SourceFrame]] = {}
    for block in text.split("GradNodeBase ")[1:]:
        head, _, body = block.partition("\n")
        m = _HEADER.match(head)
        if m is None:
            continue
        known = bodies.get(body)
        if known is None:
            known = bodies[body] = []
            for chunk in body.split('  File "')[1:]:
                f = parsed.get(chunk, False)
                if f is False:
                    f = parsed[chunk] = _frame(chunk)
                if f is not None:
                    known.append(f)
        stacks.setdefault(int(m.group(1), 16), []).extend(known)
    return stacks


def _frame(chunk: str) -> SourceFrame | None:
    """One frame of ``traceback.format_stack`` text, after its ``  File "``."""
    first, _, rest = chunk.partition("\n")
    m = _FIRST.match(first)
    if m is None:
        return None
    code = ""
    for line in rest.split("\n"):
        if line.startswith("    ") and not _CARETS.match(line):
            code = line.strip()
            break
    return SourceFrame(m.group(1), int(m.group(2)), m.group(3), code)


#: this package's files whose frames run inside the user's forward (op calls, layer calls)
_INSIDE_FILES = (opcalls.FILE, attribution.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _dirs() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Folders of (Paddle and this package, the standard library, installed packages)."""
    paths = sysconfig.get_paths()
    never = (os.path.dirname(os.path.abspath(paddle.__file__)) + os.sep, _OWN_DIR)
    stdlib = {os.path.abspath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if paths.get(k)}
    installed = {os.path.abspath(paths[k]) for k in ("purelib", "platlib") if paths.get(k)}
    try:
        installed.update(os.path.abspath(p) for p in site.getsitepackages())
        installed.add(os.path.abspath(site.getusersitepackages()))
    except Exception:
        pass
    return never, tuple(stdlib), tuple(d + os.sep for d in installed)


_NEVER, _STDLIB, _INSTALLED = _dirs()
# Paddle's own model definitions (``paddle.vision.models``, the Transformer layers built of
# other layers): their lines say where in a model an op was made, as a model library's do
# (``Model.fit`` of ``paddle.vision.models.LeNet`` otherwise gave every op the ``fit`` line)
_PADDLE_MODELS = tuple(os.path.join(_NEVER[0], *p) for p in (("vision", "models", ""), ("nn", "layer", "transformer.py")))


_USER, _NOT_USER, _INSTALLED_PKG, _OWN = 0, 1, 2, 3
_KINDS: dict[str, int] = {}  # file -> one of the above (a few hundred files at most)


def _kind(file: str) -> int:
    """Whose a frame's file is: the user's, never the user's (Paddle, this package, the
    standard library: an installed package under its folder, as in a system Python, is no
    part of it), an installed package's (Paddle's model definitions count as one); this
    package is also told apart."""
    k = _KINDS.get(file)
    if k is None:
        path = file if file.startswith("<") else os.path.abspath(file)
        if path.startswith(_OWN_DIR):
            k = _OWN
        elif path.startswith(_PADDLE_MODELS):
            k = _INSTALLED_PKG
        elif path.startswith(("<frozen ", *_NEVER)) or (path.startswith(_STDLIB) and not path.startswith(_INSTALLED)):
            k = _NOT_USER
        elif path.startswith(_INSTALLED):
            k = _INSTALLED_PKG
        else:
            k = _USER
        if len(_KINDS) > 10000:
            _KINDS.clear()
        _KINDS[file] = k
    return k


def users_file(file: str) -> bool:
    """Whether a frame of ``file`` can be a source line: the user's code or an installed
    package's (a model library), not Paddle's, this package's or the standard library's."""
    return _kind(file) in (_USER, _INSTALLED_PKG)


def user_frames(frames: list[SourceFrame], after_own: bool = False) -> tuple[SourceFrame, ...]:
    """The frames of the user's code among ``frames`` (outermost first).

    Args:
        frames: a stack as Paddle recorded it.
        after_own: keep only the frames after the last frame of this package
            (a recomputed forward runs inside a backward this package started:
            what came before is the step's ``backward()`` call, not the block).
    """
    kinds = [_kind(f.file) for f in frames]
    if after_own:
        last = max((i for i, k in enumerate(kinds) if k == _OWN), default=-1)
        frames, kinds = frames[last + 1:], kinds[last + 1:]
    out: list[SourceFrame] = []
    for f, k in zip(frames, kinds):
        if k in (_NOT_USER, _OWN):
            continue
        if not out and k == _INSTALLED_PKG:
            continue  # a launcher before the user's first own frame
        out.append(f)
    if not out:  # only installed packages: the user's code is one of them
        out = [f for f, k in zip(frames, kinds) if k == _INSTALLED_PKG]
    return tuple(out)


def apply_stacks(nodes: list[Node], ptrs: list[int | None], stacks: dict[int, list[SourceFrame]] | None,
                 program_note: str, nested: bool = False) -> None:
    """Give every op node of a walk its source, or the reason it has none.

    Args:
        nodes, ptrs: the walk's nodes and their grad node addresses.
        stacks: what :meth:`StackDump.read` gave; None: not recorded.
        program_note: ``Node.note`` of ops opened from a to_static program.
        nested: the walk is a backward run inside another (a recomputed forward).
    """
    cache: dict[tuple, tuple[SourceFrame, ...]] = {}
    for n, p in zip(nodes, ptrs):
        if n.kind != "op" or n.source is not None:
            continue
        if n.note == program_note or n.op == "Dy2St":  # Paddle records no stack for a program's run
            n.source_note = "static"
            continue
        raw = stacks.get(p) if stacks is not None and p is not None else None
        if not raw:  # no dump, or a node made while the flag was off (a forward run before the block)
            n.source_note = "backward" if made_by_backward(n.name) else "unrecorded"
            continue
        key = tuple(raw)
        frames = cache.get(key)
        if frames is None:
            frames = cache[key] = user_frames(raw, after_own=nested)
        if frames:
            n.source = frames
        else:  # a stack of Paddle's and the standard library's frames only
            n.source_note = "internal"


def prefix_recomputed(at: Node, nodes: list[Node]) -> None:
    """A recomputed block's ops (a nested backward's walk) are called from where its
    PyLayer was made: that node's frames go in front of theirs."""
    if at.source is None:
        return
    for n in nodes:
        if n.kind == "op" and n.source is not None:
            n.source = at.source + n.source
