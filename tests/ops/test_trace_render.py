"""`pdd trace`: timelines rendered from spans written by the real OpenTelemetry SDK + JsonlSpanExporter.

The span file is built the way a deployment writes it: one TracerProvider per service (its own
``service.name``), all appending to one JSONL file, with the trace context crossing "processes"
through W3C ``traceparent`` carriers like the NATS and KV-frame headers.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from xml.etree import ElementTree

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdd.launch.cli import main
from pdd.traceview.cli import render_timeline
from pdd.traceview.timeline import TraceError, build_timeline, load_spans, select_trace
from pdd.shared.telemetry import JsonlSpanExporter

STAGES = ["router.request", "prefill", "kv.transfer.fast", "kv.transfer.wan", "kv.receive", "relay.decode",
          "handoff.batch", "extend", "main.decode"]
MS = 1_000_000


class _Services:
    """One tracer per service, like separate processes writing into one span file."""

    def __init__(self, path: Path) -> None:
        self.providers = {}
        for name in ("pdd-router", "pdd-prefill", "pdd-relay", "pdd-main-decode"):
            provider = TracerProvider(resource=Resource.create({"service.name": name}))
            provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(str(path))))
            self.providers[name] = provider
        self.t0 = time.time_ns()

    def span(self, service: str, name: str, parent_headers: dict | None, start_ms: float, end_ms: float,
             **attributes) -> dict:
        """Record a finished span; returns the headers a child in another process would receive."""
        ctx = TraceContextTextMapPropagator().extract(parent_headers) if parent_headers is not None else None
        tracer = self.providers[service].get_tracer("test")
        span = tracer.start_span(name, context=ctx, start_time=self.t0 + int(start_ms * MS), attributes=attributes)
        headers: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(headers, context=trace.set_span_in_context(span))
        span.end(end_time=self.t0 + int(end_ms * MS))
        return headers

    def close(self) -> None:
        for provider in self.providers.values():
            provider.shutdown()


def write_p_rld_md(svc: _Services, request_id: str, offset_ms: float = 0.0) -> None:
    """A low-hit request: prefill, dual-path KV, relay decodes eagerly, catch-up handoff in 3 batches."""
    o = offset_ms
    root = svc.span("pdd-router", "router.request", None, o, o + 980, request_id=request_id, pipeline="P-RLD-MD",
                    prompt_tokens=4096, max_tokens=256)
    pre = svc.span("pdd-prefill", "prefill", root, o + 3, o + 118, prompt_tokens=4096, cached_tokens=512)
    fast = svc.span("pdd-prefill", "kv.transfer.fast", pre, o + 118, o + 131, bytes=176_160_768, gbps=108.4)
    svc.span("pdd-relay", "kv.receive", fast, o + 119, o + 131, bytes=176_160_768)
    wan = svc.span("pdd-prefill", "kv.transfer.wan", pre, o + 118, o + 612, bytes=154_140_672, gbps=2.5)
    svc.span("pdd-main-decode", "kv.receive", wan, o + 121, o + 612, bytes=154_140_672)
    relay = svc.span("pdd-relay", "relay.decode", root, o + 132, o + 700, tokens=70)
    main_decode = svc.span("pdd-main-decode", "main.decode", root, o + 615, o + 975, tokens=185)
    start, t = 1, 615.0
    for count, final in ((48, False), (16, False), (6, True)):
        batch = svc.span("pdd-relay", "handoff.batch", relay, o + t, o + t + 2, start=start, count=count,
                         mode="catch-up", final=final)
        svc.span("pdd-main-decode", "extend", batch, o + t + 4, o + t + 4 + count * 0.4, tokens=count)
        start, t = start + count, t + 4 + count * 0.4 + 8
    assert main_decode


def write_p_md(svc: _Services, request_id: str, offset_ms: float) -> None:
    """A high-hit request: tiny WAN transfer, MD decodes directly."""
    o = offset_ms
    root = svc.span("pdd-router", "router.request", None, o, o + 400, request_id=request_id, pipeline="P-MD")
    pre = svc.span("pdd-prefill", "prefill", root, o + 2, o + 20, prompt_tokens=4096, cached_tokens=4000)
    wan = svc.span("pdd-prefill", "kv.transfer.wan", pre, o + 20, o + 45, bytes=3_538_944, gbps=1.1)
    svc.span("pdd-main-decode", "kv.receive", wan, o + 21, o + 45, bytes=3_538_944)
    svc.span("pdd-main-decode", "main.decode", root, o + 46, o + 398, tokens=200)


@pytest.fixture(scope="module")
def span_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spans") / "spans.jsonl"
    svc = _Services(path)
    write_p_rld_md(svc, "req-lowhit", 0.0)
    write_p_md(svc, "req-highhit", 2000.0)
    svc.close()
    return path


def test_span_file_has_one_tree_per_request(span_file: Path) -> None:
    spans = load_spans(span_file)
    picked = select_trace(spans, request_id="req-lowhit")
    ids = {s["span_id"] for s in picked}
    roots = [s for s in picked if s["parent_span_id"] is None]
    assert [r["name"] for r in roots] == ["router.request"]
    assert all(s["parent_span_id"] in ids for s in picked if s is not roots[0])
    assert {s["name"] for s in picked} == set(STAGES)
    assert {s["service"] for s in picked} == {"pdd-router", "pdd-prefill", "pdd-relay", "pdd-main-decode"}


def test_timeline_rows_follow_the_tree(span_file: Path) -> None:
    tl = build_timeline(select_trace(load_spans(span_file), request_id="req-lowhit"))
    assert tl.request_id == "req-lowhit" and tl.pipeline == "P-RLD-MD"
    titles = [r.title for r in tl.rows]
    assert titles[0] == "router.request · pdd-router" and tl.rows[0].depth == 0
    wan = titles.index("kv.transfer.wan · pdd-prefill")
    assert titles[wan + 1] == "kv.receive · pdd-main-decode" and tl.rows[wan + 1].depth == tl.rows[wan].depth + 1
    handoff = tl.rows[titles.index("handoff.batch · pdd-relay")]
    assert len(handoff.bars) == 3 and "3 batches: 48+16+6 tok" in handoff.label and "catch-up" in handoff.label
    assert tl.rows[0].bars[0].start_ms == 0.0 and tl.total_ms == pytest.approx(980, abs=0.01)
    wan_bar = tl.rows[wan].bars[0]
    assert "154.1 MB" in wan_bar.label and "2.50 Gbit/s" in wan_bar.label and "494.0 ms" in wan_bar.label


def _assert_png(path: Path) -> None:
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 800
    assert float(image[..., :3].std()) > 0.01  # something was drawn


def test_render_writes_self_contained_html_and_valid_png(span_file: Path, tmp_path: Path) -> None:
    html_path, png_path = render_timeline(select_trace(load_spans(span_file), request_id="req-lowhit"), tmp_path)
    html = html_path.read_text()
    for stage in STAGES:
        assert f'data-stage="{stage}"' in html, stage
    for text in ("req-lowhit", "P-RLD-MD", "Gbit/s", "48+16+6 tok", "ms since request start"):
        assert text in html
    assert "<script" not in html and "<link" not in html and "https://" not in html  # no CDN, no fetches
    svg = ElementTree.fromstring(html[html.index("<svg"):html.index("</svg>") + 6])  # well-formed inline SVG
    assert len(svg.findall(".//{http://www.w3.org/2000/svg}rect")) >= 14
    _assert_png(png_path)


def test_cli_renders_by_request_id_and_lists(span_file: Path, tmp_path: Path, capsys) -> None:
    assert main(["trace", str(span_file), "--request-id", "req-highhit", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "P-MD" in out and "timeline-req-highhit.html" in out
    _assert_png(tmp_path / "timeline-req-highhit.png")
    trace_id = select_trace(load_spans(span_file), request_id="req-lowhit")[0]["trace_id"]
    assert main(["trace", str(span_file), "--trace-id", trace_id, "--out", str(tmp_path)]) == 0
    assert (tmp_path / "timeline-req-lowhit.html").exists()
    assert main(["trace", str(span_file), "--list"]) == 0
    listed = capsys.readouterr().out
    assert "req-lowhit" in listed and "req-highhit" in listed
    assert main(["trace", str(span_file), "--latest", "--out", str(tmp_path / "latest")]) == 0
    assert (tmp_path / "latest" / "timeline-req-highhit.html").exists()


def test_unknown_request_is_a_clear_error(span_file: Path, tmp_path: Path, capsys) -> None:
    assert main(["trace", str(span_file), "--request-id", "nope", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no request 'nope'" in err and "req-highhit" in err
    assert main(["trace", str(span_file), "--trace-id", "0" * 32, "--out", str(tmp_path)]) == 1
    assert "no trace" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("content, message", [
    ("", "no spans"),
    ('{"name": "x"\n', ":1: not a JSON span"),
    ('{"name": "prefill", "trace_id": "ab"}\n', "span lacks"),
])
def test_bad_span_files(tmp_path: Path, content: str, message: str, capsys) -> None:
    path = tmp_path / "spans.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError, match=message):
        load_spans(path)
    assert main(["trace", str(path)]) == 1
    assert message in capsys.readouterr().err


def test_missing_file_and_mixed_traces(span_file: Path, tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read span file"):
        load_spans(tmp_path / "absent.jsonl")
    with pytest.raises(TraceError, match="2 traces"):
        render_timeline(load_spans(span_file), tmp_path)


def test_orphan_and_unfinished_spans_still_render(tmp_path: Path) -> None:
    """Spans lost in export (orphans) or still open must not break the picture."""
    spans = [json.loads(line) for line in (
        '{"name":"router.request","trace_id":"t1","span_id":"a","parent_span_id":null,"start_ns":0,'
        '"end_ns":5000000,"service":"pdd-router","attributes":{"request_id":"r1"},"status":"UNSET","events":[]}',
        '{"name":"extend","trace_id":"t1","span_id":"b","parent_span_id":"lost","start_ns":1000000,'
        '"end_ns":null,"service":"pdd-main-decode","attributes":{},"status":"ERROR","events":[]}',
    )]
    tl = build_timeline(spans)
    bar = tl.rows[1].bars[0]
    assert tl.rows[1].depth == 1 and bar.unfinished and bar.end_ms == 5.0
    html_path, png_path = render_timeline(spans, tmp_path)
    assert "unfinished" in html_path.read_text()
    _assert_png(png_path)


@pytest.mark.parametrize("request_id, write", [("req-lowhit", write_p_rld_md), ("req-highhit", write_p_md),
                                               ("chatcmpl-8f14e45fceea167a5a36dedd4bea2543", write_p_rld_md)])
def test_png_legend_clear_of_title_and_axis_text(tmp_path: Path, request_id: str, write) -> None:
    """The legend overlaps neither the title (long real request ids included), the axis label, the tick labels
    nor the plot area, and stays inside the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from pdd.traceview.png import timeline_figure

    svc = _Services(tmp_path / "spans.jsonl")
    write(svc, request_id, 0.0)
    svc.close()
    fig = timeline_figure(build_timeline(select_trace(load_spans(tmp_path / "spans.jsonl"), request_id=request_id)))
    canvas = FigureCanvasAgg(fig)  # the canvas savefig(format="png") uses
    canvas.draw()
    renderer = canvas.get_renderer()
    (ax,) = fig.axes
    (legend,) = [*fig.legends, *([ax.get_legend()] if ax.get_legend() else [])]
    box = legend.get_window_extent(renderer)
    titles = [t for t in (ax.title, ax._left_title, ax._right_title, *fig.texts) if t.get_text()]
    assert any(request_id in t.get_text() for t in titles)
    others = [*titles, ax.xaxis.label, *[t for t in ax.get_xticklabels() if t.get_text()], ax.patch]
    for artist in others:
        assert not box.overlaps(artist.get_window_extent(renderer)), (artist, box)
    assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
