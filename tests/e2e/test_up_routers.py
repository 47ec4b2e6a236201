"""`pdd up --routers 2`: two router processes share the API port (SO_REUSEPORT); the kernel spreads the
connections over both, each owns what it accepted, and every answer equals one engine's greedy tokens. Killed
with -9 mid-stream, one router's clients see their streams close without [DONE], its requests are cancelled at
P, RLD and MD (no block stays held), the other router's streams complete identically, and `pdd up` restarts it.
Real processes: `pdd up` on the tiny model, a real nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from pdd.launch.natsserver import free_port
from pdd.launch.readiness import log_events
from pdd.loadgen.client import stream
from pdd.loadgen.scrape import samples_of, scrape_sync
from tests.e2e.test_up_supervise import _base_config, _wait_for

MAX_TOKENS = 64
REQUESTS = 16


def _reference(run_dir: Path):
    from pdd.engine.torch_backend.engine import TorchEngine
    from pdd.shared.config import load_config

    config = load_config(run_dir / "pdd.yaml")
    model, settings = config.model, config.engine_settings()
    return TorchEngine.from_model(model.path, dtype=settings.dtype, kv_dtype=settings.kv_dtype,
                                  kv_memory_bytes=settings.kv_memory_mb << 20, block_size=model.block_size,
                                  num_threads=1)


def _metrics_url(log: Path) -> str:
    """The live process's (the last to log ready: a restarted router listens on a new metrics port)."""
    return [e["metrics"] for e in log_events(log) if e.get("event") == "service_ready"][-1]


def _served(run_dir: Path, router: str) -> float:
    text = scrape_sync(_metrics_url(run_dir / f"{router}.log"))
    return sum(v for _, v in samples_of(text, "pdd:request_success_total"))


def _body(prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "pdd": {"return_token_ids": True}}


async def _all(base: str, prompts: list[list[int]]) -> list:
    async def one(prompt):  # a session per request: a connection of its own, spread by the kernel
        async with aiohttp.ClientSession() as session:
            return await stream(session, base + "/v1/completions", _body(prompt), timeout_s=120)
    return await asyncio.gather(*(one(p) for p in prompts))


@pytest.fixture(scope="module")
def up(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("up-routers")
    port = free_port()
    run_dir, log = tmp / "run", tmp / "up.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdd.launch.cli", "up", "--model", str(tiny_model), "--routers", "2",
             "--config", str(_base_config(tmp / "base.yaml", str(tiny_model))), "--port", str(port),
             "--run-dir", str(run_dir), "--wan", "none"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(lambda: "ready: OpenAI API" in log.read_text(), "ready line", log, proc)
        yield f"http://127.0.0.1:{port}", run_dir, log, proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.timeout(900)
def test_two_routers_share_the_port_and_answer_like_one_engine(up):
    from pdd.engine import SamplingParams

    base, run_dir, log, _ = up
    text = log.read_text()
    assert "router-0" in text and "router-1" in text
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 380) for _ in range(rng.randrange(20, 60))] for _ in range(REQUESTS)]
    before = {r: _served(run_dir, r) for r in ("router-0", "router-1")}
    done = asyncio.run(_all(base, prompts))
    expected = _reference(run_dir).generate(prompts, SamplingParams(ignore_eos=True), max_new_tokens=MAX_TOKENS)
    for d, want in zip(done, expected):
        assert d.status == 200 and d.error is None and d.finish_reason == "length", (d.status, d.error)
        assert d.token_ids == want
    served = {r: _served(run_dir, r) - before[r] for r in before}
    assert sum(served.values()) == REQUESTS and all(n > 0 for n in served.values()), served


def _engine_held(run_dir: Path) -> dict[str, int]:
    """KV blocks each engine process holds outside its cache, from its own /health."""
    from pdd.launch.local_cluster import http_json

    held = {}
    for name in ("prefill-0", "relay-0", "main-decode-0"):
        health_url = _metrics_url(run_dir / f"{name}.log").rsplit("/", 1)[0] + "/health"
        engine = (http_json(health_url)[1] or {}).get("engine") or {}
        held[name] = engine["total_blocks"] - engine["free_blocks"] - engine.get("evictable_blocks", 0)
    return held


@pytest.mark.timeout(900)
def test_a_killed_router_closes_only_its_own_streams_and_comes_back(up):
    import re

    from pdd.engine import SamplingParams

    base, run_dir, log, proc = up
    pid = int(re.search(r"router-0\s+site=site-a pid=(\d+)", log.read_text()).group(1))
    rng = random.Random(11)
    prompts = [[rng.randrange(5, 380) for _ in range(30)] for _ in range(REQUESTS)]
    expected = _reference(run_dir).generate(prompts, SamplingParams(ignore_eos=True), max_new_tokens=400)

    async def run() -> list:
        async def one(prompt):
            async with aiohttp.ClientSession() as session:
                return await stream(session, base + "/v1/completions", _body(prompt, 400), timeout_s=120)
        tasks = [asyncio.create_task(one(p)) for p in prompts]
        await asyncio.sleep(0.3)  # every stream under way
        os.kill(pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)

    done = asyncio.run(run())
    cut = [d for d in done if not d.done]
    whole = [(d, want) for d, want in zip(done, expected) if d.done]
    assert cut and whole, "the kernel gave every connection to one router"
    for d in cut:  # the dead router's clients: the stream closed, no [DONE], no finish
        assert d.finish_reason is None
    for d, want in whole:  # the other router's streams: untouched
        assert d.status == 200 and d.error is None and d.finish_reason == "length" and d.token_ids == want
    _wait_for(lambda: "restarted router-0" in log.read_text(), "router restart", log, proc)
    _wait_for(lambda: sum(e.get("event") == "api_listening" for e in log_events(run_dir / "router-0.log")) == 2,
              "the restarted router-0 listening", log, proc)
    _wait_for(lambda: _engine_held(run_dir) == {"prefill-0": 0, "relay-0": 0, "main-decode-0": 0},
              "no KV block held", log, proc, timeout=60)
    again = asyncio.run(_all(base, prompts[:4]))
    assert all(d.done and d.error is None for d in again)


@pytest.mark.timeout(900)
def test_a_client_leaving_its_router_cancels_its_request_everywhere_once(up):
    """Clients hang up mid-stream, their connections spread over both routers: each request is known to exactly one
    router (the one that logged the disconnect), and P, RLD and MD end up holding no KV block and no request."""
    base, run_dir, log, proc = up
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 380) for _ in range(30)] for _ in range(REQUESTS)]

    async def hang_up(prompt: list[int]) -> str:
        async with aiohttp.ClientSession() as session, \
                session.post(base + "/v1/completions", json=_body(prompt, 400)) as resp:
            assert resp.status == 200
            chunks = 0
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    request_id = json.loads(line[6:])["id"]
                    chunks += 1
                if chunks >= 3:
                    return request_id  # leaving the block closes the connection mid-stream
        raise AssertionError("the stream ended before 3 chunks")

    async def run() -> list[str]:
        return await asyncio.gather(*(hang_up(p) for p in prompts))

    ids = asyncio.run(run())
    assert len(set(ids)) == REQUESTS

    def disconnects(router: str) -> set[str]:
        return {e["request_id"] for e in log_events(run_dir / f"{router}.log") if e.get("event") == "client_disconnected"}

    _wait_for(lambda: disconnects("router-0") | disconnects("router-1") >= set(ids), "every disconnect seen", log, proc)
    by_router = {r: disconnects(r) & set(ids) for r in ("router-0", "router-1")}
    assert not by_router["router-0"] & by_router["router-1"], "a request known to both routers"
    assert all(by_router.values()), by_router  # the kernel gave both routers connections
    _wait_for(lambda: _engine_held(run_dir) == {"prefill-0": 0, "relay-0": 0, "main-decode-0": 0},
              "no KV block held", log, proc, timeout=60)
