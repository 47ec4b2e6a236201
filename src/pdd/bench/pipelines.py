"""PDD against cross-site PD baselines, same rules for every setup: TTFT, TT2, goodput, WAN bytes.

Setups (real processes each: nats-server, router, P, RLD, MD; built-in SmolLM2-135M-Instruct):
  colocated      P and MD in one site, no WAN; forced P-MD; MD keeps its decode-side radix cache.
  naive          cross-site PD: forced P-MD over the emulated WAN, MD without a decode-side cache
                 (the whole prompt's KV crosses on every turn).
  naive-stream0  naive, but P streams output position 0 at once (as PDD does): isolates what the
                 relay masks, the wait for position 1.
  pdd            the router's policy picks P-MD / P-RLD-MD / P-RLD per request; MD with its cache.

First-token rules (what the client sees, stated and equal): colocated and naive release position 0
when their decoder streams (conventional PD, the report's baseline); naive-stream0 and pdd stream it
from P at once. Every time is taken per output position (per-chunk token counts from
stream_options.continuous_usage_stats), never per SSE chunk: TTFT = position 0, TT2 = position 1,
handoff stall = the largest gap at the positions where main decode took over from the relay (+-2) / the
request's median gap.

The run, in order:
  1. colocated: the repeats (one per seed), then its goodput.
  2. WAN calibration, from the baselines only, in the repeats' regime: the emulated WAN rate is
     bisected (log scale) on naive runs of seed 0's closed-loop sessions (the same requests, think
     times and queueing as colocated's seed-0 repeat) until naive's P50 TTFT / colocated's = 1.6 ± 0.1
     (the report's 6.7 s / 4.2 s, a loaded production system). No PDD figure exists yet. --wan-rate
     skips this and uses the given rate.
  3. naive, naive-stream0, pdd at that rate: the repeats, then goodput.
Workload (per seed): agent sessions (a shared system prompt + a fresh task, then turns that append
an answer and new user/tool tokens; some turns carry a long tool output) plus ~3.5 % anomalous
long-input / short-output requests; the hit bins are printed. Repeats run the sessions closed-loop
(think time between turns); goodput = the highest open-loop Poisson request rate at which >= 90 % of
requests meet the SLO (TT2 and mean ITL <= 1.5 x colocated's p90 from its repeats), by geometric
bisection; a setup that sustains no tried rate reports the lowest rate as an upper bound, flagged.

Run: python -m pdd.bench.pipelines [--seeds 3 --wan-rate 200mbit ...]   Last stdout line: one JSON object.
On emulated accelerators (the same setups and rules, workload and WAN from a simulator scenario, every run
beside `pdd sim` of the same requests): python -m pdd.bench.pipelines --backend emulated (bench/pipelines_emulated.py).

Why one module: it is one benchmark, read top to bottom (setups, workload, drivers, figures,
report); the parts share its per-request records and arguments and mean nothing apart. The client,
position timing, statistics, metrics parser and cluster are the shared ones (loadgen/client.py,
loadgen/positions.py, loadgen/stats.py, loadgen/scrape.py, launch/local_cluster.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd.loadgen.positions import PositionTimes
from pdd.loadgen.stats import Bisection, bisect_geometric, highest_passing, mean_ci95, pct
from pdd.loadgen.workload import WORDS as _WORDS  # one-token English words
from pdd.launch.local_cluster import LocalCluster, two_site_layout
from pdd.launch.emulate import BACKEND as EMULATED_BACKEND
from pdd.shared.engines import DEFAULT_ENGINE, engine_plugins
from pdd.shared.pipelines import Pipeline

TARGET_RATIO, RATIO_TOLERANCE = 1.6, 0.1  # the report: naive P50 TTFT 6.7 s / same-site 4.2 s
SLO_SHARE = 0.9  # goodput: the share of requests that must meet the SLO
BACKENDS = tuple(sorted(engine_plugins()))
EMULATED = EMULATED_BACKEND  # --backend emulated: the report-scale comparison, its own program (pipelines_emulated)


@dataclass(frozen=True)
class Setup:
    name: str
    cross_site: bool  # MD in site B behind the emulated WAN
    forced: Pipeline | None  # None: the router's policy chooses
    md_cache: bool  # MD keeps a decode-side radix cache
    holds_first_token: bool  # position 0 waits until the decoder streams (router.first_token_after_kv)

    @property
    def rule(self) -> str:
        first = "held until the decoder streams" if self.holds_first_token else "streamed by P at once"
        path = self.forced or "policy"
        return (f"{self.name}: {'cross-site' if self.cross_site else 'one site'}, {path}, "
                f"MD cache {'on' if self.md_cache else 'off'}, position 0 {first}")


SETUPS = {s.name: s for s in (
    Setup("colocated", cross_site=False, forced=Pipeline.P_MD, md_cache=True, holds_first_token=True),
    Setup("naive", cross_site=True, forced=Pipeline.P_MD, md_cache=False, holds_first_token=True),
    Setup("naive-stream0", cross_site=True, forced=Pipeline.P_MD, md_cache=False, holds_first_token=False),
    Setup("pdd", cross_site=True, forced=None, md_cache=True, holds_first_token=False),
)}


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
def setup_config(setup: Setup, args: argparse.Namespace, wan_rate: str | None, spans_path: Path) -> dict:
    """The deployment config of one setup; the WAN shaper sits on P's WAN transport."""
    from pdd.transports import ucx_available

    wan_opts: dict[str, Any] = {"streams": 2}
    if setup.cross_site and wan_rate:
        wan_opts["shape"] = {"rate": wan_rate, "delay": args.delay, "jitter": args.jitter}
    policy: dict[str, Any] = {"handoff_catch_up_threshold": args.catch_up_threshold,
                              "anomalous_min_prompt_tokens": args.anomalous_min_prompt_tokens,
                              "anomalous_max_output_tokens": args.anomalous_max_output_tokens}
    if wan_rate:
        from pdd.transports.units import rate_bits

        policy["default_wan_gbps"] = rate_bits(wan_rate) / 1e9
    router: dict[str, Any] = {"request_timeout_s": 600, "first_token_after_kv": setup.holds_first_token}
    if setup.forced:
        router["forced_pipeline"] = setup.forced.value
    return {
        "model": {"backend": args.backend, "path": args.model, "kv_memory_mb": args.kv_memory_mb, "block_size": 16,
                  "max_num_seqs": 32,
                  "threads": args.threads, "max_prefill_tokens": 2048},
        **two_site_layout(main_decode_site="site-b" if setup.cross_site else "site-a"),
        "transports": {"fast": {"name": "ucx" if ucx_available() else "zmq", "options": {}},
                       "wan": {"name": "zmq", "options": wan_opts}},
        "router": router,
        "policy": policy,
        "service": {"heartbeat_ms": 250, "drain_timeout_s": 5},
        "telemetry": {"exporter": "jsonl", "jsonl_path": str(spans_path), "log_format": "json"},
    }


class System:
    """One setup's processes (a LocalCluster) and its span file."""

    def __init__(self, setup: Setup, run_dir: Path, args: argparse.Namespace, wan_rate: str | None):
        self.setup = setup
        self.spans_path = run_dir / "spans.jsonl"
        env = {} if args.ucx_python_future else {"UCXPY_ENABLE_PYTHON_FUTURE": "0"}
        no_cache = {} if setup.md_cache else {"md-0": {"PDD__MODEL__ENABLE_PREFIX_CACHE": "false"}}
        self.cluster = LocalCluster(run_dir, setup_config(setup, args, wan_rate, self.spans_path), env=env,
                                    instance_env=no_cache)

    @property
    def base_url(self) -> str:
        return self.cluster.base_url

    def start(self, timeout: float = 300.0) -> float:
        return self.cluster.start(timeout)

    def stop(self) -> None:
        self.cluster.stop()

    def wan_bytes(self) -> float:
        """P's WAN bytes so far (pdd:wan_bytes_total)."""
        from pdd.loadgen.scrape import scrape_sync

        samples = scrape_sync(self.cluster.members["p-0"].metrics_url) or {}
        return sum(v for (name, _), v in samples.items() if name in ("pdd:wan_bytes_total", "pdd_wan_bytes_total"))


# ---------------------------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------------------------
@dataclass
class Planned:
    """One request, fixed before any run: its prompt does not depend on what a setup answered (the
    previous answer in a later turn is a stand-in of the same length), so every setup and every
    driver sends identical requests."""

    session: int
    turn: int
    kind: str  # "first" (fresh task) | "turn" | "tool" (long tool output) | "anomalous"
    prompt: list[int]
    max_tokens: int  # output positions the client reads (and sends as max_tokens, unless hang_up)
    reuse: int  # leading tokens a warm cache holds from this session's previous request
    # a trace replay (loadgen/trace.py MaxTokensRule): the body's max_tokens is ``sent_max_tokens`` (None: left
    # out) and the client hangs up after ``max_tokens`` positions, the trace's output length, as loadgen does
    hang_up: bool = False
    sent_max_tokens: int | None = None

    @property
    def hit(self) -> float:
        return self.reuse / len(self.prompt)

    @functools.cached_property
    def body(self) -> bytes:
        """The request's JSON, encoded once before any run: encoding a long prompt at its send time would
        count the client's own work in its TTFT and stall the client's loop (every other stream's timing)."""
        sent = self.sent_max_tokens if self.hang_up else self.max_tokens
        return json.dumps(request_body(self.prompt, sent)).encode()


def word_ids(model_path: str) -> list[int]:
    """Token ids of one-token English words of the model's tokenizer (prompts of real tokens)."""
    from pdd.shared.model_files import resolve_model_path
    from pdd.shared.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path(model_path))
    ids = {enc[0] for w in _WORDS if len(enc := tok.encode(" " + w, add_special_tokens=False)) == 1}
    return sorted(ids)


def build_requests(seed: int, sessions: int, args: argparse.Namespace, vocab: list[int]) -> list[Planned]:
    rng = random.Random(seed)

    def text(n: int) -> list[int]:
        return [rng.choice(vocab) for _ in range(n)]

    system = text(args.system_tokens)  # shared by every session of this seed (tool definitions, rules)
    out: list[Planned] = []
    for s in range(sessions):
        prompt = system + text(rng.randint(int(args.task_tokens * 0.8), int(args.task_tokens * 1.2)))
        out.append(Planned(s, 0, "first", prompt, args.output_tokens, len(system)))
        for turn in range(1, args.turns):
            long_tool = rng.random() < args.long_tool_fraction
            new = args.long_tool_tokens if long_tool else rng.randint(args.new_tokens // 2, args.new_tokens * 3 // 2)
            previous = prompt
            prompt = previous + text(args.output_tokens) + text(new)  # the answer's stand-in, then new tokens
            out.append(Planned(s, turn, "tool" if long_tool else "turn", prompt, args.output_tokens, len(previous)))
    n_anomalous = max(1, round(args.anomalous_share * len(out) / (1 - args.anomalous_share)))
    for i in range(n_anomalous):
        out.append(Planned(sessions + i, 0, "anomalous", system + text(args.anomalous_prompt_tokens - len(system)),
                           args.anomalous_output_tokens, len(system)))
    return out


HIT_BINS = ((0.0, 0.5), (0.5, 0.9), (0.9, 0.95), (0.95, 0.98), (0.98, 1.01))


def workload_shape(requests: list[Planned]) -> dict[str, Any]:
    hits = [r.hit for r in requests]
    return {"requests": len(requests), "mean_hit": round(statistics.fmean(hits), 4),
            "share_hit_gt_95": round(sum(h > 0.95 for h in hits) / len(hits), 4),
            "anomalous_share": round(sum(r.kind == "anomalous" for r in requests) / len(requests), 4),
            "bins": {f"{lo:.2f}-{min(hi, 1.0):.2f}": sum(lo <= h < hi for h in hits) for lo, hi in HIT_BINS},
            "prompt_tokens_mean": round(statistics.fmean(len(r.prompt) for r in requests), 1)}


# ---------------------------------------------------------------------------------------------
# drivers
# ---------------------------------------------------------------------------------------------
@dataclass
class Result:
    planned: Planned
    ok: bool = False
    error: str = ""
    positions: PositionTimes | None = None
    output_tokens: int = 0
    info: dict = field(default_factory=dict)
    request_id: str = ""
    sent: float = 0.0  # when it went out, seconds after the run's start (drivers that schedule by time)


def handoff_stall(r: Result) -> float | None:
    """The stall where main decode took over from the relay (position = the relay's tokens + 1); None for a
    request with no handoff."""
    if not (r.info.get("handoff_mode") and r.positions and r.info.get("rld_tokens")):
        return None
    return r.positions.stall(int(r.info["rld_tokens"]) + 1)


def request_body(prompt: list[int], max_tokens: int | None) -> dict:
    """A completions body of token ids; ``max_tokens`` None leaves the field out (the server's room)."""
    # usage on every chunk: how many tokens each chunk carried, so times are per output position
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "pdd": {"return_token_ids": True}}
    if max_tokens is None:
        del body["max_tokens"]
    return body


async def send(session, base_url: str, planned: Planned) -> Result:
    from pdd.loadgen.client import stream

    s = await stream(session, base_url + "/v1/completions", planned.body,
                     abort_after_tokens=planned.max_tokens if planned.hang_up else None)
    res = Result(planned, request_id=s.id, info=s.info)
    if s.exception is not None or s.status != 200 or s.error is not None:
        res.error = (f"{type(s.exception).__name__}: {s.exception}" if s.exception is not None
                     else f"HTTP {s.status}: {s.body_text[:200]}" if s.status != 200 else json.dumps(s.error))[:300]
        return res
    times = s.token_times()
    if times is not None and planned.hang_up:  # the chunk that reached the read limit may carry tokens past it
        times = times[:planned.max_tokens]
    if times is None or len(times) != planned.max_tokens:
        res.error = f"stream gave {len(times or [])} positions, expected {planned.max_tokens}"
        return res
    res.positions, res.output_tokens, res.ok = PositionTimes(s.t_send, times), len(times), True
    return res


def client_session():
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=600, sock_read=600))


async def run_sessions(base_url: str, requests: list[Planned], think_s: float, stagger_s: float,
                       seed: int) -> tuple[list[Result], float]:
    """Closed loop: sessions side by side (started ``stagger_s`` apart), each turn after the previous
    one ended plus a think time."""
    rng = random.Random(seed + 7)
    by_session: dict[int, list[Planned]] = {}
    for r in requests:
        by_session.setdefault(r.session, []).append(r)
    results: list[Result] = []

    async def one(client, sid: int, plans: list[Planned], t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + sid * stagger_s - time.perf_counter()))
        for i, planned in enumerate(plans):
            results.append(await send(client, base_url, planned))
            if i + 1 < len(plans) and think_s:
                await asyncio.sleep(rng.uniform(0.5 * think_s, 1.5 * think_s))

    for r in requests:
        r.body  # noqa: B018 - encoded before the clock starts
    async with client_session() as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, sid, plans, t0) for sid, plans in by_session.items()))
        return results, time.perf_counter() - t0


async def run_open_loop(base_url: str, requests: list[Planned], rate: float, seed: int) -> tuple[list[Result], float]:
    """Open loop: Poisson arrivals at ``rate`` requests/s, whatever the system does; requests go out
    turn by turn across sessions, so a session's next turn follows its previous one by ~sessions/rate."""
    rng = random.Random(seed + 11)
    ordered = sorted(requests, key=lambda r: (r.turn, r.session))
    t, arrivals = 0.0, []
    for _ in ordered:
        arrivals.append(t)
        t += rng.expovariate(rate)
    return await run_at(base_url, ordered, arrivals)


async def run_at(base_url: str, requests: list[Planned], arrivals: list[float],
                 after: list[int] | None = None) -> tuple[list[Result], float]:
    """Open loop at given times: request i goes out ``arrivals[i]`` seconds after the start, whatever the
    system does, or, where ``after[i]`` names an earlier request (>= 0), once that one ended if that is later
    (an agent's next turn waits for its previous answer). Results in the requests' order, each with its send
    time (``Result.sent``, seconds after the start)."""
    ended = [asyncio.Event() for _ in requests]

    async def at(client, i: int, t0: float) -> Result:
        try:
            if after is not None and after[i] >= 0:
                await ended[after[i]].wait()
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            sent = time.perf_counter() - t0
            res = await send(client, base_url, requests[i])
            res.sent = sent
            return res
        finally:
            ended[i].set()

    for r in requests:
        r.body  # noqa: B018 - encoded before the clock starts
    async with client_session() as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(at(client, i, t0) for i in range(len(requests))))
        return list(results), time.perf_counter() - t0


async def warm_up(base_url: str, vocab: list[int]) -> None:
    """Open every link and warm kernels, on prompts that share nothing with the workload."""
    from pdd.loadgen.client import stream

    rng = random.Random(12345)
    async with client_session() as client:
        for pipeline in (Pipeline.P_MD, Pipeline.P_RLD_MD, None):
            body = {**request_body([rng.choice(vocab) for _ in range(60)], 8), "stream": False}
            body.pop("stream_options")
            if pipeline:
                body["pdd"]["pipeline"] = pipeline
            s = await stream(client, base_url + "/v1/completions", body, timeout_s=300.0)
            if s.status != 200 or s.exception is not None or s.timed_out:
                raise RuntimeError(f"warm-up request failed: {s.status} {s.body_text[:300] or s.exception}")


# ---------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------
def summarize(results: list[Result], makespan: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    pos = [r.positions for r in ok if r.positions]
    ttft, tt2 = [p.ttft for p in pos], [p.tt2 for p in pos]
    mitl = [p.mean_itl for p in pos]
    stalls = [x for r in ok if (x := handoff_stall(r)) is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    pipelines: dict[str, int] = {}
    for r in ok:
        pipelines[r.info.get("pipeline", "?")] = pipelines.get(r.info.get("pipeline", "?"), 0) + 1

    def q(vals: list, scale: float = 1.0) -> dict[str, float | None]:
        return {"mean": round(statistics.fmean(v for v in vals if v is not None) * scale, 4) if vals else None,
                **{f"p{k}": (round(v * scale, 4) if (v := pct(vals, k)) is not None else None) for k in (50, 90)}}

    return {"requests": len(results), "completed": len(ok), "errors": [r.error for r in results if not r.ok][:3],
            "makespan_s": round(makespan, 2), "ttft_s": q(ttft), "tt2_s": q(tt2), "mean_itl_ms": q(mitl, 1000),
            "handoff_stall": {**q(stalls), "max": round(max(stalls), 3) if stalls else None, "n": len(stalls)},
            "output_tokens": out_tokens,
            "rld_tokens": sum(int(r.info.get("rld_tokens", 0) or 0) for r in ok),
            "wan_bytes_resp": sum(float(r.info.get("wan_bytes", 0) or 0) for r in ok),
            "pipeline_mix": pipelines}


def slo_misses(results: list[Result], tt2_slo: float, itl_slo: float) -> dict[str, int]:
    """How many requests missed each part of the SLO (a request may miss both); 'failed' ended in error."""
    done = _completed(results)
    return {"failed": len(results) - len(done), "tt2": sum(r.positions.tt2 > tt2_slo for r in done),
            "mean_itl": sum((r.positions.mean_itl or 0) > itl_slo for r in done)}


def slo_share(results: list[Result], tt2_slo: float, itl_slo: float) -> float:
    good = [r for r in _completed(results) if r.positions.tt2 <= tt2_slo and (r.positions.mean_itl or 0) <= itl_slo]
    return len(good) / max(1, len(results))


def _completed(results: list[Result]) -> list[Result]:
    """Requests that streamed at least two positions (the SLO's TT2 exists)."""
    return [r for r in results if r.ok and r.positions and r.positions.tt2 is not None]


def read_spans(spans_path: Path, request_ids: set[str]) -> list[dict]:
    """The spans of the given requests (the workload's, not warm-up or probes)."""
    out = []
    if spans_path.exists():
        for line in spans_path.read_text(errors="replace").splitlines():
            try:
                s = json.loads(line)
            except json.JSONDecodeError:
                continue
            if (s.get("attributes") or {}).get("request_id") in request_ids:
                out.append(s)
    return out


def fast_path(spans: list[dict]) -> dict[str, Any]:
    """kv.transfer.fast (P -> relay): p50/p90 ms and MB/s pool to pool."""
    fast = [s for s in spans if s.get("name") == "kv.transfer.fast" and (s.get("attributes") or {}).get("bytes")]
    ms = [(s["end_ns"] - s["start_ns"]) / 1e6 for s in fast]
    rates = [a["bytes"] / a["seconds"] / 1e6 for s in fast if (a := s["attributes"]).get("seconds")]
    return {"n": len(ms), "p50_ms": round(pct(ms, 50), 1) if ms else None,
            "p90_ms": round(pct(ms, 90), 1) if ms else None,
            "mb_per_s_p50": round(pct(rates, 50), 1) if rates else None}


def span_profile(spans: list[dict]) -> dict[str, dict[str, float]]:
    """Where the time goes: per stage and service, mean / p90 ms."""
    stages: dict[str, list[float]] = {}
    for s in spans:
        key = f"{s.get('name')}@{str(s.get('service', '?')).replace('pdd-', '')}"
        stages.setdefault(key, []).append((s.get("end_ns", 0) - s.get("start_ns", 0)) / 1e6)
    return {k: {"n": len(v), "mean_ms": round(statistics.fmean(v), 1), "p90_ms": round(pct(v, 90), 1)}
            for k, v in sorted(stages.items())}


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=BACKENDS, default=DEFAULT_ENGINE,
                    help="torch: real compute (this module); emulated: every engine on the emulated backend, "
                         "workload and WAN from a simulator scenario, each run beside `pdd sim` of the same "
                         "requests (bench/pipelines_emulated.py; `--backend emulated --help` for its options); vllm: "
                         "every engine on vLLM with PDD's connector (run from .venv-vllm; docs/BACKENDS.md)")
    ap.add_argument("--model", default="default", help="'default' = SmolLM2-135M-Instruct")
    ap.add_argument("--seeds", type=int, default=3, help="repeats (one workload seed each)")
    ap.add_argument("--sessions", type=int, default=2, help="agent sessions per repeat")
    ap.add_argument("--turns", type=int, default=12, help="requests per session (the first is the low-hit one)")
    ap.add_argument("--system-tokens", type=int, default=600, help="system prompt shared by a seed's sessions")
    ap.add_argument("--task-tokens", type=int, default=400, help="fresh task tokens of a session's first turn")
    ap.add_argument("--new-tokens", type=int, default=16, help="new user/tool tokens per later turn (mean)")
    ap.add_argument("--long-tool-fraction", type=float, default=0.12, help="later turns with a long tool output")
    ap.add_argument("--long-tool-tokens", type=int, default=240)
    ap.add_argument("--output-tokens", type=int, default=16, help="max_tokens per turn (ignore_eos)")
    ap.add_argument("--anomalous-share", type=float, default=0.035,
                    help="long-input/short-output requests (report: 3-4 %%)")
    ap.add_argument("--anomalous-prompt-tokens", type=int, default=2400)
    ap.add_argument("--anomalous-output-tokens", type=int, default=4)
    ap.add_argument("--anomalous-min-prompt-tokens", type=int, default=2000,
                    help="policy: prompts this long with short output finish on the relay (report: 16K at GPU scale)")
    ap.add_argument("--anomalous-max-output-tokens", type=int, default=8, help="policy: 'short output' (report: < 500)")
    ap.add_argument("--think-s", type=float, default=0.5, help="mean think time between turns (repeats)")
    ap.add_argument("--stagger-s", type=float, default=2.0, help="session start spacing (repeats)")
    ap.add_argument("--wan-rate", default=None, help="skip the calibration and emulate this WAN rate (e.g. 200mbit)")
    ap.add_argument("--rate-range", default="30mbit:3gbit", help="calibration search range")
    ap.add_argument("--calibration-steps", type=int, default=4)
    ap.add_argument("--delay", default="20ms", help="one-way WAN delay (an assumption; not calibrated)")
    ap.add_argument("--jitter", default="2ms")
    ap.add_argument("--goodput-range", default="0.1:1.6", help="request rates (req/s) the goodput search spans")
    ap.add_argument("--goodput-steps", type=int, default=3, help="bisection probes (the lowest rate only if all fail)")
    ap.add_argument("--goodput-requests", type=int, default=12, help="requests per goodput probe (whole sessions, plus the anomalous share)")
    ap.add_argument("--slo-factor", type=float, default=1.5, help="SLO = factor x colocated's p90 (TT2, mean ITL)")
    ap.add_argument("--catch-up-threshold", type=int, default=4,
                    help="policy.handoff_catch_up_threshold for pdd (report: 64 at GPU speed)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine process")
    ap.add_argument("--kv-memory-mb", type=int, default=768)
    ap.add_argument("--no-ucx-python-future", dest="ucx_python_future", action="store_false",
                    help="leave ucxx's default request polling (busy-polls a core share per endpoint here)")
    ap.add_argument("--setups", default=",".join(SETUPS), help="which setups (colocated is needed for the SLO)")
    ap.add_argument("--run-dir", default=None, help="logs/config/spans (default: a temp dir, kept)")
    return ap.parse_args(argv)


class Bench:
    def __init__(self, args: argparse.Namespace, run_root: Path):
        self.args = args
        self.run_root = run_root
        self.vocab = word_ids(args.model)
        self.systems: list[System] = []
        self.setups: dict[str, dict[str, Any]] = {}

    def open(self, setup: Setup, tag: str, wan_rate: str | None) -> System:
        system = System(setup, self.run_root / f"{setup.name}-{tag}", self.args, wan_rate)
        self.systems.append(system)
        startup = system.start()
        asyncio.run(warm_up(system.base_url, self.vocab))
        print(f"  [{setup.name}/{tag}] ready in {startup:.1f}s", flush=True)
        return system

    def close(self, system: System) -> None:
        system.stop()
        self.systems.remove(system)

    def calibration_run(self, system: System) -> float:
        """P50 TTFT of seed 0's closed-loop sessions, as in the repeats: the report's 1.6 is a ratio of a
        loaded system, so the probe carries the same queueing as the colocated repeat it is compared with."""
        requests = build_requests(0, self.args.sessions, self.args, self.vocab)
        results, _ = asyncio.run(run_sessions(system.base_url, requests, self.args.think_s, self.args.stagger_s, 0))
        failed = [r.error for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"calibration run failed: {failed[:2]}")
        return pct([r.positions.ttft for r in results], 50)

    def calibrate(self, colocated_p50: float) -> Bisection:
        from pdd.transports.units import rate_bits

        lo, hi = (rate_bits(x) for x in self.args.rate_range.split(":"))

        def ratio_at(bits: float) -> float:
            system = self.open(SETUPS["naive"], f"calibrate-{bits / 1e6:.0f}mbit", f"{bits / 1e6:.3f}mbit")
            try:
                ratio = self.calibration_run(system) / colocated_p50
            finally:
                self.close(system)
            print(f"  calibration: {bits / 1e6:.0f} Mbit/s -> naive/colocated P50 TTFT {ratio:.3f}", flush=True)
            return ratio

        return bisect_geometric(ratio_at, TARGET_RATIO, RATIO_TOLERANCE, lo, hi, self.args.calibration_steps)

    def repeats(self, system: System, name: str) -> list[dict[str, Any]]:
        out = []
        for seed in range(self.args.seeds):
            requests = build_requests(seed, self.args.sessions, self.args, self.vocab)
            wan0 = system.wan_bytes()
            results, makespan = asyncio.run(run_sessions(system.base_url, requests, self.args.think_s,
                                                         self.args.stagger_s, seed))
            s = summarize(results, makespan)
            s["wan_bytes_metric"] = system.wan_bytes() - wan0
            s["request_ids"] = [r.request_id for r in results if r.request_id]
            s["_results"] = results
            out.append(s)
            print(f"  [{name}] seed {seed}: {s['completed']}/{s['requests']} ok in {makespan:.1f}s; TTFT p50 "
                  f"{s['ttft_s']['p50']}s, TT2 p50 {s['tt2_s']['p50']}s; {s['pipeline_mix']}", flush=True)
        return out

    def goodput(self, system: System, name: str, tt2_slo: float, itl_slo: float) -> Bisection:
        lo, hi = (float(x) for x in self.args.goodput_range.split(":"))
        step = [0]

        def passes(rate: float) -> bool:
            step[0] += 1
            seed = 500 + step[0]
            sessions = -(-self.args.goodput_requests // self.args.turns)  # ceil: whole sessions
            requests = build_requests(seed, sessions, self.args, self.vocab)
            results, makespan = asyncio.run(run_open_loop(system.base_url, requests, rate, seed))
            share = slo_share(results, tt2_slo, itl_slo)
            print(f"  [{name}] goodput probe {rate:.3f} req/s: {share:.0%} within SLO "
                  f"({sum(r.ok for r in results)}/{len(results)} ok, {makespan:.0f}s; missed "
                  f"{slo_misses(results, tt2_slo, itl_slo)})", flush=True)
            return share >= SLO_SHARE

        return highest_passing(passes, lo, hi, self.args.goodput_steps)

    def run_setup(self, setup: Setup, wan_rate: str | None, slo: tuple[float, float] | None) -> dict[str, Any]:
        """Every setup its repeats (seed 0's P50 TTFT is the calibration's figure: colocated's is the
        reference, naive's at the chosen rate the regime's check), then its goodput search."""
        system = self.open(setup, "main", wan_rate)
        try:
            reps = self.repeats(system, setup.name)
            calibration_p50 = reps[0]["ttft_s"]["p50"]
            if slo is None:  # colocated: its repeats define the SLO
                f = self.args.slo_factor
                pooled = [r for rep in reps for r in rep["_results"] if r.ok]
                slo = (f * pct([r.positions.tt2 for r in pooled], 90),
                       f * pct([r.positions.mean_itl for r in pooled], 90))
            good = self.goodput(system, setup.name, *slo)
        finally:
            self.close(system)
        time.sleep(0.5)
        spans = read_spans(system.spans_path, {i for rep in reps for i in rep["request_ids"]})
        return {"rule": setup.rule, "repeats": reps, "slo": slo, "goodput": good,
                "calibration_ttft_p50": calibration_p50, "fast_path": fast_path(spans), "profile": span_profile(spans)}


def reduction(base: float | None, new: float | None) -> float | None:
    return 1 - new / base if base and new is not None else None


def build_report(setups: dict[str, dict], repeats: int, model: str, wan: dict, shape: dict,
                 elapsed: float, backend: str = DEFAULT_ENGINE) -> dict[str, Any]:
    """The JSON report from each setup's measured repeats (also the emulated benchmark's, which adds its keys)."""
    s = setups
    seeds = range(repeats)

    def per_seed(setup: str, key: str, stat: str) -> list[float | None]:
        return [s[setup]["repeats"][i][key][stat] for i in seeds] if setup in s else []

    def ratios(setup_a: str, key: str, stat: str) -> dict:
        return mean_ci95([reduction(a, b) for a, b in zip(per_seed(setup_a, key, stat), per_seed("pdd", key, stat))])

    naive_p50 = s.get("naive", {}).get("calibration_ttft_p50")
    colocated_p50 = s.get("colocated", {}).get("calibration_ttft_p50")
    report: dict[str, Any] = {"bench": "pipelines", "backend": backend, "model": model,
                              "repeats": repeats,
                              "naive_over_colocated_ttft_p50": (round(naive_p50 / colocated_p50, 3)
                                                                if naive_p50 and colocated_p50 else None),
                              "workload": shape, "mean_hit": shape["mean_hit"], "wan": wan,
                              "wan_mbit": wan["mbit"], "rules": [SETUPS[n].rule for n in s]}
    ci = {}
    if "naive" in s and "pdd" in s:
        for key, field_ in (("ttft_mean_reduction_vs_naive", ("ttft_s", "mean")),
                            ("ttft_p90_reduction_vs_naive", ("ttft_s", "p90")),
                            ("tt2_mean_reduction_vs_naive", ("tt2_s", "mean")),
                            ("tt2_p90_reduction_vs_naive", ("tt2_s", "p90"))):
            ci[key] = ratios("naive", *field_)
        naive_wan = sum(r["wan_bytes_metric"] for r in s["naive"]["repeats"])
        pdd_wan = sum(r["wan_bytes_metric"] for r in s["pdd"]["repeats"])
        ci["wan_bytes_ratio_naive_over_pdd"] = mean_ci95(
            [a["wan_bytes_metric"] / b["wan_bytes_metric"] if b["wan_bytes_metric"] else None
             for a, b in zip(s["naive"]["repeats"], s["pdd"]["repeats"])])
        report["wan_bytes_ratio_naive_over_pdd"] = round(naive_wan / pdd_wan, 3) if pdd_wan else None
        gn, gp = s["naive"]["goodput"], s["pdd"]["goodput"]
        report["goodput_gain_vs_naive"] = round(gp.value / gn.value - 1, 4)
        report["goodput_flags"] = {n: s[n]["goodput"].note for n in s if not s[n]["goodput"].converged}
    if "naive-stream0" in s and "pdd" in s:
        ci["tt2_p90_reduction_vs_naive_stream0"] = ratios("naive-stream0", "tt2_s", "p90")
    for key, v in ci.items():
        report[key] = v["mean"]
    report["ci95"] = ci
    if "pdd" in s:
        reps = s["pdd"]["repeats"]
        values = [x for rep in reps for r in rep["_results"] if r.ok and (x := handoff_stall(r)) is not None]
        report["handoff_stall_p90"] = round(pct(values, 90), 3) if values else None
        report["handoff_stall_max"] = round(max(values), 3) if values else None
        report["handoffs"] = len(values)
        output_tokens = max(1, sum(r["output_tokens"] for r in reps))
        report["rld_token_share"] = round(sum(r["rld_tokens"] for r in reps) / output_tokens, 4)
        fp = s["pdd"]["fast_path"] or {}
        report["fast_path_p50_ms"], report["fast_path_p90_ms"] = fp.get("p50_ms"), fp.get("p90_ms")
        report["fast_path_mb_per_s_p50"] = fp.get("mb_per_s_p50")
    report["setups"] = {n: {"rule": v["rule"], "goodput_rps": round(v["goodput"].value, 4), "profile": v["profile"],
                            "goodput_search": {"note": v["goodput"].note, "probes": v["goodput"].probes},
                            "slo": {"tt2_s": round(v["slo"][0], 4), "mean_itl_ms": round(v["slo"][1] * 1000, 2)},
                            "repeats": [{k: x for k, x in rep.items() if not k.startswith("_") and k != "request_ids"}
                                        for rep in v["repeats"]]} for n, v in s.items()}
    report["goals"] = goals(report)
    report["elapsed_s"] = round(elapsed, 1)
    return report


GOALS = (("ttft_mean_reduction_vs_naive", 0.515, True), ("tt2_mean_reduction_vs_naive", 0.515, True),
         ("ttft_p90_reduction_vs_naive", 0.6, True), ("tt2_p90_reduction_vs_naive", 0.6, True),
         ("goodput_gain_vs_naive", 0.278, True), ("wan_bytes_ratio_naive_over_pdd", 10.0, True),
         ("handoff_stall_p90", 1.5, False), ("handoff_stall_max", 2.5, False),
         ("fast_path_mb_per_s_p50", 1000.0, True))


def goals(report: dict) -> dict[str, dict]:
    out = {}
    for key, target, higher in GOALS:
        v = report.get(key)
        out[key] = {"value": v, "target": target,
                    "met": v is not None and (v >= target if higher else v <= target)}
    return out


def fmt(v: Any, nd: int = 3) -> str:
    return "-" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def print_report(report: dict, wan_delay: str) -> None:
    """The table; ``wan_delay`` states the emulated WAN's one-way delay (and jitter) for its line."""
    print()
    w = report["workload"]
    print(f"Workload (all seeds): {w['requests']} requests, mean hit {w['mean_hit']:.3f}, "
          f"{w['share_hit_gt_95']:.0%} above 95 %, anomalous {w['anomalous_share']:.1%}, bins {w['bins']}, "
          f"mean prompt {w['prompt_tokens_mean']:.0f} tokens")
    wan = report["wan"]
    print(f"WAN: {wan['mbit']:.1f} Mbit/s, {wan_delay} ({wan['how']})")
    print("Rules: times per output position (TTFT = position 0, TT2 = position 1); " + "; ".join(report["rules"]))
    cols = list(report["setups"])
    rows: list[tuple[str, Any]] = []
    for label, key, stat in (("TTFT mean s", "ttft_s", "mean"), ("TTFT p90 s", "ttft_s", "p90"),
                             ("TT2 mean s", "tt2_s", "mean"), ("TT2 p90 s", "tt2_s", "p90"),
                             ("mean ITL p90 ms", "mean_itl_ms", "p90")):
        rows.append((label, lambda n, key=key, stat=stat: fmt(mean_ci95(
            [r[key][stat] for r in report["setups"][n]["repeats"]])["mean"])))
    rows += [("completed", lambda n: f"{sum(r['completed'] for r in report['setups'][n]['repeats'])}/"
                                     f"{sum(r['requests'] for r in report['setups'][n]['repeats'])}"),
             ("WAN MB/request", lambda n: fmt(_per_request(report["setups"][n], "wan_bytes_metric") / 1e6, 2)),
             ("goodput req/s", lambda n: fmt(report["setups"][n]["goodput_rps"], 3)),
             ("pipelines", lambda n: " ".join(f"{k}:{v}" for k, v in sorted(_mix(report["setups"][n]).items())))]
    width = max(len(r[0]) for r in rows) + 2
    print(f"{'':{width}s}" + "".join(f" {c:>22s}" for c in cols))
    for label, fn in rows:
        print(f"{label:{width}s}" + "".join(f" {fn(c):>22s}" for c in cols))
    print()
    for key, g in report["goals"].items():
        ci = report["ci95"].get(key) or {}
        interval = f" ± {ci['ci95']}" if ci.get("ci95") is not None else ""
        print(f"  {key:38s} {fmt(g['value'])}{interval}  goal {'<=' if key.startswith('handoff') else '>='} "
              f"{g['target']}  {'MET' if g['met'] else 'MISSED'}")
    if report.get("goodput_flags"):
        print(f"  goodput flags: {report['goodput_flags']}")
    if not all(g["met"] for g in report["goals"].values()):
        print("\nWhere the time goes (spans of the repeats; mean / p90 ms per stage@service):")
        for name, setup in report["setups"].items():
            print(f"  {name:13s} " + "; ".join(f"{k} {v['mean_ms']:.0f}/{v['p90_ms']:.0f}"
                                              for k, v in setup["profile"].items()))


def _per_request(setup: dict, key: str) -> float:
    reps = setup["repeats"]
    return sum(r[key] for r in reps) / max(1, sum(r["requests"] for r in reps))


def _mix(setup: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for rep in setup["repeats"]:
        for k, v in rep["pipeline_mix"].items():
            out[k] = out.get(k, 0) + v
    return out


@contextlib.contextmanager
def setups_running(systems: list) -> Iterator[None]:
    """Around a benchmark's setups: SIGTERM acts as Ctrl-C, and an interrupt exits 130 once every process of
    ``systems`` has stopped (they stop in any case). Shared with bench/pipelines_emulated.py."""
    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        yield
    except KeyboardInterrupt:
        print("interrupted: stopping every process", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    finally:
        for system in list(systems):
            system.stop()


def emit(report: dict, run_root: Path) -> None:
    """The last lines of a run: where its files are, then the report as one JSON line."""
    print(f"elapsed {report['elapsed_s']:.0f}s; logs, configs and spans under {run_root}")
    print(json.dumps(report, sort_keys=True, default=str))


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--backend", choices=BACKENDS, default=DEFAULT_ENGINE)
    known, _ = pre.parse_known_args(argv)
    if known.backend == EMULATED:
        # the emulated comparison is its own program (bench/pipelines_emulated.py), which imports this one's
        # drivers and summaries: run as a child, not imported, so the two form no import circle
        import subprocess

        forwarded = list(sys.argv[1:] if argv is None else argv)
        return subprocess.call([sys.executable, "-m", "pdd.bench.pipelines_emulated", *forwarded])
    args = parse_args(argv)
    t_start = time.monotonic()
    run_root = Path(args.run_dir or tempfile.mkdtemp(prefix="pdd-bench-"))
    run_root.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.setups.split(",") if n]
    unknown = [n for n in names if n not in SETUPS]
    if unknown or "colocated" not in names:
        print(f"--setups: unknown {unknown}; colocated is required (it sets the SLO and the calibration)",
              file=sys.stderr)
        return 2
    bench = Bench(args, run_root)
    shape = workload_shape([r for seed in range(args.seeds)
                            for r in build_requests(seed, args.sessions, args, bench.vocab)])
    print(f"pipelines benchmark: setups {names}, {args.seeds} seeds; run dir {run_root}", flush=True)
    with setups_running(bench.systems):
        print("[colocated] repeats, goodput", flush=True)
        bench.setups["colocated"] = bench.run_setup(SETUPS["colocated"], None, None)
        slo = bench.setups["colocated"]["slo"]
        colocated_p50 = bench.setups["colocated"]["calibration_ttft_p50"]
        from pdd.transports.units import rate_bits

        if args.wan_rate:
            bits = rate_bits(args.wan_rate)
            wan = {"mbit": bits / 1e6, "how": f"--wan-rate {args.wan_rate}"}
        else:
            print(f"[calibration] colocated P50 TTFT {colocated_p50:.3f}s; bisecting the WAN rate for "
                  f"naive/colocated = {TARGET_RATIO} ± {RATIO_TOLERANCE}", flush=True)
            found = bench.calibrate(colocated_p50)
            bits = found.value
            wan = {"mbit": bits / 1e6, "how": f"calibrated on the baselines: {found.note}",
                   "probes": [{"mbit": round(p["x"] / 1e6, 2), "ratio": round(p["y"], 3)} for p in found.probes],
                   "converged": found.converged}
            print(f"[calibration] WAN {bits / 1e6:.1f} Mbit/s ({found.note})", flush=True)
        for name in names:
            if name == "colocated":
                continue
            print(f"[{name}] repeats, goodput at {bits / 1e6:.1f} Mbit/s", flush=True)
            bench.setups[name] = bench.run_setup(SETUPS[name], f"{bits / 1e6:.3f}mbit", slo)
    report = build_report(bench.setups, args.seeds, args.model, wan, shape, time.monotonic() - t_start, args.backend)
    print_report(report, f"{args.delay} one-way ± {args.jitter}")
    emit(report, run_root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
