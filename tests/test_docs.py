"""The README and the user guide: the site builds with no broken link or reference, and every
code block marked runnable runs.

A block is runnable when the line before its opening fence is ``<!-- runnable -->`` (invisible
on GitHub and in the built site). Each runs in a fresh interpreter in an empty folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
MARK = "<!-- runnable -->"
BLOCK = re.compile(r"^<!-- runnable -->\n```python\n(.*?)^```", re.S | re.M)
PICTURES = REPO / "docs" / "pictures.py"


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of every runnable block in a Markdown text.

    Examples:
        >>> runnable_blocks("x\\n<!-- runnable -->\\n```python\\nprint(1)\\n```\\n```python\\nno\\n```\\n")
        [(2, 'print(1)\\n')]
    """
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def markdown_files() -> list[Path]:
    return [REPO / "README.md"] + sorted(DOCS.rglob("*.md"))


def _cases():
    for path in markdown_files():
        for line, code in runnable_blocks(path.read_text()):
            yield pytest.param(code, id=f"{path.relative_to(REPO)}:{line}")


def test_every_marked_block_is_found():
    """A marker not followed by a python fence would silently skip a snippet."""
    for path in markdown_files():
        text = path.read_text()
        assert text.count(MARK) == len(runnable_blocks(text)), f"{path}: a {MARK} not followed by ```python"


@pytest.mark.parametrize("code", list(_cases()))
def test_runnable_snippet(code, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"snippet failed:\n{code}\n--- stderr ---\n{r.stderr[-3000:]}"


def test_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: a broken link, a missing page or an unresolved API reference fails
    (not ``-q``: it hides the warnings that strict mode counts)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").exists()
    assert not (tmp_path / "site" / "pictures.py").exists()  # the pictures' script is not published
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "BackwardGraphRecorder" in api
    import paddleviz_hooks

    listed = set(re.findall(r"^::: paddleviz_hooks\.[\w.]*?\.?(\w+)$", (DOCS / "reference" / "api.md").read_text(), re.M))
    assert set(paddleviz_hooks.__all__) - {"__version__"} <= listed, (
        f"public names missing from docs/reference/api.md: {sorted(set(paddleviz_hooks.__all__) - {'__version__'} - listed)}")
    assert not re.findall(r":(?:class|meth|func|attr):<", api)  # docstrings' Sphinx roles shown as code


def test_pictures_shown_are_made_by_the_script():
    """Every picture the README and the guide show is one that docs/pictures.py writes."""
    made = set(re.findall(r'"(\w+\.png)"', PICTURES.read_text()))
    for path in markdown_files():
        for target in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", path.read_text()):
            assert Path(target).name in made, f"{path.relative_to(REPO)} shows {target}, which docs/pictures.py does not make"


def test_readme_links_point_at_files():
    """The README is read on a code host, not built by MkDocs: its relative links are checked here."""
    text = (REPO / "README.md").read_text()
    for target in re.findall(r"\]\((?!https?:|#)([^)#\s]+)", text):
        assert (REPO / target).exists(), f"README links to {target}, which does not exist"


FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def heading_anchors(text: str) -> set[str]:
    """The ids MkDocs gives a page's headings (Python-Markdown's ``toc`` slugify; code spans are
    plain text there).

    Examples:
        >>> sorted(heading_anchors("# A page\\n## In `Model.fit`\\n### Very deep: one, two\\n"))
        ['a-page', 'in-modelfit', 'very-deep-one-two']
    """
    from markdown.extensions.toc import slugify

    text = FENCE.sub("", text)
    return {slugify(h.replace("`", ""), "-") for h in re.findall(r"^#{1,6} +(.+?) *$", text, re.M)}


def test_relative_links_and_anchors_resolve():
    """Every relative link of the README and the docs names a file that exists, and its ``#anchor``
    a heading of that page (MkDocs' strict mode does not fail on a missing anchor: a guide page
    split in two left "see ... below" pointing at nothing)."""
    bad = []
    for path in markdown_files():
        text = FENCE.sub("", path.read_text())
        for target, anchor in re.findall(r"\]\((?!https?:|mailto:)([^)#\s]*)(?:#([^)\s]+))?\)", text):
            page = (path.parent / target).resolve() if target else path
            where = f"{path.relative_to(REPO)} -> {target}{'#' + anchor if anchor else ''}"
            if not page.exists():
                bad.append(f"{where}: no such file")
            elif anchor and page.suffix == ".md" and anchor not in heading_anchors(page.read_text()):
                bad.append(f"{where}: no such heading")
    assert not bad, "\n".join(bad)


def test_no_page_repeats_its_title_as_a_subheading():
    for path in sorted(DOCS.rglob("*.md")):
        heads = re.findall(r"^(#{1,2}) +(.+?) *$", FENCE.sub("", path.read_text()), re.M)
        if len(heads) >= 2 and heads[0][0] == "#" and heads[1][0] == "##":
            title, sub = (h[1].replace("`", "").lower() for h in heads[:2])
            assert not sub.startswith(title.split(":")[0]), f"{path.relative_to(REPO)}: '## {heads[1][1]}' repeats the title"


def _options_table() -> dict[str, str]:
    """option -> its default as the guide's options table writes it (the code span's text)."""
    text = (DOCS / "guide" / "capture.md").read_text()
    table = text.split("| option | default | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, re.M)
    assert rows, "no options table in docs/guide/capture.md"
    return dict(rows)


def test_options_table_matches_the_signatures():
    """The guide's options table names every option of the recorder and the callback, with the
    default the code has (a new option, or a default changed, fails here until the table says it)."""
    import ast
    import inspect

    from paddleviz_hooks import BackwardGraphCallback, BackwardGraphRecorder
    from paddleviz_hooks.options import RecorderOptions
    from paddleviz_hooks.recorder import option_names

    table = _options_table()
    params = {p.name: p.default for p in inspect.signature(BackwardGraphRecorder.__init__).parameters.values()
              if p.name != "self" and p.kind is not p.VAR_KEYWORD}
    assert set(table) == set(params), (f"missing from the table: {sorted(set(params) - set(table))}; "
                                       f"not an option: {sorted(set(table) - set(params))}")
    for name, default in params.items():
        assert ast.literal_eval(table[name]) == default, f"{name}: the table says {table[name]}, the code {default!r}"
    fields = {f.name: f.default for f in RecorderOptions.__dataclass_fields__.values()}
    for name, default in fields.items():  # the checked options' own defaults (every/steps: None means "say nothing")
        if name not in ("every", "steps"):
            assert ast.literal_eval(table[name]) == default, f"RecorderOptions.{name}: {default!r}, the table {table[name]}"
    cb = inspect.signature(BackwardGraphCallback.__init__).parameters
    for name in ("log_dir", "every", "steps"):
        assert ast.literal_eval(table[name]) == cb[name].default, f"BackwardGraphCallback {name}"
    listed = set(re.findall(r"``(\w+)``", BackwardGraphCallback.__doc__.split("The model is")[0]))
    assert set(option_names()) - {"model"} <= listed, (
        f"BackwardGraphCallback's docstring omits {sorted(set(option_names()) - {'model'} - listed)}")


def test_results_are_documented_where_help_shows_them():
    """``help(BackwardGraphRecorder)`` names what a run recorded (plain attributes, not properties:
    only the class docstring shows them), and the callback forwards each of them."""
    import pydoc

    from paddleviz_hooks import BackwardGraphCallback, BackwardGraphRecorder

    results = ("captured_steps", "triggers", "lost_steps", "undrawn_steps", "dropped_steps", "run_dir")
    attributes = BackwardGraphRecorder.__doc__.split("Attributes:", 1)
    assert len(attributes) == 2, "BackwardGraphRecorder's docstring has no Attributes section"
    shown = pydoc.render_doc(BackwardGraphRecorder, renderer=pydoc.plaintext)
    cb = pydoc.render_doc(BackwardGraphCallback, renderer=pydoc.plaintext)
    for name in results:
        assert re.search(rf"^\s+{name}: ", attributes[1], re.M), f"{name} is not in the Attributes section"
        assert name in shown
        assert isinstance(getattr(BackwardGraphCallback, name, None), property), f"BackwardGraphCallback.{name}"
        assert name in cb
    assert "renderer was busy" not in cb  # dropped steps are refused because the writer stopped
