"""`pdd bench` as a `vllm bench serve` user drives it, against a real OpenAI-shaped SSE server started here.

The server serves one model name and answers 404 for any other (as PDD and vLLM do); it streams
``TOKENS_PER_CHUNK`` tokens per chunk with cumulative usage on every chunk when asked
(``stream_options.continuous_usage_stats``), so timing by token position can be checked.
"""

import asyncio
import json
import math

import numpy as np
import pytest
from aiohttp import web

from pdd.loadgen.runner import intervals
from tests.loadgen.servers import free_port, run_bench, serving

MODEL = "served-elsewhere"
TOKENS_PER_CHUNK = 2
GAP_S = 0.02



class Server:
    def __init__(self) -> None:
        self.models: list[str] = []  # the "model" of every generation request
        self.stream_options: list[dict] = []

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "root": MODEL}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.models.append(body.get("model"))
        self.stream_options.append(body.get("stream_options") or {})
        if body.get("model") != MODEL:
            return web.json_response({"error": {"message": f"model {body.get('model')!r} not found",
                                                 "code": "model_not_found"}}, status=404)
        continuous = (body.get("stream_options") or {}).get("continuous_usage_stats", False)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n, sent = body["max_tokens"], 0
        while sent < n:
            await asyncio.sleep(GAP_S)
            k = min(TOKENS_PER_CHUNK, n - sent)
            sent += k
            msg: dict = {"choices": [{"index": 0, "delta": {"content": "ab" * k}}]}
            if continuous:
                msg["usage"] = {"prompt_tokens": 5, "completion_tokens": sent, "total_tokens": 5 + sent}
            await resp.write(f"data: {json.dumps(msg)}\n\n".encode())
        usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def server():
    fake = Server()
    app = web.Application()
    app.router.add_get("/v1/models", fake.list_models)
    app.router.add_post("/v1/chat/completions", fake.generate)
    app.router.add_post("/v1/completions", fake.generate)
    async with serving(app) as base:
        yield fake, base



async def test_no_model_takes_the_first_listed_and_writes_vllm_keys(server, tmp_path, capsys):
    fake, base = server
    out = tmp_path / "result.json"
    rc = await run_bench(["--base-url", base, "--dataset-name", "random", "--num-prompts", "4",
                       "--random-input-len", "8", "--random-output-len", "5", "--metrics-url", "none",
                       "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99.9",
                       "--save-result", "--result-filename", str(out), "--disable-tqdm"])
    assert rc == 0
    assert fake.models == [MODEL] * 4  # never "default"
    assert all(o.get("continuous_usage_stats") and o.get("include_usage") for o in fake.stream_options)
    data = json.loads(out.read_text())
    assert data["model_id"] == MODEL and data["completed"] == 4 and data["failed"] == 0
    assert data["total_input_tokens"] == 20 and data["total_output_tokens"] == 20
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert data[f"{stat}_{metric}_ms"] is not None, f"{stat}_{metric}_ms"
    assert data["request_goodput"] is None  # no --goodput given
    assert data["request_throughput"] == pytest.approx(4 / data["duration"])
    assert data["output_throughput"] == pytest.approx(20 / data["duration"])
    assert "requests" not in data and "itls" not in data  # not --save-detailed
    assert data["pdd"]["itl_per_token"] is True
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completed"] == 4


async def test_itl_is_per_token_position_and_tpot_excludes_the_first(server, tmp_path):
    from pdd.loadgen.cli import add_arguments, bench

    _, base = server
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--base-url", base, "--dataset-name", "random", "--num-prompts", "2",
                              "--random-input-len", "8", "--random-output-len", "6", "--metrics-url", "none",
                              "--disable-tqdm"])
    result = await bench(args)
    for rec in result["requests"]:
        # 6 tokens in chunks of 2: positions 1..5 -> 5 gaps; the second token of each chunk arrives with the first
        assert len(rec["itl"]) == 5
        assert rec["itl"][0] == 0.0 and rec["itl"][2] == 0.0 and rec["itl"][4] == 0.0
        assert rec["itl"][1] > 0 and rec["itl"][3] > 0
        assert rec["tpot"] == pytest.approx((rec["e2el"] - rec["ttft"]) / 5)
    itls = [x for rec in result["requests"] for x in rec["itl"]]
    assert result["mean_itl_ms"] == pytest.approx(1000 * sum(itls) / len(itls))
    assert result["itls"] == [rec["itl"] for rec in result["requests"]]


async def test_goodput_counts_requests_within_every_slo(server):
    from pdd.loadgen.report import parse_goodput, summarize
    from pdd.loadgen.runner import LoadConfig, run_load
    from pdd.loadgen.workload import random_specs

    _, base = server
    results, duration = await run_load(random_specs(3, 8, 4, seed=1),
                                       LoadConfig(url=base + "/v1/chat/completions", model=MODEL))
    loose = summarize(results, duration, parse_goodput(["ttft:60000", "tpot:60000", "e2el:60000"]))
    assert loose["request_goodput"] == pytest.approx(loose["request_throughput"])
    tight = summarize(results, duration, parse_goodput(["ttft:0"]))  # every TTFT is > 0
    assert tight["request_goodput"] == 0 and tight["pdd"]["slo_attainment"] == 0


async def test_wrong_model_fails_every_request_with_its_404(server):
    _, base = server
    rc = await run_bench(["--base-url", base, "--model", "default", "--num-prompts", "2", "--random-input-len", "4",
                       "--random-output-len", "2", "--metrics-url", "none", "--disable-tqdm"])
    assert rc == 1


@pytest.mark.parametrize("flags, named", [
    (["--goodput", "latency:5"], "--goodput"),
    (["--percentile-metrics", "ttft,speed"], "--percentile-metrics"),
    (["--metric-percentiles", "101"], "--metric-percentiles"),
    (["--burstiness", "0", "--request-rate", "5"], "--burstiness"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--metadata", "novalue"], "--metadata"),
])
async def test_bad_flags_exit_2_naming_the_flag(server, capsys, flags, named):
    fake, base = server
    rc = await run_bench(["--base-url", base, "--model", MODEL, "--num-prompts", "2", "--metrics-url", "none",
                       "--disable-tqdm", *flags])
    assert rc == 2 and named in capsys.readouterr().err
    assert fake.models == []  # nothing was sent


async def test_no_server_to_ask_for_models_is_a_clear_error(capsys):
    rc = await run_bench(["--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "1", "--disable-tqdm"])
    assert rc == 2 and "/v1/models" in capsys.readouterr().err


def test_arrivals_are_gamma_normalised_like_vllm():
    gaps = intervals(200, 10.0, 0.5, seed=3)
    assert gaps.sum() == pytest.approx(200 / 10.0)  # n sends span n / rate seconds
    assert np.std(gaps) > np.std(intervals(200, 10.0, 4.0, seed=3))  # burstier with a smaller shape
    assert np.allclose(intervals(5, 2.0, math.inf, seed=0), 0.5)
    assert not intervals(5, math.inf, 1.0, seed=0).any()


async def test_plot_has_ttft_tpot_and_itl_panels_with_compare(server, tmp_path):
    import matplotlib.image

    _, base = server
    first, png = tmp_path / "a.json", tmp_path / "cdf.png"
    common = ["--base-url", base, "--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "4",
              "--metrics-url", "none", "--disable-tqdm"]
    assert await run_bench([*common, "--label", "first", "--save-json", str(first)]) == 0
    assert await run_bench([*common, "--label", "second", "--plot", str(png), "--compare", str(first)]) == 0
    image = matplotlib.image.imread(str(png))
    assert image.shape[1] > 2.5 * image.shape[0]  # three panels side by side
    from pdd.loadgen.cli import latency_series

    series = latency_series(json.loads(first.read_text()))
    assert len(series["ttft"]) == 3 and len(series["tpot"]) == 3 and len(series["itl"]) == 9
