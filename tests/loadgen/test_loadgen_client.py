"""Client and runner against a real (tiny) OpenAI-compatible SSE server started in the test."""

import asyncio
import json
import math

import pytest
from aiohttp import web

from pdd.loadgen.client import send
from pdd.loadgen.report import parse_goodput, summarize
from pdd.loadgen.runner import LoadConfig, run_load
from pdd.loadgen.scrape import parse, pdd_figures, scrape
from pdd.loadgen.workload import random_specs
from tests.loadgen.servers import serving

FIRST_DELAY, TOKEN_DELAY = 0.05, 0.01



class FakeServer:
    """Streams max_tokens chunks; /metrics exposes PDD counters that grow per request."""

    def __init__(self) -> None:
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("max_tokens", 0) <= 0:
            return web.json_response({"error": {"message": "bad max_tokens"}}, status=400)
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat = request.path.endswith("/chat/completions")
        await asyncio.sleep(FIRST_DELAY)
        n = body["max_tokens"]
        for i in range(n):
            choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            await asyncio.sleep(TOKEN_DELAY)
        usage = {"prompt_tokens": 7, "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": 3}}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        self.in_flight -= 1
        return resp

    async def metrics(self, request: web.Request) -> web.Response:
        n = self.requests
        text = (
            "# TYPE pdd:wan_bytes_total counter\n"
            f"pdd:wan_bytes_total {1000.0 * n}\n"
            f'pdd:pipeline_requests_total{{pipeline="P-MD"}} {n}\n'
            f'pdd:pipeline_requests_total{{pipeline="P-RLD-MD"}} 0\n'
            f"pdd:rld_tokens_total {2.0 * n}\n"
            f"pdd:generation_tokens_total {10.0 * n}\n"
        )
        return web.Response(text=text)


@pytest.fixture
async def server():
    fake = FakeServer()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.chat)
    app.router.add_post("/v1/completions", fake.chat)
    app.router.add_get("/metrics", fake.metrics)
    async with serving(app) as base:
        yield fake, base


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
async def test_client_measures_stream(server, endpoint):
    import time

    import aiohttp

    fake, base = server
    spec = random_specs(1, 10, 5, seed=0)[0]
    async with aiohttp.ClientSession() as s:
        r = await send(s, base + endpoint, spec, "m", time.perf_counter())
    assert r.success, r.error
    assert r.output_tokens == 5 and len(r.itl) == 4
    assert r.ttft >= FIRST_DELAY and r.e2el >= r.ttft + 4 * TOKEN_DELAY
    assert r.tpot == pytest.approx((r.e2el - r.ttft) / 4)
    assert r.server_cached_tokens == 3 and r.prompt_tokens == 7


async def test_failures_are_counted_not_raised(server):
    import time

    import aiohttp

    _, base = server
    spec = random_specs(1, 10, 5, seed=0)[0]
    spec.output_tokens = 0
    async with aiohttp.ClientSession() as s:
        bad = await send(s, base + "/v1/chat/completions", spec, "m", time.perf_counter())
        dead = await send(s, "http://127.0.0.1:1/v1/chat/completions", spec, "m", time.perf_counter())
    assert not bad.success and "400" in bad.error
    assert not dead.success and dead.error


async def test_closed_loop_respects_concurrency_and_warmup(server):
    fake, base = server
    specs = random_specs(12, 10, 3, seed=1)
    cfg = LoadConfig(url=base + "/v1/chat/completions", model="m", max_concurrency=2, warmup=2)
    results, duration = await run_load(specs, cfg)
    assert len(results) == 10 and all(r.success for r in results)
    assert fake.max_in_flight <= 2 and fake.requests == 12
    s = summarize(results, duration, parse_goodput(["ttft:60000", "tpot:60000"]), percentiles=(90, 99),
                  percentile_metrics=("ttft", "tpot", "itl", "e2el"))
    assert s["completed"] == 10 and s["failed"] == 0
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])
    for key in ("mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms",
                "mean_e2el_ms", "output_throughput", "total_token_throughput"):
        assert s[key] is not None


async def test_open_loop_poisson_and_metrics_scrape(server):
    fake, base = server
    before = await scrape(base + "/metrics")
    results, duration = await run_load(random_specs(6, 10, 2, seed=2),
                                       LoadConfig(url=base + "/v1/completions", model="m", request_rate=50.0,
                                                  burstiness=0.5, seed=3))
    after = await scrape(base + "/metrics")
    figs = pdd_figures(before, after, completed=6)
    assert figs["wan_bytes_per_request"] == pytest.approx(1000.0)
    assert figs["pipeline_mix"]["P-MD"] == 6 and figs["rld_token_share"] == pytest.approx(0.2)
    assert await scrape("http://127.0.0.1:1/metrics") is None
    assert pdd_figures(None, parse("other_metric 1\n"), 3) == {}


def test_goodput_parse_errors():
    assert parse_goodput(["ttft:2000", "tpot:50"]) == {"ttft": 2.0, "tpot": 0.05}
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


async def test_cli_end_to_end(server, tmp_path):
    """`pdd bench` through the real CLI dispatcher: JSON, per-request records, CDF plot."""
    from pdd.launch.cli import main

    _, base = server
    out = tmp_path / "run.json"
    png = tmp_path / "cdf.png"
    argv = ["bench", "--base-url", base, "--model", "m", "--dataset", "agentic", "--num-prompts", "6",
            "--context-tokens", "64", "--output-tokens", "3", "--max-concurrency", "3", "--goodput", "ttft:60000",
            "--save-json", str(out), "--plot", str(png), "--no-progress"]
    assert await asyncio.to_thread(main, argv) == 0  # the CLI runs its own event loop in a thread
    data = json.loads(out.read_text())
    assert data["completed"] == 6 and len(data["requests"]) == 6 and data["pdd"]["pipeline_mix"]
    assert png.stat().st_size > 0
    assert math.isfinite(data["mean_ttft_ms"])
