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

Two sites, each with its own nats-server (site B's a leaf node of site A's; services/launch/sites.py),
in network namespaces joined by the kernel WAN emulation when root (``--sites netns``), else two
servers on this box (``--sites local``, labelled FALLBACK in the output):
- nats_kill_a / nats_kill_b: ``kill -9`` of site A's / site B's nats-server mid-stream, restarted
  after --nats-down-s seconds;
- wan_cut_net: all cross-site traffic (leaf link, KV, replies) dropped for --wan-cut-s seconds by an
  nftables rule on the WAN device (netns); without root the in-process shaper cut stands in.
  Reports the leaf link's reconnect time and the requests finished in site A.

Per scenario: total, completed (finished with output), identical (output token ids equal the
reference), lost (ended with an error), hung (no end by deadline + grace), leaked_blocks (KV
blocks still held on live instances once idle), health_unanswered (live engines that did not answer
that health read: their blocks were not counted, so the scenario fails rather than reading "0 leaked").
The last line is one JSON object keyed by scenario.

Mid-stream: each fault must hit requests in flight. Just before it strikes, what the victim holds is
read (``hit_in_flight``): the killed instance's own in-flight count from its /health; for
nats_restart every engine's, since the bus is what they all lose; for wan_cut the main decoders', the
far end of the cut link; for the two-site scenarios the client's streams under way. A fault that hit
none is repeated on a restored system, up to --fault-attempts times, and the scenario fails if none
landed (``fault_mid_stream``). stop_p is exempt: it freezes the prefill before the requests arrive,
by design (``fault_mid_stream`` null).

Why one module: it is one benchmark, read top to bottom (configuration, client, scenarios and their
faults, verdict); every scenario shares the reference run, the load driver and the summary. The
clusters it drives are the shared ones (services/launch/local_cluster.py, services/launch/sites.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pdd.bench.soak import leak_accounting
from pdd.loadgen.client import Chunk, Stream, stream
from pdd.loadgen.scrape import samples_of, scrape_sync
from pdd.services.launch.local_cluster import LocalCluster, two_site_layout
from pdd.services.launch.sites import LOCAL, NETNS, SITE_A, SITE_B, SitesCluster
from pdd.shared.pipelines import Pipeline
from pdd.shared.roles import Role
from pdd.transports.wan_emulation import WanConfig

SITE_SCENARIOS = ("nats_kill_a", "nats_kill_b", "wan_cut_net")  # on two sites, one nats-server each
SCENARIOS = ("kill_md", "kill_rld", "nats_restart", "wan_cut", "stop_p", *SITE_SCENARIOS)
DEFAULT_SCENARIOS = (*SCENARIOS[:4], *SITE_SCENARIOS)  # stop_p checks the retry path (no token out yet)
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
        "router": {"request_timeout_s": args.deadline_s, "stall_timeout_s": args.stall_timeout_s, "max_migrations": 3,
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


def held_in_flight(cluster: LocalCluster, role: str | None = None) -> int:
    """Requests held by the live instances of ``role`` (every engine when None), from their /health."""
    return sum(m.health().get("in_flight", 0) or 0 for m in cluster.engine_members() if role in (None, m.role))


def summarize(results: list[Outcome], reference: list[list[int]], leaked: dict[str, int],
              roles: dict[str, str] | None = None) -> dict:
    """``leaked``: LocalCluster.wait_idle's reading; ``roles``: the live engines it should cover (default:
    the ids it has). An engine that did not answer counts in health_unanswered, never as 0 leaked."""
    completed = [r for r in results if r.finish_reason is not None and r.error is None and not r.hung]
    accounting = leak_accounting(roles if roles is not None else dict.fromkeys(leaked, Role.MAIN_DECODE), leaked)
    return {
        "total": len(results),
        "completed": len(completed),
        "identical": sum(1 for r in completed if r.tokens == reference[r.index]),
        "lost": sum(1 for r in results if r.error is not None),
        "hung": sum(1 for r in results if r.hung),
        "leaked_blocks": sum(v for v in accounting["leaked"].values() if v is not None),
        "health_unanswered": accounting["unanswered"],
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
    elif name == "wan_cut_net":  # P-MD until the cut: KV in flight; later ones (no MD reachable) routed freely
        pipelines = [Pipeline.P_MD if i < len(texts) // 5 else None for i in range(len(texts))]

    # transfers keep starting across the cut
    spread = args.wan_cut_s * 2 if name in ("wan_cut", "wan_cut_net") else 0.0

    if name == "stop_p":
        facts["stopped"] = "p-0"  # equal cost ties go to the lowest id: p-0 gets the requests
        cluster.kill("p-0", signal.SIGSTOP)

    async def fault(progress: list[int]) -> None:
        if name == "stop_p":
            await asyncio.sleep(0)
            return
        if name in ("wan_cut", "wan_cut_net"):
            await asyncio.sleep(spread * 0.2)
            if name == "wan_cut":  # and a main decoder holds requests, or the cut would hit nothing in flight
                await asyncio.to_thread(wait_busy, cluster, Role.MAIN_DECODE, 1, spread)
        elif name == "kill_rld":  # relays hold requests briefly (until handoff or a short P-RLD finish)
            await wait_streaming(progress, 0.05, 2)
            await asyncio.to_thread(wait_busy, cluster, Role.RELAY, max(1, len(texts) // 8))
        else:
            await wait_streaming(progress, 0.5, 3)
        if name in ("kill_md", "kill_rld"):
            victim = busiest(cluster, Role.MAIN_DECODE if name == "kill_md" else Role.RELAY)
            facts["killed"] = victim
            facts["hit_in_flight"] = cluster.members[victim].health().get("in_flight", 0) or 0
            cluster.kill(victim)
        elif name == "nats_restart":
            facts["hit_in_flight"] = await asyncio.to_thread(held_in_flight, cluster)
            cluster.stop_nats()
            await asyncio.sleep(args.nats_down_s)
            cluster.start_nats()
            facts["serving_again_s"] = await first_success_after(cluster, time.monotonic())
        elif name == "wan_cut":
            down = cluster.run_dir / "wan.down"
            facts["hit_in_flight"] = await asyncio.to_thread(held_in_flight, cluster, Role.MAIN_DECODE)
            down.touch()
            await asyncio.sleep(args.wan_cut_s)
            down.unlink()
            facts["links_marked_down"] = len(await asyncio.to_thread(links_down, cluster)) or "none yet"
            facts["wan_back_after_s"] = await asyncio.to_thread(wait_links_up, cluster, time.monotonic())
        elif name in SITE_SCENARIOS:
            facts.update(await site_fault(name, cluster, progress, args))

    t0 = time.monotonic()
    try:
        results = await run_load(cluster, texts, args, pipelines, fault, spread)
    finally:
        if name == "stop_p":
            cluster.kill("p-0", signal.SIGCONT)
    facts["seconds"] = round(time.monotonic() - t0, 1)
    leaked = await asyncio.to_thread(cluster.wait_idle, 30.0)
    summary = summarize(results, reference, leaked, {m.instance_id: m.role for m in cluster.engine_members()})
    summary.update(facts)
    hit = facts.get("hit_in_flight", facts.get("in_flight_at_fault", 0))
    summary["fault_mid_stream"] = None if name == "stop_p" else hit > 0
    summary["pipelines"] = count_by(r.info.get("pipeline") for r in results if r.info)
    summary["migrated"] = sum(1 for r in results if r.info.get("migrations"))
    summary["alive"] = sorted(m.instance_id for m in cluster.members.values() if m.alive)
    if name in SITE_SCENARIOS:
        site_a = {i["id"] for i in cluster.config["instances"] if i["site"] == SITE_A}
        summary["finished_locally"] = sum(1 for r in results if r.finish_reason and not r.error and not r.hung
                                          and finished_in(r.info, site_a))
    return summary


def in_flight(progress: list[int], max_tokens: int) -> int:
    """Requests that have streamed and not yet finished: what a fault now lands on."""
    return sum(1 for p in progress if 0 < p < max_tokens)


def finished_in(info: dict, site_ids: set[str]) -> bool:
    """Whether a finished request's last decoder was one of ``site_ids``: a P-RLD route, the relay
    finishing after a WAN failure, or a resume there (when the ``pdd`` block names ``resumed_on``)."""
    if info.get("resumed_on"):
        return info["resumed_on"] in site_ids
    return info.get("pipeline") == Pipeline.P_RLD or bool(info.get("wan_fallback"))


async def site_fault(name: str, cluster: SitesCluster, progress: list[int], args: argparse.Namespace) -> dict:
    """The fault of a two-site scenario, injected now (requests are streaming); returns its facts."""
    sites = cluster.sites
    facts: dict[str, Any] = {"in_flight_at_fault": in_flight(progress, args.max_tokens)}
    if name in ("nats_kill_a", "nats_kill_b"):
        site = SITE_A if name == "nats_kill_a" else SITE_B
        facts["killed"] = f"nats-server of {site} (kill -9)"
        sites.kill_nats(site)
        await asyncio.sleep(args.nats_down_s)
        await asyncio.to_thread(sites.start_nats, site)
    elif sites.can_cut:
        facts["cut"] = "network: nftables drops every packet on the WAN device, both ways"
        sites.cut()
        try:
            await asyncio.sleep(args.wan_cut_s)
            facts["leaf_dropped"] = await asyncio.to_thread(sites.leaf_links, SITE_B) == 0
        finally:
            sites.mend()
    else:
        facts["cut"] = (f"FALLBACK ({fallback_why(args)}): in-process shaper cut of KV sends; leaf link and "
                        f"replies stay up")
        down = cluster.run_dir / "wan.down"
        down.touch()
        await asyncio.sleep(args.wan_cut_s)
        down.unlink()
    t0 = time.monotonic()
    facts["leaf_reconnect_s"] = await asyncio.to_thread(sites.wait_leaf, t0)
    if name == "wan_cut_net":
        facts["links_marked_down"] = len(await asyncio.to_thread(links_down, cluster)) or "none yet"
        facts["wan_back_after_s"] = await asyncio.to_thread(wait_links_up, cluster, t0)
    else:
        facts["serving_again_s"] = await first_success_after(cluster, t0)
    return facts


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
    reference: list[list[int]] | None = None
    one_box = [n for n in args.scenarios if n not in SITE_SCENARIOS]
    two_sites = [n for n in args.scenarios if n in SITE_SCENARIOS]
    for names, cluster in ((one_box, lambda: LocalCluster(root / "run", build_config(args, root / "run"))),
                           (two_sites, lambda: sites_cluster(args, root / "sites"))):
        if names:
            reference = await run_scenarios(cluster(), names, texts, reference, args, report)
    return report


def fallback_why(args: argparse.Namespace) -> str:
    """Why the two sites share this box's network: asked for, or no root."""
    return f"--sites {LOCAL}" if args.sites == LOCAL else "not root: no network namespaces"


def sites_cluster(args: argparse.Namespace, run_dir: Path) -> SitesCluster:
    """The two-site system: namespaces and the kernel WAN (root), else two nats-servers on this box."""
    mode = args.sites if args.sites != "auto" else (NETNS if os.geteuid() == 0 else LOCAL)
    config = build_config(args, run_dir)
    if mode == NETNS:  # the kernel link carries the WAN figures; no in-process shaper on top
        config["transports"]["wan"]["options"].pop("shape")
        wan = WanConfig(rate="1gbit", delay="5ms", ns_a="pdd-chaos-a", ns_b="pdd-chaos-b", subnet="10.86.0")
        return SitesCluster(run_dir, config, NETNS, wan)
    return SitesCluster(run_dir, config, LOCAL)


async def run_scenarios(cluster: LocalCluster, names: list[str], texts: list[str],
                        reference: list[list[int]] | None, args: argparse.Namespace, report: dict) -> list[list[int]]:
    """Start ``cluster``, take the reference outputs unless given, run each scenario into ``report``."""
    with cluster:
        layout = "one box" if not isinstance(cluster, SitesCluster) else (
            "two sites in network namespaces, kernel WAN" if cluster.sites.can_cut
            else f"FALLBACK two sites on one box ({fallback_why(args)})")
        print(f"[chaos] starting the system ({layout}) in {cluster.run_dir}", flush=True)
        cluster.start(300)
        if reference is None:
            ref = await run_load(cluster, texts, args, [None] * len(texts))
            bad = [r for r in ref if r.error or r.hung or not r.tokens]
            if bad:
                raise RuntimeError(f"the undisturbed reference run failed for {len(bad)} requests: {bad[0]}")
            reference = [r.tokens for r in ref]
            print(f"[chaos] reference run: {len(ref)} requests, {sum(map(len, reference))} tokens", flush=True)
        for name in names:
            for attempt in range(1, args.fault_attempts + 1):
                restore(cluster)
                result = await scenario(name, cluster, texts, reference, args)
                result["attempts"] = attempt
                if result["fault_mid_stream"] is not False:
                    break
                print(f"[chaos] {name}: the fault hit no request in flight (attempt {attempt}); "
                      + ("repeating" if attempt < args.fault_attempts else "giving up"), flush=True)
            report[name] = result
            print(f"[chaos] {name}: " + json.dumps(result), flush=True)
    return reference


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--deadline-s", type=float, default=120.0, help="per-request deadline (router)")
    p.add_argument("--stall-timeout-s", type=float, default=10.0,
                   help="router.stall_timeout_s: a stream silent this long migrates (raise it for a real model on a "
                        "loaded box, where a first decode step can take longer)")
    p.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS), help=f"comma list from {SCENARIOS}")
    p.add_argument("--model", default=None, help="model path (default: a tiny seeded checkpoint)")
    p.add_argument("--kv-memory-mb", type=int, default=64)
    p.add_argument("--nats-down-s", type=float, default=5.0)
    p.add_argument("--wan-cut-s", type=float, default=10.0)
    p.add_argument("--fault-attempts", type=int, default=3,
                   help="tries per scenario for its fault to hit requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--sites", default="auto", choices=["auto", NETNS, LOCAL],
                   help=f"layout of {', '.join(SITE_SCENARIOS)}: network namespaces + kernel WAN (root), two "
                        f"nats-servers on this box (the fallback), auto: {NETNS} when root")
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
        "total", "completed", "identical", "lost", "hung", "leaked_blocks", "health_unanswered", "fault_mid_stream")}
        for name, r in report.items()}))
    return 0 if all(scenario_ok(r) for r in report.values()) else 1


def scenario_ok(r: dict) -> bool:
    """Every request completed identically, none hung, every live engine answered and holds no block, and
    the fault hit requests in flight (stop_p's needs not)."""
    return (r["completed"] == r["total"] == r["identical"] and not r["hung"] and not r["leaked_blocks"]
            and not r["health_unanswered"] and r.get("fault_mid_stream") is not False)


if __name__ == "__main__":
    sys.exit(main())
