"""Real processes against a real nats-server: discovery, failure detection, bad input, tracing."""

import asyncio
import json
import time

import nats
import pytest

from pdd.shared.bus import Bus, BusError
from pdd.shared.config import NatsConfig, TelemetryConfig
from pdd.shared.protocol import Ping, Pong, Subjects, encode
from pdd.shared.telemetry import get_tracer, setup_tracing, shutdown_tracing
from tests.helpers import ServiceProcess, write_config

HEARTBEAT_MS = 200
SUSPECT_S = 1.0


@pytest.fixture
def config_path(tmp_path, nats_url, tiny_model):
    return write_config(tmp_path / "pdd.yaml", {
        "model": {"path": tiny_model},
        "router": {"port": 0},
        "nats": {"url": nats_url},
        "sites": [{"name": "site-a"}, {"name": "site-b"}],
        "instances": [
            {"id": "router-a", "role": "router", "site": "site-a"},
            {"id": "router-b", "role": "router", "site": "site-b"},
        ],
        "service": {"heartbeat_ms": HEARTBEAT_MS, "missed_heartbeats": 3, "drain_timeout_s": 2,
                    "suspect_timeout_s": SUSPECT_S},
        "telemetry": {"exporter": "jsonl", "jsonl_path": str(tmp_path / "spans.jsonl"), "log_format": "json"},
    })


def registry_of(proc: ServiceProcess) -> list[str]:
    _, body = proc.health()
    return [i["instance"] for i in body["instances"]]


def wait_until(predicate, timeout: float, step: float = 0.02) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(step)
    raise AssertionError("condition not met in time")


@pytest.fixture
def two_services(config_path, tmp_path):
    """Two processes that have discovered each other through announce/heartbeat."""
    a = ServiceProcess("router", config_path, "router-a", tmp_path)
    b = ServiceProcess("router", config_path, "router-b", tmp_path)
    try:
        a.wait_log("service_ready")
        b.wait_log("service_ready")
        wait_until(lambda: "router-b" in registry_of(a), timeout=10)
        wait_until(lambda: "router-a" in registry_of(b), timeout=10)
        yield a, b
    finally:
        a.stop()
        b.stop()


def test_discovery_and_kill9_detection(two_services):
    a, b = two_services
    b.kill()  # SIGKILL: no goodbye message
    killed_at = time.monotonic()

    def suspected() -> bool:
        return any(i["instance"] == "router-b" and i["suspected"] for i in a.health()[1]["instances"])

    wait_until(suspected, timeout=5, step=0.01)
    # suspected (no new work) within 3 heartbeat periods (plus one prune tick and the health poll) ...
    assert time.monotonic() - killed_at <= 3 * HEARTBEAT_MS / 1000 + 0.3
    wait_until(lambda: "router-b" not in registry_of(a), timeout=10, step=0.01)
    # ... and dropped suspect_timeout_s later
    assert time.monotonic() - killed_at <= 3 * HEARTBEAT_MS / 1000 + SUSPECT_S + 0.3
    assert a.health()[0] == 200


def test_sigterm_drains_and_leaves_the_registry_at_once(two_services):
    a, b = two_services
    # startup objects (modules, config, model) are frozen out of the collector: no full-GC pauses
    # over them while serving, no final collection over them at exit
    assert b.wait_log("service_ready")["gc_frozen_objects"] > 10_000
    assert b.stop() == 0
    assert "service_stopped" in b.log()
    # the 'stopped' announce removes it before any heartbeat could be missed
    wait_until(lambda: "router-b" not in registry_of(a), timeout=HEARTBEAT_MS / 1000)


async def test_bad_messages_are_rejected_and_service_keeps_answering(config_path, tmp_path, nats_url):
    a = ServiceProcess("router", config_path, "router-a", tmp_path)
    try:
        await asyncio.to_thread(a.wait_log, "service_ready")
        nc = await nats.connect(nats_url)
        subject = Subjects.instance("router-a", "ping")
        good = encode(Ping(payload="hi"))
        bad_inputs = [b"", b"\x00\xff garbage", good[:-2], good.replace(b"\x01", b"\x07", 1), b"x" * 1_040_000]
        for data in bad_inputs:
            reply = await nc.request(subject, data, timeout=3)
            assert b"protocol_error" in reply.data
        await nc.publish(subject, b"\x93garbage no reply")  # fire-and-forget garbage too
        await nc.close()
        bus = Bus(NatsConfig(url=nats_url), "test")
        await bus.connect()
        pong = await bus.request(subject, Ping(payload="still there"), expect=Pong)
        assert pong.payload == "still there" and pong.instance_id == "router-a"
        with pytest.raises(BusError) as info:
            await bus.request(Subjects.instance("nobody", "ping"), Ping(), timeout=1)
        assert info.value.code in ("no_responders", "timeout")
        await bus.close()
        log = a.log()
        assert log.count('"bus_message_rejected"') >= len(bad_inputs)
        assert '"code": "oversize"' in log and '"code": "wrong_version"' in log
    finally:
        a.stop()


async def test_one_trace_spans_two_processes(config_path, tmp_path, nats_url):
    spans_path = tmp_path / "spans.jsonl"
    client_spans = tmp_path / "client_spans.jsonl"
    a = ServiceProcess("router", config_path, "router-a", tmp_path)
    try:
        await asyncio.to_thread(a.wait_log, "service_ready")
        setup_tracing("test-client", TelemetryConfig(exporter="jsonl", jsonl_path=str(client_spans)))
        bus = Bus(NatsConfig(url=nats_url), "test")
        await bus.connect()
        with get_tracer("test").start_as_current_span("client.request") as span:
            trace_id = format(span.get_span_context().trace_id, "032x")
            await bus.request(Subjects.instance("router-a", "ping"), Ping(payload="traced"))
        await bus.close()
        shutdown_tracing()
        a.stop()  # flushes the service's spans
        service_spans = [json.loads(line) for line in spans_path.read_text().splitlines()]
        ping_spans = [s for s in service_spans if s["name"] == "ping"]
        assert ping_spans, service_spans
        assert ping_spans[-1]["trace_id"] == trace_id
        assert ping_spans[-1]["service"] == "pdd-router"
        client = [json.loads(line) for line in client_spans.read_text().splitlines()]
        assert client[0]["span_id"] == ping_spans[-1]["parent_span_id"]
    finally:
        a.stop()


async def test_dead_trace_collector_never_breaks_serving(tmp_path, nats_url, tiny_model):
    """OTLP pointed at a closed port: spans are dropped in the background, requests keep flowing."""
    path = write_config(tmp_path / "otlp.yaml", {
        "model": {"path": tiny_model}, "router": {"port": 0}, "nats": {"url": nats_url},
        "instances": [{"id": "router-x", "role": "router", "site": "site-a"}],
        "telemetry": {"exporter": "otlp", "otlp_endpoint": "http://127.0.0.1:1", "log_format": "json"},
    })
    proc = ServiceProcess("router", path, "router-x", tmp_path)
    try:
        await asyncio.to_thread(proc.wait_log, "service_ready")
        bus = Bus(NatsConfig(url=nats_url), "test")
        await bus.connect()
        for i in range(30):
            pong = await bus.request(Subjects.instance("router-x", "ping"), Ping(payload=str(i)), timeout=5)
            assert pong.payload == str(i)
        await bus.close()
        assert proc.stop() == 0
        assert "service_stopped" in proc.log()
    finally:
        proc.stop()
