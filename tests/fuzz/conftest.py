"""One live PDD system (nats-server, router, prefill, relay, main decode as real processes on a tiny
model), shared by the HTTP and bus fuzz tests of a session: starting it is most of their cost."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pdd.launch.local_cluster import LocalCluster, two_site_layout

ROUTER = "router-0"
ENGINES = ("p-0", "rld-0", "md-0")
MAX_BODY_BYTES = 256 * 1024  # small, so oversize bodies are cheap to send


def cluster_config(model: str) -> dict:
    return {
        "model": {"path": model, "kv_memory_mb": 8, "block_size": 16, "max_num_seqs": 32, "threads": 1},
        **two_site_layout(),
        "transports": {"fast": {"name": "zmq"}, "wan": {"name": "zmq", "options": {"streams": 2}}},
        "router": {"request_timeout_s": 60, "max_body_bytes": MAX_BODY_BYTES},
        "service": {"heartbeat_ms": 500, "missed_heartbeats": 6, "drain_timeout_s": 5},
        "telemetry": {"exporter": "none", "log_format": "json"},
    }


@pytest.fixture(scope="session")
def fuzz_cluster(tiny_model, tmp_path_factory):
    cluster = LocalCluster(tmp_path_factory.mktemp("fuzz-cluster"), cluster_config(str(tiny_model)))
    try:
        seconds = cluster.start(240)
        print(f"\n[fuzz] live system ready in {seconds:.1f}s ({cluster.run_dir})")
        yield cluster
    finally:
        cluster.stop()


def complete(cluster: LocalCluster, prompt: str = "Hello world", max_tokens: int = 4, timeout: float = 60,
             **extra) -> dict:
    """One ordinary request; raises unless it succeeds."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}).encode()
    req = urllib.request.Request(cluster.base_url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def assert_system_healthy(cluster: LocalCluster, idle_timeout: float = 60.0) -> dict[str, int]:
    """Every process alive and serving; no engine holds request KV once idle; a normal request works
    on each pipeline. Returns the leaked-blocks reading (all zero)."""
    dead = {m.instance_id: m.proc.returncode for m in cluster.members.values() if not m.alive}
    assert not dead, f"processes died: {dead}; logs in {cluster.run_dir}"
    cluster.wait_ready(60)
    for m in cluster.members.values():
        if m.role != "router":
            health = m.health()
            assert health.get("status") == "ready" and health.get("nats_connected"), (m.instance_id, health)
    leaked = cluster.wait_idle(idle_timeout)
    assert all(v == 0 for v in leaked.values()), f"KV blocks still held when idle: {leaked}"
    for pipeline in ("P-MD", "P-RLD-MD", "P-RLD"):
        out = complete(cluster, max_tokens=6, pdd={"pipeline": pipeline, "return_token_ids": True})
        assert out["usage"]["completion_tokens"] >= 1, out
        assert out["pdd"]["pipeline"] == pipeline, out["pdd"]
    leaked = cluster.wait_idle(idle_timeout)
    assert all(v == 0 for v in leaked.values()), f"KV blocks held after normal requests: {leaked}"
    return leaked


def wait_router_view(cluster: LocalCluster, expected: set[str], timeout: float = 30.0) -> None:
    """Wait until the router's registry lists exactly the real instances (spoofed ones gone)."""
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(cluster.base_url + "/health", timeout=5) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        except OSError:
            body = {}
        seen = {i["instance"] for i in body.get("instances", [])}
        if seen == expected:
            return
        time.sleep(0.25)
    raise AssertionError(f"router still lists {sorted(seen)}, expected {sorted(expected)}")


def log_events(cluster: LocalCluster, *events: str) -> dict[str, int]:
    """How many log lines of each member name one of ``events`` (bugs the services caught themselves)."""
    out: dict[str, int] = {}
    for m in cluster.members.values():
        try:
            text = Path(m.log_path).read_text(errors="replace")
        except OSError:
            continue
        n = sum(1 for line in text.splitlines() if any(f'"event": "{e}"' in line for e in events))
        if n:
            out[m.instance_id] = n
    return out
