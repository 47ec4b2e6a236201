"""bench/control_plane.py end to end on one small level: real processes (router, P, RLD, MD on the emulated
backend, nats-server), real streams. Checks what it measures is there and sane — every stream completed, the
delivered rate and per-service CPU per token are positive, the added ITL is ITL p99 less the modeled step —
never a speed (the box is shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_level_reports_rates_latency_and_cpu_per_token(tmp_path, tiny_model) -> None:
    proc = subprocess.run([sys.executable, "-m", "pdd.bench.control_plane", "--model", str(tiny_model),
                           "--levels", "8x4", "--tokens", "60", "--run-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    (level,) = report["levels"]
    assert level["completed"] == level["requests"] == 8
    assert level["delivered_tokens_per_s"] > 0 and level["offered_tokens_per_s"] > 0
    assert level["modeled_step_ms"] > 0 and level["md_steps"] >= 60 - 1
    assert abs(level["itl_p99_ms"] - level["modeled_step_ms"] - level["added_itl_p99_ms"]) < 0.01
    # the router's own delay, from its /metrics histogram over the level: one SSE event per token or fewer
    assert 0 < level["router_delay_p50_ms"] <= level["router_delay_p99_ms"]
    for service in ("router", "md", "p", "nats-server", "client"):
        assert level["cpu_us_per_token"][service] > 0, (service, level)
    assert "Rules:" in proc.stdout


def test_two_routers_share_the_port_and_their_figures_add_up(tmp_path, tiny_model) -> None:
    """--routers 2: the client's connections spread over both routers (each served some), CPU and delay are the
    routers' together, and the 64-stream CPU figure is the level's."""
    proc = subprocess.run([sys.executable, "-m", "pdd.bench.control_plane", "--model", str(tiny_model),
                           "--levels", "64x8", "--tokens", "30", "--routers", "2", "--run-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    (level,) = report["levels"]
    assert report["routers"] == level["routers"] == 2
    assert level["completed"] == 64 and sum(level["served_per_router"]) == 64, level
    assert all(n > 0 for n in level["served_per_router"]), level["served_per_router"]
    assert report["router_cpu_us_per_token_64_streams"] == level["cpu_us_per_token"]["router"] > 0
    assert 0 < level["router_delay_p50_ms"] <= level["router_delay_p99_ms"]
