"""The report's merged view of a multi-rank run: one entry per step captured on 2 or more ranks.

A run whose folder has ``rank_K`` subfolders (the recorder's folders for
rank K; the run folder itself holds rank 0) gets one more entry in the
report's run selector, ``<run>: ranks 0, 1 merged``. Each of its steps shows
the merged drawing (:func:`paddleviz_hooks.render.render_ranks`: per-rank
gradient norms on every edge, nodes not on every rank marked), and a panel
with the comparison in words, the gradient norm of every parameter on each
rank, and the nodes that are not on every rank. Each rank's own drawing stays
in its own run entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..escape import html_escape as _e
from ..graph import BackwardGraph
from ..ranks import RankView, compare_ranks
from ..text import describe_node, fmt_num, rank_presence, rank_view_lines

__all__ = ["MergedStep", "MergedRun", "merged_run", "merged_panel", "merged_overview", "merged_chart"]


@dataclass
class MergedStep:
    """One step captured on several ranks; ``svg``/``problem`` are filled by the report's drawing jobs."""

    number: int
    graphs: dict[int, BackwardGraph]
    view: RankView
    svg: str | None = None
    problem: str | None = None


@dataclass
class MergedRun:
    """The merged view of one run over its ranks."""

    name: str
    ranks: list[int]
    steps: list[MergedStep] = field(default_factory=list)


def merged_run(name: str, steps_by_rank: dict[int, dict[int, BackwardGraph]]) -> MergedRun | None:
    """The steps captured on 2 or more of the ranks, each matched across them.

    Args:
        name: the run's name in the report.
        steps_by_rank: rank -> step number -> that rank's graph.

    Returns:
        A :class:`MergedRun`, or None when no step was captured on 2 ranks.
    """
    ranks = sorted(steps_by_rank)
    numbers = sorted({s for by_step in steps_by_rank.values() for s in by_step})
    run = MergedRun(f"{name}: ranks {', '.join(str(r) for r in ranks)} merged", ranks)
    for s in numbers:
        graphs = {r: steps_by_rank[r][s] for r in ranks if s in steps_by_rank[r]}
        if len(graphs) >= 2:
            run.steps.append(MergedStep(s, graphs, compare_ranks(graphs)))
    return run if run.steps else None


def _row(name: str, values: dict[int, float], ranks: list[int]) -> str:
    cells = "".join(f'<td class="num" data-rank="{r}">{_e(fmt_num(values.get(r), 4))}</td>' for r in ranks)
    return f"<tr><td>{_e(name)}</td>{cells}</tr>"


def _table(title: str, css: str, table: dict[str, dict[int, float]], ranks: list[int]) -> str:
    head = "".join(f"<th>r{r}</th>" for r in ranks)
    body = "".join(_row(name, table[name], ranks) for name in sorted(table))
    return (f'<h3>{_e(title)}</h3><table class="ranks {css}"><thead><tr><th>parameter</th>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>")


def _differences(view: RankView) -> str:
    rows = []
    for r, d in view.diffs.items():
        for keys, where in ((d.added_nodes, rank_presence(only=r)), (d.removed_nodes, rank_presence([r]))):
            for key in keys[:40]:
                info = d.node_info.get(key)
                rows.append(f'<li><span class="badge bad">{_e(where)}</span> '
                            f"{_e(describe_node(info) if info else key)} <code>{_e(key)}</code></li>")
            if len(keys) > 40:
                rows.append(f'<li class="muted">and {len(keys) - 40} more</li>')
    return f'<ul class="nodes ranks">{"".join(rows)}</ul>' if rows else ""


def merged_panel(run: MergedRun, ri: int, si: int) -> str:
    """The side panel of one merged step (element id ``panel-<ri>-<si>``, as the report's others)."""
    st = run.steps[si]
    v = st.view
    cls = "bad" if v.structure_differs else "same"
    out = [f'<section class="step-panel" id="panel-{ri}-{si}" hidden>',
           f"<h2>step {_e(st.number)}</h2>",
           f'<h3 class="{cls} ranks">Across ranks {_e(", ".join(str(r) for r in v.ranks))}</h3>',
           f'<ul class="facts ranks">{"".join(f"<li>{_e(x)}</li>" for x in rank_view_lines(v))}</ul>',
           _differences(v)]
    if v.local_param_norms:
        out.append(_table("Gradient norm per parameter, after all-reduce", "applied", v.param_norms, v.ranks))
        out.append(_table("Each rank's own gradient norm (before all-reduce)", "local", v.local_param_norms, v.ranks))
    elif v.param_norms:
        out.append(_table("Gradient norm per parameter", "applied", v.param_norms, v.ranks))
    if st.problem:
        out.append(f'<p class="bad">Drawing problem: {_e(st.problem)}</p>')
    out.append("</section>")
    return "".join(out)


def merged_overview(run: MergedRun, ri: int) -> str:
    """The steps at which the ranks' graphs differ, as jump buttons (element id ``overview-<ri>``)."""
    differ = [f'<button class="jump" data-run="{ri}" data-step="{si}">{_e(st.number)}</button>'
              for si, st in enumerate(run.steps) if st.view.structure_differs]
    body = (f'<p>{" ".join(differ)}</p>' if differ else '<p class="muted">The same structure on every rank at every step.</p>')
    return f'<div class="overview" id="overview-{ri}" hidden><h3 class="{"bad" if differ else ""}">Ranks differ in structure at steps</h3>{body}</div>'


def merged_chart(run: MergedRun, ri: int) -> str:
    """Global gradient norm per step and rank, a table (element id ``chart-<ri>``)."""
    head = "".join(f"<th>r{r}</th>" for r in run.ranks)
    rows = "".join(
        f"<tr><td>{_e(st.number)}</td>"
        + "".join(f'<td class="num">{_e(fmt_num(st.view.global_norms.get(r), 4))}</td>' for r in run.ranks)
        + "</tr>" for st in run.steps)
    return (f'<div id="chart-{ri}" hidden><h3>Global gradient norm per rank</h3><table class="ranks global">'
            f"<thead><tr><th>step</th>{head}</tr></thead><tbody>{rows}</tbody></table></div>")
