"""Per-transfer telemetry: one OTel span and three Prometheus metrics per completed transfer.

The span joins the request's trace through the W3C context carried in the frames, so a handoff
timeline shows when each KV transfer ran and at what rate.
"""

from __future__ import annotations

import time

from opentelemetry import propagate, trace
from prometheus_client import Counter, Histogram

_tracer = trace.get_tracer("pdd.transports")

BYTES = Counter("pdd:kv_transfer_bytes", "KV bytes moved by transports", ["transport", "direction"])
SECONDS = Histogram("pdd:kv_transfer_seconds", "Duration of one KV transfer", ["transport"],
                    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
GBPS = Histogram("pdd:kv_transfer_gbps", "Achieved Gbit/s of one KV transfer", ["transport"],
                 buckets=(0.01, 0.1, 0.5, 1, 2, 5, 10, 25, 50, 100, 400))


def record(transport: str, direction: str, nbytes: int, seconds: float,
           trace_context: dict | None = None, request_id: str | None = None) -> None:
    """Count the bytes, observe duration and rate, and emit a span covering the transfer."""
    gbps = nbytes * 8 / seconds / 1e9 if seconds > 0 else 0.0
    BYTES.labels(transport, direction).inc(nbytes)
    SECONDS.labels(transport).observe(seconds)
    GBPS.labels(transport).observe(gbps)
    parent = propagate.extract(trace_context) if trace_context else None
    end_ns = time.time_ns()
    span = _tracer.start_span(f"kv.transfer.{direction}", context=parent,
                              start_time=end_ns - int(seconds * 1e9))
    span.set_attributes({"pdd.transport": transport, "pdd.kv.bytes": nbytes,
                         "pdd.kv.duration_s": seconds, "pdd.kv.gbps": gbps,
                         "pdd.request_id": request_id or ""})
    span.end(end_time=end_ns)
