"""``rlhfc explain``: what the compiler decided and what it predicts, in five formats.

:func:`build_report` (:mod:`.report`) prices, simulates and checks the module after the passes and
returns a :class:`Report`; :func:`render` turns it into text (:mod:`.text`), JSON (:mod:`.jsonout`), a
self-contained HTML page (:mod:`.html`), Graphviz source (:mod:`.dot`) or the predicted timeline as Chrome
trace events (:mod:`.trace`, the layout of ``rlhf run --trace``).
"""

from __future__ import annotations

from .report import Report, build_report, device_groups, fmt_bytes, fmt_seconds, ids_text

FORMATS = ("text", "json", "html", "dot", "trace")

__all__ = ["FORMATS", "Report", "build_report", "render", "fmt_seconds", "fmt_bytes", "device_groups", "ids_text"]


def render(report: Report, fmt: str) -> str:
    if fmt == "text":
        from .text import render_text
        return render_text(report)
    if fmt == "json":
        from .jsonout import render_json
        return render_json(report)
    if fmt == "html":
        from .html import render_html
        return render_html(report)
    if fmt == "dot":
        from .dot import render_dot
        return render_dot(report)
    if fmt == "trace":
        from .trace import render_trace
        return render_trace(report)
    raise ValueError(f"unknown format {fmt!r}: {', '.join(FORMATS)}")
