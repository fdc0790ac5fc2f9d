"""Writing files so that a reader never sees a partial one; reading inputs of a bounded size."""

from __future__ import annotations

import errno
import os
import stat
import tempfile

__all__ = ["MAX_INPUT_BYTES", "atomic_write", "read_input"]


def _umask() -> int:
    """The process umask, read without changing it (os.umask would race with threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def atomic_write(path: str, data: bytes | str) -> str:
    """Write ``data`` to ``path`` through a temporary file and a rename.

    Returns:
        ``path``.

    Raises:
        OSError: the directory is missing, unwritable or full; no partial
            file is left behind. Its ``filename`` is ``path`` (never the
            temporary file, which the caller never asked for), its
            ``strerror`` the reason.

    Examples:
        >>> import tempfile
        >>> missing = os.path.join(tempfile.mkdtemp(), "gone", "report.html")
        >>> try:
        ...     atomic_write(missing, "x")
        ... except OSError as exc:
        ...     exc.filename == missing, exc.strerror.startswith("No such file or directory (making a new file in ")
        (True, True)
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    except OSError as exc:  # where the refusal came from: the folder, not the file (which may not exist)
        raise _naming(exc, path, f" (making a new file in {directory})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; honour the umask
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise _naming(exc, path) from None
        raise
    return path


def _naming(exc: OSError, path: str, where: str = "") -> OSError:
    """The same error (same class and errno: ``except PermissionError`` still catches it) about
    ``path``, the file the caller asked for, instead of a temporary file next to it."""
    if exc.errno is None:
        return OSError(f"cannot write {path}: {exc}{where}")
    return OSError(exc.errno, (exc.strerror or os.strerror(exc.errno)) + where, path)


#: The largest step JSON the command line and the report read (bytes). A capture of
#: 10,000 nodes is about 3.5 MB; 32 MiB is about 75,000 nodes, past which reading,
#: diffing and drawing no longer finish in minutes on a laptop.
MAX_INPUT_BYTES = 32 * 1024 * 1024


def read_input(path: str, max_bytes: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``, checked before anything is read.

    Raises:
        OSError: the file is missing or unreadable; it is not a regular file
            (a FIFO or device would block or never end).
        ValueError: it is larger than ``max_bytes`` (the message says how to
            raise the limit).
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, socket or device)"
        raise OSError(errno.EINVAL, f"it is {kind}", path)
    if st.st_size > max_bytes:
        raise ValueError(f"{path} is {st.st_size / 2**20:,.0f} MiB, over the {max_bytes / 2**20:,.0f} MiB limit "
                         "for one graph (raise it with --max-input-mb N, or collapse before saving)")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # swapped for a FIFO after the check: no hang
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(errno.EINVAL, "it is not a regular file", path)
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew after the check
        raise ValueError(f"{path} is over the {max_bytes / 2**20:,.0f} MiB limit for one graph "
                         "(raise it with --max-input-mb N)")
    return data
