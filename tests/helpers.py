"""Launch PDD services as real subprocesses and wait for them (used by integration tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


class ServiceProcess:
    def __init__(self, role: str, config: Path, instance_id: str, log_dir: Path, env: dict | None = None):
        self.role = role
        self.instance_id = instance_id
        self.log_path = log_dir / f"{instance_id}.log"
        child_env = dict(os.environ)
        child_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdd.launch.cli", "serve", role, "--config", str(config),
             "--instance-id", instance_id],
            stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT, env=child_env, start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, needle: str, timeout: float = 60.0) -> dict:
        """Wait for a JSON log line whose text contains ``needle``; return it parsed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log().splitlines():
                if needle in line:
                    try:
                        return json.loads(line)
                    except json.JSONDecodeError:
                        return {"raw": line}
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.instance_id} exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.instance_id}: no log line with {needle!r} in {timeout}s:\n{self.log()[-3000:]}")

    def health(self) -> tuple[int, dict]:
        url = self.wait_log("service_ready")["metrics"].replace("/metrics", "/health")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
