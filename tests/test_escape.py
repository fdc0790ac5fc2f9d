"""escape.py: the one module that escapes, and its allowlist SVG sanitiser."""

from __future__ import annotations

import pathlib

import pytest

from paddleviz_hooks import BackwardGraph, capture_backward
from paddleviz_hooks.escape import clean_svg, dot_html_table, json_for_script, safe_filename, vdl_tag
from paddleviz_hooks.render import find_engine, render_diff, render_svg

SVG = '<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink">{}</svg>'

UNSAFE = {
    "set href to javascript": '<set attributeName="href" to="javascript:alert(1)"/>',
    "set on a link": '<a xlink:href="#x"><set attributeName="xlink:href" to="javascript:alert(1)"/></a>',
    "animate": '<animate attributeName="href" values="javascript:alert(1)"/>',
    "animateTransform": '<animateTransform attributeName="transform"/>',
    "script": "<script>alert(1)</script>",
    "foreignObject": "<foreignObject><div/></foreignObject>",
    "onclick": '<g onclick="alert(1)"/>',
    "onload on svg": None,  # built below: the attribute sits on the root
    "onmouseover upper case": '<rect ONMOUSEOVER="alert(1)"/>',
    "javascript link": '<a xlink:href="javascript:alert(1)"><text>x</text></a>',
    "data link": '<a href="data:text/html,hi"><text>x</text></a>',
    "external link": '<a xlink:href="https://example.com"><text>x</text></a>',
    "use": '<use xlink:href="#a"/>',
    "image": '<image href="x.png"/>',
    "iframe": "<iframe/>",
    "style url": '<rect style="fill:url(https://x/y)"/>',
    "xhtml namespace": '<g><h:p xmlns:h="http://www.w3.org/1999/xhtml">x</h:p></g>',
    "unknown attribute": '<rect formaction="x"/>',
}


@pytest.mark.parametrize("name", sorted(UNSAFE))
def test_sanitiser_rejects(name):
    body = UNSAFE[name]
    text = ('<svg xmlns="http://www.w3.org/2000/svg" onload="alert(1)"></svg>' if body is None
            else SVG.format(body))
    assert clean_svg(text) is None


def test_sanitiser_keeps_what_graphviz_writes(tmp_path):
    """Real engine output (tooltips, classes, internal links) passes unchanged."""
    if find_engine() is None:
        pytest.skip("no Graphviz engine installed")
    import paddle

    net = paddle.nn.Sequential(paddle.nn.Linear(3, 4), paddle.nn.ReLU(), paddle.nn.Linear(4, 2))
    with capture_backward(net) as cap:
        net(paddle.randn([2, 3])).sum().backward()
        (net(paddle.randn([2, 3])) * 2).sum().backward()
    svg = render_svg(cap.graph).decode("utf-8")
    cleaned = clean_svg(svg)
    assert cleaned is not None and cleaned == svg[svg.index("<svg"):svg.rindex("</svg>") + 6]
    from paddleviz_hooks import diff_graphs

    older, newer = cap.graphs
    diff_svg = render_diff(diff_graphs(older, newer), newer, older, format="svg").decode("utf-8")
    assert clean_svg(diff_svg) is not None


def test_sanitiser_rejects_malformed_and_missing():
    assert clean_svg("no svg here") is None
    assert clean_svg("<svg><g></svg>") is None
    assert clean_svg('<!DOCTYPE x [<!ENTITY e "boom">]><svg xmlns="http://www.w3.org/2000/svg">&e;</svg>') is None


def test_other_escapes():
    assert "</script" not in json_for_script({"x": "</script><script>alert(1)</script>"})
    table = dot_html_table('t<"&>', [({"BGCOLOR": '"red'}, "a<b>&c")])
    assert "a&lt;b&gt;&amp;c" in table and 't&lt;&quot;&amp;&gt;' in table and 'BGCOLOR="&quot;red"' in table
    assert safe_filename("../../etc/passwd") == "etc_passwd"
    assert "%" not in vdl_tag("50% done") and ".." not in vdl_tag("a/../b")


def test_graph_json_keeps_strings_that_look_like_floats():
    g = BackwardGraph(meta={"note": "inf", "loss": float("inf"), "nested": {"v": float("nan"), "s": "nan"}})
    back = BackwardGraph.from_json(g.to_json())
    assert back.meta["note"] == "inf" and back.meta["nested"]["s"] == "nan"
    assert back.meta["loss"] == float("inf")
    assert back.meta["nested"]["v"] != back.meta["nested"]["v"]  # NaN


# --------------------------------------------------------------------------
# hidden characters (issue 28 item 6): controls and bidi overrides made visible in every view
# --------------------------------------------------------------------------
RLO = "\u202e"
HIDDEN = [RLO, "\u2066", "\u200f", "\u200b", "\ufeff", "\x07", "\x85", "\u2028"]


def _bidi_graph() -> BackwardGraph:
    from paddleviz_hooks.graph import Edge, GradMeta, Node

    grad = GradMeta(shape=(4,), dtype="float32", norm=1.07, min=-0.5, max=0.5)
    layer = "fc" + "".join(HIDDEN)
    nodes = [Node(0, "root", "loss", "loss"), Node(1, "op", "MatmulGradNode", "Matmul", layer=layer),
             Node(2, "param", "GradNodeAccumulation", "Parameter", param=f"{layer}.weight", shape=(4,),
                  dtype="float32", grad=grad)]
    return BackwardGraph(nodes, [Edge(0, 1, 0, grad), Edge(1, 2, 0, grad)], layers={"": "Net", layer: "Linear"},
                         meta={"step": 1})


def _strings(data):
    if isinstance(data, str):
        yield data
    elif isinstance(data, dict):
        for k, v in data.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(data, list):
        for v in data:
            yield from _strings(v)


def _assert_visible(text: str, view: str) -> None:
    for ch in HIDDEN:
        assert ch not in text, f"{view}: U+{ord(ch):04X} left as it is"
    assert "\\u202e" in text, f"{view}: the override is not shown"


def test_hidden_characters_are_visible_in_every_view(tmp_path):
    import json

    from paddleviz_hooks.cli import main
    from paddleviz_hooks.render import to_dot
    from paddleviz_hooks.sinks.explorer import export_explorer
    from paddleviz_hooks.sinks.report import build_report
    from paddleviz_hooks.sinks.vdl_graph import write_vdl_graph

    g = _bidi_graph()
    _assert_visible(to_dot(g), "DOT")
    if find_engine() is not None:
        _assert_visible(render_svg(g).decode(), "SVG")
    log = tmp_path / "log"
    log.mkdir()
    (log / "step_000001.json").write_text(g.to_json())
    build_report(str(log), str(tmp_path / "r.html"))
    page = (tmp_path / "r.html").read_text()
    _assert_visible(page, "report")
    data = page.split('<script type="application/json" id="pvh-data">', 1)[1].split("</script>", 1)[0]
    _assert_visible("\n".join(_strings(json.loads(data))), "report data")
    files = export_explorer(g, str(tmp_path / "me"))
    for path in [files.graphs, *files.overlays.values()]:
        text = "\n".join(_strings(json.loads(pathlib.Path(path).read_text(encoding="utf-8"))))
        if path == files.graphs:
            _assert_visible(text, "Model Explorer graph")
        for ch in HIDDEN:
            assert ch not in text, path
    vdl = write_vdl_graph(str(tmp_path / "vdl"), g)
    _assert_visible("\n".join(_strings(json.loads(pathlib.Path(vdl).read_text(encoding="utf-8")))), "VisualDL graph")
    import contextlib
    import io

    out = io.StringIO()
    older = tmp_path / "old.json"
    older.write_text(BackwardGraph([g.nodes[0]], meta={"step": 0}).to_json())
    with contextlib.redirect_stdout(out):
        assert main(["diff", str(older), str(log / "step_000001.json")]) == 0
    _assert_visible(out.getvalue(), "diff summary")
