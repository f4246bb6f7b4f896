"""A self-contained HTML page (``--format html``): stage graph and timelines drawn as inline SVG.

Nothing is fetched from the network: styles, drawings and the one small script
live in the page. The script measures the drawn SVGs after layout and writes
what it found into ``<pre id="render-check">`` (tests load the page in a
headless browser and read it back).
"""

from __future__ import annotations

import html

from rlhfc.ir.plan import stream_chunk

from .report import Report, device_groups, fmt_bytes, fmt_seconds, ids_text, search_summary
from .dot import model_colours

DRIVER_COLOUR = "#9aa0a6"


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _graph_svg(report: Report) -> str:
    m = report.module
    stages = m.graph.stages
    producers = {id(v): s for s in stages for v in s.outputs}
    depth: dict[str, int] = {}
    for s in stages:
        preds = [producers[id(v)].name for v in s.inputs if id(v) in producers]
        depth[s.name] = 1 + max((depth[p] for p in preds), default=-1)
    layers: dict[int, list] = {}
    for s in stages:
        layers.setdefault(depth[s.name], []).append(s)
    w, h, gx, gy, pad = 150, 58, 60, 18, 20
    pos = {}
    for d, ss in layers.items():
        for i, s in enumerate(ss):
            pos[s.name] = (pad + d * (w + gx), pad + i * (h + gy))
    width = pad * 2 + (max(layers) + 1) * (w + gx) - gx
    height = pad * 2 + max(len(ss) for ss in layers.values()) * (h + gy) - gy
    colours = model_colours(report)
    per_node = m.cluster.per_node
    cpu = m.cluster.device == "cpu"
    out = [f'<svg data-check="graph" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" style="max-width:100%;height:auto" role="img" aria-label="stage graph">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>']
    for s in stages:
        for v in s.inputs:
            p = producers.get(id(v))
            if p is None:
                continue
            x1, y1 = pos[p.name][0] + w, pos[p.name][1] + h / 2
            x2, y2 = pos[s.name][0], pos[s.name][1] + h / 2
            mx = (x1 + x2) / 2
            out.append(f'<path class="edge" d="M{x1},{y1} C{mx},{y1} {mx},{y2} {x2 - 2},{y2}" fill="none" '
                       f'stroke="#777" stroke-width="1.2" marker-end="url(#arrow)"><title>%{_e(v.name)}</title></path>')
    for e in m.graph.versions:
        if e.writer not in pos or e.reader not in pos:
            continue
        x1, y1 = pos[e.writer][0] + w / 2, pos[e.writer][1] + h
        x2, y2 = pos[e.reader][0] + w / 2, pos[e.reader][1] + h
        out.append(f'<path class="version" d="M{x1},{y1} Q{(x1 + x2) / 2},{max(y1, y2) + 40} {x2},{y2}" fill="none" '
                   f'stroke="#aaa" stroke-dasharray="4 3"><title>@{_e(e.model)} [+{e.distance}]</title></path>')
    for s in stages:
        c = report.costs[s.name]
        x, y = pos[s.name]
        fill = colours.get(c.model or "", DRIVER_COLOUR) if c.model else DRIVER_COLOUR
        where = f"{c.layout.describe(per_node)}" if c.layout else "driver"
        out.append(f'<g class="node"><rect x="{x}" y="{y}" width="{w}" height="{h}" rx="7" fill="{fill}" '
                   f'opacity="0.92"/><text x="{x + 8}" y="{y + 17}" font-weight="bold">%{_e(s.name)}</text>'
                   f'<text x="{x + 8}" y="{y + 32}">{_e(s.op)}{" @" + _e(c.model) if c.model else ""}</text>'
                   f'<text x="{x + 8}" y="{y + 47}">{_e(where)} · {_e(fmt_seconds(c.time_s))}</text>'
                   f'<title>%{_e(s.name)}: {_e(s.op)}, {_e(where)}'
                   f'{", " + _e(c.layout.parallel_text(cpu)) if c.layout else ""}, {_e(fmt_seconds(c.time_s))}'
                   f'{", stream chunk " + str(stream_chunk(s)) if stream_chunk(s) else ""}</title></g>')
    out.append("</svg>")
    return "\n".join(out)


def _bars_svg(report: Report, rows: list[tuple[str, list]], check: str) -> str:
    """A Gantt chart: one row per (label, [(start, end, colour, title)])."""
    sim = report.sim
    t_end = max(sim.makespan_s, 1e-12)
    label_w, plot_w, row_h, top = 170, 760, 22, 28
    width = label_w + plot_w + 20
    height = top + row_h * len(rows) + 10
    sx = plot_w / t_end
    out = [f'<svg data-check="{check}" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{check}">']
    for i in range(6):
        t = t_end * i / 5
        x = label_w + t * sx
        out.append(f'<line x1="{x}" y1="{top - 6}" x2="{x}" y2="{height - 6}" stroke="#e3e3e3"/>'
                   f'<text x="{x}" y="{top - 10}" text-anchor="middle" class="tick">{_e(fmt_seconds(t) if t else "0")}'
                   f'</text>')
    for k, (a, b) in enumerate(sim.step_spans):
        x = label_w + a * sx
        out.append(f'<line x1="{x}" y1="{top - 4}" x2="{x}" y2="{height - 6}" stroke="#888" stroke-dasharray="2 3"/>'
                   f'<text x="{x + 3}" y="{height - 8}" class="tick">step {k + 1}</text>')
    for r, (label, bars) in enumerate(rows):
        y = top + r * row_h
        out.append(f'<text x="4" y="{y + 15}">{_e(label)}</text>')
        for a, b, colour, title in bars:
            out.append(f'<rect class="bar" x="{label_w + a * sx:.2f}" y="{y + 3}" '
                       f'width="{max((b - a) * sx, 1.0):.2f}" height="{row_h - 6}" rx="2" fill="{colour}">'
                       f'<title>{_e(title)}</title></rect>')
    out.append("</svg>")
    return "\n".join(out)


def _stage_rows(report: Report) -> list:
    colours = model_colours(report)
    rows = []
    for s in report.module.graph.stages:
        bars = []
        for t in report.sim.tasks:
            if t.stage != s.name:
                continue
            colour = colours.get(t.model or "", DRIVER_COLOUR) if t.model else DRIVER_COLOUR
            spans = [(a, b) for a, b, _ in t.chunks] if t.chunks else [(t.start, t.end)]
            for a, b in spans:
                bars.append((a, b, colour, f"%{s.name} step {t.step + 1}: {fmt_seconds(a)} - {fmt_seconds(b)}"))
        rows.append((f"%{s.name}", bars))
    return rows


def _device_rows(report: Report) -> list:
    colours = model_colours(report)
    rows = []
    for ids, _ in device_groups(report):
        first = ids[0]
        bars = []
        for t in report.sim.tasks:
            if t.devices and t.devices[0] <= first < t.devices[0] + t.devices[1]:
                spans = [(a, b) for a, b, _ in t.chunks] if t.chunks else [(t.start, t.end)]
                for a, b in spans:
                    bars.append((a, b, colours.get(t.model or "", DRIVER_COLOUR),
                                 f"%{t.stage} step {t.step + 1} on devices {ids_text(ids)}"))
        rows.append((f"devices {ids_text(ids)}", bars))
    driver = [(t.start, t.end, DRIVER_COLOUR, f"%{t.stage} step {t.step + 1}") for t in report.sim.tasks
              if t.devices is None]
    rows.append(("driver", driver))
    return rows


def _memory_svg(report: Report) -> str:
    groups = device_groups(report)
    colours = model_colours(report)
    cap = max(max(d.capacity_bytes, d.peak_memory_bytes) for _, d in groups)
    label_w, plot_w, row_h = 170, 560, 22
    width, height = label_w + plot_w + 160, 10 + row_h * len(groups)
    sx = plot_w / cap
    out = [f'<svg data-check="memory" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="memory per device">']
    for r, (ids, d) in enumerate(groups):
        y = 5 + r * row_h
        x = label_w
        out.append(f'<text x="4" y="{y + 15}">devices {_e(ids_text(ids))}</text>')
        for key, val in sorted(d.static.items()):
            model = key.split()[0].lstrip("@")
            out.append(f'<rect class="bar" x="{x:.2f}" y="{y + 3}" width="{val * sx:.2f}" height="{row_h - 6}" '
                       f'fill="{colours.get(model, DRIVER_COLOUR)}" opacity="{0.55 if "grads" in key else 0.9}">'
                       f'<title>{_e(key)} {_e(fmt_bytes(val))}</title></rect>')
            x += val * sx
        transient = d.peak_memory_bytes - sum(d.static.values())
        out.append(f'<rect class="bar" x="{x:.2f}" y="{y + 3}" width="{max(transient * sx, 0):.2f}" '
                   f'height="{row_h - 6}" fill="#bbb"><title>activations / KV at the peak '
                   f'{_e(fmt_bytes(transient))}</title></rect>')
        cx = label_w + d.capacity_bytes * sx
        over = d.peak_memory_bytes > d.capacity_bytes
        out.append(f'<line x1="{cx:.2f}" y1="{y}" x2="{cx:.2f}" y2="{y + row_h}" stroke="#c00" stroke-width="2"/>'
                   f'<text x="{label_w + plot_w + 8}" y="{y + 15}" fill="{"#c00" if over else "#333"}">'
                   f'{_e(fmt_bytes(d.peak_memory_bytes))} / {_e(fmt_bytes(d.capacity_bytes))}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _table(report: Report) -> str:
    per_node = report.module.cluster.per_node
    head = "".join(f"<th>{h}</th>" for h in ("stage", "op", "model", "devices", "parallel", "time",
                                              "memory / device", "bound", "source"))
    rows = []
    for s in report.module.graph.stages:
        c = report.costs[s.name]
        rows.append("<tr>" + "".join(f"<td>{_e(x)}</td>" for x in (
            f"%{s.name}", s.op, f"@{c.model}" if c.model else "-",
            c.layout.describe(per_node) if c.layout else "driver",
            c.layout.parallel_text(report.module.cluster.device == "cpu") if c.layout else "-", fmt_seconds(c.time_s),
            fmt_bytes(c.total_bytes) if c.layout else "-", c.bound or "-", c.source)) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


STYLE = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; border-bottom: 1px solid #ddd; }
svg { font-size: 11px; font-family: inherit; } svg text.tick { fill: #666; font-size: 10px; }
.node text { fill: white; font-size: 11px; }
table { border-collapse: collapse; font-size: 12px; } td, th { padding: 3px 9px; border-bottom: 1px solid #eee;
text-align: left; } .summary { font-size: 14px; } .diag { color: #b00; white-space: pre-wrap; }
pre { background: #f7f7f7; padding: 8px; font-size: 11px; overflow-x: auto; } .legend span { margin-right: 14px; }
.legend i { display: inline-block; width: 11px; height: 11px; margin-right: 4px; vertical-align: middle; }
"""

CHECK = """
(function () {
  var out = [];
  var svgs = document.querySelectorAll('svg[data-check]');
  for (var i = 0; i < svgs.length; i++) {
    var s = svgs[i], box = s.getBBox();
    out.push(s.getAttribute('data-check') + ':' + s.querySelectorAll('.bar, .node').length + ':' +
             Math.round(box.width) + 'x' + Math.round(box.height));
  }
  document.getElementById('render-check').textContent = out.join(' ');
})();
"""


def render_html(report: Report) -> str:
    m = report.module
    sim = report.sim
    colours = model_colours(report)
    legend = "".join(f'<span><i style="background:{c}"></i>@{_e(n)}</span>' for n, c in colours.items()
                     if m.graph.stages_on(n)) + f'<span><i style="background:{DRIVER_COLOUR}"></i>driver</span>'
    b = sim.bottleneck
    diag = "".join(f'<p class="diag">error: {_e(i.message)}\nhint: {_e(i.hint)}</p>' for i in report.issues)
    notes = "".join(f"<li>{_e(n)}</li>" for n in report.notes)
    passes = "".join(f"<details><summary>after {_e(r.spec)}{'' if r.changed else ' (no change)'}</summary>"
                     f"<pre>{_e(r.after)}</pre></details>" for r in report.records)
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>rlhfc explain: {_e(m.name)}</title><style>{STYLE}</style></head><body>",
        f"<h1>rlhfc explain: @{_e(m.name)}</h1>",
        f'<p class="summary">Predicted step time <b>{_e(fmt_seconds(sim.step_time_s))}</b> on cluster '
        f'{_e(report.device_label())}; -{_e(report.level or "custom")} '
        f'(passes: {_e(", ".join(report.passes) or "none")}).'
        + (f" Bottleneck: %{_e(b['stage'])} ({_e(b['op'])}), {b['share'] * 100:.0f}% of the step, "
           f"{_e(b['bound'])}-bound. {_e(b.get('hint', ''))}" if b else "") + "</p>",
        f'<p class="summary">{_e(search_summary(report))}.</p>' if report.search else "",
        f'<p class="legend">{legend}</p>', diag,
        "<h2>Stage graph</h2>", _graph_svg(report),
        "<h2>Timeline by stage</h2>", _bars_svg(report, _stage_rows(report), "timeline"),
        "<h2>Timeline by device</h2>", _bars_svg(report, _device_rows(report), "devices"),
        "<h2>Placement</h2>", _table(report),
        "<h2>Memory per device (peak)</h2>", _memory_svg(report),
        f"<h2>Notes</h2><ul>{notes or '<li>none</li>'}</ul>",
        f"<h2>IR</h2>{passes}<details open><summary>final IR</summary><pre>{_e(report.ir)}</pre></details>",
        '<pre id="render-check">not rendered</pre>',
        f"<script>{CHECK}</script>", "</body></html>",
    ]
    return "\n".join(parts) + "\n"
