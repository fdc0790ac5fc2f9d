"""Every escaping rule, in one place.

Layer names, op names, parameter names and user tags come from models and
users. Whatever view they reach, characters that could hide or reorder the
text around them (controls, bidi overrides and isolates, zero-width and other
invisible format characters) are first made visible as ``\\u202e``
(:func:`visible`, :func:`visible_data`). They reach DOT source
(:func:`dot_quote`, :func:`dot_label`),
Graphviz HTML-like labels (:func:`dot_html_table`), HTML pages
(:func:`html_escape`), JSON inside ``<script>`` (:func:`json_for_script`),
VisualDL tags (:func:`vdl_tag`), VisualDL graph node and folder names
(:func:`vdl_graph_name`) and file names (:func:`safe_filename`) only
through these helpers; SVG drawn by the layout engine is inlined into pages
only after :func:`clean_svg` (an allowlist) accepted it. Nothing else of the
package is imported here.
"""

from __future__ import annotations

import html
import json
import re
import unicodedata
from typing import Any, Iterable, Mapping
from xml.etree import ElementTree

__all__ = [
    "clean_svg",
    "dot_attrs",
    "dot_html_table",
    "dot_label",
    "dot_quote",
    "html_escape",
    "json_for_script",
    "markdown_literal",
    "safe_filename",
    "shorten",
    "vdl_graph_name",
    "vdl_tag",
    "visible",
    "visible_data",
]

MAX_TEXT = 120
# kept as they are: zero-width (non-)joiners, which some scripts and emoji need
_KEEP = {"\u200c", "\u200d"}
# controls (Cc), line/paragraph separators (Zl, Zp), invisible format characters (Cf: bidi marks,
# embeddings, overrides and isolates, zero-width space, word joiner, BOM, tags...), unassigned
# and private-use code points, surrogates
_HIDDEN_CATEGORIES = {"Cc", "Cf", "Zl", "Zp", "Cn", "Co", "Cs"}
# a candidate is any character outside printable ASCII; its category decides
_CANDIDATE = re.compile(r"[^\x20-\x7e]")
_CANDIDATE_BUT_LINES = re.compile(r"[^\x20-\x7e\n]")


def _shown(m: re.Match) -> str:
    ch = m.group()
    c = ord(ch)
    if ch in _KEEP or unicodedata.category(ch) not in _HIDDEN_CATEGORIES or 0xE000 <= c <= 0xF8FF or c >= 0xF0000:
        return ch  # letters of any script, symbols, private-use icons
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" if c < 0x10000 else f"\\U{c:08x}"


def visible(text: Any, *, lines: bool = False) -> str:
    """``text`` with every character that could hide or reorder what is read made visible.

    Controls, bidi embeddings, overrides, isolates and marks, zero-width
    spaces and other invisible format characters become ``\\x07``,
    ``\\u202e``..., so a right-to-left override in a layer name cannot make
    ``1.07`` read ``70.1``. Newlines stay when ``lines`` is true.

    Examples:
        >>> print(visible("fc.weight\\u202e 1.07"))
        fc.weight\\u202e 1.07
        >>> visible("a\\nb", lines=True) == "a\\nb"
        True
    """
    return (_CANDIDATE_BUT_LINES if lines else _CANDIDATE).sub(_shown, str(text))


def visible_data(data: Any) -> Any:
    """JSON-like data with :func:`visible` applied to every string (keys included; newlines kept)."""
    if isinstance(data, str):
        return visible(data, lines=True)
    if isinstance(data, dict):
        return {visible_data(k): visible_data(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [visible_data(v) for v in data]
    return data


#: Hover text holds a node's forward call stack (a few frames with their code lines)
MAX_TOOLTIP = 1500
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def shorten(text: str, limit: int = MAX_TEXT) -> str:
    """Cut very long text to ``limit`` characters with an ellipsis in the middle."""
    text = str(text)
    if len(text) <= limit:
        return text
    half = (limit - 1) // 2
    return text[:half] + "\u2026" + text[-(limit - 1 - half):]


def _clean_line(text: str) -> str:
    return visible(str(text).replace("\t", " ").replace("\r", " ").replace("\n", " "))


def _dot_text(text: str) -> str:
    """One line of text as the inside of a DOT double-quoted string, shown literally."""
    # Graphviz decodes HTML entities in every string (&amp; &#60; shown as & <): & is written as one
    return text.replace("&", "&amp;").replace("\\", "\\\\").replace('"', '\\"')


def dot_quote(text: str, limit: int = MAX_TEXT) -> str:
    """A DOT double-quoted string holding ``text`` literally (one line).

    Backslashes are doubled so Graphviz escapes such as ``\\N`` or ``\\l``
    cannot be injected; quotes are escaped; ``&`` is written as ``&amp;`` (Graphviz
    decodes entities such as ``&amp;`` or ``&#60;`` in any string); newlines become spaces.

    Examples:
        >>> dot_quote('a"b'), dot_quote("x&amp;y")
        ('"a\\\\"b"', '"x&amp;amp;y"')
    """
    return '"' + _dot_text(_clean_line(shorten(text, limit))) + '"'


def dot_label(*lines: str) -> str:
    """A DOT quoted label whose lines are each escaped (as :func:`dot_quote`) and centred."""
    return '"' + "\\n".join(_dot_text(_clean_line(shorten(line))) for line in lines) + '"'


def dot_attrs(attrs: Mapping[str, Any]) -> str:
    """``key="value", ...`` for a DOT attribute list, every value quoted
    (a ``tooltip`` may be longer than other text, up to ``MAX_TOOLTIP``).

    Examples:
        >>> print(dot_attrs({"label": 'say "hi"', "color": "red"}))
        label="say \\"hi\\"", color="red"
    """
    return ", ".join(f"{k}={dot_quote(v, MAX_TOOLTIP if k == 'tooltip' else MAX_TEXT)}" for k, v in attrs.items())


def dot_html_table(title: str, rows: Iterable[tuple[Mapping[str, str], str]], *, spacing: int = 1) -> str:
    """A Graphviz HTML-like label: a bold title, then one row per (swatch, text).

    Args:
        title: the first row, in bold.
        rows: ``(swatch cell attributes, text)``; an empty attribute dict
            makes the text span both columns.
        spacing: ``CELLSPACING`` of the table.

    Examples:
        >>> dot_html_table("legend", [({"BGCOLOR": "#ff0000"}, "a <b>")])[:40]
        '<<TABLE BORDER="0" CELLBORDER="0" CELLSP'
        >>> "a &lt;b&gt;" in dot_html_table("legend", [({}, "a <b>")])
        True
    """
    cells = [f'<TR><TD COLSPAN="2"><B>{html_escape(title)}</B></TD></TR>']
    for swatch, text in rows:
        if swatch:
            attrs = " ".join(f'{k}="{html_escape(v)}"' for k, v in swatch.items())
            cells.append(f'<TR><TD {attrs} WIDTH="14"></TD><TD ALIGN="LEFT">{html_escape(text)}</TD></TR>')
        else:
            cells.append(f'<TR><TD COLSPAN="2" ALIGN="LEFT">{html_escape(text)}</TD></TR>')
    return (f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="{int(spacing)}" CELLPADDING="2">'
            + "".join(cells) + "</TABLE>>")


def html_escape(text: Any) -> str:
    """Escape text for HTML element content and quoted attributes (hidden characters made :func:`visible`).

    Examples:
        >>> html_escape('<a href="x">')
        '&lt;a href=&quot;x&quot;&gt;'
    """
    return html.escape(visible(text, lines=True), quote=True)


def markdown_literal(text: Any) -> str:
    """Text shown as it is by a Markdown renderer (TensorBoard's text tab): an indented
    code block, so line breaks stay and nothing in it is read as markup or HTML.

    Examples:
        >>> markdown_literal("a <b>\\n*c*")
        '    a <b>\\n    *c*'
    """
    return "\n".join("    " + line for line in visible(_CONTROL.sub(" ", str(text)), lines=True).splitlines())


def json_for_script(data: Any) -> str:
    """JSON that can sit inside ``<script type="application/json">`` (every string made :func:`visible`).

    ``<``, ``>`` and ``&`` are written as ``\\u003c`` etc., so no text can end
    the script element.

    Examples:
        >>> json_for_script({"name": "</script>"})
        '{"name":"\\\\u003c/script\\\\u003e"}'
    """
    text = json.dumps(visible_data(data), ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


# \w is Unicode-aware: layer names in any script stay readable (VisualDL
# stores and serves non-ASCII tags fine; only '%' breaks it)
_TAG_UNSAFE = re.compile(r"[^\w.\-/~]+")


def vdl_tag(text: str) -> str:
    """A VisualDL tag from arbitrary text (no ``%``, no spaces, no ``..``).

    Letters, digits, ``_ . - / ~`` stay (``~`` sorts our groups last).

    Examples:
        >>> vdl_tag("grad norm/../50%")
        'grad_norm/_/50_'
    """
    tag = _TAG_UNSAFE.sub("_", str(text)).replace("..", "_").strip("/")
    return tag[:120] or "unnamed"


# VisualDL's Graphs page puts node names and graph folder paths into query
# strings without encoding them: only unreserved URL characters survive
_GRAPH_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def vdl_graph_name(text: str, limit: int = 60) -> str:
    """A node name (or folder name) for VisualDL's Graphs tab from arbitrary text.

    ASCII letters, digits, ``_`` and ``-`` only (no ``/``, ``.``, ``&``,
    ``#``, ``+``, ``%`` or spaces), never empty.

    Examples:
        >>> vdl_graph_name("PyLayer:My Op+1"), vdl_graph_name("../")
        ('PyLayer_My_Op_1', 'unnamed')
    """
    text = unicodedata.normalize("NFKD", str(text)).encode("ascii", "ignore").decode()
    return _GRAPH_UNSAFE.sub("_", text).strip("_")[:limit] or "unnamed"


_UNSAFE_FILE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_filename(text: str, limit: int = 80) -> str:
    """A file-name component made from arbitrary text.

    Never empty, never ``.``/``..``, no path separators, ASCII only.

    Examples:
        >>> safe_filename("../../etc/passwd")
        'etc_passwd'
    """
    text = unicodedata.normalize("NFKD", str(text)).encode("ascii", "ignore").decode()
    text = _UNSAFE_FILE.sub("_", text).strip("._-")
    text = text[:limit].strip("._-")
    return text or "unnamed"


# --------------------------------------------------------------------------
# SVG from the layout engine, before it is inlined into a page
# --------------------------------------------------------------------------
_SVG = "http://www.w3.org/2000/svg"
_XLINK = "http://www.w3.org/1999/xlink"
#: The elements Graphviz writes; anything else (script, foreignObject,
#: animate, set, use, image...) makes the SVG unfit.
SVG_ELEMENTS = frozenset({
    "svg", "g", "title", "desc", "polygon", "polyline", "path", "ellipse", "circle", "line",
    "rect", "text", "tspan", "a", "defs", "lineargradient", "radialgradient", "stop",
})
#: Attributes (local names) Graphviz writes on those elements.
SVG_ATTRIBUTES = frozenset({
    "id", "class", "width", "height", "viewbox", "version", "preserveaspectratio", "transform",
    "points", "d", "cx", "cy", "rx", "ry", "r", "x", "y", "x1", "y1", "x2", "y2", "fill", "stroke",
    "stroke-width", "stroke-dasharray", "stroke-opacity", "fill-opacity", "stroke-linecap",
    "stroke-linejoin", "stroke-miterlimit", "font-family", "font-size", "font-weight",
    "font-style", "text-anchor", "text-decoration", "href", "title", "target", "style", "offset",
    "stop-color", "stop-opacity", "gradientunits", "gradienttransform", "opacity", "space",
})
_CSS_URL = re.compile(r"url\s*\(|expression|@import|javascript:", re.I)


def clean_svg(text: str) -> str | None:
    """The ``<svg>`` element of an engine's SVG output, or None if it is unfit to inline.

    An allowlist: only elements and attributes the layout engine writes are
    accepted; links may only point inside the document (``#id``); a style
    attribute may not load anything. Text and attribute values are escaped
    by the engine and may say anything.

    Examples:
        >>> clean_svg('<svg xmlns="http://www.w3.org/2000/svg"><g id="a"/></svg>')
        '<svg xmlns="http://www.w3.org/2000/svg"><g id="a"/></svg>'
        >>> clean_svg('<svg xmlns="http://www.w3.org/2000/svg"><set attributeName="href" to="javascript:x()"/></svg>') is None
        True
    """
    start = text.find("<svg")
    end = text.rfind("</svg>")
    if start < 0 or end < start:
        return None
    svg = text[start:end + len("</svg>")]  # no prolog or DOCTYPE (hence no entity definitions)
    try:
        root = ElementTree.fromstring(svg)
    except ElementTree.ParseError:
        return None
    for el in root.iter():
        if not isinstance(el.tag, str):
            return None
        ns, _, local = el.tag[1:].partition("}") if el.tag.startswith("{") else ("", "", el.tag)
        if ns not in ("", _SVG) or local.lower() not in SVG_ELEMENTS:
            return None
        for name, value in el.attrib.items():
            ans, _, alocal = name[1:].partition("}") if name.startswith("{") else ("", "", name)
            if ans not in ("", _XLINK, "http://www.w3.org/XML/1998/namespace"):
                return None
            alocal = alocal.lower()
            if alocal not in SVG_ATTRIBUTES:
                return None
            if alocal == "href" and not value.startswith("#"):
                return None
            if alocal == "style" and _CSS_URL.search(value):
                return None
    return svg
