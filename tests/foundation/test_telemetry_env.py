"""The OTel SDK reads its own OTEL_* variables: service name, resource attributes, OTLP endpoint and protocol
(http/protobuf and grpc). Spans go to real receivers on free ports and are decoded with opentelemetry-proto."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from pdd.shared.config import TelemetryConfig
from pdd.shared.telemetry import JsonlSpanExporter, span_exporter, tracing_resource

OTEL_VARS = ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_EXPORTER_OTLP_ENDPOINT",
             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
             "OTEL_TRACES_EXPORTER", "PDD_TRACE_JSONL")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


def _export_one_span(exporter, service_name: str = "pdd-router", instance_id: str | None = "router-0") -> None:
    provider = TracerProvider(resource=tracing_resource(service_name, instance_id))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("test").start_as_current_span("router.request"):
        pass
    provider.shutdown()


def _attributes(resource_spans) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}


def test_pdd_names_when_the_environment_sets_none() -> None:
    attrs = tracing_resource("pdd-prefill", "p-0").attributes
    assert attrs["service.name"] == "pdd-prefill" and attrs["service.instance.id"] == "p-0"
    assert attrs["telemetry.sdk.name"] == "opentelemetry"  # the SDK's own detectors ran


def test_env_service_name_and_attributes_reach_the_jsonl_spans(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pdd-site-b")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging,service.instance.id=md-custom")
    attrs = tracing_resource("pdd-main-decode", "md-0").attributes
    assert attrs["service.name"] == "pdd-site-b" and attrs["service.instance.id"] == "md-custom"
    assert attrs["deployment.environment"] == "staging"
    monkeypatch.delenv("OTEL_SERVICE_NAME")  # service.name given only in OTEL_RESOURCE_ATTRIBUTES also wins
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs")
    path = tmp_path / "spans.jsonl"
    _export_one_span(JsonlSpanExporter(str(path)), "pdd-router")
    (span,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert span["service"] == "from-attrs" and span["name"] == "router.request"


class _Collector(BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Collector.received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def http_collector() -> Iterator[int]:
    _Collector.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.received: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):
        self.received.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def grpc_collector() -> Iterator[tuple[int, _TraceService]]:
    service = _TraceService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, service
    server.stop(grace=None)


def test_otlp_http_protobuf_from_env(http_collector, monkeypatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{http_collector}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod,cloud.region=eu-west")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pdd-eu")
    _export_one_span(span_exporter(TelemetryConfig()))  # exporter auto: OTLP because the endpoint is set
    ((path, body),) = _Collector.received
    assert path == "/v1/traces"  # the SDK appends the signal path to OTEL_EXPORTER_OTLP_ENDPOINT
    (resource_spans,) = trace_service_pb2.ExportTraceServiceRequest.FromString(body).resource_spans
    attrs = _attributes(resource_spans)
    assert attrs["service.name"] == "pdd-eu" and attrs["service.instance.id"] == "router-0"
    assert attrs["deployment.environment"] == "prod" and attrs["cloud.region"] == "eu-west"
    assert [s.name for s in resource_spans.scope_spans[0].spans] == ["router.request"]


def test_otlp_http_from_config_endpoint(http_collector) -> None:
    config = TelemetryConfig(exporter="otlp", otlp_endpoint=f"http://127.0.0.1:{http_collector}")
    _export_one_span(span_exporter(config))
    ((path, body),) = _Collector.received
    assert path == "/v1/traces"
    (resource_spans,) = trace_service_pb2.ExportTraceServiceRequest.FromString(body).resource_spans
    assert _attributes(resource_spans)["service.name"] == "pdd-router"


def test_otlp_grpc_from_env(grpc_collector, monkeypatch) -> None:
    port, service = grpc_collector
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")  # the per-signal variable wins
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=grpc-test")
    _export_one_span(span_exporter(TelemetryConfig()), "pdd-relay", "rld-0")
    (request,) = service.received
    (resource_spans,) = request.resource_spans
    attrs = _attributes(resource_spans)
    assert attrs["service.name"] == "pdd-relay" and attrs["service.instance.id"] == "rld-0"
    assert attrs["deployment.environment"] == "grpc-test"
    assert [s.name for s in resource_spans.scope_spans[0].spans] == ["router.request"]


def test_unsupported_protocol_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match=r"OTEL_EXPORTER_OTLP_PROTOCOL='http/json'.*http/protobuf"):
        span_exporter(TelemetryConfig(exporter="otlp"))


def test_exporter_choice(tmp_path, monkeypatch) -> None:
    assert span_exporter(TelemetryConfig()) is None  # auto with nothing set: no export
    monkeypatch.setenv("PDD_TRACE_JSONL", str(tmp_path / "s.jsonl"))
    assert isinstance(span_exporter(TelemetryConfig()), JsonlSpanExporter)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")  # the SDK's off switch beats everything
    assert span_exporter(TelemetryConfig(exporter="jsonl")) is None
