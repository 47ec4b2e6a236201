"""Real PDD processes on a NATS server that requires TLS and a password.

With the right credentials and CA a service comes up and serves requests over the bus; a service
with a wrong password or an untrusted CA stops at start with a clear error (exit 1) instead of
retrying forever; no log line carries the password. The whole system (router, P, RLD, MD) serving
a completion over such a bus is the slow variant.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
import yaml

from pdd.launch.local_cluster import LocalCluster, two_site_layout
from pdd.launch.natsserver import ServerTLS, start_nats_server
from pdd.shared.bus import Bus
from pdd.shared.config import NatsConfig
from pdd.shared.protocol import CacheQuery, CacheQueryReply, Ping, Pong, Subjects
from tests.helpers import ServiceProcess
from tests.security.test_nats_auth import request_retrying

PASSWORD = "pw-9d2c41e7"
INSTANCES = two_site_layout()["instances"]


def _config(model: str, pki) -> dict:
    return {
        "model": {"path": str(model), "kv_memory_mb": 8, "block_size": 16, "max_num_seqs": 8, "threads": 1},
        "nats": {"user": "pdd", "password": PASSWORD, "tls": {"ca_file": pki.ca_file}},
        "sites": [{"name": "site-a"}, {"name": "site-b"}],
        "instances": INSTANCES,
        "transports": {"fast": {"name": "zmq"}, "wan": {"name": "zmq", "options": {"streams": 1}}},
        "router": {"request_timeout_s": 60},
        "service": {"heartbeat_ms": 500, "missed_heartbeats": 6, "drain_timeout_s": 5},
        "telemetry": {"exporter": "none", "log_format": "json"},
    }


def _service_failed(proc: ServiceProcess) -> dict:
    for line in proc.log().splitlines():
        if '"service_failed"' in line:
            return json.loads(line)
    raise AssertionError(f"no service_failed line:\n{proc.log()[-2000:]}")


async def _ask(nats_config: NatsConfig) -> tuple[Pong, CacheQueryReply]:
    bus = Bus(nats_config, "test-client")
    await bus.connect()
    try:
        pong = await request_retrying(bus, Subjects.instance("p-0", "ping"), Ping(payload="over tls"), timeout=30,
                                      expect=Pong)
        cached = await request_retrying(bus, Subjects.instance("p-0", "cache_query"), CacheQuery(prompt_ids=[1, 2, 3]),
                                        timeout=30, expect=CacheQueryReply)
        return pong, cached  # type: ignore[return-value]
    finally:
        await bus.close()


def test_prefill_with_credentials_serves_and_wrong_ones_exit(tiny_model, pki, tmp_path) -> None:
    server = start_nats_server(user="pdd", password=PASSWORD, tls=ServerTLS(pki.server_cert, pki.server_key),
                               log_file=str(tmp_path / "nats-server.log"))
    config = _config(tiny_model, pki)
    config["nats"]["url"] = server.url
    path = tmp_path / "pdd.yaml"
    path.write_text(yaml.safe_dump(config))
    procs = {}
    try:  # all three at once: the two refused ones only cost their start-up
        for name, env in (("good", {}), ("wrong-password", {"PDD__NATS__PASSWORD": "pw-wrong-1"}),
                          ("untrusted-ca", {"PDD__NATS__TLS__CA_FILE": pki.other_ca_file})):
            (tmp_path / name).mkdir()
            procs[name] = ServiceProcess("prefill", path, "p-0", tmp_path / name, env=env)
        for name, needle in (("wrong-password", "credentials refused"), ("untrusted-ca", "TLS handshake failed")):
            code = procs[name].proc.wait(timeout=240)  # bounded: a refused service must not retry forever
            assert code == 1, procs[name].log()[-2000:]
            assert needle in _service_failed(procs[name])["error"]
        procs["good"].wait_log("service_ready", timeout=240)
        pong, cached = asyncio.run(_ask(NatsConfig(**config["nats"])))
        assert pong.instance_id == "p-0" and pong.payload == "over tls"
        assert cached.instance_id == "p-0" and cached.cached_tokens == 0
        assert procs["good"].proc.poll() is None
    finally:
        for proc in procs.values():
            proc.stop()
        server.stop()
    for name, proc in procs.items():
        log = proc.log()
        assert PASSWORD not in log and "pw-wrong-1" not in log, name


@pytest.mark.slow
def test_whole_system_over_tls_and_password(tiny_model, pki, tmp_path) -> None:
    cluster = LocalCluster(tmp_path, _config(tiny_model, pki), nats_options={
        "user": "pdd", "password": PASSWORD, "tls": ServerTLS(pki.server_cert, pki.server_key)})
    try:
        cluster.start(timeout=300)
        assert cluster.config["nats"]["url"].startswith("tls://")
        body = json.dumps({"prompt": "hello secure world", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(cluster.base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            reply = json.loads(resp.read())
        assert reply["choices"][0]["finish_reason"] in ("length", "stop")
        assert reply["usage"]["completion_tokens"] >= 1
        for member in cluster.members.values():
            assert member.alive and member.health().get("nats_connected") is True
    finally:
        cluster.stop()
    for member in cluster.members.values():
        assert PASSWORD not in member.log_path.read_text(errors="replace"), member.instance_id
