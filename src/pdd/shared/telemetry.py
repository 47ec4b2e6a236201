"""Logging (structlog) and tracing (OpenTelemetry) setup shared by every service.

- Logs are JSON when stderr is not a TTY; ``request_id``/``trace_id`` are bound via contextvars.
- Spans go to OTLP (Jaeger), a JSONL file (for ``pdd trace`` and tests), or nowhere. The OTel SDK reads
  its own ``OTEL_*`` variables (service name, resource attributes, OTLP endpoint, protocol http/protobuf
  or grpc, headers, timeout); PDD only fills in its role's service name and instance id. Export always
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
from opentelemetry.environment_variables import OTEL_TRACES_EXPORTER
from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TIMEOUT,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_TIMEOUT,
)
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, OTELResourceDetector, Resource
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


_OTLP_PACKAGES = {"http/protobuf": "opentelemetry-exporter-otlp-proto-http",
                  "grpc": "opentelemetry-exporter-otlp-proto-grpc"}


def tracing_resource(service_name: str, instance_id: str | None = None) -> Resource:
    """The SDK's resource (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME, its detectors), with PDD's service
    name and instance id filled in where the environment does not set them: the operator's word wins."""
    from_env = OTELResourceDetector().detect().attributes
    own = {SERVICE_NAME: service_name, **({SERVICE_INSTANCE_ID: instance_id} if instance_id else {})}
    return Resource.create({key: value for key, value in own.items() if key not in from_env})


def _otlp_exporter(endpoint: str | None) -> SpanExporter:
    """OTLP over the protocol OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL names (default http/protobuf, port 4318).

    Endpoint, headers, certificates, compression and timeout come from the SDK's own OTEL_EXPORTER_OTLP_*
    handling; ``endpoint`` (telemetry.otlp_endpoint) is a base URL like OTEL_EXPORTER_OTLP_ENDPOINT."""
    variable = next((v for v in (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, OTEL_EXPORTER_OTLP_PROTOCOL)
                     if os.environ.get(v)), OTEL_EXPORTER_OTLP_PROTOCOL)
    protocol = os.environ.get(variable, "http/protobuf").strip()
    if protocol not in _OTLP_PACKAGES:
        raise ValueError(f"{variable}={protocol!r}: unsupported OTLP protocol for traces; "
                         f"use one of {list(_OTLP_PACKAGES)}")
    # a dead collector must not hold a stopping service for the SDK's default 10 s, unless the operator says so
    timeout_set = any(os.environ.get(v) for v in (OTEL_EXPORTER_OTLP_TIMEOUT, OTEL_EXPORTER_OTLP_TRACES_TIMEOUT))
    timeout = None if timeout_set else 2
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            return GrpcExporter(endpoint=endpoint, timeout=timeout)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    except ImportError as exc:
        raise ValueError(f"{variable}={protocol}: needs the package {_OTLP_PACKAGES[protocol]} ({exc})") from None
    if endpoint and not endpoint.rstrip("/").endswith("/v1/traces"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HttpExporter(endpoint=endpoint, timeout=timeout)


def span_exporter(config: TelemetryConfig) -> SpanExporter | None:
    """The exporter ``config`` asks for: OTLP, PDD's JSONL file (for ``pdd trace``), or none."""
    name = config.exporter
    jsonl_path = config.jsonl_path or os.environ.get("PDD_TRACE_JSONL")
    if name == "auto":
        otlp_set = config.otlp_endpoint or any(
            os.environ.get(v) for v in (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT))
        name = "otlp" if otlp_set else ("jsonl" if jsonl_path else "none")
    if os.environ.get(OTEL_TRACES_EXPORTER, "").strip().lower() == "none":
        name = "none"
    if name == "otlp":
        return _otlp_exporter(config.otlp_endpoint)
    if name == "jsonl":
        if not jsonl_path:
            raise ValueError("telemetry.exporter is 'jsonl' but telemetry.jsonl_path is not set")
        return JsonlSpanExporter(jsonl_path)
    return None


def setup_tracing(service_name: str, config: TelemetryConfig, instance_id: str | None = None) -> TracerProvider:
    """Install the global tracer provider once per process with the configured exporter."""
    global _provider
    if _provider is not None:
        return _provider
    provider = TracerProvider(resource=tracing_resource(service_name, instance_id))
    exporter = span_exporter(config)
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
