"""MkDocs hooks of the documentation site (``hooks:`` in ``mkdocs.yml``).

The docstrings cross-reference in Sphinx's style (``:class:`BackwardGraph```,
``:meth:`~StatsQueue.resolve```), which reads well in ``help()`` and in the
source; mkdocstrings renders such a role as its raw name followed by code.
This hook shows the code alone, as Sphinx would (``~``: the last name only).
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:class|meth|func|attr|data|mod|exc|obj):<code>(~?)([^<]*)</code>")


def _shown(m: re.Match) -> str:
    name = m.group(2)
    return f"<code>{name.rsplit('.', 1)[-1] if m.group(1) else name}</code>"


def on_page_content(html: str, **_: object) -> str:
    """Sphinx roles in the rendered page become plain code."""
    return _ROLE.sub(_shown, html)
