"""Escaping of untrusted text, in one place.

Layer names, op names, parameter names and user tags come from models and
users; they reach DOT source, HTML and file names only through these helpers.
"""

from __future__ import annotations

import html
import re
import unicodedata

__all__ = ["dot_quote", "dot_label", "html_escape", "safe_filename", "shorten"]

MAX_TEXT = 120
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def shorten(text: str, limit: int = MAX_TEXT) -> str:
    """Cut very long text to ``limit`` characters with an ellipsis in the middle."""
    text = str(text)
    if len(text) <= limit:
        return text
    half = (limit - 1) // 2
    return text[:half] + "\u2026" + text[-(limit - 1 - half):]


def _clean_line(text: str) -> str:
    return _CONTROL.sub("?", str(text).replace("\t", " "))


def dot_quote(text: str) -> str:
    """A DOT double-quoted string holding ``text`` literally (one line).

    Backslashes are doubled so Graphviz escapes such as ``\\N`` or ``\\l``
    cannot be injected; quotes are escaped; newlines become spaces.

    Example:
        >>> dot_quote('a"b')
        '"a\\\\"b"'
    """
    text = _clean_line(shorten(text)).replace("\r", " ").replace("\n", " ")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def dot_label(*lines: str) -> str:
    """A DOT quoted label whose lines are each escaped and centred."""
    parts = []
    for line in lines:
        text = _clean_line(shorten(line)).replace("\r", " ").replace("\n", " ")
        parts.append(text.replace("\\", "\\\\").replace('"', '\\"'))
    return '"' + "\\n".join(parts) + '"'


def html_escape(text: str) -> str:
    """Escape text for HTML element content and quoted attributes."""
    return html.escape(str(text), quote=True)


_UNSAFE_FILE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_filename(text: str, limit: int = 80) -> str:
    """A file-name component made from arbitrary text.

    Never empty, never ``.``/``..``, no path separators, ASCII only.

    Example:
        >>> safe_filename("../../etc/passwd")
        'etc_passwd'
    """
    text = unicodedata.normalize("NFKD", str(text)).encode("ascii", "ignore").decode()
    text = _UNSAFE_FILE.sub("_", text).strip("._-")
    text = text[:limit].strip("._-")
    return text or "unnamed"
