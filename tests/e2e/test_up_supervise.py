"""`pdd up` supervises its services and guards its port: a kill -9'd main decoder is restarted and the
system serves again; a taken API port is refused (naming it) with nothing started; readiness never
takes a foreign server answering /health for its own router; `--api-key` gives 401 without the key
(OpenAI's error shape) and 200 with it. Real processes: `pdd up` on the tiny model, a real nats-server."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from pdd.launch.natsserver import free_port
from pdd.launch.readiness import router_ready
from pdd.transports import ucx_available
from tests.e2e.test_up import alive

KEY = "sk-test-supervise"


def _wait_for(predicate, what: str, log: Path, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    """Poll until ``predicate()``; fail (with the log) when `pdd up` exits or the generous deadline passes."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"pdd up exited ({proc.returncode}) waiting for {what}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {what}:\n{log.read_text()}"
        time.sleep(0.3)


def _post(url: str, body: dict, key: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _base_config(path: Path, model: str) -> Path:
    path.write_text(yaml.safe_dump({
        "model": {"path": model, "kv_memory_mb": 8, "block_size": 16, "max_num_seqs": 32, "threads": 1},
        "transports": {"fast": {"name": "ucx" if ucx_available() else "zmq", "options": {}},
                       "wan": {"name": "zmq", "options": {"streams": 2}}},
        "router": {"request_timeout_s": 60},
        "service": {"heartbeat_ms": 500, "missed_heartbeats": 6, "drain_timeout_s": 5},
    }))
    return path


def _count(path: Path, needle: str) -> int:
    try:
        return path.read_text(errors="replace").count(needle)
    except OSError:
        return 0


@pytest.mark.timeout(600)
def test_pdd_up_restarts_a_killed_decoder_and_requires_its_api_key(tmp_path, tiny_model):
    from openai import APIError, OpenAI

    port = free_port()
    run_dir = tmp_path / "run"
    log = tmp_path / "up.log"
    with open(log, "wb") as out:  # the child holds its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdd.launch.cli", "up", "--model", str(tiny_model),
             "--config", str(_base_config(tmp_path / "base.yaml", str(tiny_model))), "--port", str(port),
             "--run-dir", str(run_dir), "--wan", "none", "--api-key", KEY],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(lambda: "ready: OpenAI API" in log.read_text(), "ready line", log, proc)
        assert "API key required" in log.read_text()
        assert oct((run_dir / "pdd.yaml").stat().st_mode & 0o777) == "0o600"  # the key is in it
        base = f"http://127.0.0.1:{port}"
        models = urllib.request.Request(base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(models, timeout=30) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        chat = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                "temperature": 0}
        # the API key: none or a wrong one -> 401 in OpenAI's error shape; the right one -> 200
        for key in (None, "sk-wrong"):
            status, body = _post(base + "/v1/chat/completions", chat, key)
            assert status == 401, body
            assert body["error"]["code"] == "invalid_api_key" and body["error"]["message"], body
        status, body = _post(base + "/v1/chat/completions", chat, KEY)
        assert status == 200 and body["choices"][0]["message"]["content"] is not None, body

        text = log.read_text()
        md_pid = int(re.search(r"main-decode-0\s+site=site-b pid=(\d+)", text).group(1))
        md_log = run_dir / "main-decode-0.log"
        assert _count(md_log, '"service_ready"') == 1
        client = OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "count"}], max_tokens=400, temperature=0,
            stream=True, extra_body={"ignore_eos": True, "pdd": {"pipeline": "P-MD"}})
        got, finish, error = 0, None, None
        try:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    got += 1
                    if got == 3:  # main decode is streaming this request: kill it
                        os.kill(md_pid, signal.SIGKILL)
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
        except APIError as exc:
            error = str(exc)
        assert got >= 3, log.read_text()
        # during the outage the request either finished (resumed elsewhere) or failed with a stated reason
        assert finish is not None or error, (finish, error)

        _wait_for(lambda: "main-decode-0 exited with signal SIGKILL" in log.read_text(), "exit line", log, proc)
        _wait_for(lambda: "restarted main-decode-0" in log.read_text(), "restart line", log, proc)
        assert "restart #1" in log.read_text()
        _wait_for(lambda: _count(md_log, '"service_ready"') == 2, "restarted decoder ready", log, proc)
        assert not alive(md_pid)

        def serves() -> bool:  # the router has taken the new decoder back: a P-MD request completes
            status, body = _post(base + "/v1/chat/completions", {**chat, "pdd": {"pipeline": "P-MD"}}, KEY)
            return status == 200 and body["pdd"]["pipeline"] == "P-MD"

        _wait_for(serves, "a P-MD request served after the restart", log, proc)
        assert proc.poll() is None  # pdd up kept running throughout
        for name in ("router-0", "prefill-0", "relay-0"):  # the others were never restarted
            assert f"restarted {name}" not in log.read_text()

        pids = [int(p) for p in re.findall(r"pid[= ](\d+)", log.read_text())]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
        assert "restarts: main-decode-0 1" in log.read_text()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if alive(p)], log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_pdd_up_refuses_a_taken_port(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        run_dir = tmp_path / "run"
        done = subprocess.run([sys.executable, "-m", "pdd.launch.cli", "up", "--port", str(port),
                               "--run-dir", str(run_dir)], check=False, capture_output=True, text=True,
                              timeout=120)
    assert done.returncode != 0, done.stdout + done.stderr
    assert f"port {port}" in done.stderr and "in use" in done.stderr, done.stderr
    assert not run_dir.exists()  # nothing was started: no run folder, no nats-server, no services


class _ForeignHealth(http.server.BaseHTTPRequestHandler):
    """Another system on the port: its /health says ok, even with the same router id `pdd up` uses."""

    def do_GET(self) -> None:
        body = json.dumps({"status": "ok", "router": "router-0", "instances": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_readiness_does_not_take_a_foreign_server_for_its_router(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ForeignHealth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    base = f"http://127.0.0.1:{port}"
    router_log = tmp_path / "router-0.log"
    try:
        router_log.write_text('{"event": "model_loaded"}\n')  # our router has not bound the port
        assert not router_ready(base, port, "router-0", router_log)
        router_log.write_text(f'{{"event": "api_listening", "url": "http://127.0.0.1:{free_port()}/v1"}}\n')
        assert not router_ready(base, port, "router-0", router_log)  # ours listens elsewhere
        assert not router_ready(base, port, "router-7", router_log)  # another id
        # our router's own log says it listens here and /health carries its id: that is ours, ready once it says so
        router_log.write_text(f'{{"event": "api_listening", "url": "http://127.0.0.1:{port}/v1"}}\n')
        assert not router_ready(base, port, "router-0", router_log)  # listening, not yet announced
        with router_log.open("a") as f:
            f.write('{"event": "service_ready", "metrics": "http://127.0.0.1:1/metrics"}\n')
        assert router_ready(base, port, "router-0", router_log)
        # ...but only the current process's lines count (a restarted router appends to the same log)
        assert not router_ready(base, port, "router-0", router_log, log_offset=router_log.stat().st_size)
    finally:
        server.shutdown()
        server.server_close()


def test_api_key_from_the_flag_and_from_the_environment(tmp_path, monkeypatch):
    import argparse

    from pdd.launch.up import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    nats = "nats://127.0.0.1:4222"
    assert build_config(parser.parse_args([]), nats, tmp_path / "none")["router"]["api_keys"] == []
    config = build_config(parser.parse_args(["--api-key", "k1", "--api-key", "k2"]), nats, tmp_path / "flag")
    assert config["router"]["api_keys"] == ["k1", "k2"]
    monkeypatch.setenv("PDD__ROUTER__API_KEYS", '["k-env"]')  # keeps the key out of the process list
    assert build_config(parser.parse_args([]), nats, tmp_path / "env")["router"]["api_keys"] == ["k-env"]
