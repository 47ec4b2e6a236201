"""A request's handoff timeline, built from the JSONL spans that ``shared/telemetry.py`` exports.

Pure data (no plotting) so the HTML and PNG renderers draw the same rows and labels, and tests can
check the model without pixels. One row per (stage, service): spans of one kind from one service
share a row (e.g. every ``handoff.batch``), rows are ordered depth-first along the span tree so a
child sits under its parent, and times are milliseconds from the request's start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd.shared.roles import Role

ROOT_SPAN = "router.request"


class TraceError(ValueError):
    """The span file is unreadable, malformed, or does not hold the asked-for request."""


@dataclass(frozen=True)
class Bar:
    """One span drawn as a bar from ``start_ms`` to ``end_ms`` (ms from the request start)."""

    span_id: str
    parent_id: str | None
    name: str
    service: str
    start_ms: float
    end_ms: float
    label: str
    status: str
    attributes: dict[str, Any]
    events: list[tuple[float, str]]
    unfinished: bool = False

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass
class Row:
    """Spans of one stage from one service, drawn on one line; ``depth`` indents the label."""

    key: tuple[str, str]
    depth: int
    bars: list[Bar] = field(default_factory=list)

    @property
    def label(self) -> str:
        """One label per row: the bar's own, or a summary (handoff batch sizes) for repeated spans."""
        if len(self.bars) == 1:
            return self.bars[0].label
        busy = human_ms(sum(b.duration_ms for b in self.bars))
        if self.key[0] == "handoff.batch":
            sizes = "+".join(str(b.attributes.get("count", "?")) for b in self.bars)
            modes = sorted({str(b.attributes["mode"]) for b in self.bars if b.attributes.get("mode")})
            return " · ".join([f"{len(self.bars)} batches: {sizes} tok", *modes, busy])
        if all("tokens" in b.attributes for b in self.bars):
            return f"{len(self.bars)}×: " + "+".join(str(b.attributes["tokens"]) for b in self.bars) + f" tok · {busy}"
        return f"{len(self.bars)}× · {busy}"

    @property
    def title(self) -> str:
        name, service = self.key
        return f"{name} · {service}" if service else name


@dataclass
class Timeline:
    trace_id: str
    request_id: str | None
    pipeline: str | None
    total_ms: float
    rows: list[Row]

    @property
    def bars(self) -> list[Bar]:
        return [b for r in self.rows for b in r.bars]

    def row_of(self, span_id: str) -> int:
        for i, row in enumerate(self.rows):
            if any(b.span_id == span_id for b in row.bars):
                return i
        raise KeyError(span_id)


# -- loading and selecting ------------------------------------------------------------------------
_REQUIRED = ("name", "trace_id", "span_id", "start_ns")


def load_spans(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSONL span file; a bad line is an error naming its line number."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read span file ({exc.strerror})") from None
    spans = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            span = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{lineno}: not a JSON span ({exc.msg})") from None
        missing = [k for k in _REQUIRED if not isinstance(span, dict) or k not in span]
        if missing:
            raise TraceError(f"{path}:{lineno}: span lacks {missing}; is this a `pdd` JSONL span file?")
        spans.append(span)
    if not spans:
        raise TraceError(f"{path}: no spans in file")
    return spans


def requests_in(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Root ``router.request`` spans, oldest first (for ``--list`` and ``--latest``)."""
    roots = [s for s in spans if s["name"] == ROOT_SPAN]
    return sorted(roots, key=lambda s: s["start_ns"])


def select_trace(spans: list[dict[str, Any]], request_id: str | None = None,
                 trace_id: str | None = None) -> list[dict[str, Any]]:
    """The spans of one trace, chosen by request id or trace id; neither means the latest request."""
    if trace_id is not None:
        chosen = trace_id.lower()
    elif request_id is not None:
        hits = [s for s in requests_in(spans) if str(s.get("attributes", {}).get("request_id")) == request_id]
        if not hits:
            known = [str(s.get("attributes", {}).get("request_id")) for s in requests_in(spans)][-5:]
            raise TraceError(f"no request {request_id!r} in the span file (latest request ids: {known or 'none'})")
        chosen = hits[-1]["trace_id"]
    else:
        roots = requests_in(spans)
        if roots:
            chosen = roots[-1]["trace_id"]
        else:
            trace_ids = {s["trace_id"] for s in spans}
            if len(trace_ids) != 1:
                raise TraceError(f"no {ROOT_SPAN!r} span in the file; pass --trace-id (have {len(trace_ids)} traces)")
            chosen = next(iter(trace_ids))
    picked = [s for s in spans if s["trace_id"] == chosen]
    if not picked:
        raise TraceError(f"no trace {chosen!r} in the span file")
    return picked


# -- labels ----------------------------------------------------------------------------------------
def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def human_ms(ms: float) -> str:
    return f"{ms / 1000:.2f} s" if ms >= 1000 else (f"{ms:.1f} ms" if ms >= 1 else f"{ms * 1000:.0f} µs")


def span_label(name: str, duration_ms: float, attrs: dict[str, Any]) -> str:
    """Duration plus the attributes that explain a stage: bytes, Gbit/s, batch size, pipeline."""
    parts = [human_ms(duration_ms)]
    if "pipeline" in attrs:
        parts.append(str(attrs["pipeline"]))
    if "bytes" in attrs:
        parts.append(human_bytes(float(attrs["bytes"])))
    if "gbps" in attrs:
        parts.append(f"{float(attrs['gbps']):.2f} Gbit/s")
    if name == "handoff.batch":
        count, start = attrs.get("count"), attrs.get("start")
        batch = f"{count} tok" if count is not None else "batch"
        if start is not None:
            batch += f" @{start}"
        parts.append(batch)
        if attrs.get("mode"):
            parts.append(str(attrs["mode"]))
        if attrs.get("final"):
            parts.append("final")
    elif "tokens" in attrs:
        parts.append(f"{attrs['tokens']} tok")
    return " · ".join(parts)


# -- building --------------------------------------------------------------------------------------
def build_timeline(spans: list[dict[str, Any]]) -> Timeline:
    """Rows and bars of one trace; spans whose parent is missing hang under the root."""
    if not spans:
        raise TraceError("no spans to render")
    trace_ids = {s["trace_id"] for s in spans}
    if len(trace_ids) > 1:
        raise TraceError(f"spans of {len(trace_ids)} traces given; select one (select_trace) before rendering")
    by_id = {s["span_id"]: s for s in spans}
    roots = [s for s in spans if s["name"] == ROOT_SPAN] or [min(spans, key=lambda s: s["start_ns"])]
    root = roots[0]
    t0 = min(s["start_ns"] for s in spans)
    last_end = max((s.get("end_ns") or s["start_ns"]) for s in spans)
    children: dict[str | None, list[dict]] = {}
    for s in spans:
        parent = s.get("parent_span_id")
        if s is root:
            continue
        if parent not in by_id:
            parent = root["span_id"]  # orphan (its parent was lost): keep it visible under the root
        children.setdefault(parent, []).append(s)

    rows: dict[tuple[str, str], Row] = {}
    order: list[tuple[str, str]] = []

    def visit(span: dict, depth: int) -> None:
        key = (span["name"], span.get("service") or "")
        if key not in rows:
            rows[key] = Row(key=key, depth=depth)
            order.append(key)
        rows[key].bars.append(_bar(span, t0, last_end))
        for child in sorted(children.get(span["span_id"], []), key=lambda c: c["start_ns"]):
            visit(child, depth + 1)

    visit(root, 0)
    attrs = root.get("attributes") or {}
    return Timeline(
        trace_id=root["trace_id"],
        request_id=str(attrs["request_id"]) if "request_id" in attrs else None,
        pipeline=attrs.get("pipeline"),
        total_ms=(last_end - t0) / 1e6,
        rows=[rows[k] for k in order],
    )


def _bar(span: dict, t0: int, last_end: int) -> Bar:
    end_ns = span.get("end_ns")
    unfinished = end_ns is None
    end_ns = last_end if unfinished else end_ns
    start_ms, end_ms = (span["start_ns"] - t0) / 1e6, (end_ns - t0) / 1e6
    attrs = dict(span.get("attributes") or {})
    label = span_label(span["name"], end_ms - start_ms, attrs) + (" · unfinished" if unfinished else "")
    events = [((e["ts_ns"] - t0) / 1e6, e.get("name", "")) for e in span.get("events") or [] if "ts_ns" in e]
    return Bar(span_id=span["span_id"], parent_id=span.get("parent_span_id"), name=span["name"],
               service=span.get("service") or "", start_ms=start_ms, end_ms=end_ms, label=label,
               status=span.get("status") or "UNSET", attributes=attrs, events=events, unfinished=unfinished)


# -- colours shared by both renderers ----------------------------------------------------------------
_ROLE_COLORS = {Role.ROUTER: "#5b6f8a", Role.PREFILL: "#e07b39", Role.RELAY: "#3a9a5b", Role.MAIN_DECODE: "#7a4fb5"}
_FALLBACK = ("#2a7fb8", "#b8892a", "#b82a6a", "#2ab8a5", "#8a8a8a")
ERROR_COLOR = "#d62728"


def service_color(service: str) -> str:
    """A stable colour per role (router, prefill, relay, main-decode), whatever the service-name prefix."""
    for role, color in _ROLE_COLORS.items():
        if role in service:
            return color
    return _FALLBACK[sum(service.encode()) % len(_FALLBACK)]
