"""Timeline as a PNG (matplotlib, Agg, imported lazily) for READMEs, tickets and terminals without a browser.

Uses ``matplotlib.figure.Figure`` directly instead of pyplot: no global backend state, no display
needed, safe to call from a server or a test.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pdd.traceview.timeline import ERROR_COLOR, Timeline, human_ms, service_color

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def render_png(tl: Timeline, path: str | Path, dpi: int = 110) -> Path:
    """Write the timeline as a PNG file; returns its path."""
    out = Path(path)
    timeline_figure(tl, dpi).savefig(out, format="png")
    return out


def timeline_figure(tl: Timeline, dpi: int = 110) -> Figure:
    """The timeline drawn on a matplotlib Figure (one row per stage and service, bars on a ms axis)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    n = len(tl.rows)
    height = 1.45 + 0.42 * n  # inches: 0.5 title band, rows, 0.95 for ticks, axis label and legend
    fig = Figure(figsize=(13, height), dpi=dpi)
    ax = fig.add_subplot(1, 1, 1)
    total = tl.total_ms or 1.0
    mids = {b.span_id: i for i, r in enumerate(tl.rows) for b in r.bars}
    for i, row in enumerate(tl.rows):
        for bar in row.bars:
            color = ERROR_COLOR if bar.status == "ERROR" else service_color(bar.service)
            ax.barh(i, max(bar.duration_ms, total * 0.003), left=bar.start_ms, height=0.56, color=color,
                    alpha=0.55 if bar.unfinished else 0.9, edgecolor="none")
            for ms, _name in bar.events:
                ax.plot([ms, ms], [i - 0.34, i + 0.34], color="#111", linewidth=0.8)
            if bar.parent_id in mids:  # parent -> child connector
                ax.plot([bar.start_ms, bar.start_ms], [mids[bar.parent_id], i], color="#999",
                        linewidth=0.7, linestyle=":", zorder=0)
        end = max(b.end_ms for b in row.bars)
        ax.text(end + total * 0.006, i, row.label, va="center", fontsize=8, color="#333", clip_on=False)
    ax.set_yticks(range(n))
    ax.set_yticklabels([])
    ax.tick_params(axis="y", length=0)
    left_of_axes = blended_transform_factory(ax.transAxes, ax.transData)
    for i, row in enumerate(tl.rows):  # left-aligned, indented by depth: the tree reads down the margin
        ax.text(-0.3 + 0.018 * row.depth, i, ("└ " if row.depth else "") + row.title, transform=left_of_axes,
                ha="left", va="center", fontsize=8.5)
    ax.invert_yaxis()
    ax.set_xlim(0, total * 1.02)
    ax.set_xlabel("ms since request start")
    ax.grid(axis="x", color="#e4e4e4", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"request {tl.request_id or '?'} · {tl.pipeline or '?'} · {human_ms(tl.total_ms)}",
                 loc="left", fontsize=10)
    left = 0.22
    fig.subplots_adjust(left=left, right=0.8, top=1 - 0.5 / height, bottom=0.95 / height)
    # the legend has its own band at the bottom, under the axis label: a long request id in the title
    # (chatcmpl-<32 hex>) never runs into it
    services = sorted({b.service for b in tl.bars})
    fig.legend(handles=[Patch(color=service_color(s), label=s) for s in services], loc="lower left", fontsize=8,
               frameon=False, bbox_to_anchor=(left, 0.04 / height), ncol=len(services) or 1)
    return fig
