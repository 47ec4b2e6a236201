"""What the control plane carries: token streams through NATS, the router and its HTTP API on this box.

The engines are emulated (model.backend: emulated, sim/scenarios/small.yaml), so a decode step costs no CPU:
each step of main decode sleeps to its modeled deadline and emits one token for every running request. What
remains on the CPUs is the control plane a datacenter fleet loads: per token, main decode's publish
(TokenChunk over NATS), nats-server, the router (decode, ownership, detokenize, SSE) and the client reading
the stream (this process; on a real deployment it is elsewhere).

Each level runs ``streams`` concurrent P-MD requests of ``--tokens`` output tokens (ignore_eos) with main
decode's steps dilated by ``k``: the offered token rate is ``streams / (modeled step x k)``. Per level:
- delivered tokens/s at the client;
- inter-token latency by output position (positions 8 and later; loadgen/positions.py) p50/p99, and what the
  control plane adds: ITL p99 minus main decode's modeled step (a constant for a fixed batch: every request
  decodes in the same step). Steps main decode itself overran (the box could not keep its pace) are counted
  (``md_overrun_share``) and inflate the figure too: read both;
- what the router itself adds: ``pdd:router_token_delay_seconds`` (a token off the bus until its SSE event goes
  to the HTTP server) p50/p99 over the level, from the router's /metrics before and after (bucket-interpolated).
  Unlike the client's ITL it holds neither main decode's pacing nor the client process (both on these cores);
- CPU microseconds per delivered token of each process (router, main decode, prefill, nats-server, client),
  from /proc/<pid>/stat over the level.
The headline: the highest delivered token rate at which the router's added delay p99 stays under
``--added-p99-ms`` (5); beside it the same for the client's added ITL p99 (the stricter, end-to-end reading),
and the routers' CPU per delivered token, the mean over the 64-stream levels.

``--routers N`` runs N router processes on the one API port (SO_REUSEPORT, as ``pdd up --routers N``): the client's
connections spread over them; router CPU is their sum and the router delay their merged histogram. On a 2-core
box the routers share the cores with main decode, nats-server and the client: more routers cannot add CPU.

Run: python -m pdd.bench.control_plane [--levels 16x8,64x4,64x2,64x1.5,64x1,256x1 --tokens 300 --routers 1]
Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 32
SKIP_POSITIONS = 8  # the first positions carry start-up (prefill, KV over the WAN, the first steps)
ROUTER_DELAY = "pdd:router_token_delay_seconds"
SUCCESS = "pdd:request_success_total"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="the tokenizer the router uses ('default': SmolLM2's)")
    ap.add_argument("--levels", default="16x8,64x4,64x2,64x1.5,64x1,256x1",
                    help="comma-separated STREAMSxDILATION: concurrent streams and main decode's time dilation")
    ap.add_argument("--tokens", type=int, default=300, help="output tokens per stream")
    ap.add_argument("--scenario", default="small", help="emulation scenario (sim/scenarios); its main decode chip")
    ap.add_argument("--added-p99-ms", type=float, default=5.0, help="the headline's bound on the added ITL p99")
    ap.add_argument("--routers", type=int, default=1, help="router processes sharing the API port")
    ap.add_argument("--run-dir", default=None, help="logs and configs (default: a temp dir, kept)")
    return ap.parse_args(argv)


def levels(spec: str) -> list[tuple[int, float]]:
    out = []
    for part in spec.split(","):
        streams, _, k = part.strip().partition("x")
        out.append((int(streams), float(k or 1)))
    return out


def cluster_config(args: argparse.Namespace, dilation: float) -> dict:
    from pdd.launch.local_cluster import two_site_layout
    from pdd.launch.emulate import BACKEND as EMULATED_BACKEND
    from pdd.shared.pipelines import Pipeline

    return {
        "model": {"backend": EMULATED_BACKEND, "path": args.model, "block_size": 16, "max_num_seqs": 512},
        "emulation": {"scenario": args.scenario, "system": "pdd", "kv_scale": 1, "time_dilation": dilation},
        **two_site_layout(prefill=1, relay=1, main_decode=1, routers=args.routers),
        "transports": {"fast": {"name": "zmq", "options": {}}, "wan": {"name": "zmq", "options": {"streams": 2}}},
        "router": {"request_timeout_s": 600, "forced_pipeline": Pipeline.P_MD.value, "reuse_port": args.routers > 1},
        "service": {"heartbeat_ms": 500, "drain_timeout_s": 5},
        "telemetry": {"exporter": "none", "log_format": "json"},
    }


def vocab_size(model: str) -> int:
    """The router's tokenizer's vocabulary: prompts are drawn inside it (the emulated engines take it too)."""
    from pdd.shared.model_files import resolve_model_path
    from pdd.shared.tokenizer import load_tokenizer

    return len(load_tokenizer(resolve_model_path(model)))


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (its threads included), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def run_streams(base_url: str, n: int, tokens: int, vocab: int, seed: int) -> list[Any]:
    import random

    import aiohttp

    from pdd.loadgen.client import stream

    rng = random.Random(seed)
    bodies = [{"prompt": [rng.randrange(vocab // 8, vocab - vocab // 8) for _ in range(PROMPT_TOKENS)],
               "max_tokens": tokens, "ignore_eos": True, "stream": True, "temperature": 0,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}} for _ in range(n)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return await asyncio.gather(*(stream(session, base_url + "/v1/completions", b, timeout_s=600) for b in bodies))


def merged(scrapes: list[Any]) -> dict:
    """Several routers' /metrics as one: each sample summed over the routers (counters and histogram buckets)."""
    out: dict = {}
    for samples in scrapes:
        for key, value in (samples or {}).items():
            out[key] = out.get(key, 0.0) + value
    return out


def run_level(args: argparse.Namespace, run_root: Path, streams: int, dilation: float) -> dict[str, Any]:
    from pdd.loadgen.scrape import histogram_quantile, samples_of, scrape_sync
    from pdd.loadgen.stats import pct
    from pdd.engine.emulated_backend import profile as emulation
    from pdd.launch.local_cluster import LocalCluster
    from pdd.engine.emulated_backend.settings import EmulationSettings
    from pdd.shared.roles import Role

    cfg = cluster_config(args, dilation)
    md_model = emulation.profile(EmulationSettings(**cfg["emulation"]), Role.MAIN_DECODE).cost_model
    ctx = streams * (PROMPT_TOKENS + args.tokens / 2)
    modeled_step_s = md_model.step_time(streams, ctx) * dilation
    with LocalCluster(run_root / f"s{streams}-k{dilation:g}", cfg) as cluster:
        cluster.start()
        routers = [m for m in cluster.members.values() if m.role == Role.ROUTER]  # start() waited for each
        vocab = vocab_size(args.model)
        asyncio.run(run_streams(cluster.base_url, 2, 8, vocab, seed=1))  # warm: links open
        pids = {m.instance_id: m.proc.pid for m in cluster.members.values()}
        pids["nats-server"] = cluster.nats.pid
        md = next(m for m in cluster.members.values() if m.role == Role.MAIN_DECODE)
        md0 = md.health().get("engine", {})
        per_router0 = [scrape_sync(r.metrics_url) for r in routers]
        delay0 = merged(per_router0)
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        client0, t0 = client_cpu_seconds(), time.perf_counter()
        results = asyncio.run(run_streams(cluster.base_url, streams, args.tokens, vocab, seed=2))
        wall = time.perf_counter() - t0
        client_cpu = client_cpu_seconds() - client0
        cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
        md1 = md.health().get("engine", {})
        per_router1 = [scrape_sync(r.metrics_url) or {} for r in routers]
        delay1 = merged(per_router1)
    ok = [r for r in results if r.status == 200 and r.error is None and r.exception is None]
    gaps: list[float] = []
    delivered = 0
    for r in ok:
        times = r.token_times() or []
        delivered += len(times)
        gaps += [b - a for a, b in zip(times[SKIP_POSITIONS:], times[SKIP_POSITIONS + 1:])]
    served = [round(sum(v for _, v in samples_of(after, SUCCESS)) - sum(v for _, v in samples_of(before or {}, SUCCESS)))
              for before, after in zip(per_router0, per_router1)]  # requests each router completed
    steps = (md1.get("steps", 0) or 0) - (md0.get("steps", 0) or 0)
    overruns = (md1.get("overrun_steps", 0) or 0) - (md0.get("overrun_steps", 0) or 0)
    per_token: dict[str, float] = {"client": client_cpu}
    for name, v in cpu.items():  # one figure per role: several routers' CPU summed
        role = name.split("-")[0] if name != "nats-server" else name
        per_token[role] = per_token.get(role, 0.0) + v
    p99 = pct(gaps, 99)
    return {
        "streams": streams, "time_dilation": dilation, "routers": len(routers), "served_per_router": served,
        "completed": len(ok), "requests": streams,
        "offered_tokens_per_s": round(streams / modeled_step_s, 1),
        "delivered_tokens_per_s": round(delivered / wall, 1), "wall_s": round(wall, 2),
        "modeled_step_ms": round(modeled_step_s * 1e3, 3),
        "itl_p50_ms": round(pct(gaps, 50) * 1e3, 3) if gaps else None,
        "itl_p99_ms": round(p99 * 1e3, 3) if p99 is not None else None,
        "added_itl_p99_ms": round((p99 - modeled_step_s) * 1e3, 3) if p99 is not None else None,
        **{f"router_delay_p{q}_ms": _ms(histogram_quantile(delay0, delay1, ROUTER_DELAY, q / 100)) for q in (50, 99)},
        "md_steps": steps, "md_overrun_share": round(overruns / steps, 4) if steps else None,
        "cpu_us_per_token": {k: round(v / max(1, delivered) * 1e6, 1) for k, v in sorted(per_token.items())},
        "cpu_share_of_wall": {k: round(v / wall, 3) for k, v in sorted(per_token.items())},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_root = Path(args.run_dir or tempfile.mkdtemp(prefix="pdd-control-plane-"))
    run_root.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    print(f"control-plane benchmark: levels {args.levels}, {args.tokens} tokens per stream, scenario "
          f"{args.scenario}; {os.cpu_count()} CPUs, load {load[0]:.2f}; run dir {run_root}", flush=True)
    print("Rules: P-MD forced, one prefill / relay / main decode, emulated engines; ITL per output position "
          f"from position {SKIP_POSITIONS}; added = ITL p99 - main decode's modeled step; CPU from /proc", flush=True)
    rows = []
    for streams, dilation in levels(args.levels):
        row = run_level(args, run_root, streams, dilation)
        rows.append(row)
        cpu = row["cpu_us_per_token"]
        print(f"  {streams:4d} streams x{dilation:<4g} offered {row['offered_tokens_per_s']:8.0f} tok/s, delivered "
              f"{row['delivered_tokens_per_s']:8.0f} tok/s; ITL p50 {row['itl_p50_ms']} / p99 {row['itl_p99_ms']} ms "
              f"(step {row['modeled_step_ms']} ms, added p99 {row['added_itl_p99_ms']} ms, MD overrun "
              f"{row['md_overrun_share']}); router delay p50 {row['router_delay_p50_ms']} / p99 "
              f"{row['router_delay_p99_ms']} ms; CPU us/token " + " ".join(f"{k} {v}" for k, v in cpu.items()),
              flush=True)

    def highest(key: str) -> dict[str, Any] | None:
        within = [r for r in rows
                  if r[key] is not None and r[key] < args.added_p99_ms and r["completed"] == r["requests"]]
        return max(within, key=lambda r: r["delivered_tokens_per_s"]) if within else None

    best, best_client = highest("router_delay_p99_ms"), highest("added_itl_p99_ms")
    at_64 = [r["cpu_us_per_token"]["router"] for r in rows if r["streams"] == 64 and r["completed"] == r["requests"]]
    report = {"bench": "control_plane", "cpus": os.cpu_count(), "load_before": round(load[0], 2),
              "load_after": round(os.getloadavg()[0], 2),
              "scenario": args.scenario, "tokens_per_stream": args.tokens, "levels": rows, "routers": args.routers,
              "added_p99_bound_ms": args.added_p99_ms,
              "highest_tokens_per_s_within_bound": best["delivered_tokens_per_s"] if best else None,
              "highest_tokens_per_s_client_itl_within_bound":
                  best_client["delivered_tokens_per_s"] if best_client else None,
              "router_cpu_us_per_token_64_streams": round(sum(at_64) / len(at_64), 1) if at_64 else None,
              "router_cpu_us_per_token": best["cpu_us_per_token"].get("router") if best else None}
    print(f"{args.routers} router(s): highest delivered rate with the router's added delay p99 < {args.added_p99_ms:g} "
          f"ms: {report['highest_tokens_per_s_within_bound']} tok/s; with the client's added ITL p99 under it: "
          f"{report['highest_tokens_per_s_client_itl_within_bound']} tok/s; router CPU per token at 64 streams "
          f"{report['router_cpu_us_per_token_64_streams']} us")
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
