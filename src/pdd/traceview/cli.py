"""`pdd trace SPANS.jsonl`: render one request's handoff timeline (Gantt) as HTML and PNG.

The spans come from the JSONL exporter in ``shared/telemetry.py`` (``telemetry.jsonl_path`` or
``PDD_TRACE_JSONL``); every service of a run appends to the same file, so one file holds whole
traces. Useful when Jaeger is not deployed, and as an artifact that survives the run.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from pdd.traceview.timeline import TraceError, build_timeline, human_ms, load_spans, requests_in, select_trace


def render_timeline(spans: list[dict[str, Any]], out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``timeline-<request>.html`` and ``.png`` for the spans of one trace; returns both paths."""
    from pdd.traceview.html import render_html
    from pdd.traceview.png import render_png

    tl = build_timeline(spans)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "timeline-" + re.sub(r"[^A-Za-z0-9._-]", "_", tl.request_id or tl.trace_id[:16])
    html_path = out / f"{stem}.html"
    html_path.write_text(render_html(tl), encoding="utf-8")
    png_path = render_png(tl, out / f"{stem}.png")
    return html_path, png_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spans", help="JSONL span file (telemetry.jsonl_path / PDD_TRACE_JSONL)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--request-id", help="the request's id (router.request attribute request_id)")
    which.add_argument("--trace-id", help="the 32-hex trace id (as in logs and Jaeger)")
    which.add_argument("--latest", action="store_true", help="the most recent request (default)")
    which.add_argument("--list", action="store_true", help="list the requests in the file and exit")
    parser.add_argument("--out", default=".", help="output directory (default: .)")


def _list(spans: list[dict[str, Any]]) -> None:
    for root in requests_in(spans):
        attrs = root.get("attributes") or {}
        dur = human_ms(((root.get("end_ns") or root["start_ns"]) - root["start_ns"]) / 1e6)
        print(f"{attrs.get('request_id', '?')}\t{root['trace_id']}\t{attrs.get('pipeline', '?')}\t{dur}")


def run(args: argparse.Namespace) -> int:
    try:
        spans = load_spans(args.spans)
        if args.list:
            _list(spans)
            return 0
        picked = select_trace(spans, request_id=args.request_id, trace_id=args.trace_id)
        html_path, png_path = render_timeline(picked, args.out)
    except TraceError as exc:
        print(f"pdd trace: {exc}", file=sys.stderr)
        return 1
    tl = build_timeline(picked)
    print(f"request {tl.request_id or '?'} (trace {tl.trace_id}) · {tl.pipeline or '?'} · {human_ms(tl.total_ms)}")
    for row in tl.rows:
        print(f"  {'  ' * row.depth}{row.title:<40} {row.label}")
    print(f"html: {html_path}\npng:  {png_path}")
    return 0
