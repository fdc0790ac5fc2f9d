"""escape.py: the one module that escapes, and its allowlist SVG sanitiser."""

from __future__ import annotations

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
