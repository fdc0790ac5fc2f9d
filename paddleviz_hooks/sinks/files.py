"""Per-step files on disk: ``step_000100.png``, ``.svg``, ``.dot``, ``.json``.

A run folder has one writer at a time and is never written over: the writer
holds a lock on ``.writer.lock`` in it for as long as it writes (removed when
it is done), and a folder
that another live writer holds, or that already keeps recorded files (an
earlier run, an earlier ``Model.fit``, a recorder opened again), is left as
it is: the next free ``<folder>_2``, ``<folder>_3``... is used instead
(:func:`claim_run_dir`). Temporary files a killed writer left behind
(``.tmp-*``, ``.probe-*``, the drawing process's log and half-made pictures
in ``.pending``) are removed when a folder nobody holds is looked at.
"""

from __future__ import annotations

import os
import tempfile

from .._fileio import atomic_write
from ..escape import safe_filename

__all__ = ["StepFiles", "step_stem", "claim_run_dir", "LOCK_NAME"]

LOCK_NAME = ".writer.lock"
_TEMP_PREFIXES = (".tmp-", ".probe-")
#: entries of a run folder that are no recorded data
_NOT_RECORDS = (LOCK_NAME, ".pending")


def step_stem(step: int, suffix: str = "") -> str:
    """File stem for a step, sorting by step: ``step_000100`` (+ ``_suffix``)."""
    stem = f"step_{int(step):06d}"
    return f"{stem}_{safe_filename(suffix)}" if suffix else stem


def _lock(directory: str, opened: list):
    """An open, exclusively locked ``.writer.lock`` of ``directory``, or None when another
    live process holds it. Where locks are not supported the folder counts as free.
    The file is added to ``opened`` as it is opened (the caller closes them all on failure)."""
    opened.append(open(os.path.join(directory, LOCK_NAME), "a+b"))  # one line: nothing in between
    f = opened[-1]
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the folder's contents still decide
        return f
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    except OSError:  # a file system without locks
        pass
    return f


def _release(directory: str, lock) -> None:
    """Give a held folder back: its lock file goes (the folder keeps the run's files only)."""
    try:
        os.unlink(os.path.join(directory, LOCK_NAME))
    except OSError:
        pass
    lock.close()


def _clean_temporaries(directory: str) -> list[str]:
    """Remove what a killed writer left half-written in ``directory`` and its ``graphs/``
    and ``.pending`` folders (never in the ``rank_K`` folders of other processes): in
    ``.pending``, everything but the captures' JSON waiting to be drawn (its pictures half
    made, the drawing process's log), and the folder itself once empty."""
    removed = []
    for sub in ("", "graphs", ".pending"):
        top = os.path.join(directory, sub)
        for root, dirs, names in os.walk(top):
            if sub == "":
                dirs[:] = []  # only the folder itself
            for name in names:
                if name.startswith(_TEMP_PREFIXES) or (sub == ".pending" and not name.endswith(".json")):
                    try:
                        os.unlink(os.path.join(root, name))
                        removed.append(os.path.join(root, name))
                    except OSError:
                        pass
    try:
        os.rmdir(os.path.join(directory, ".pending"))  # only when empty
    except OSError:
        pass
    return removed


def _holds_records(directory: str) -> bool:
    for name in os.listdir(directory):
        if name in _NOT_RECORDS or name.startswith(_TEMP_PREFIXES):
            continue
        if name.startswith("rank_") and os.path.isdir(os.path.join(directory, name)):
            continue  # another rank's own folder
        return True
    return False


def claim_run_dir(directory: str, limit: int = 1000, opened: list | None = None):
    """The folder this writer may write in: ``directory`` or the first free ``directory_N``.

    Args:
        directory: the folder asked for (created if missing).
        opened: every lock file opened on the way is added to it (so a caller
            interrupted anywhere can close them all).

    Returns:
        ``(path, lock)``: the folder claimed and the open lock file that
        holds it (close it when done writing).

    Raises:
        OSError: no folder could be created or locked.
    """
    base = os.path.abspath(directory)
    opened = [] if opened is None else opened
    for n in range(1, limit + 1):
        path = base if n == 1 else f"{base}_{n}"
        os.makedirs(path, exist_ok=True)
        lock = _lock(path, opened)
        if lock is None:
            continue  # another live writer holds it
        _clean_temporaries(path)
        if not _holds_records(path):
            return path, lock
        _release(path, lock)  # an earlier run's folder: left exactly as it was
    raise OSError(f"no free run folder next to {base!r} (tried {limit})")


class StepFiles:
    """Writes artefacts of captured steps into one directory, atomically.

    Args:
        directory: created if missing.
        lock: the open lock file holding ``directory`` (see
            :func:`claim_run_dir`); closed by :meth:`close`.

    Raises:
        OSError: the directory cannot be created or written.
    """

    def __init__(self, directory: str, lock=None) -> None:
        self.directory = os.path.abspath(directory)
        self._lock = lock
        os.makedirs(self.directory, exist_ok=True)
        try:
            probe = tempfile.NamedTemporaryFile(dir=self.directory, prefix=".probe-", delete=True)
        except OSError as exc:  # about the folder asked for, not the probe file's made-up name
            raise OSError(exc.errno, exc.strerror, self.directory) if exc.errno else exc from None
        probe.close()

    def path(self, step: int, ext: str, suffix: str = "") -> str:
        return os.path.join(self.directory, f"{step_stem(step, suffix)}.{safe_filename(ext)}")

    def write(self, step: int, ext: str, data: bytes | str, suffix: str = "") -> str:
        """Write one artefact; returns its path. Partial files never remain."""
        return atomic_write(self.path(step, ext, suffix), data)

    def close(self) -> None:
        """Let the folder go (another writer may claim it; it keeps the files); a folder the
        run wrote nothing into goes too (a step that recorded nothing leaves no empty run folder)."""
        lock = self._lock
        if lock is not None:  # forgotten only once released: a second call finishes an interrupted one
            _release(self.directory, lock)
            self._lock = None
            try:
                os.rmdir(self.directory)  # only when empty
            except OSError:
                pass
