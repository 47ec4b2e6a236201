"""Fault scenarios against a locally started PDD system: does every request still end, and end right?

    python -m pdd.bench.chaos [--requests 200] [--scenarios kill_md,kill_rld,nats_restart,wan_cut]

The system is real processes (nats-server, router, prefill, 2 relays, 2 main decoders; tiny seeded
model unless --model) with an emulated WAN (in-process shaper whose link is cut from outside by a
file). First an undisturbed greedy run of the prompt set gives the reference outputs; then each
scenario streams the same requests concurrently and injects its fault mid-stream:

- kill_md / kill_rld: ``kill -9`` of the main decoder / relay holding the most requests;
- nats_restart: nats-server stopped for --nats-down-s seconds, then restarted on the same port;
- stop_p: ``SIGSTOP`` of the prefill the router prefers, before the requests arrive; they are
  retried on the other prefill once the registry misses its heartbeats (SIGCONT at the end);
- wan_cut: the WAN link blackholed for --wan-cut-s seconds while requests keep arriving (half of
  them forced onto P-MD, so their KV must cross the cut link).

Per scenario: total, completed (finished with output), identical (output token ids equal the
reference), lost (ended with an error), hung (no end by deadline + grace), leaked_blocks (KV
blocks still held on live instances once idle). The last line is one JSON object keyed by scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pdd.loadgen.client import Chunk, Stream, stream
from pdd.loadgen.scrape import samples_of, scrape_sync
from pdd.services.launch.local_cluster import LocalCluster, two_site_layout
from pdd.shared.pipelines import Pipeline
from pdd.shared.roles import Role

SCENARIOS = ("kill_md", "kill_rld", "nats_restart", "wan_cut", "stop_p")
DEFAULT_SCENARIOS = SCENARIOS[:4]  # the four; stop_p checks the retry path (no token out yet)
HANG_GRACE_S = 15.0


@dataclass
class Outcome:
    index: int
    tokens: list[int] = field(default_factory=list)
    streamed: int = 0
    finish_reason: str | None = None
    error: str | None = None
    hung: bool = False
    info: dict = field(default_factory=dict)


def build_config(args: argparse.Namespace, run_dir: Path) -> dict:
    from pdd.transports import ucx_available

    fast = "ucx" if ucx_available() else "zmq"
    return {
        "model": {"path": args.model, "kv_memory_mb": args.kv_memory_mb, "block_size": 16, "max_num_seqs": 64,
                  "threads": 1},
        **two_site_layout(prefill=2, relay=2, main_decode=2),
        "transports": {
            "fast": {"name": fast, "options": {}},
            "wan": {"name": "zmq", "options": {"streams": 2, "shape": {
                "rate": "1gbit", "delay": "5ms", "down_timeout_s": 3.0, "down_file": str(run_dir / "wan.down")}}},
        },
        "router": {"request_timeout_s": args.deadline_s, "stall_timeout_s": 10.0, "max_migrations": 3,
                   "wan_probe_interval_s": 1.0},
        "service": {"heartbeat_ms": 500, "missed_heartbeats": 6, "drain_timeout_s": 5},
        "telemetry": {"exporter": "none", "log_format": "json"},
    }


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "alpha beta gamma delta river stone cloud paper light green north market table window".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, 40))) for _ in range(n)]


async def stream_one(session: aiohttp.ClientSession, base_url: str, index: int, prompt: str, max_tokens: int,
                     deadline_s: float, pipeline: str | None, progress: list[int], start_delay: float) -> Outcome:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                            "ignore_eos": True, "pdd": {"return_token_ids": True}}
    if pipeline:
        body["pdd"]["pipeline"] = pipeline
    out = Outcome(index)
    await asyncio.sleep(start_delay)

    def on_chunk(s: Stream, _: Chunk) -> None:
        out.streamed = progress[index] = s.streamed_tokens

    s = await stream(session, base_url + "/v1/completions", body, timeout_s=deadline_s + HANG_GRACE_S,
                     on_chunk=on_chunk)
    out.finish_reason = s.finish_reason
    out.info = s.info
    out.tokens = s.token_ids
    if s.timed_out:
        out.hung = True
    elif s.exception is not None:
        if not isinstance(s.exception, (aiohttp.ClientError, ValueError)):
            raise s.exception
        out.error = f"{type(s.exception).__name__}: {s.exception}"
    elif s.status != 200:
        out.error = f"http {s.status}: {s.body_text[:200]}"
    elif s.error is not None:
        out.error = str((s.error.get("code") if isinstance(s.error, dict) else None) or s.error)
    if out.finish_reason is None and out.error is None and not out.hung:
        out.error = "stream ended without a finish"
    return out


async def run_load(cluster: LocalCluster, texts: list[str], args: argparse.Namespace,
                   pipelines: list[str | None], fault=None, spread_s: float = 0.0) -> list[Outcome]:
    """Requests start evenly over ``spread_s`` (0: all at once); ``fault(progress)`` runs alongside."""
    progress = [0] * len(texts)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = [asyncio.create_task(stream_one(session, cluster.base_url, i, t, args.max_tokens, args.deadline_s,
                                                pipelines[i], progress, spread_s * i / len(texts)))
                 for i, t in enumerate(texts)]
        fault_task = asyncio.create_task(fault(progress)) if fault else None
        results = await asyncio.gather(*tasks)
        if fault_task is not None:
            await fault_task
    return results


async def wait_streaming(progress: list[int], share: float, min_tokens: int, timeout: float = 120.0) -> None:
    """Until ``share`` of the requests have streamed at least ``min_tokens`` tokens (mid-stream)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(1 for p in progress if p >= min_tokens) >= share * len(progress):
            return
        await asyncio.sleep(0.05)


def wait_busy(cluster: LocalCluster, role: str, in_flight: int, timeout: float = 60.0) -> None:
    """Until one instance of ``role`` holds at least ``in_flight`` requests."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(m.health().get("in_flight", 0) >= in_flight for m in cluster.members.values()
               if m.role == role and m.alive):
            return
        time.sleep(0.1)


def links_down(cluster: LocalCluster) -> list[str]:
    """Main-decode instances the router currently routes no KV to (``pdd:wan_link_up`` = 0)."""
    samples = scrape_sync(cluster.base_url + "/metrics", timeout_s=10)
    if samples is None:
        raise OSError(f"no metrics from {cluster.base_url}/metrics")
    return [next(iter(labels.values()), "") for labels, v in samples_of(samples, "pdd:wan_link_up") if v == 0]


def wait_links_up(cluster: LocalCluster, t0: float, timeout: float = 60.0) -> float | None:
    """Seconds from t0 (the link restored) until the router's probes bring every link back."""
    while time.monotonic() - t0 < timeout:
        if not links_down(cluster):
            return round(time.monotonic() - t0, 2)
        time.sleep(0.2)
    return None


def busiest(cluster: LocalCluster, role: str) -> str:
    members = [m for m in cluster.members.values() if m.role == role and m.alive]
    return max(members, key=lambda m: (m.health().get("in_flight", 0), m.instance_id)).instance_id


def summarize(results: list[Outcome], reference: list[list[int]], leaked: dict[str, int]) -> dict:
    completed = [r for r in results if r.finish_reason is not None and r.error is None and not r.hung]
    return {
        "total": len(results),
        "completed": len(completed),
        "identical": sum(1 for r in completed if r.tokens == reference[r.index]),
        "lost": sum(1 for r in results if r.error is not None),
        "hung": sum(1 for r in results if r.hung),
        "leaked_blocks": sum(max(0, v) for v in leaked.values()),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


async def scenario(name: str, cluster: LocalCluster, texts: list[str], reference: list[list[int]],
                   args: argparse.Namespace) -> dict:
    pipelines: list[str | None] = [None] * len(texts)
    facts: dict[str, Any] = {}
    if name == "kill_md":
        pipelines = [Pipeline.P_MD if i % 2 else Pipeline.P_RLD_MD for i in range(len(texts))]
    elif name == "kill_rld":
        pipelines = [Pipeline.P_RLD if i % 2 else Pipeline.P_RLD_MD for i in range(len(texts))]
    elif name == "wan_cut":
        pipelines = [Pipeline.P_MD if i % 2 else None for i in range(len(texts))]

    spread = args.wan_cut_s * 2 if name == "wan_cut" else 0.0  # transfers keep starting across the cut

    if name == "stop_p":
        facts["stopped"] = "p-0"  # equal cost ties go to the lowest id: p-0 gets the requests
        cluster.kill("p-0", signal.SIGSTOP)

    async def fault(progress: list[int]) -> None:
        if name == "stop_p":
            await asyncio.sleep(0)
            return
        if name == "wan_cut":
            await asyncio.sleep(spread * 0.2)
        elif name == "kill_rld":  # relays hold requests briefly (until handoff or a short P-RLD finish)
            await wait_streaming(progress, 0.05, 2)
            await asyncio.to_thread(wait_busy, cluster, Role.RELAY, max(1, len(texts) // 8))
        else:
            await wait_streaming(progress, 0.5, 3)
        if name in ("kill_md", "kill_rld"):
            victim = busiest(cluster, Role.MAIN_DECODE if name == "kill_md" else Role.RELAY)
            facts["killed"] = victim
            facts["victim_in_flight"] = cluster.members[victim].health().get("in_flight", 0)
            cluster.kill(victim)
        elif name == "nats_restart":
            cluster.stop_nats()
            await asyncio.sleep(args.nats_down_s)
            cluster.start_nats()
            facts["serving_again_s"] = await first_success_after(cluster, time.monotonic())
        elif name == "wan_cut":
            down = cluster.run_dir / "wan.down"
            down.touch()
            await asyncio.sleep(args.wan_cut_s)
            down.unlink()
            facts["links_marked_down"] = len(await asyncio.to_thread(links_down, cluster)) or "none yet"
            facts["wan_back_after_s"] = await asyncio.to_thread(wait_links_up, cluster, time.monotonic())

    t0 = time.monotonic()
    try:
        results = await run_load(cluster, texts, args, pipelines, fault, spread)
    finally:
        if name == "stop_p":
            cluster.kill("p-0", signal.SIGCONT)
    facts["seconds"] = round(time.monotonic() - t0, 1)
    leaked = await asyncio.to_thread(cluster.wait_idle, 30.0)
    summary = summarize(results, reference, leaked)
    summary.update(facts)
    summary["pipelines"] = count_by(r.info.get("pipeline") for r in results if r.info)
    summary["migrated"] = sum(1 for r in results if r.info.get("migrations"))
    summary["alive"] = sorted(m.instance_id for m in cluster.members.values() if m.alive)
    return summary


async def first_success_after(cluster: LocalCluster, t0: float, timeout: float = 60.0) -> float | None:
    """Seconds from t0 until a fresh one-token request succeeds."""
    deadline = t0 + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            s = await stream(session, cluster.base_url + "/v1/completions",
                             {"prompt": "ping", "max_tokens": 2, "temperature": 0}, timeout_s=5)
            if s.status == 200:
                return round(time.monotonic() - t0, 2)
            await asyncio.sleep(0.2)
    return None


def count_by(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def restore(cluster: LocalCluster) -> None:
    """Respawn what a scenario killed and wait until the whole system serves again."""
    for member in list(cluster.members.values()):
        if not member.alive:
            member.stop()
            cluster.spawn(member.instance_id)
    cluster.wait_ready(300)
    time.sleep(1.5)  # a few heartbeats: the router sees every instance again


async def run(args: argparse.Namespace) -> dict:
    root = Path(args.run_dir or tempfile.mkdtemp(prefix="pdd-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    if not args.model:
        from pdd.engine.tiny import build_tiny_checkpoint

        args.model = str(build_tiny_checkpoint(root / "model", seed=0, max_position_embeddings=1024))
    texts = prompts(args.requests, args.seed)
    report: dict[str, Any] = {}
    with LocalCluster(root / "run", build_config(args, root / "run")) as cluster:
        print(f"[chaos] starting the system in {cluster.run_dir}", flush=True)
        cluster.start(300)
        ref = await run_load(cluster, texts, args, [None] * len(texts))
        bad = [r for r in ref if r.error or r.hung or not r.tokens]
        if bad:
            raise RuntimeError(f"the undisturbed reference run failed for {len(bad)} requests: {bad[0]}")
        reference = [r.tokens for r in ref]
        print(f"[chaos] reference run: {len(ref)} requests, {sum(map(len, reference))} tokens", flush=True)
        for name in args.scenarios:
            restore(cluster)
            result = await scenario(name, cluster, texts, reference, args)
            report[name] = result
            print(f"[chaos] {name}: " + json.dumps(result), flush=True)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--deadline-s", type=float, default=120.0, help="per-request deadline (router)")
    p.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS), help=f"comma list from {SCENARIOS}")
    p.add_argument("--model", default=None, help="model path (default: a tiny seeded checkpoint)")
    p.add_argument("--kv-memory-mb", type=int, default=64)
    p.add_argument("--nats-down-s", type=float, default=5.0)
    p.add_argument("--wan-cut-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default=None)
    args = p.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}; choose from {SCENARIOS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    print(json.dumps({name: {k: v for k, v in r.items() if k in (
        "total", "completed", "identical", "lost", "hung", "leaked_blocks")} for name, r in report.items()}))
    ok = all(r["completed"] == r["total"] == r["identical"] and not r["hung"] and not r["leaked_blocks"]
             for r in report.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
