"""A PDD system of real processes on one machine: a nats-server and one `pdd serve` per instance.

Fault tests and benchmarks (bench/chaos.py, bench/soak.py, bench/pipelines.py,
bench/calibration_holdout.py, the reliability tests) need the same things: start a config, wait
until it serves, kill or restart a part, read each instance's health and memory, stop everything.
`pdd up` is the user-facing launcher; this is the programmable one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdd.launch.children import child_env, serve_argv
from pdd.launch.natsserver import NatsServer, free_port, start_nats_server
from pdd.shared.roles import Role


def two_site_layout(prefill: int = 1, relay: int = 1, main_decode: int = 1, main_decode_site: str = "site-b",
                    routers: int = 1) -> dict:
    """The `sites` and `instances` of a config: routers (router-N), P (p-N) and relays (rld-N) at site-a, main
    decoders (md-N) at `main_decode_site` — the smallest system in which every pipeline runs. Several routers
    need ``router.reuse_port`` (they share the API port)."""
    roles = (("p", Role.PREFILL, prefill, "site-a"), ("rld", Role.RELAY, relay, "site-a"),
             ("md", Role.MAIN_DECODE, main_decode, main_decode_site))
    return {
        "sites": [{"name": "site-a"}, {"name": "site-b"}],
        "instances": [{"id": f"router-{i}", "role": Role.ROUTER.value, "site": "site-a"} for i in range(routers)]
        + [{"id": f"{prefix}-{i}", "role": role.value, "site": site} for prefix, role, n, site in roles for i in range(n)],
    }


def http_json(url: str, timeout: float = 2.0) -> tuple[int, Any]:
    """(status, parsed body); status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {}
    except (OSError, ValueError):
        return 0, {}


@dataclass
class Member:
    """One instance's process; stopped or killed by its own pid only."""

    instance_id: str
    role: str
    log_path: Path
    proc: subprocess.Popen
    _log_file: Any = field(default=None, repr=False)
    log_offset: int = 0  # where this process's lines start (a respawned instance appends to its log)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_event(self, event: str) -> dict | None:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return None
        for line in text.splitlines():
            if f'"{event}"' in line:
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    return None
        return None

    @property
    def metrics_url(self) -> str | None:
        ready = self.log_event("service_ready")
        return ready.get("metrics") if ready else None

    def health(self, timeout: float = 10.0) -> dict:
        url = self.metrics_url
        return http_json(url.replace("/metrics", "/health"), timeout)[1] if url else {}

    def rss_bytes(self) -> int:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive:
            os.kill(self.proc.pid, sig)
            if sig == signal.SIGKILL:
                self.proc.wait()

    def stop(self, timeout: float = 20.0) -> None:
        if self.alive:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            except ProcessLookupError:
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


class LocalCluster:
    """``config``: a whole PDD config (dict); ``nats.url`` and the router port are filled in here.

    ``nats_options``: keyword arguments of ``start_nats_server`` for auth and TLS (``token``, ``user``,
    ``password``, ``tls``); the services' credentials go in ``config["nats"]`` as in a deployment.
    """

    def __init__(self, run_dir: Path, config: dict, env: dict[str, str] | None = None,
                 nats_args: list[str] | None = None, nats_options: dict[str, Any] | None = None,
                 instance_env: dict[str, dict[str, str]] | None = None,
                 launch_prefix: dict[str, list[str]] | None = None):
        self.run_dir = Path(run_dir)
        self.config = json.loads(json.dumps(config))
        self.env = {"UCXPY_ENABLE_PYTHON_FUTURE": "1", **(env or {})}
        self.nats_args = list(nats_args or [])
        self.nats_options = dict(nats_options or {})
        self.instance_env = dict(instance_env or {})  # extra environment for one instance (by id)
        self.launch_prefix = dict(launch_prefix or {})  # argv before one instance's (by id): its site's netns
        self.nats: NatsServer | None = None
        self.nats_port = free_port()
        self.members: dict[str, Member] = {}
        router = self.config.setdefault("router", {})
        if not router.get("port"):
            router["port"] = free_port()
        self.port = int(router["port"])
        self.config_path = self.run_dir / "pdd.yaml"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 300.0) -> float:
        """Start everything and wait until every instance is ready and the router answers /health."""
        t0 = time.monotonic()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.start_nats()
        assert self.nats is not None
        self.config.setdefault("nats", {})["url"] = self.nats.url
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        for inst in self.config["instances"]:
            self.spawn(inst["id"])
        self.wait_ready(timeout - (time.monotonic() - t0))
        return time.monotonic() - t0

    def spawn(self, instance_id: str, env: dict[str, str] | None = None) -> Member:
        """(Re)start one instance from the written config."""
        inst = next(i for i in self.config["instances"] if i["id"] == instance_id)
        log_path = self.run_dir / f"{instance_id}.log"
        log_file = open(log_path, "ab")
        offset = log_file.tell()
        proc = subprocess.Popen(
            serve_argv(inst["role"], self.config_path, instance_id, self.launch_prefix.get(instance_id)),
            stdout=log_file, stderr=subprocess.STDOUT, env=child_env(self.env, self.instance_env.get(instance_id), env),
            start_new_session=True)
        member = Member(instance_id, inst["role"], log_path, proc, log_file, offset)
        self.members[instance_id] = member
        return member

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + max(1.0, timeout)
        while time.monotonic() < deadline:
            for m in self.members.values():
                if not m.alive:
                    raise RuntimeError(f"{m.instance_id} exited ({m.proc.returncode}); log {m.log_path}:\n"
                                       f"{m.log_path.read_text(errors='replace')[-3000:]}")
            every_ready = all(m.log_event("service_ready") for m in self.members.values())  # each router too
            if every_ready and http_json(self.base_url + "/health")[0] == 200:
                return
            time.sleep(0.25)
        raise TimeoutError(f"system not ready after {timeout:.0f}s; logs in {self.run_dir}")

    # -- faults -----------------------------------------------------------------------------------
    def start_nats(self) -> None:
        self.nats = start_nats_server(port=self.nats_port, log_file=str(self.run_dir / "nats-server.log"),
                                      extra_args=self.nats_args, **self.nats_options)

    def stop_nats(self) -> None:
        if self.nats is not None:
            self.nats.stop()
            self.nats = None

    def kill(self, instance_id: str, sig: int = signal.SIGKILL) -> None:
        self.members[instance_id].kill(sig)

    # -- state ------------------------------------------------------------------------------------
    def engine_members(self) -> list[Member]:
        return [m for m in self.members.values() if m.role != Role.ROUTER and m.alive]

    def leaked_blocks(self) -> dict[str, int]:
        """Per live engine instance: KV blocks neither free nor reclaimable cache (should be 0 when idle)."""
        out = {}
        for m in self.engine_members():
            engine = m.health().get("engine") or {}
            if not engine:
                out[m.instance_id] = -1  # did not answer
                continue
            out[m.instance_id] = (engine["total_blocks"] - engine["free_blocks"]
                                  - engine.get("evictable_blocks", 0))
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, int]:
        """Wait until no live engine holds request KV; returns the last leaked_blocks() reading."""
        deadline = time.monotonic() + timeout
        leaked = self.leaked_blocks()
        while time.monotonic() < deadline and any(v != 0 for v in leaked.values()):
            time.sleep(0.5)
            leaked = self.leaked_blocks()
        return leaked

    def stop(self, timeout: float = 20.0, until_exit: bool = True) -> dict[str, bool]:
        """SIGTERM every instance (they drain), wait up to ``timeout`` seconds, SIGKILL what is left,
        close the logs and stop nats-server. Returns per instance whether it stopped gracefully.

        ``until_exit``: wait for each process to exit (spans and logs written after
        ``service_stopped`` are flushed: bench/pipelines.py reads them); False counts an instance
        as stopped once it logged ``service_stopped`` (drained, bus closed) and SIGKILLs its
        interpreter teardown instead of waiting for it (bench/soak.py)."""
        for m in self.members.values():
            if m.alive:
                try:
                    m.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        clean: dict[str, bool] = {}
        while len(clean) < len(self.members):
            for iid, m in self.members.items():
                if iid in clean:
                    continue
                if not m.alive:
                    clean[iid] = m.proc.returncode == 0
                elif not until_exit and m.log_event("service_stopped"):
                    clean[iid] = True
            if len(clean) == len(self.members) or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        for iid, m in self.members.items():
            clean.setdefault(iid, False)
            m.kill()  # no-op for those already gone
            m.stop()  # closes its log
        self.stop_nats()
        return clean
