"""Graphviz source of the stage graph (``--format dot``): one box per stage (op, model, placement, predicted
time), data edges labelled with the value, dashed parameter-version edges ``[+d]``, overlap groups as
clusters. Render with ``dot -Tsvg``."""

from __future__ import annotations

import json

from rlhfc.ir.plan import overlap_group, stream_chunk

from .report import Report, fmt_seconds

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7")


def _q(text: str) -> str:
    return json.dumps(text)


def model_colours(report: Report) -> dict[str, str]:
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(report.module.models)}


def render_dot(report: Report) -> str:
    m = report.module
    colours = model_colours(report)
    per_node = m.cluster.per_node
    lines = [f"digraph {_q(m.name)} {{", "  rankdir=LR;", '  node [shape=box, style="rounded,filled", '
             'fontname="Helvetica", fontsize=10];', '  edge [fontname="Helvetica", fontsize=9];',
             f"  label={_q(f'{m.name}: predicted {fmt_seconds(report.sim.step_time_s)} per step')};"]
    groups: dict = {}
    for s in m.graph.stages:
        g = overlap_group(s)
        if g is not None:
            groups.setdefault(g, []).append(s)
    grouped = {s.name for ss in groups.values() for s in ss}

    def node(s, indent="  "):
        c = report.costs[s.name]
        cpu = report.module.cluster.device == "cpu"
        where = c.layout.describe(per_node) + "\\n" + c.layout.parallel_text(cpu) if c.layout else "driver"
        label = f"%{s.name}\\n{s.op}" + (f" @{c.model}" if c.model else "") + f"\\n{where}\\n{fmt_seconds(c.time_s)}"
        if stream_chunk(s):
            label += f"\\nstream chunk {stream_chunk(s)}"
        fill = colours.get(c.model or "", "#dddddd") if c.model else "#eeeeee"
        font = "white" if c.model else "black"
        return f'{indent}{_q(s.name)} [label="{label}", fillcolor="{fill}", fontcolor="{font}"];'

    for g, ss in sorted(groups.items()):
        lines.append(f"  subgraph cluster_overlap_{g} {{")
        lines.append(f"    label={_q(f'overlap {g}')}; style=dashed;")
        lines += [node(s, "    ") for s in ss]
        lines.append("  }")
    lines += [node(s) for s in m.graph.stages if s.name not in grouped]
    producers = {id(v): s for s in m.graph.stages for v in s.outputs}
    for s in m.graph.stages:
        for v in s.inputs:
            p = producers.get(id(v))
            if p is not None:
                lines.append(f"  {_q(p.name)} -> {_q(s.name)} [label={_q('%' + v.name)}];")
    for e in m.graph.versions:
        lines.append(f"  {_q(e.writer)} -> {_q(e.reader)} [style=dashed, color=gray40, constraint=false, "
                     f"label={_q(f'@{e.model} [+{e.distance}]')}];")
    lines.append("}")
    return "\n".join(lines) + "\n"
