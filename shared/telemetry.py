"""Logging (structlog) and tracing (OpenTelemetry) setup shared by every service.

- Logs are JSON when stderr is not a TTY; ``request_id``/``trace_id`` are bound via contextvars.
- Spans go to OTLP (Jaeger), a JSONL file (for ``pdd trace`` and tests), or nowhere. Export always
  runs in a BatchSpanProcessor's background thread with a bounded queue, so a dead collector drops
  spans instead of slowing or breaking serving.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from pdd.shared.config import REDACTED, SECRET_KEYS, TelemetryConfig, redact_url

_provider: TracerProvider | None = None


class JsonlSpanExporter(SpanExporter):
    """One JSON object per finished span, appended to a file shared by all processes of a run.

    Lines are written with a single ``write`` of < PIPE_BUF-ish size under O_APPEND, so several
    services can append to the same file without interleaving.
    """

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            lines = "".join(json.dumps(span_to_dict(s), separators=(",", ":")) + "\n" for s in spans)
            with self._lock:
                for line in lines.splitlines(keepends=True):
                    os.write(self._fd, line.encode())
            return SpanExportResult.SUCCESS
        except Exception:  # never let an exporter break the caller
            return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_span_id": format(parent.span_id, "016x") if parent else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "service": span.resource.attributes.get("service.name"),
        "attributes": {k: (list(v) if isinstance(v, tuple) else v) for k, v in (span.attributes or {}).items()},
        "status": span.status.status_code.name,
        "events": [{"name": e.name, "ts_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events],
    }


def setup_tracing(service_name: str, config: TelemetryConfig, instance_id: str | None = None) -> TracerProvider:
    """Install the global tracer provider once per process with the configured exporter."""
    global _provider
    if _provider is not None:
        return _provider
    attributes = {"service.name": service_name}
    if instance_id:
        attributes["service.instance.id"] = instance_id
    provider = TracerProvider(resource=Resource.create(attributes))
    exporter_name = config.exporter
    endpoint = config.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    jsonl_path = config.jsonl_path or os.environ.get("PDD_TRACE_JSONL")
    if exporter_name == "auto":
        exporter_name = "otlp" if endpoint else ("jsonl" if jsonl_path else "none")
    if os.environ.get("OTEL_TRACES_EXPORTER") == "none":
        exporter_name = "none"
    exporter: SpanExporter | None = None
    if exporter_name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = endpoint or "http://127.0.0.1:4318"
        if not url.rstrip("/").endswith("/v1/traces"):
            url = url.rstrip("/") + "/v1/traces"
        exporter = OTLPSpanExporter(endpoint=url, timeout=2)
    elif exporter_name == "jsonl":
        if not jsonl_path:
            raise ValueError("telemetry.exporter is 'jsonl' but telemetry.jsonl_path is not set")
        exporter = JsonlSpanExporter(jsonl_path)
    if exporter is not None:
        provider.add_span_processor(
            BatchSpanProcessor(exporter, max_queue_size=8192, schedule_delay_millis=200, export_timeout_millis=2000)
        )
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing(timeout_s: float = 3.0) -> None:
    """Flush and stop the exporter, bounded: a dead collector (retrying with backoff) never delays exit."""
    global _provider
    if _provider is not None:
        provider, _provider = _provider, None

        def flush_and_stop() -> None:
            provider.force_flush(timeout_millis=int(timeout_s * 1000))
            provider.shutdown()

        worker = threading.Thread(target=flush_and_stop, name="otel-shutdown", daemon=True)
        worker.start()
        worker.join(timeout_s)


def _add_trace_ids(_: Any, __: str, event_dict: dict) -> dict:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid and "trace_id" not in event_dict:
        event_dict["trace_id"] = format(ctx.trace_id, "032x")
    return event_dict


_SECRET_LOG_KEYS = frozenset(SECRET_KEYS | {"api_key", "authorization", "nkeys_seed", "credentials"})


def _redact_secrets(_: Any, __: str, event_dict: dict) -> dict:
    """No password, token or key in a log line, whatever a caller passed: by field name, and
    credentials inside URLs (nats://user:pass@host)."""
    for key, value in event_dict.items():
        if key in _SECRET_LOG_KEYS and value not in (None, ""):
            event_dict[key] = REDACTED
        elif isinstance(value, str) and "://" in value and "@" in value:
            event_dict[key] = redact_url(value)
    return event_dict


def setup_logging(config: TelemetryConfig, **static: Any) -> None:
    """structlog to stderr: JSON unless attached to a terminal; ``static`` fields on every line."""
    level = getattr(logging, config.log_level.upper())
    fmt = config.log_format
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = structlog.dev.ConsoleRenderer() if fmt == "console" else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_ids,
            structlog.processors.format_exc_info,
            _redact_secrets,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    if static:
        structlog.contextvars.bind_contextvars(**static)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """W3C traceparent/tracestate of the current span, for NATS headers or KV frame headers."""
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(dict(headers or {}))


def get_tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
