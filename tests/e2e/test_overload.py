"""Under overload nothing alive is declared dead: two busy-loop processes beside the system (2 cores, so every
service loses CPU to them) for 60 s while 16 streams run back to back. With the defaults (heartbeats 500 ms x
3 missed, then 5 s of suspicion) no instance is declared lost and no request fails: late beats only make an
instance suspected for a moment. Real processes (router, P, RLD, MD) on the tiny model."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import aiohttp
import pytest

from pdd.launch.local_cluster import LocalCluster, two_site_layout
from pdd.loadgen.client import stream

STREAMS = 16
SECONDS = 60.0


@pytest.mark.timeout(600)
def test_busy_box_declares_nothing_dead_and_fails_nothing(tmp_path, tiny_model):
    config = {
        "model": {"path": str(tiny_model), "kv_memory_mb": 16, "block_size": 16, "max_num_seqs": 32, "threads": 1},
        **two_site_layout(prefill=1, relay=1, main_decode=1),
        "transports": {"fast": {"name": "zmq", "options": {}},
                       "wan": {"name": "zmq", "options": {"streams": 2, "shape": {"delay": "20ms"}}}},
        "telemetry": {"exporter": "none", "log_format": "json"},
    }  # service: the defaults under test
    with LocalCluster(tmp_path / "overload", config) as cluster:
        cluster.start()
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        try:
            outcomes = asyncio.run(_load(cluster.base_url))
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        failed = [o for o in outcomes if o is not None]
        assert len(outcomes) >= STREAMS and not failed, failed[:3]
        router = cluster.members["router-0"]
        assert router.log_event("instance_lost") is None, router.log_event("instance_lost")
        assert router.log_event("request_migrated") is None


async def _load(base: str) -> list:
    """Every stream sends request after request for SECONDS; returns None per success, else what went wrong."""
    until = time.monotonic() + SECONDS
    outcomes: list = []

    async def worker(k: int) -> None:
        async with aiohttp.ClientSession() as session:
            i = 0
            while time.monotonic() < until:
                body = {"prompt": f"worker {k} request {i} alpha beta gamma river stone", "max_tokens": 64,
                        "temperature": 0, "ignore_eos": True, "stream": True}
                s = await stream(session, base + "/v1/completions", body, timeout_s=120)
                ok = s.status == 200 and s.error is None and s.exception is None and s.finish_reason == "length"
                outcomes.append(None if ok else (s.status, s.error, repr(s.exception)))
                i += 1

    await asyncio.gather(*(worker(k) for k in range(STREAMS)))
    return outcomes
