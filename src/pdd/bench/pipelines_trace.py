"""`python -m pdd.bench.pipelines --backend emulated --trace F`: the emulated pipelines benchmark (bench/
pipelines_emulated.py: the same setups, engines, link, SLO and sim beside every run) on a Mooncake trace instead of
the scenario's agent sessions.

What the trace changes, and why:

- Requests: the first --num-prompts lines of F (loadgen/trace.py `read_trace`), less those that leave no room for
  one output token in the scenario model's context (`model.max_context_tokens`: skipped and counted, never cut, as
  loadgen/replay.py does). Prompts are token ids built as `pdd bench` builds them (replay.py `plan_replay`,
  `trace.prompt_token_ids`): each hash id is a fixed block of --trace-block-tokens ordinary tokens of the served
  model (replay.py's /tokenize pool, computed here with the router's tokenizer and checked against each setup's
  /tokenize), so equal hash ids give identical blocks and the emulated engines' real radix caches see the
  trace's reuse. The block must be a whole number of the engines' KV blocks: a shared trace block is then whole
  engine blocks, and the simulator's block-chain hits are the hits the engines can have.
- max_tokens: --max-tokens none|output|N (`MaxTokensRule`): what the body says (none: left out, the router sees
  the model's room); the client reads the trace's output length, cut by what was sent, and hangs up.
- Arrivals: the trace's timestamps x the time scale (x dilation, in wall seconds); nothing waits for anything.
  Ties (--trace-ties, default spread): a trace may record arrivals on a coarse grid (the conversation trace: a 3 s
  grid, 1,180 distinct timestamps for 12,031 requests, up to 28 on one). Replayed as they stand (burst), a tick's
  requests reach P in whatever order the router finishes reading them (measured: nearly random, the longest
  bodies last), while the simulator takes them in file order; with one long prompt in a tick, that order alone
  decides most of the tick's TTFTs, so live and sim no longer run the same requests in the same order. Spread:
  the k requests of a tick go out in file order, evenly over the tick (up to the next distinct timestamp; the
  last tick: the median tick), in live and sim alike; requests alone on their timestamp keep it.
  The time scale's rule (default): at the trace's rate the scenario's pdd system serves it with k prefill
  instances (its first split, as `pdd up --emulate` splits it), each carrying the rate / k; the live fleet has one
  P, so it is offered the trace's rate / k: timestamps x k (k = 1 / the instance fraction). One emulated P thus
  carries what one of the scenario's P instances carries at the trace's rate. Nothing is tuned on the system
  under test. --trace-time-scale S sets it; --rate R (modeled req/s) sets S = the slice's own rate / R.
- Cold caches in every run, live and simulated: every run (repeat or goodput probe) replays the slice with its
  hash ids moved to a range of their own (`salted`: + k x 2^40 in run k), so nothing an earlier run left in the
  live caches is hit, as the simulator starts each run empty. No warm-up prefix request.
- The simulator of each run gets the same requests with `SimInput.chains` (their hash-id chains, `trace_arrays`
  under the same rule), so it models P's and MD's prefix caches per instance (sim/prefix_cache.py) and places
  requests with the router's `instance_cost`. Its capacities are the live engines' own: each instance's KV pool
  in tokens (total blocks x block size, read from its /health once it runs), as P's cache
  (`prefill_cache_tokens`) and as MD's and the relay's KV (their cost models' `kv_capacity_tokens`, inside which
  the simulated MD cache lives). The emulated engine sized that pool from the same cost model
  (kv_capacity_tokens // block x block), so the two differ by less than one block; the JSON states both.
- Goodput: probes replay the slice's first --goodput-requests lines (default: all of it) at multiples of the
  slice's scaled rate, live and simulated.
- Per request, live beside sim (`per_request`, written to the run dir; totals in the JSON): P's and MD's hits
  (the spans' `cached_tokens` of prefill and main.decode), the pipeline, TTFT and the live WAN bytes. The JSON's
  hit totals are the engines' own counts (their /health, before and after each run); a run ends once every
  engine is idle, so KV still crossing after the last stream (a relay that finished first) counts in its run.

Run: python -m pdd.bench.pipelines --backend emulated --trace F [--num-prompts N --max-tokens none|output|N
     --trace-block-tokens B --trace-time-scale S --trace-ties spread|burst ...], or python -m
     pdd.bench.pipelines_trace F [the same flags]. Last stdout line: one JSON object (pipelines_emulated.py's keys,
     plus `trace` and per setup `vs_sim.p_hit_tokens` / `md_hit_tokens` and `per_request_vs_sim`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pdd.bench import pipelines as live
from pdd.loadgen.replay import TOKEN_POOL_TEXT, plan_replay
from pdd.loadgen.trace import (
    TRACE_BLOCK_TOKENS,
    MaxTokensRule,
    TraceArrays,
    TraceRequest,
    hit_tokens,
    read_trace,
    trace_arrays,
)
from pdd.shared.pipelines import Pipeline
from pdd.sim.event_loop import PIPELINE_NAMES, SimResult

TRACE_KIND = "trace"  # Planned.kind of a replayed trace line
SPREAD, BURST = "spread", "burst"  # --trace-ties: a tick's requests spread over it in file order, or all at once
TIES = (SPREAD, BURST)
SALT_STRIDE = 1 << 40  # run k's hash ids are moved by k x this: far above any trace's ids, so runs share no block
PREFILL_SPAN, MAIN_DECODE_SPAN = "prefill", "main.decode"  # roles/prefill.py, roles/main_decode.py
WAN_SPAN = "kv.transfer.wan"  # roles/prefill.py: kv.transfer.{link}, its bytes as sent
HIT_ATTRIBUTE = "cached_tokens"  # the prefill and main.decode spans' prefix hit, in tokens


@dataclass(frozen=True)
class TraceSlice:
    """The slice of a trace this run replays, and how it is scaled."""

    path: Path
    lines: int  # lines read: the first --num-prompts
    requests: list[TraceRequest]  # those that fit the model's context, in file order
    skipped_too_long: int
    block_tokens: int
    rule: MaxTokensRule
    max_context_tokens: int
    pool: list[int]  # ordinary token ids the blocks are drawn from
    rate: float  # the slice's own mean rate, req/s: (n - 1) / its span (1 when it has no span)
    time_scale: float
    time_scale_how: str
    ties: str = SPREAD  # one of TIES: how requests that share a timestamp go out
    tick_s: float = 0.0  # the trace's timestamp resolution: median gap between distinct timestamps (s)

    @property
    def modeled_rate(self) -> float:
        """The rate offered to the live fleet, modeled req/s."""
        return self.rate / self.time_scale

    def describe(self) -> dict[str, Any]:
        """The JSON's ``trace`` block: what was replayed, how scaled, and what the slice's reuse could be."""
        return {"file": self.path.name, "slice": f"first {self.lines} lines", "lines": self.lines,
                "requests": len(self.requests), "skipped_too_long": self.skipped_too_long,
                "max_context_tokens": self.max_context_tokens, "block_tokens": self.block_tokens,
                "max_tokens": str(self.rule), "slice_rate_rps": round(self.rate, 4),
                "time_scale": round(self.time_scale, 4), "time_scale_how": self.time_scale_how,
                "prompt_tokens_mean": round(float(np.mean([r.input_tokens(self.block_tokens)
                                                           for r in self.requests])), 1),
                "hit_unbounded": round(unbounded_hit(self.requests, self.block_tokens), 4),
                "ties": self.ties, "tick_s": round(self.tick_s, 3),
                "requests_sharing_a_timestamp": shared_timestamps(self.requests),
                "cold_caches": "each run's hash ids + k x 2^40 (run k): no run hits another's blocks"}


def add_arguments(ap: argparse.ArgumentParser, engine_block: int) -> None:
    """The trace flags, as `pdd bench --dataset-name mooncake_trace` spells them."""
    ap.add_argument("--trace", default=None, help="a Mooncake JSONL trace: replay it instead of the scenario's "
                                                  "sessions (bench/pipelines_trace.py)")
    ap.add_argument("--num-prompts", type=int, default=None, help="--trace: its first N lines (default: all)")
    ap.add_argument("--trace-block-tokens", type=int, default=None,
                    help="--trace: tokens per hash id (default 512, as recorded; a multiple of the engines' "
                         f"{engine_block}-token KV block)")
    ap.add_argument("--trace-time-scale", type=float, default=None,
                    help="--trace: timestamps x this (default: the scenario's pdd prefill instances, so one "
                         "emulated P carries what one of them carries at the trace's rate)")
    ap.add_argument("--max-tokens", default=None, help="--trace: none (default; left out, the client hangs up at "
                                                       "the trace's output length) | output | N")
    ap.add_argument("--trace-ties", choices=TIES, default=None,
                    help="--trace: requests sharing a timestamp go out spread over its tick in file order (default "
                         "spread) or all at once (burst)")


def check_arguments(args: argparse.Namespace, block: int) -> str | None:
    """Why the trace flags cannot run (None when they can); session-only flags are refused with --trace.
    ``block``: the live engines' KV block (tokens), of which a trace block must be a whole number."""
    trace_only = {"--num-prompts": args.num_prompts, "--trace-block-tokens": args.trace_block_tokens,
                  "--trace-time-scale": args.trace_time_scale, "--max-tokens": args.max_tokens,
                  "--trace-ties": args.trace_ties}
    if args.trace is None:
        given = [k for k, v in trace_only.items() if v is not None]
        return f"{', '.join(given)}: only with --trace" if given else None
    if args.context_tokens or args.output_tokens:
        return "--context-tokens/--output-tokens shape the scenario's sessions: the trace has its own lengths"
    if args.trace_block_tokens is None:
        args.trace_block_tokens = TRACE_BLOCK_TOKENS
    if args.trace_ties is None:
        args.trace_ties = SPREAD
    if args.trace_block_tokens < block or args.trace_block_tokens % block:
        return (f"--trace-block-tokens {args.trace_block_tokens}: a multiple of the engines' {block}-token KV block, "
                "so a shared trace block is whole engine blocks (the simulator's hits are then the engines')")
    if args.num_prompts is not None and args.num_prompts < 1:
        return f"--num-prompts must be >= 1, got {args.num_prompts}"
    if args.trace_time_scale is not None and not args.trace_time_scale > 0:
        return f"--trace-time-scale must be > 0, got {args.trace_time_scale}"
    try:
        MaxTokensRule.parse(args.max_tokens)
    except ValueError as exc:
        return str(exc)
    return None


def token_pool(tokenizer: Any) -> list[int]:
    """replay.py's pool as the router's /tokenize gives it: the distinct ids of its text, no special tokens."""
    return sorted(set(tokenizer.encode(TOKEN_POOL_TEXT, add_special_tokens=False)))


def unbounded_hit(reqs: list[TraceRequest], block_tokens: int) -> float:
    """Token-weighted share of prompts an unbounded prefix cache would hold (the trace's bound on reuse)."""
    prompt = [r.input_tokens(block_tokens) for r in reqs]
    return float(hit_tokens([r.hash_ids for r in reqs], prompt, block_tokens).sum()) / max(1, sum(prompt))


def load_slice(args: argparse.Namespace, max_context_tokens: int, prefill_instances: int,
               pool: list[int]) -> TraceSlice:
    """The slice, its rate and its time scale (the rule in the module docstring); ValueError names the problem."""
    reqs = read_trace(args.trace, args.num_prompts)
    bt = args.trace_block_tokens
    kept = [r for r in reqs if r.input_tokens(bt) < max_context_tokens]
    if not kept:
        raise ValueError(f"every one of the {len(reqs)} trace requests is longer than the model's context "
                         f"({max_context_tokens} tokens) at --trace-block-tokens {bt}")
    top = max(h for r in kept for h in r.hash_ids)
    if top >= SALT_STRIDE or min(h for r in kept for h in r.hash_ids) < 0:
        raise ValueError(f"hash ids outside [0, 2^40) (largest {top}): runs could not be kept apart")
    span = kept[-1].arrival_s - kept[0].arrival_s
    rate = (len(kept) - 1) / span if span > 0 else 1.0
    if args.trace_time_scale is not None:
        scale, how = args.trace_time_scale, "--trace-time-scale"
    elif args.rate is not None:
        scale, how = rate / args.rate, f"--rate {args.rate:g}: the slice's rate / it"
    else:
        scale = float(prefill_instances)
        how = (f"the scenario's pdd system has {prefill_instances} prefill instances, the live fleet 1: at the "
               f"trace's rate each of them carries 1/{prefill_instances} of it, so the live P is offered the trace's "
               f"rate / {prefill_instances} (timestamps x {prefill_instances}; x dilation in wall seconds)")
    _, tick = spread_ties(np.array([r.arrival_s for r in kept]))
    return TraceSlice(Path(args.trace), len(reqs), kept, len(reqs) - len(kept), bt,
                      MaxTokensRule.parse(args.max_tokens), max_context_tokens, pool, rate, scale, how,
                      args.trace_ties, tick)


def shared_timestamps(reqs: list[TraceRequest]) -> int:
    """Requests whose timestamp another request of the slice has too."""
    _, counts = np.unique([r.timestamp_ms for r in reqs], return_counts=True)
    return int(counts[counts > 1].sum())


def spread_ties(arrival: np.ndarray) -> tuple[np.ndarray, float]:
    """Arrivals with each timestamp's k requests spread evenly, in order, up to the next distinct timestamp (the
    last: the median gap between distinct timestamps, the trace's tick); returns them and the tick (0 when the
    slice has one timestamp only: nothing to spread over)."""
    arrival = np.asarray(arrival, dtype=float)
    distinct = np.unique(arrival)
    if len(distinct) < 2:
        return arrival.copy(), 0.0
    tick = float(np.median(np.diff(distinct)))
    ends = np.append(distinct[1:], distinct[-1] + tick)
    out = arrival.copy()
    for t, end in zip(distinct.tolist(), ends.tolist()):
        idx = np.flatnonzero(arrival == t)
        if len(idx) > 1:
            out[idx] = t + np.arange(len(idx)) * (end - t) / len(idx)
    return out, tick


def salted(reqs: list[TraceRequest], salt: int) -> list[TraceRequest]:
    """The requests with their hash ids moved to run ``salt``'s own range: same sharing, no block in common
    with any other run."""
    if not salt:
        return list(reqs)
    off = salt * SALT_STRIDE
    return [replace(r, hash_ids=tuple(h + off for h in r.hash_ids)) for r in reqs]


def build(ts: TraceSlice, salt: int, n: int | None = None) -> tuple[list[live.Planned], TraceArrays, np.ndarray]:
    """Run ``salt``'s first ``n`` requests: as the live client sends them (token ids, the rule's max_tokens, read
    up to the output, then hang up), as the simulator gets them (columns and chains), and their arrival times
    at unit rate (the slice's rate: divide by a modeled rate; the slice's own scaled rate gives trace x scale)."""
    reqs = salted(ts.requests[:n], salt)
    replay = plan_replay(reqs, ts.rule, ts.block_tokens, 1.0, ts.pool, ts.max_context_tokens)
    arrays = trace_arrays(reqs, ts.rule, ts.max_context_tokens, ts.block_tokens)
    assert len(replay.specs) == len(arrays) == len(reqs), (len(replay.specs), len(arrays), len(reqs))
    planned = [live.Planned(session=i, turn=0, kind=TRACE_KIND, prompt=spec.prompt_token_ids(),
                            max_tokens=int(out), reuse=spec.cached_tokens, hang_up=True,
                            sent_max_tokens=spec.sent_max_tokens())
               for i, (spec, out) in enumerate(zip(replay.specs, arrays.output.tolist()))]
    arrival = arrays.arrival
    if ts.ties == SPREAD:  # over the whole slice's ticks, then cut: a probe's last tick spreads as the slice's
        arrival = spread_ties(np.array([r.arrival_s for r in ts.requests]) - ts.requests[0].arrival_s)[0][:len(reqs)]
    return planned, arrays, arrival * ts.rate


def span_hits(spans: list[dict]) -> dict[str, dict[str, Any]]:
    """Per request id: P's hit (as P looked it up on arrival) and the pipeline (prefill span), MD's hit
    (main.decode span), the real bytes P sent over the WAN (kv.transfer.wan)."""
    out: dict[str, dict[str, Any]] = {}
    for s in spans:
        a = s.get("attributes") or {}
        rid = a.get("request_id")
        if not rid:
            continue
        row = out.setdefault(rid, {})
        if s.get("name") == PREFILL_SPAN:
            row["p_hit"], row["pipeline"] = a.get(HIT_ATTRIBUTE), a.get("pipeline")
        elif s.get("name") == MAIN_DECODE_SPAN:
            row["md_hit"] = a.get(HIT_ATTRIBUTE)
        elif s.get("name") == WAN_SPAN:
            row["wan_bytes"] = row.get("wan_bytes", 0) + int(a.get("bytes") or 0)
    return out


def per_request(results: list[live.Result], res: SimResult, spans: dict[str, dict[str, Any]],
                dilation: float, kv_scale: float) -> list[dict[str, Any]]:
    """One row per request, live beside sim: prompt, P's and MD's hits, pipeline, TTFT (s, wall), and live the
    WAN bytes (modeled: real x ``kv_scale``)."""
    rows = []
    for i, r in enumerate(results):
        sp = spans.get(r.request_id, {})
        ok = bool(res.ok[i])
        rows.append({
            "i": i, "request_id": r.request_id, "prompt": len(r.planned.prompt), "sim_prompt": int(res.prompt[i]),
            "live_p_hit": sp.get("p_hit"), "sim_p_hit": int(res.p_cached[i]),
            "live_md_hit": sp.get("md_hit"), "sim_md_hit": int(res.md_cached[i]),
            "live_pipeline": sp.get("pipeline"), "sim_pipeline": PIPELINE_NAMES[int(res.pipeline[i])],
            "live_wan_bytes": round(sp.get("wan_bytes", 0) * kv_scale),
            "live_ttft_s": round(r.positions.ttft, 4) if r.ok and r.positions else None,
            "sim_ttft_s": round(float(res.ttft[i]) * dilation, 4) if ok else None})
    return rows


def hit_summary(rows: list[dict[str, Any]], cross_site_policy: bool) -> dict[str, Any]:
    """Totals over a setup's rows: P's and MD's hit tokens live (the spans: P's lookup when the request reached
    it, MD's where MD was asked for the KV) / sim (MD's likewise only where its pipeline reaches MD), how many
    requests hit alike, and (for the policy's setup) how many got the same pipeline."""
    reach_md = {Pipeline.P_MD.value, Pipeline.P_RLD_MD.value}

    def total(key: str) -> int | None:
        vals = [x[key] for x in rows if x[key] is not None
                and (key != "sim_md_hit" or x["sim_pipeline"] in reach_md)]
        return int(sum(vals)) if vals else None

    out: dict[str, Any] = {"requests": len(rows)}
    for role in ("p", "md"):
        lv, sv = total(f"live_{role}_hit"), total(f"sim_{role}_hit")
        out[f"{role}_hit_tokens"] = {"live": lv, "sim": sv,
                                     "rel_err": round(lv / sv - 1, 4) if lv is not None and sv else None}
        out[f"{role}_hit_same_requests"] = sum(x[f"live_{role}_hit"] == x[f"sim_{role}_hit"] for x in rows)
    out["prompts_equal"] = all(x["prompt"] == x["sim_prompt"] for x in rows)
    if cross_site_policy:
        out["pipeline_same_requests"] = sum(x["live_pipeline"] == x["sim_pipeline"] for x in rows)
    return out


def live_pipeline_mix(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Pipelines by the spans: a client that hangs up never gets the final event's `pdd` block."""
    mix: dict[str, int] = {}
    for x in rows:
        key = x["live_pipeline"] or "?"
        mix[key] = mix.get(key, 0) + 1
    return mix


def main(argv: list[str] | None = None) -> int:
    """`python -m pdd.bench.pipelines_trace F [flags]` = `python -m pdd.bench.pipelines --backend emulated --trace F
    [flags]`. Run as a child, as bench/pipelines.py runs the emulated benchmark: that one imports this module's
    helpers, so importing it here would close an import circle."""
    import subprocess

    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-"):
        args = ["--trace", *args]
    return subprocess.call([sys.executable, "-m", "pdd.bench.pipelines_emulated", *args])


if __name__ == "__main__":
    sys.exit(main())
