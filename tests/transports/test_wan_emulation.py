"""Kernel WAN emulation (root): the link's measured RTT and rate match the settings within 10%."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdd.transports.wan_emulation import WanConfig, WanEmulation, WanError

from .conftest import ROOT_SKIP

PROBE = str(Path(__file__).with_name("wan_probe.py"))
root = pytest.mark.skipif(ROOT_SKIP is not None, reason=ROOT_SKIP or "")


@pytest.mark.root
@root
def test_rtt_and_rate_match_settings() -> None:
    cfg = WanConfig(rate="200mbit", delay="20ms", ns_a="pddt-a", ns_b="pddt-b", subnet="10.78.0")
    with WanEmulation(cfg) as wan:
        assert wan.status()["relay_alive"]
        server = subprocess.Popen([*wan.exec_prefix("b"), sys.executable, PROBE, "server", "5201"],
                                  stdout=subprocess.PIPE)
        try:
            assert server.stdout.readline().strip() == b"LISTENING"

            def probe(kind: str) -> float:
                out = subprocess.run([*wan.exec_prefix("a"), sys.executable, PROBE, kind, cfg.addr_b, "5201"],
                                     capture_output=True, text=True, timeout=60, check=True)
                return json.loads(out.stdout)

            rtt, rate = probe("rtt"), probe("rate")
        finally:
            server.kill()
            server.wait()
    assert abs(rtt - 0.040) <= 0.004, f"RTT {rtt * 1e3:.1f} ms, expected 40 ms ± 10%"
    assert abs(rate - 200e6) <= 20e6, f"rate {rate / 1e6:.1f} Mbit/s, expected 200 ± 10%"
    assert not WanEmulation(cfg).is_up()
    assert "pddt-a" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.root
@root
def test_cli_up_status_down_and_double_up_refused(capsys) -> None:
    from pdd.launch.cli import main

    args = ["--ns-a", "pddt-c", "--ns-b", "pddt-d", "--subnet", "10.79.0"]
    assert main(["wan", "up", "--rate", "100mbit", "--delay", "5ms", "--jitter", "1ms", "--loss", "0.1%", *args]) == 0
    try:
        assert main(["wan", "up", *args]) == 1
        assert "already exist" in capsys.readouterr().out
        assert main(["wan", "status", *args]) == 0
        assert json.loads(capsys.readouterr().out)["up"] is True
    finally:
        assert main(["wan", "down", *args]) == 0
    assert main(["wan", "status", *args]) == 0
    assert json.loads(capsys.readouterr().out.split("WAN down")[-1])["up"] is False


def test_non_root_gets_a_clear_message(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(WanError, match="needs root"):
        WanEmulation(WanConfig(ns_a="x-a", ns_b="x-b")).up()
