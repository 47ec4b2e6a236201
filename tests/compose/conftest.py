"""The compose suite's system: compose/docker-compose.yaml built and brought up on this machine's dockerd.

Everything is real: the image (built by scripts/compose_up.sh --prepare: local base image, wheelhouse,
Compose v2 where missing), the WAN container, NATS leaf across it, the four roles (two routers behind the
`api` load balancer). The one change is
the model: a seeded tiny checkpoint (bind-mounted through an override file, ``PDD__MODEL__PATH``) so the
suite fits on 2 cores; the compose file itself serves the built-in SmolLM2. The suite skips, with the
reason, where no Docker engine answers and none can be started.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose" / "docker-compose.yaml"
PROJECT = "pdd-compose-test"
PDD_SERVICES = ("router-0", "router-1", "prefill", "relay", "main-decode")
ROUTERS = ("router-0", "router-1")  # behind `api`, the one published API port
WAN_RATE, WAN_DELAY = "200mbit", "20ms"


def _docker_answers() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True, check=False).returncode == 0


def ensure_dockerd() -> str | None:
    """None when a Docker engine answers (started here as root if needed), else why not."""
    if _docker_answers():
        return None
    if shutil.which("docker") is None or shutil.which("dockerd") is None:
        return "no docker CLI or dockerd here (Debian: apt-get install docker.io)"
    if os.geteuid() != 0:
        return "no Docker engine answers and starting dockerd needs root"
    with open("/var/log/pdd-dockerd.log", "ab") as log:  # dockerd keeps running after the suite
        subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
    for _ in range(60):
        if _docker_answers():
            return None
        time.sleep(1)
    return "dockerd did not start: " + Path("/var/log/pdd-dockerd.log").read_text(errors="replace")[-500:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ComposeProject:
    """`docker compose` on the project's file plus the suite's override, under its own project name."""

    override: Path
    env: dict[str, str]
    model_dir: str
    api_port: int
    otlp_port: int
    router_metrics_ports: dict[str, int] = field(default_factory=dict)  # each router's published metrics port
    log: list[str] = field(default_factory=list)

    def cmd(self, *args: str, check: bool = True, timeout: float = 600, input: str | None = None
            ) -> subprocess.CompletedProcess:
        argv = ["docker", "compose", "-p", PROJECT, "-f", str(COMPOSE_FILE), "-f", str(self.override), *args]
        proc = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout, input=input,
                              check=False)
        self.log.append(f"$ {' '.join(argv[6:])} -> {proc.returncode}")
        if check and proc.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} failed ({proc.returncode}):\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def ps(self) -> dict[str, dict]:
        """Every container of the project (stopped ones too), by service name."""
        out = self.cmd("ps", "-a", "--format", "json").stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        if len(rows) == 1 and isinstance(rows[0], list):  # older Compose prints one JSON array
            rows = rows[0]
        return {row["Service"]: row for row in rows}

    def exec_python(self, service: str, code: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return self.cmd("exec", "-T", service, "python", "-c", code, check=False, timeout=timeout)

    def can_connect(self, service: str, host: str, port: int, timeout_s: float = 3.0) -> bool:
        """Whether a TCP connection from inside ``service`` to host:port completes."""
        code = f"import socket; socket.create_connection(({host!r}, {port}), timeout={timeout_s}).close()"
        return self.exec_python(service, code, timeout=timeout_s + 30).returncode == 0

    def wait_healthy(self, services: tuple[str, ...] | None = None, timeout: float = 300) -> dict[str, dict]:
        """Until every listed (default: every long-running) container is running and, where it has a
        healthcheck, healthy; returns ``ps``."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.ps()
            wanted = services or tuple(s for s in rows if not s.startswith("keys-"))
            bad = {s: (rows.get(s) or {}).get("Status", "missing") for s in wanted
                   if s not in rows or rows[s]["State"] != "running" or rows[s].get("Health") not in ("", "healthy")}
            if not bad:
                return rows
            if time.monotonic() > deadline:
                logs = self.cmd("logs", "--tail", "40", *bad, check=False).stdout
                raise AssertionError(f"not healthy after {timeout:.0f}s: {bad}\n{logs[-6000:]}")
            time.sleep(2)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}/v1"


@pytest.fixture(scope="session")
def compose_project(tmp_path_factory) -> ComposeProject:
    reason = ensure_dockerd()
    if reason:
        pytest.skip(reason)
    from pdd.engine.torch_backend.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("compose")
    # big enough that a 1,000-token prompt's KV (2 KB a token) outlasts the WAN shaper's burst
    model = build_tiny_checkpoint(root / "model", seed=0, hidden_size=256, num_heads=8, num_kv_heads=4,
                                  intermediate_size=512, max_position_embeddings=4096)
    os.chmod(root, 0o755)
    model_env = {"PDD__MODEL__PATH": "/models/tiny"}
    override = {"services": {name: {"environment": model_env, "volumes": [f"{model}:/models/tiny:ro"]}
                             for name in PDD_SERVICES}}
    override_path = root / "override.yaml"
    override_path.write_text(yaml.safe_dump(override))
    api_port, otlp_port = free_port(), free_port()
    metrics_ports = {router: free_port() for router in ROUTERS}
    env = {**os.environ, "BASE_IMAGE": os.environ.get("BASE_IMAGE", "pdd-base:bookworm"),
           "PDD_API_PORT": str(api_port), "PDD_OTLP_PORT": str(otlp_port),
           "PDD_ROUTER_METRICS_PORT": str(metrics_ports["router-0"]),
           "PDD_ROUTER_1_METRICS_PORT": str(metrics_ports["router-1"]),
           "WAN_RATE": WAN_RATE, "WAN_DELAY": WAN_DELAY, "WAN_JITTER": "0ms"}
    project = ComposeProject(override_path, env, model, api_port, otlp_port, metrics_ports)
    project.cmd("down", "-v", "--remove-orphans", check=False)  # a crashed earlier run
    yield project
    project.cmd("down", "-v", "--remove-orphans", "-t", "5", check=False)
