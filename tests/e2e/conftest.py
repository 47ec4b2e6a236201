"""A whole PDD system of real processes (router, prefill, relay, main decode) on a tiny model."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from pdd.services.launch.local_cluster import two_site_layout
from pdd.services.launch.natsserver import free_port
from pdd.transports import ucx_available
from tests.helpers import ServiceProcess, write_config


class System:
    def __init__(self, root: Path, config_path: Path, port: int, procs: dict[str, ServiceProcess]):
        self.root = root
        self.config_path = config_path
        self.port = port
        self.procs = procs

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")
        except OSError:
            return 0, {}

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs.values():
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.instance_id} exited:\n{p.log()[-4000:]}")
            if self.health()[0] == 200:
                return
            time.sleep(0.2)
        raise TimeoutError(f"system not ready: {self.health()}")

    def instance_health(self, instance_id: str) -> dict:
        return self.procs[instance_id].health()[1]

    def stop(self) -> None:
        for p in self.procs.values():
            p.stop()


def start_system(root: Path, nats_url: str, model: str, wan_options: dict | None = None,
                 policy: dict | None = None) -> System:
    port = free_port()
    config = {
        "model": {"path": model, "kv_memory_mb": 8, "block_size": 16, "max_num_seqs": 32, "threads": 1},
        "nats": {"url": nats_url},
        **two_site_layout(),
        "transports": {
            "fast": {"name": "ucx" if ucx_available() else "zmq", "options": {}},
            "wan": {"name": "zmq", "options": {"streams": 2, **(wan_options or {})}},
        },
        "router": {"port": port, "request_timeout_s": 60},
        "policy": policy or {},
        "service": {"heartbeat_ms": 500, "missed_heartbeats": 6, "drain_timeout_s": 5},
        "telemetry": {"exporter": "jsonl", "jsonl_path": str(root / "spans.jsonl"), "log_format": "json"},
    }
    path = write_config(root / "pdd.yaml", config)
    procs = {}
    for inst in config["instances"]:
        procs[inst["id"]] = ServiceProcess(inst["role"], path, inst["id"], root)
    system = System(root, path, port, procs)
    try:
        system.wait_ready()
    except Exception:
        system.stop()
        raise
    return system


WAN_DELAY_S = 0.5


@pytest.fixture(scope="session")
def system(tmp_path_factory, nats_url, tiny_model):
    """One system for the e2e session; the WAN delay makes MD's KV land mid-stream."""
    sys_ = start_system(tmp_path_factory.mktemp("pdd"), nats_url, tiny_model,
                        wan_options={"shape": {"delay": f"{int(WAN_DELAY_S * 1000)}ms"}},
                        policy={"handoff_final_gap": 2})
    yield sys_
    sys_.stop()


@pytest.fixture(scope="session")
def reference(tiny_model):
    from pdd.engine import Engine

    return Engine.from_model(tiny_model, kv_memory_bytes=8 << 20, num_threads=1)
