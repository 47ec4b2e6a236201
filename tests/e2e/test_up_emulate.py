"""`pdd up --emulate SCENARIO`: the live system on emulated accelerators.

Cheap (no processes): the config it writes for the report's scenario — backend, instance counts from the
scenario's pdd system, the WAN from its link figures divided by the KV scale — and the banner stating them.
Real: `pdd up --emulate small` (the small test profile) answers a chat request through real processes.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from pdd.launch.natsserver import free_port
from pdd.launch.up import build_config
from pdd.shared.config import load_config
from pdd.transports.units import rate_bits, seconds
from tests.e2e.test_up import _args

NATS = "nats://127.0.0.1:4222"


def test_emulate_report_writes_the_reports_shape(tmp_path) -> None:
    import yaml

    notes: dict = {}
    config = build_config(_args("--emulate", "report"), NATS, tmp_path, notes)
    (tmp_path / "pdd.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    loaded = load_config(tmp_path / "pdd.yaml", environ={})  # what every service reads
    assert loaded.model.backend == "emulated"
    assert (loaded.engine_section().scenario, loaded.engine_section().system) == ("report", "pdd")
    roles = [i.role for i in loaded.instances]
    # 43 GPU-A in instances of 8: 4 prefill + 1 relay; 32 GPU-B: 4 main decode
    assert (roles.count("prefill"), roles.count("relay"), roles.count("main-decode")) == (4, 1, 4)
    shape = config["transports"]["wan"]["options"]["shape"]
    scale = 50000 / 48  # the report's 50 KB/token over 48 real bytes
    assert rate_bits(shape["rate"]) == pytest.approx(10e9 / scale, rel=1e-3)  # 10 Gbit/s per flow / scale
    assert seconds(shape["delay"]) == pytest.approx(0.015 + 0.18)  # latency + per-transfer setup
    # the router decides as the simulator does: the scenario's policy, the emulated link's rate assumed until
    # main decode has measured one (so a 64K-token transfer is not taken for a small one)
    assert loaded.policy.anomalous_max_output_tokens == 500
    assert loaded.policy.default_wan_gbps * 1e9 == pytest.approx(rate_bits(shape["rate"]), rel=1e-3)
    assert "scale 1/1042" in notes["emulation"] and "GPU-B (H200-class)" in notes["emulation"]
    assert "per flow / 1042 (KV scale)" in notes["wan"]


def test_emulate_counts_and_wan_given_on_the_command_line_win(tmp_path) -> None:
    config = build_config(_args("--emulate", "report", "--prefill", "1", "--main-decode", "2", "--wan",
                                "rate=1gbit,delay=5ms", "--time-dilation", "2"), NATS, tmp_path, {})
    roles = [i["role"] for i in config["instances"]]
    assert (roles.count("prefill"), roles.count("relay"), roles.count("main-decode")) == (1, 1, 2)
    assert config["transports"]["wan"]["options"]["shape"] == {"rate": "1gbit", "delay": "5ms"}
    assert config["emulation"]["time_dilation"] == 2


@pytest.mark.timeout(300)
def test_emulate_small_answers_a_chat_request(tmp_path, tiny_model) -> None:
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "pdd.launch.cli", "up", "--emulate", "small", "--model", str(tiny_model),
         "--port", str(free_port()), "--run-dir", str(run), "--ask", "hello", "--exit-after-ask",
         "--ask-timeout", "120"], capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "emulated accelerators (small, system pdd)" in out and "[pipeline:" in out
    for name in ("prefill-0", "relay-0", "main-decode-0"):
        loaded = [json.loads(line) for line in (run / f"{name}.log").read_text().splitlines()
                  if '"model_loaded"' in line]
        assert loaded and loaded[0]["backend"] == "emulated", name
        assert loaded[0]["emulated"]["chip"] == "small test chip"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed (tests/vllm covers it)")
def test_backend_vllm_without_vllm_is_a_clear_config_error(tmp_path) -> None:
    from pdd.shared.config import ConfigError

    with pytest.raises(ConfigError, match="bash scripts/install_vllm.sh"):
        build_config(_args("--backend", "vllm"), NATS, tmp_path, {})
