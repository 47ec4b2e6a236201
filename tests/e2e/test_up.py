"""`pdd up` as a user runs it: the default model answers an OpenAI chat request; SIGTERM leaves nothing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pdd.services.launch.natsserver import free_port


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(600)
def test_pdd_up_default_model_chat_then_sigterm(tmp_path):
    from openai import OpenAI

    port = free_port()
    log = tmp_path / "up.log"
    proc = subprocess.Popen([sys.executable, "-m", "pdd.services.launch.cli", "up", "--port", str(port),
                             "--run-dir", str(tmp_path / "run"), "--wan", "rate=1gbit,delay=10ms"],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 540
        while "ready: OpenAI API" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        text = log.read_text()
        pids = [int(p) for p in re.findall(r"pid[= ](\d+)", text)]
        assert len(pids) >= 5, text  # nats-server + router + prefill + relay + decode
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0)
        answer = reply.choices[0].message.content
        assert "Paris" in answer, answer
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if alive(p)], log.read_text()
        for name in ("router-0", "prefill-0", "relay-0", "main-decode-0"):
            assert "service_stopped" in (tmp_path / "run" / f"{name}.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
