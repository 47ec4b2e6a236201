"""Traces and metrics of a running system: the P-RLD-MD span tree, `pdd trace`, a real Prometheus."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse

import httpx
import pytest

from pdd.launch.natsserver import free_port
from tests.e2e.test_pipelines import body_for, wait_for_spans

STAGES = {"prefill", "kv.transfer.fast", "kv.transfer.wan", "relay.decode", "handoff.batch", "extend", "main.decode"}


def handed_over_request(system) -> str:
    """A P-RLD-MD request long enough that MD takes over (catch-up)."""
    body = body_for(list(range(30, 130)), "P-RLD-MD", "catch-up", ignore_eos=True)
    body["max_tokens"] = 900
    for _ in range(3):
        r = httpx.post(system.base_url + "/v1/completions", json=body, timeout=60).json()
        if r["pdd"].get("handoff_mode") == "catch-up":
            return r["id"]
    pytest.fail(f"no handoff happened: {r['pdd']}")


def test_p_rld_md_span_tree_and_pdd_trace(system, tmp_path):
    rid = handed_over_request(system)
    root = wait_for_spans(system, lambda s: s["name"] == "router.request"
                          and s["attributes"].get("request_id") == rid)[-1]
    wait_for_spans(system, lambda s: s["name"] == "main.decode" and s["trace_id"] == root["trace_id"])
    spans = [json.loads(x) for x in (system.root / "spans.jsonl").read_text().splitlines() if x]
    tree = [s for s in spans if s["trace_id"] == root["trace_id"]]
    by_id = {s["span_id"]: s for s in tree}
    names = {s["name"] for s in tree}
    assert STAGES <= names, STAGES - names
    services = {s["name"]: s["service"] for s in tree}
    assert services["prefill"] == "pdd-prefill" and services["relay.decode"] == "pdd-relay"
    assert services["extend"] == "pdd-main-decode" and services["main.decode"] == "pdd-main-decode"
    for s in tree:
        if s["span_id"] == root["span_id"] or s["name"].startswith(("POST ", "fastapi.")):
            continue
        # every stage hangs off the request's root, through real parent links
        chain, node = [], s
        while node["parent_span_id"] in by_id:
            node = by_id[node["parent_span_id"]]
            chain.append(node["name"])
        assert "router.request" in chain, (s["name"], chain)
    wan = next(s for s in tree if s["name"] == "kv.transfer.wan")
    assert wan["attributes"]["bytes"] > 0 and "gbps" in wan["attributes"]
    batches = [s for s in tree if s["name"] == "handoff.batch"]
    assert batches[-1]["attributes"]["final"] is True
    out = tmp_path / "timeline"
    res = subprocess.run([sys.executable, "-m", "pdd.launch.cli", "trace", str(system.root / "spans.jsonl"),
                          "--request-id", rid, "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    html = next(out.glob("*.html")).read_text()
    assert all(stage in html for stage in STAGES)
    png = next(out.glob("*.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(str(png))
    assert image.shape[0] > 100 and image.shape[1] > 100


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def test_real_prometheus_scrapes_ttft_and_wan_bytes(system, tmp_path):
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("Debian's prometheus is not installed (apt-get install prometheus; .ci/run does this)")
    targets = [system.procs[i].wait_log("service_ready")["metrics"] for i in ("router-0", "p-0")]
    hostports = [urllib.parse.urlparse(t).netloc for t in targets]
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: pdd\n"
                      f"    static_configs: [{{targets: {json.dumps(hostports)}}}]\n")
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = httpx.post(system.base_url + "/v1/completions", json=body_for(list(range(40, 90)), "P-MD"), timeout=60)
        assert r.status_code == 200
        api = f"http://127.0.0.1:{port}/api/v1/query"
        wanted = {"ttft": 'sum(pdd:time_to_first_token_seconds_count)', "wan": 'sum(pdd:wan_bytes_total)'}
        deadline = time.monotonic() + 60
        results = {}
        while time.monotonic() < deadline and len(results) < 2:
            for key, query in wanted.items():
                try:
                    data = httpx.get(api, params={"query": query}, timeout=5).json()
                except httpx.HTTPError:
                    continue
                if data.get("status") == "success" and data["data"]["result"]:
                    value = float(data["data"]["result"][0]["value"][1])
                    if value > 0:
                        results[key] = value
            time.sleep(1)
        assert set(results) == {"ttft", "wan"}, results
        hist = httpx.get(api, params={"query": 'pdd:time_to_first_token_seconds_bucket{le="+Inf"}'}, timeout=5).json()
        assert hist["data"]["result"], "TTFT histogram buckets missing"
    finally:
        proc.terminate()
        proc.wait(10)
