"""The compose file's OTLP/HTTP trace collector: every service exports here (OTEL_EXPORTER_OTLP_ENDPOINT).

Why it exists: Jaeger's image cannot be pulled everywhere, yet every site's spans must land somewhere
inside the compose network and be readable. This collector decodes each OTLP/HTTP protobuf export
(opentelemetry-proto, installed with the SDK), keeps the spans in memory for `GET /spans` (the compose
test suite reads one trace per request from it), and forwards the export unchanged to ``--forward``
(Jaeger's OTLP port in the `observability` profile), so Jaeger reads the same stream.

    python compose/otlp_sink.py --port 4318 [--forward http://jaeger:4318]
    curl localhost:4318/spans?trace_id=HEX
"""

from __future__ import annotations

import argparse
import gzip
import json
import threading
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

MAX_SPANS = 200_000  # oldest dropped beyond this: a long-running compose stays bounded


def any_value(value: AnyValue) -> Any:
    """An OTLP attribute value as plain JSON."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind) if kind else None


def decode(body: bytes) -> list[dict[str, Any]]:
    """Every span of one export, flat, with its service's resource attributes."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: any_value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append({
                    "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex(), "name": span.name,
                    "service": resource.get("service.name", ""), "instance": resource.get("service.instance.id", ""),
                    "start_ns": span.start_time_unix_nano, "end_ns": span.end_time_unix_nano,
                    "attributes": {kv.key: any_value(kv.value) for kv in span.attributes},
                })
    return spans


class Store:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[dict[str, Any]] = []
        self.exports = 0

    def add(self, spans: list[dict[str, Any]]) -> None:
        with self.lock:
            self.spans.extend(spans)
            del self.spans[:-MAX_SPANS]
            self.exports += 1

    def query(self, trace_id: str | None) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if trace_id is None or s["trace_id"] == trace_id]


def make_handler(store: Store, forward: str | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # one line per export would drown the compose logs
            pass

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            if self.path.split("?")[0] != "/v1/traces":
                self._reply(404, b"only /v1/traces (OTLP/HTTP protobuf)", "text/plain")
                return
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = gzip.decompress(raw) if self.headers.get("Content-Encoding") == "gzip" else raw
            try:
                store.add(decode(body))
            except DecodeError as exc:
                self._reply(400, f"not an OTLP ExportTraceServiceRequest: {exc}".encode(), "text/plain")
                return
            if forward:
                _forward(forward, body)
            self._reply(200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

        def do_GET(self) -> None:
            url = urllib.parse.urlparse(self.path)
            if url.path == "/health":
                self._reply(200, json.dumps({"status": "ok", "exports": store.exports}).encode(), "application/json")
            elif url.path == "/spans":
                trace_id = urllib.parse.parse_qs(url.query).get("trace_id", [None])[0]
                self._reply(200, json.dumps(store.query(trace_id)).encode(), "application/json")
            else:
                self._reply(404, b"GET /spans[?trace_id=HEX] or /health", "text/plain")

    return Handler


def _forward(base: str, body: bytes) -> None:
    """Pass the export on unchanged; a missing or slow Jaeger never fails the services' export."""
    req = urllib.request.Request(base.rstrip("/") + "/v1/traces", data=body, method="POST",
                                 headers={"Content-Type": "application/x-protobuf"})
    try:
        urllib.request.urlopen(req, timeout=2).close()
    except OSError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--forward", default="", help="also send every export to this OTLP/HTTP base URL")
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), make_handler(Store(), args.forward or None))
    print(f"otlp-sink: listening on {args.host}:{args.port}" + (f", forwarding to {args.forward}" if args.forward
                                                                  else ""), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
