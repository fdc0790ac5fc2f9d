"""Per-step files on disk: ``step_000100.png``, ``.svg``, ``.dot``, ``.json``."""

from __future__ import annotations

import os
import tempfile

from .._fileio import atomic_write
from ..escape import safe_filename

__all__ = ["StepFiles", "step_stem"]


def step_stem(step: int, suffix: str = "") -> str:
    """File stem for a step, sorting by step: ``step_000100`` (+ ``_suffix``)."""
    stem = f"step_{int(step):06d}"
    return f"{stem}_{safe_filename(suffix)}" if suffix else stem


class StepFiles:
    """Writes artefacts of captured steps into one directory, atomically.

    Args:
        directory: created if missing.

    Raises:
        OSError: the directory cannot be created or written.
    """

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=self.directory, prefix=".probe-", delete=True)
        probe.close()

    def path(self, step: int, ext: str, suffix: str = "") -> str:
        return os.path.join(self.directory, f"{step_stem(step, suffix)}.{safe_filename(ext)}")

    def write(self, step: int, ext: str, data: bytes | str, suffix: str = "") -> str:
        """Write one artefact; returns its path. Partial files never remain."""
        return atomic_write(self.path(step, ext, suffix), data)
