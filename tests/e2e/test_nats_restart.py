"""The control bus goes away under load and comes back: real processes (router, P, RLD, MD) on a tiny model.

16 streaming requests (a mix of P-MD, P-RLD-MD and P-RLD) are mid-stream when nats-server stops
for 5 s and restarts on the same port. Then:
- every request ends by its deadline (+ the HTTP layer's grace): complete, or with a clear error
  (an HTTP error status, or an SSE error event before [DONE]); none hangs;
- the system serves a new request soon after the restart (polled; the time is printed and reported);
- every process is alive and back on NATS, and no engine holds request KV once idle (0 leaked blocks).

Figures go to stdout (``-s``) and to ``nats_restart.json`` in the run folder.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from pdd.launch.local_cluster import LocalCluster, http_json, two_site_layout

pytestmark = pytest.mark.slow  # a full system start plus a 40 s deadline: well over 30 s on 2 cores

N_REQUESTS = 16
MAX_TOKENS = 600  # with ignore_eos: streams outlast the outage, and finish well before the deadline on a loaded box
REQUEST_TIMEOUT_S = 40.0
HTTP_GRACE_S = 15.0  # the router's HTTP layer backstop is 5 s; the rest is slack for a loaded 2-core box
OUTAGE_S = 5.0
PIPELINES = ["P-MD", "P-RLD-MD", "P-RLD"]


def _config(model: str, run_dir) -> dict:
    return {
        "model": {"path": str(model), "kv_memory_mb": 16, "block_size": 16, "max_num_seqs": 32, "threads": 1},
        **two_site_layout(),
        "transports": {"fast": {"name": "zmq"}, "wan": {"name": "zmq", "options": {"streams": 2}}},
        "router": {"request_timeout_s": REQUEST_TIMEOUT_S},
        "service": {"heartbeat_ms": 500, "missed_heartbeats": 6, "drain_timeout_s": 5},
        "telemetry": {"exporter": "jsonl", "jsonl_path": str(run_dir / "spans.jsonl"), "log_format": "json"},
    }


async def _stream(client: httpx.AsyncClient, url: str, i: int, started: asyncio.Event, counter: list) -> dict:
    """One streaming request, classified: completed / error (with its code) / hung (never ended)."""
    t0 = time.monotonic()
    out = {"i": i, "pipeline": PIPELINES[i % len(PIPELINES)], "tokens": 0, "outcome": None, "code": None}
    body = {"model": "model", "prompt": [5 + i, 17, 42, 99, 7 + i, 3, 250], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True, "pdd": {"pipeline": out["pipeline"]}}
    first = True

    async def run() -> None:
        nonlocal first
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                out["outcome"], out["code"] = "error", f"http {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out["outcome"] = out["outcome"] or "truncated"  # [DONE] without a finish: not expected
                    return
                event = json.loads(data)
                now = round(time.monotonic() - t0, 2)
                out.setdefault("id", event.get("id"))
                out.setdefault("t_first", now)
                out["t_last"] = now
                if "error" in event:
                    out["outcome"], out["code"] = "error", event["error"].get("code") or event["error"].get("type")
                    continue
                choice = event["choices"][0]
                if choice.get("text"):
                    out["tokens"] += 1  # chunks, not tokens: enough to see progress
                    if first:
                        first = False
                        counter[0] += 1
                        if counter[0] == N_REQUESTS:
                            started.set()
                if choice.get("finish_reason"):
                    out["outcome"], out["finish_reason"] = "completed", choice["finish_reason"]
            out["outcome"] = out["outcome"] or "truncated"

    try:
        await asyncio.wait_for(run(), REQUEST_TIMEOUT_S + HTTP_GRACE_S)
    except asyncio.TimeoutError:
        out["outcome"] = "hung"
    except httpx.HTTPError as exc:
        out["outcome"], out["code"] = "error", f"transport: {type(exc).__name__}"
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


SMALL = {"model": "model", "prompt": [11, 12, 13, 14], "max_tokens": 4, "temperature": 0}


def _small_request(url: str, timeout: float) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        r = httpx.post(url + "/v1/completions", json=SMALL, timeout=timeout)
        ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"]
        return ("ok" if ok else str(r.status_code)), time.monotonic() - t0
    except httpx.HTTPError as exc:
        return type(exc).__name__, time.monotonic() - t0


def _first_success_after(url: str, t_restart: float, budget_s: float) -> tuple[float | None, list]:
    """Poll small requests until one succeeds; seconds from the restart to its reply (None: never).
    Each attempt: [sent at (s after the restart), outcome, its duration]."""
    attempts = []
    deadline = t_restart + budget_s
    while time.monotonic() < deadline:
        sent = time.monotonic() - t_restart
        outcome, took = _small_request(url, max(1.0, min(10.0, deadline - time.monotonic())))
        attempts.append([round(sent, 2), outcome, round(took, 2)])
        if outcome == "ok":
            return time.monotonic() - t_restart, attempts
        time.sleep(0.1)
    return None, attempts


def test_nats_restart_under_load(tiny_model, tmp_path) -> None:
    cluster = LocalCluster(tmp_path, _config(tiny_model, tmp_path))
    figures: dict = {}
    try:
        figures["startup_s"] = round(cluster.start(timeout=300), 1)
        warm = httpx.post(cluster.base_url + "/v1/completions", timeout=120, json={
            "model": "model", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
        assert warm.status_code == 200, warm.text
        outage: dict = {}

        async def load() -> list[dict]:
            started = asyncio.Event()
            counter = [0]
            limits = httpx.Limits(max_connections=N_REQUESTS + 4)
            async with httpx.AsyncClient(timeout=None, limits=limits) as client:
                tasks = [asyncio.create_task(_stream(client, cluster.base_url, i, started, counter))
                         for i in range(N_REQUESTS)]
                await asyncio.wait_for(started.wait(), 120)  # every stream is producing tokens
                # what a small request costs under this load with the bus up: context for recovery_s
                outage["baseline"] = await asyncio.to_thread(_small_request, cluster.base_url, 60.0)

                def bounce() -> None:
                    outage["t_stop"] = time.monotonic()
                    cluster.stop_nats()
                    time.sleep(OUTAGE_S)
                    cluster.start_nats()
                    outage["t_restart"] = time.monotonic()

                await asyncio.to_thread(bounce)
                def recover() -> None:
                    outage["recovery_s"], outage["poll_attempts"] = _first_success_after(
                        cluster.base_url, outage["t_restart"], REQUEST_TIMEOUT_S)

                poll = threading.Thread(target=recover)
                poll.start()
                results = await asyncio.gather(*tasks)
                await asyncio.to_thread(poll.join)
                return results

        results = asyncio.run(load())
        outcomes = [r["outcome"] for r in results]
        figures.update({
            "requests": len(results), "completed": outcomes.count("completed"), "errored": outcomes.count("error"),
            "hung": outcomes.count("hung"), "truncated": outcomes.count("truncated"),
            "error_codes": sorted({str(r["code"]) for r in results if r["outcome"] == "error"}),
            "longest_request_s": max(r["seconds"] for r in results),
            "recovery_s": None if outage.get("recovery_s") is None else round(outage["recovery_s"], 2),
            "poll_attempts": outage.get("poll_attempts"),
            "small_request_under_load_before_outage_s": round(outage["baseline"][1], 2),
        })
        figures["leaked_blocks"] = cluster.wait_idle(timeout=60)
        figures["alive"] = {m.instance_id: m.alive for m in cluster.members.values()}
        figures["nats_connected"] = {m.instance_id: m.health().get("nats_connected") for m in cluster.members.values()}
        figures["router_health"] = http_json(cluster.base_url + "/health")[0]
        figures["per_request"] = results
        print("\nNATS restart figures:", json.dumps({k: v for k, v in figures.items() if k != "per_request"}))
        (tmp_path / "nats_restart.json").write_text(json.dumps(figures, indent=1))

        assert figures["hung"] == 0 and figures["truncated"] == 0, figures
        assert figures["completed"] + figures["errored"] == N_REQUESTS
        assert all(r["seconds"] <= REQUEST_TIMEOUT_S + HTTP_GRACE_S for r in results)
        assert figures["recovery_s"] is not None, f"no request served after the restart: {figures}"
        assert all(figures["alive"].values()), figures["alive"]
        assert all(figures["nats_connected"].values()), figures["nats_connected"]
        assert all(v == 0 for v in figures["leaked_blocks"].values()), figures["leaked_blocks"]
    finally:
        cluster.stop()
