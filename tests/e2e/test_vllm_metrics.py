"""A vLLM user's tools against a live PDD system: vLLM's reference Grafana dashboard and `pdd bench`.

- Every PromQL expression of vLLM's reference dashboard (tests/e2e/data/vllm_grafana_queries.json,
  vendored verbatim), with ``vllm:`` swapped for ``pdd:`` and the dashboard's ``$model_name`` set to
  the served model name, returns at least one series from a real Prometheus (Debian's
  /usr/bin/prometheus) scraping the router and every engine.
- The vLLM-named counters and histograms count what was served: ITL once per output token.
- `pdd bench` without ``--model`` completes against a second router that serves the fleet under
  another name (``model.name`` in its config), and its JSON has vLLM's keys.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest
import yaml

from pdd.loadgen.scrape import parse, samples_of
from pdd.launch.natsserver import free_port
from tests.e2e.test_observability import prometheus_binary
from tests.helpers import ServiceProcess, write_config

QUERIES = json.loads((Path(__file__).parent / "data" / "vllm_grafana_queries.json").read_text())["expressions"]
RENAMED = "renamed-model"
RATE_INTERVAL = "1m"  # what Grafana's $__rate_interval becomes at a 1 s scrape interval, rounded up


def served_name(system) -> str:
    return httpx.get(system.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]


def metrics_urls(system) -> dict[str, str]:
    return {i: p.wait_log("service_ready")["metrics"] for i, p in system.procs.items()}


def total(samples, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples_of(samples, name) if all(lab.get(k) == x for k, x in labels.items()))


def router_samples(system):
    return parse(httpx.get(system.base_url + "/metrics", timeout=10).text)


def test_vllm_named_metrics_count_what_was_served(system):
    model = served_name(system)
    before = router_samples(system)
    outputs = []
    for i in range(3):
        r = httpx.post(system.base_url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": f"count {i} to ten", "max_tokens": 6, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        outputs.append(r.json()["usage"]["completion_tokens"])
    after = router_samples(system)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, model_name=model, **labels) - total(before, name, model_name=model, **labels)

    assert outputs == [6, 6, 6]
    assert delta("pdd:generation_tokens_total") == 18
    assert delta("pdd:request_success_total", finished_reason="length") == 3
    assert delta("pdd:time_to_first_token_seconds_count") == 3
    assert delta("pdd:inter_token_latency_seconds_count") == 3 * 5  # per token after the first, not per chunk
    assert delta("pdd:request_generation_tokens_sum") == 18
    assert delta("pdd:request_max_num_generation_tokens_sum") == 18
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"pdd:request_{phase}_time_seconds_count") == 3
    # decode time is the sum of the per-token ITLs: both run from the first token to the last
    assert delta("pdd:request_decode_time_seconds_sum") == pytest.approx(
        delta("pdd:inter_token_latency_seconds_sum"), rel=1e-6, abs=1e-6)
    assert not samples_of(after, "pdd:generated_tokens_total")  # the old name is gone


def test_engines_report_scheduler_kv_and_prefix_cache_in_tokens(system):
    model = served_name(system)
    urls = metrics_urls(system)
    p = parse(httpx.get(urls["p-0"], timeout=10).text)
    queries = total(p, "pdd:prefix_cache_queries_total", model_name=model, role="prefill")
    hits = total(p, "pdd:prefix_cache_hits_total", model_name=model, role="prefill")
    assert queries > 0 and 0 <= hits <= queries
    for instance in ("p-0", "rld-0", "md-0"):
        s = parse(httpx.get(urls[instance], timeout=10).text)
        usage = samples_of(s, "pdd:kv_cache_usage_perc")
        assert usage and all(lab["model_name"] == model and 0 <= v <= 1 for lab, v in usage), (instance, usage)
        assert samples_of(s, "pdd:num_requests_running") and samples_of(s, "pdd:num_requests_waiting")


def test_vllm_reference_dashboard_queries_all_return_series(system, tmp_path):
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("Debian's prometheus is not installed (apt-get install prometheus; .ci/run does this)")
    model = served_name(system)
    hostports = [urllib.parse.urlparse(u).netloc for u in metrics_urls(system).values()]
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: pdd\n    honor_labels: true\n"
                      f"    static_configs: [{{targets: {json.dumps(hostports)}}}]\n")
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}/api/v1"
    queries = {q: q.replace("vllm:", "pdd:").replace("$model_name", model).replace("$__rate_interval", RATE_INTERVAL)
               for q in QUERIES}
    try:
        answered: dict[str, int] = {}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(answered) < len(queries):
            r = httpx.post(system.base_url + "/v1/completions", timeout=60, json={
                "model": model, "prompt": "the dashboard", "max_tokens": 4, "ignore_eos": True, "stream": True})
            assert r.status_code == 200
            for original, query in queries.items():
                if original in answered:
                    continue
                try:
                    data = httpx.get(api + "/query", params={"query": query}, timeout=5).json()
                except httpx.HTTPError:
                    continue  # Prometheus still starting
                assert data.get("status") == "success", (query, data)
                if data["data"]["result"]:
                    answered[original] = len(data["data"]["result"])
            time.sleep(1)
        missing = [queries[q] for q in queries if q not in answered]
        assert not missing, f"{len(missing)} of {len(queries)} dashboard queries returned no series: {missing}"
        values = httpx.get(api + "/label/model_name/values", timeout=5).json()["data"]  # the dashboard's variable
        assert model in values
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def renamed_router(system, tmp_path):
    """A second router on the same fleet, serving it as ``renamed-model`` (model.name in its config)."""
    cfg = yaml.safe_load(system.config_path.read_text())
    cfg["model"]["name"] = RENAMED
    cfg["router"]["port"] = free_port()
    cfg["instances"].append({"id": "router-renamed", "role": "router", "site": cfg["instances"][0]["site"]})
    proc = ServiceProcess("router", write_config(tmp_path / "renamed.yaml", cfg), "router-renamed", tmp_path)
    url = f"http://127.0.0.1:{cfg['router']['port']}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.proc.poll() is not None:
                raise RuntimeError(proc.log()[-3000:])
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise TimeoutError(f"second router not ready:\n{proc.log()[-3000:]}")
        yield url
    finally:
        proc.stop()


def test_pdd_bench_without_model_against_a_renamed_router(renamed_router, tmp_path):
    out = tmp_path / "result.json"
    res = subprocess.run(
        [sys.executable, "-m", "pdd.launch.cli", "bench", "--base-url", renamed_router,
         "--dataset-name", "random", "--num-prompts", "4", "--random-input-len", "12", "--random-output-len", "5",
         "--max-concurrency", "2", "--goodput", "ttft:600000", "tpot:600000", "--save-result",
         "--result-filename", str(out), "--disable-tqdm"],
        check=False, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["model_id"] == RENAMED
    assert data["completed"] == 4 and data["failed"] == 0 and data["total_output_tokens"] == 20
    for key in ("request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
                "p99_itl_ms", "max_concurrent_requests"):
        assert data[key] is not None, key
    assert data["request_goodput"] == pytest.approx(data["request_throughput"])
    assert data["max_concurrent_requests"] <= 2
    assert data["pdd"]["itl_per_token"] is True  # the router reports tokens per chunk
    assert sum(data["pdd"]["pipeline_mix"].values()) == 4  # PDD's own figures, from the router's /metrics
