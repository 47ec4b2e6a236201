"""`pdd up` as a user runs it: the default model answers an OpenAI chat request; SIGTERM leaves nothing.
Also (cheap, no processes): the WAN it emulates by default, `--wan none`, explicit figures, and a base
config's own shaper figures winning over the default."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from pdd.launch.natsserver import free_port
from pdd.launch.up import DEFAULT_WAN, add_arguments, build_config
from pdd.shared.config import load_config

NATS = "nats://127.0.0.1:4222"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _up_config(tmp_path, *argv: str) -> tuple[dict, str]:
    notes: dict = {}
    config = build_config(_args(*argv), NATS, tmp_path, notes)
    path = tmp_path / "pdd.yaml"  # what `pdd up` writes and every service loads: must stay valid
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    load_config(path, environ={})
    return config["transports"]["wan"]["options"], notes["wan"]


def _help() -> str:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.format_help()


def test_pdd_up_emulates_a_wan_by_default(tmp_path) -> None:
    assert DEFAULT_WAN == "rate=100mbit,delay=20ms"
    options, line = _up_config(tmp_path)
    assert options["shape"] == {"rate": "100mbit", "delay": "20ms"}
    assert line.startswith("WAN site-a <-> site-b: 100 Mbit/s, 20 ms one-way (emulated; --wan none to switch off)")
    assert "default" in line and "assumed" in line  # the figures' source is stated
    assert "Default rate=100mbit,delay=20ms" in " ".join(_help().split())  # --help states it too


def test_pdd_up_wan_none_and_explicit_figures(tmp_path) -> None:
    options, line = _up_config(tmp_path / "none", "--wan", "none")
    assert "shape" not in options and "not emulated" in line
    options, line = _up_config(tmp_path / "explicit", "--wan", "rate=1gbit,delay=5ms")
    assert options["shape"] == {"rate": "1gbit", "delay": "5ms"}
    assert line == "WAN site-a <-> site-b: 1 Gbit/s, 5 ms one-way (emulated; --wan none to switch off)"
    with pytest.raises(ValueError, match="--wan"):
        build_config(_args("--wan", "rate=fast"), NATS, tmp_path / "bad")


def test_pdd_up_base_config_shape_wins_over_the_default(tmp_path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"transports": {"wan": {"name": "zmq", "options": {
        "shape": {"rate": "10gbit", "delay": "40ms"}}}}}))
    options, line = _up_config(tmp_path / "a", "--config", str(base))
    assert options["shape"] == {"rate": "10gbit", "delay": "40ms"}
    assert line.startswith("WAN site-a <-> site-b: 10 Gbit/s, 40 ms one-way") and "base config" in line
    # an explicit --wan still overrides it, as before
    options, _ = _up_config(tmp_path / "b", "--config", str(base), "--wan", "rate=1gbit,delay=5ms")
    assert options["shape"] == {"rate": "1gbit", "delay": "5ms"}


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
    proc = subprocess.Popen([sys.executable, "-m", "pdd.launch.cli", "up", "--port", str(port),
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
        assert "WAN site-a <-> site-b: 1 Gbit/s, 10 ms one-way (emulated" in log.read_text(), log.read_text()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if alive(p)], log.read_text()
        for name in ("router-0", "prefill-0", "relay-0", "main-decode-0"):
            assert "service_stopped" in (tmp_path / "run" / f"{name}.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
