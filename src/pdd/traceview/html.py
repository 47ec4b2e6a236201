"""Timeline as one self-contained HTML page: inline SVG Gantt chart plus a span table, no scripts or CDN.

Self-contained so it can be attached to an incident, opened offline, or served as a CI artifact.
Hovering a bar shows every attribute and event (SVG ``<title>``).
"""

from __future__ import annotations

import json
import math
from html import escape

from pdd.traceview.timeline import ERROR_COLOR, Bar, Timeline, human_ms, service_color

LABEL_W, CHART_W, TEXT_W = 280, 860, 300
ROW_H, BAR_H, TOP, BOTTOM = 30, 16, 36, 34


def nice_ticks(total_ms: float, target: int = 8) -> list[float]:
    """Round tick positions (1, 2, 5 × 10^k ms) covering [0, total_ms]."""
    if total_ms <= 0:
        return [0.0]
    raw = total_ms / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(total_ms / step) + 1)]


def _x(ms: float, total_ms: float) -> float:
    return LABEL_W + (ms / total_ms * CHART_W if total_ms > 0 else 0.0)


def _tooltip(bar: Bar) -> str:
    lines = [f"{bar.name} ({bar.service})", f"{bar.start_ms:.3f} → {bar.end_ms:.3f} ms ({human_ms(bar.duration_ms)})",
             f"status: {bar.status}"]
    lines += [f"{k}: {json.dumps(v) if not isinstance(v, str) else v}" for k, v in sorted(bar.attributes.items())]
    lines += [f"event {name} @ {ms:.3f} ms" for ms, name in bar.events]
    return escape("\n".join(lines))


def render_svg(tl: Timeline) -> str:
    total = tl.total_ms or 1.0
    height = TOP + ROW_H * len(tl.rows) + BOTTOM
    width = LABEL_W + CHART_W + TEXT_W
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">']
    axis_y = TOP + ROW_H * len(tl.rows)
    for tick in nice_ticks(total):
        x = _x(tick, total)
        out.append(f'<line x1="{x:.1f}" y1="{TOP - 6}" x2="{x:.1f}" y2="{axis_y}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{x:.1f}" y="{axis_y + 16}" text-anchor="middle" fill="#555">{tick:g}</text>')
    out.append(f'<text x="{LABEL_W + CHART_W / 2}" y="{axis_y + 31}" text-anchor="middle" fill="#333">'
               f'ms since request start</text>')
    mid = {}
    for i, row in enumerate(tl.rows):
        y = TOP + i * ROW_H
        if i % 2:
            out.append(f'<rect x="0" y="{y}" width="{LABEL_W + CHART_W}" height="{ROW_H}" fill="#f7f7f9"/>')
        indent = 8 + 16 * row.depth
        prefix = "└ " if row.depth else ""
        out.append(f'<text class="row" x="{indent}" y="{y + ROW_H / 2 + 4}" fill="#222">'
                   f'{escape(prefix + row.title)}</text>')
        for bar in row.bars:
            mid[bar.span_id] = y + ROW_H / 2
    for bar in tl.bars:  # parent -> child connectors, drawn under the bars
        if bar.parent_id in mid:
            x = _x(bar.start_ms, total)
            out.append(f'<line x1="{x:.1f}" y1="{mid[bar.parent_id]:.1f}" x2="{x:.1f}" '
                       f'y2="{mid[bar.span_id]:.1f}" stroke="#999" stroke-dasharray="2,2"/>')
    for i, row in enumerate(tl.rows):
        y = TOP + i * ROW_H + (ROW_H - BAR_H) / 2
        for bar in row.bars:
            x0, x1 = _x(bar.start_ms, total), _x(bar.end_ms, total)
            color = ERROR_COLOR if bar.status == "ERROR" else service_color(bar.service)
            out.append(f'<g class="span" data-stage="{escape(bar.name)}" data-span-id="{escape(bar.span_id)}">'
                       f'<title>{_tooltip(bar)}</title>'
                       f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0, 1.5):.1f}" height="{BAR_H}" rx="2" '
                       f'fill="{color}" opacity="{0.55 if bar.unfinished else 0.9}"/>')
            for ms, _name in bar.events:
                ex = _x(ms, total)
                out.append(f'<line x1="{ex:.1f}" y1="{y - 2:.1f}" x2="{ex:.1f}" y2="{y + BAR_H + 2:.1f}" '
                           f'stroke="#111"/>')
            out.append("</g>")
        if row.bars:
            end = _x(max(b.end_ms for b in row.bars), total)
            out.append(f'<text x="{end + 4:.1f}" y="{y + BAR_H / 2 + 4:.1f}" fill="#333" font-size="11">'
                       f'{escape(row.label)}</text>')
    out.append("</svg>")
    return "\n".join(out)


_CSS = """body{font-family:sans-serif;margin:24px;color:#222}h1{font-size:18px}
.meta{color:#555;margin-bottom:12px}table{border-collapse:collapse;font-size:12px;margin-top:18px}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}th{background:#f0f0f4}
.legend span{display:inline-block;margin-right:14px}.sw{width:10px;height:10px;display:inline-block;margin-right:4px}"""


def render_html(tl: Timeline) -> str:
    title = f"PDD handoff timeline · request {tl.request_id or '?'}"
    services = sorted({b.service for b in tl.bars})
    legend = "".join(f'<span><i class="sw" style="background:{service_color(s)}"></i>{escape(s)}</span>'
                     for s in services)
    rows = []
    for bar in sorted(tl.bars, key=lambda b: b.start_ms):
        attrs = ", ".join(f"{k}={v}" for k, v in sorted(bar.attributes.items()))
        rows.append(f"<tr><td>{escape(bar.name)}</td><td>{escape(bar.service)}</td><td>{bar.start_ms:.3f}</td>"
                    f"<td>{bar.end_ms:.3f}</td><td>{escape(human_ms(bar.duration_ms))}</td>"
                    f"<td>{escape(bar.status)}</td><td>{escape(attrs)}</td></tr>")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title><style>{_CSS}</style></head>
<body><h1>{escape(title)}</h1>
<div class="meta">trace {escape(tl.trace_id)} · pipeline {escape(str(tl.pipeline or '?'))}
 · total {escape(human_ms(tl.total_ms))} · {len(tl.bars)} spans</div>
<div class="legend">{legend}</div>
{render_svg(tl)}
<table><tr><th>stage</th><th>service</th><th>start ms</th><th>end ms</th><th>duration</th><th>status</th>
<th>attributes</th></tr>
{chr(10).join(rows)}
</table></body></html>
"""
