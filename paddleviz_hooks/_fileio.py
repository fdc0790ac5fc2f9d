"""Writing files so that a reader never sees a partial one."""

from __future__ import annotations

import os
import tempfile

__all__ = ["atomic_write"]


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
            file is left behind.
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; honour the umask
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
