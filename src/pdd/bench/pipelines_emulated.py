"""`python -m pdd.bench.pipelines --backend emulated`: PDD against cross-site PD on emulated accelerators, every run
beside `pdd sim` of the very same requests.

The setups (colocated, naive, naive-stream0, pdd), their first-token rules, the timing by output position, the
drivers, per-run summaries and the JSON keys are bench/pipelines.py's. What differs:

- Engines: every engine on the emulated backend (`model.backend: emulated`, engine/emulated_backend/): step times
  from the cost model of its role's chips in the scenario, oracle tokens, real KV bytes at 1/kv_scale of the
  modeled ones over the real transports. Chips per setup, from the scenario's systems: colocated -> `baseline`
  (P and MD on GPU-A, one site), naive and naive-stream0 -> `naive` (P on A, MD on B), pdd -> `pdd` (P and RLD
  on A, MD on B).
- Instances: 1 P, 1 RLD, 1 MD per setup: a fraction (1 / the pdd system's prefill instances, as `pdd up
  --emulate` splits it) of the scenario's. The request rate is the scenario's comparison rate
  (`comparison.ttft_load` x naive's capacity at its split: sim/report.py's rule) x that fraction, so one P
  carries what one of the scenario's carries.
- Workload: the scenario's agent sessions (loadgen/workload.py `agentic_sessions`: context and output lengths,
  hit bins, anomalous share, turns per session), optionally shorter (--context-tokens / --output-tokens; the
  policy's anomalous thresholds and the anomalous outputs scale with them), sent as token ids. A later turn's
  prompt carries the oracle's own answer to the previous turn, so main decode's cache holds what the spec says
  is cached (P never sees answers: its hit is the previous prompt's whole blocks). Turns are ordered across
  sessions (turn k of every session before turn k+1) and timed by sim/scenario.py `unit_poisson` / rate, but a
  turn goes out only once its session's previous turn ended, if that is later: an agent sends its next turn
  after the answer it builds on. The simulator applies the same rule to its own timeline (`SimInput.after`), so
  live and sim each hold turns back by their own answers. Before each run one request carrying the sessions'
  shared prefix warms the caches (not timed). Goodput probes are open loop (`open_loop`), in live and sim.
- WAN: the scenario's link as `pdd up --emulate` shapes it (launch/emulate.py `wan_link`): per-flow
  rate / (KV scale x dilation), delay (latency + setup) x dilation; nothing is calibrated on any setup.
- WAN codec (--wan-codec none | lossless | fp8 | fp8+lossless, default none): every setup that crosses the WAN
  uses it (naive too: a fair comparison). Its ratio is the one `python -m pdd.bench.codec` measured on real bf16
  KV (bench/codec.py `MEASURED_BF16_RATIO`, from which run: `MEASURED_ON`), not one measured here: the emulated
  KV is float32 with every head dim equal (K = token id, V = position), on which lossless gives 12-30x,
  fp8+lossless 32-170x and fp8 3.9x (the float32 size) instead of bf16's 2x, and fp8 garbles the token ids the
  checkable bytes carry (off by up to ~1,700). So the live WAN link runs without a codec (`transports.wan.codec`
  none) and its shaper emulates one: `wire_ratio` = 1 / ratio, so the emulated line carries, and P's WAN byte
  counter (the report's live WAN bytes) counts, that many wire bytes per KV byte (transports/shaper.py); the
  simulator gets the same ratio (`wan.codec_wire_ratio`, a scenario override). Coding is modeled free, as on a
  GPU that codes at line rate: live no coding time is spent (the shaper charges bytes only) and in the sim
  `wan.codec_mb_s` is 0; one core's measured 418 MB/s (3.3 Gbit/s of KV) would be the bottleneck of a 10 Gbit/s
  flow (docs/TRANSPORTS.md). The offered rate is the scenario's without the codec, so every codec offers the
  same requests at the same times. The router assumes the link's KV rate (line rate / wire ratio) until main
  decode has measured one (in KV bytes, as it always does).
- SLO: the scenario's (TTFT and TPOT = mean ITL, x dilation in wall seconds). Goodput = the highest rate at
  which >= the scenario's attainment of requests meet it, by geometric bisection over multiples of the
  comparison rate (probes of fresh sessions; the lowest rate only if every probe failed).
- Simulator: each live run (repeat or goodput probe) is simulated (sim/event_loop.py `simulate`) with the same
  prompt / output arrays, P's and main decode's hits as above (`SimInput.md_cached`), the same arrival times and
  session order,
  the same instance counts and first-token rule, and the link as the live shaper emulates it (one flow per P
  process, no jitter or throughput spread). The report prints `sim_*` beside each live figure with the
  relative error (live / sim - 1); sim times x dilation.

Why one module: it is one benchmark mode, read top to bottom (the scenario as this run uses it, the workload as
token ids, the simulator of the same run, the processes, the run, the figures); its parts share the plan and the
runs and mean nothing apart. Everything the real-compute run also does (setups, drivers, summaries, the report's
keys) is bench/pipelines.py's, imported, not restated.

On a Mooncake trace instead of the sessions (--trace F: its requests as token ids, its timestamps x a time scale
from the scenario, the simulator with the requests' block chains, so P's and MD's prefix caches are modeled):
bench/pipelines_trace.py says what changes and why.

Run: python -m pdd.bench.pipelines --backend emulated [--context-tokens 16384 --output-tokens 64 --wan-codec fp8 ...]
     python -m pdd.bench.pipelines --backend emulated --trace F [--num-prompts N --max-tokens none|output|N ...]
Last stdout line: one JSON object (bench/pipelines.py's keys, plus backend, scenario, scale, dilation,
instance fraction, overrun shares and the sim_* figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from pdd.bench import codec as codec_bench
from pdd.bench import pipelines as live
from pdd.bench import pipelines_trace as trace_mode
from pdd.loadgen.stats import Bisection, highest_passing, mean_ci95, pct
from pdd.loadgen.workload import WORDS, Workload, agentic_sessions
from pdd.engine.emulated_backend import profile as emulation
from pdd.launch import emulate
from pdd.launch.local_cluster import LocalCluster, two_site_layout
from pdd.launch.emulate import BACKEND as EMULATED_BACKEND
from pdd.roles.kv_export import BLOCKS_FINAL_EVENT
from pdd.engine.emulated_backend.settings import EmulationSettings
from pdd.shared.pipelines import Pipeline
from pdd.shared.roles import Role
from pdd.loadgen.trace import TraceArrays
from pdd.sim.event_loop import P_MD, P_RLD_MD, SimInput, SimResult, simulate
from pdd.sim.metrics import Slo, attainment
from pdd.sim.scenario import Scenario, load_yaml, set_path, stage_capacity, unit_poisson

HEARTBEAT_MS = 250  # every engine's heartbeat (service.heartbeat_ms); the simulator's router reads P's as often
SYSTEM_OF = {"colocated": "baseline", "naive": "naive", "naive-stream0": "naive", "pdd": "pdd"}
TIMING_RULES = ("times per output position at the client (stream_options.continuous_usage_stats): TTFT = "
                "position 0, TT2 = position 1, mean ITL = (last - first) / (n - 1) = the simulator's TPOT",
                "position 0: colocated and naive hold it until the decoder streams (router.first_token_after_kv; "
                "the simulator's decoder-first-token rule); naive-stream0 and pdd stream it from P at once "
                "(the simulator's first_token_from_prefill)",
                "live times are wall seconds; sim_* times are modeled seconds x time dilation",
                "WAN bytes: P's pdd:wan_bytes_total x the effective KV scale (modeled bytes), the simulator's "
                "modeled bytes beside them; wire bytes, after the link's codec (--wan-codec: the shaper's "
                "wire_ratio x KV bytes, live; codec_wire_ratio x KV bytes, sim)")
WAN_CODEC_GOAL = 20.0  # issue #38: with fp8 (then lossless) PDD sends >= 20x fewer bytes than naive uncoded, hit 0.90
CODEC_COST = ("free: no coding time, live (the shaper charges bytes, nothing is coded) or in the sim (codec_mb_s "
              "0), as a GPU coding at line rate would; one core's measured speed would bound a 10 Gbit/s flow")


# ---------------------------------------------------------------------------------------------
# the scenario, as this run uses it
# ---------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """Everything derived from the scenario before any process starts."""

    data: dict  # the scenario with this run's overrides (written to the run dir; every engine reads it)
    path: Path
    scn: Scenario
    scale: float  # effective KV scale (modeled bytes per real byte)
    link: emulate.EmulatedLink
    rate: float  # modeled requests/s offered to the live fleet (scenario comparison rate x fraction)
    fraction: float
    scenario_rate: float
    scenario_split: dict[str, int]
    slo: Slo
    overrides: dict[str, Any]
    vocab_size: int
    eos: list[int]
    to_id: dict[str, int]
    trace: trace_mode.TraceSlice | None = None  # --trace: the slice replayed instead of the sessions
    codec: dict[str, Any] | None = None  # --wan-codec: which, its ratio and where it came from (wan_codec())
    heartbeat_s: float = HEARTBEAT_MS / 1000  # the engines' heartbeat in modeled seconds (wall / dilation)


def plan(args: argparse.Namespace, run_root: Path) -> Plan:
    from pdd.shared.model_files import resolve_model_path
    from pdd.shared.policy import PolicyConfig
    from pdd.shared.tokenizer import load_tokenizer

    data = load_yaml(args.scenario)
    wl = dict(data.get("workload", {}))
    ctx0, out0 = int(wl.get("context_tokens", 64512)), int(wl.get("output_tokens", 1024))
    ctx, out = args.context_tokens or ctx0, args.output_tokens or out0
    kc, ko = ctx / ctx0, out / out0
    pol = PolicyConfig(**data.get("policy", {}))
    overrides: dict[str, Any] = {
        "workload.context_tokens": ctx, "workload.output_tokens": out,
        "policy.anomalous_min_prompt_tokens": max(1, round(pol.anomalous_min_prompt_tokens * kc)),
        "policy.anomalous_max_output_tokens": max(2, math.ceil(pol.anomalous_max_output_tokens * ko))}
    if "anomalous_output" in wl:
        lo, hi = wl["anomalous_output"]
        overrides["workload.anomalous_output"] = [max(1, round(lo * ko)), max(1, round(hi * ko))]
    for key, value in overrides.items():
        data = set_path(data, key, value)
    plain = Scenario.from_dict(data)  # the link without the codec: the offered rate
    codec = wan_codec(args.wan_codec)
    if args.wan_codec != "none":
        overrides.update({"wan.codec_wire_ratio": codec["wire_ratio"], "wan.codec_mb_s": 0.0})
        for key in ("wan.codec_wire_ratio", "wan.codec_mb_s"):
            data = set_path(data, key, overrides[key])
    path = run_root / "scenario.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    scn = Scenario.from_dict(data)
    for name in set(SYSTEM_OF.values()):
        scn.system(name)  # every setup's system must exist (ValueError names the missing one)
    cfg = EmulationSettings(scenario=str(path), system="pdd", kv_scale=args.kv_scale, time_dilation=args.time_dilation)
    scale = emulation.profile(cfg, Role.PREFILL).scale
    link = emulate.wan_link(scn.wan, scale, args.time_dilation)
    # the scenario's comparison rate (sim/report.py: comparison.ttft_load x naive's capacity at its split)
    ref = plain.arrays()
    split_naive = plain.splits("naive")[0]
    capacity = min(stage_capacity(plain.sim_input("naive", split_naive, 1.0, ref, unit_poisson(len(ref), 1))).values())
    load = args.load if args.load is not None else float(data.get("comparison", {}).get("ttft_load", 0.5))
    scenario_rate = load * capacity
    split = scn.splits("pdd")[0]
    fraction = 1 / split["prefill"]
    tok = load_tokenizer(resolve_model_path(args.model))
    eos = tok.eos_token_id
    vocab = live.word_ids(args.model)
    trace = (trace_mode.load_slice(args, scn.model.max_context_tokens, split["prefill"], trace_mode.token_pool(tok))
             if args.trace else None)
    rate = trace.modeled_rate if trace else args.rate or scenario_rate * fraction
    return Plan(data=data, path=path, scn=scn, scale=scale, link=link, rate=rate,
                fraction=fraction, scenario_rate=scenario_rate, scenario_split=split,
                slo=Slo(**data.get("slo", {})), overrides=overrides, vocab_size=len(tok),
                eos=[eos] if isinstance(eos, int) else [],
                to_id={w: vocab[i % len(vocab)] for i, w in enumerate(WORDS)}, trace=trace,
                heartbeat_s=HEARTBEAT_MS / 1000 / args.time_dilation, codec=codec)


def wan_codec(name: str) -> dict[str, Any]:
    """The WAN codec as this run charges it: bench/codec.py's ratio on real bf16 KV (module docstring)."""
    ratio = codec_bench.MEASURED_BF16_RATIO[name]
    return {"codec": name, "ratio_kv_per_wire_byte": ratio, "wire_ratio": round(1 / ratio, 6),
            "source": ("no codec" if name == "none" else
                       f"measured on real bf16 KV, not on the emulated KV: {codec_bench.MEASURED_ON}"),
            "how": ("live: transports.wan.codec none, the WAN shaper's wire_ratio charges and counts wire bytes; "
                    "sim: wan.codec_wire_ratio"),
            "coding": CODEC_COST}


# ---------------------------------------------------------------------------------------------
# workload: the scenario's sessions as token ids, in arrival order, with the same arrays for the simulator
# ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    planned: list[live.Planned]  # in arrival order
    arrays: Workload  # the simulator's prompt / cached (P's hits) / output, same order
    md_cached: np.ndarray  # main decode's hits (the spec's: it decoded the previous answer, P did not)
    unit: np.ndarray  # unit-rate arrival times (divide by a modeled rate)
    after: np.ndarray  # per request, its session's previous turn (it goes out after that one ended), -1 for none
    warm: list[int]  # the sessions' shared prefix: one request with it warms P's and MD's caches
    seed: int
    trace: TraceArrays | None = None  # --trace: the simulator's columns and block chains (caches simulated)


def build_run(p: Plan, n: int, seed: int, args: argparse.Namespace) -> Run:
    from pdd.engine.emulated_backend.engine import TokenOracle
    from pdd.engine.core.sampling_params import SamplingParams

    oracle = TokenOracle(p.vocab_size, p.eos, args.oracle_seed)
    params = SamplingParams(ignore_eos=True)

    def answer(ids: list[int], k: int) -> list[int]:  # what every engine of the fleet answers
        tokens = list(ids)
        for j in range(k):
            tokens.append(oracle.next_token(tokens, j, params))
        return tokens[len(ids):]

    specs = agentic_sessions(replace(p.scn.workload, num_requests=n, seed=seed))
    # session -> (last prompt's words, its ids + answer, its length)
    state: dict[int, tuple[list[str], list[int], int]] = {}
    rows: list[tuple[live.Planned, int]] = []  # each request and P's hit on it
    for spec in specs:
        words = " ".join(m["content"] for m in spec.messages or []).split()
        assert len(words) == spec.prompt_tokens, (len(words), spec.prompt_tokens)
        prev = state.get(spec.session)
        if prev and words[:len(prev[0])] == prev[0] and len(words) >= len(prev[1]):
            ids = prev[1] + [p.to_id[w] for w in words[len(prev[1]):]]  # extends prompt + answer
        else:  # a new session, or one that compacted: the shared part, then new text
            common = 0
            if prev:
                while common < min(len(words), len(prev[0])) and words[common] == prev[0][common]:
                    common += 1
            ids = (prev[1][:common] if prev else []) + [p.to_id[w] for w in words[common:]]
        p_hit = spec.cached_tokens
        if prev:  # P prefilled the previous prompt, never its answer: it holds their common whole blocks
            common = next((i for i, (a, b) in enumerate(zip(ids, prev[1][:prev[2]])) if a != b),
                          min(len(ids), prev[2]))
            p_hit = min(p_hit, common // BLOCK_SIZE * BLOCK_SIZE)
        state[spec.session] = (words, ids + answer(ids, spec.output_tokens), len(ids))
        kind = "anomalous" if spec.output_tokens < p.scn.policy.anomalous_max_output_tokens else \
            ("first" if spec.turn == 0 else "turn")
        rows.append((live.Planned(spec.session, spec.turn, kind, ids, spec.output_tokens, spec.cached_tokens), p_hit))
    rows.sort(key=lambda row: (row[0].turn, row[0].session))
    p_hits = np.array([hit for _, hit in rows], dtype=np.int64)
    planned = [r for r, _ in rows]
    firsts = [r for r in planned if r.turn == 0]
    warm = max((r.prompt[:r.reuse] for r in firsts), key=len, default=[])
    arrays = Workload(np.array([len(r.prompt) for r in planned], dtype=np.int64), p_hits,
                      np.array([r.max_tokens for r in planned], dtype=np.int64))
    last_of: dict[int, int] = {}  # session -> index of its latest turn so far
    after = np.full(len(planned), -1, dtype=np.int64)
    for i, r in enumerate(planned):
        after[i] = last_of.get(r.session, -1)
        last_of[r.session] = i
    return Run(planned, arrays, np.array([r.reuse for r in planned], dtype=np.int64),
               unit_poisson(len(planned), seed), after, warm, seed)


def build_trace_run(p: Plan, salt: int, n: int | None) -> Run:
    """Run ``salt`` of the trace slice (its first ``n`` requests): hash ids of its own, so its caches start cold
    live as in the sim; arrivals at the trace's timestamps (unit = the slice's rate); nothing waits, nothing warms.
    ``md_cached`` is the trace's unbounded-cache bound (the report's ceiling on the WAN ratio; the simulator
    takes MD's hits from its simulated cache)."""
    assert p.trace is not None
    planned, arrays, unit = trace_mode.build(p.trace, salt, n)
    bound = np.array([r.reuse for r in planned], dtype=np.int64)
    wl = Workload(arrays.prompt, np.zeros_like(arrays.prompt), arrays.output)
    return Run(planned, wl, bound, unit, np.full(len(planned), -1, dtype=np.int64), [], salt, arrays)


def open_loop(run: Run) -> Run:
    """The run with no turn waiting for its session's previous one: a goodput probe offers its rate. A probe's
    few sessions (2 of 8 turns per 16 requests in the report's workload) would otherwise cap what it offers at
    what 2 sessions send back to back, whatever the rate; a fleet's thousands of sessions do not bind so."""
    return replace(run, after=np.full_like(run.after, -1))


# ---------------------------------------------------------------------------------------------
# the simulator of the same run
# ---------------------------------------------------------------------------------------------
def sim_input(p: Plan, setup: live.Setup, run: Run, rate: float, capacity: dict[str, int] | None = None) -> SimInput:
    """The live fleet of ``setup`` in the simulator: 1 instance per role, the run's arrays and arrival times, the
    setup's first-token rule and decode-side cache, and the link as the live shaper emulates it (one flow per P
    process at the per-flow rate; no setup jitter or throughput spread). A trace run brings its block chains (P's
    and MD's caches simulated); ``capacity`` (tokens per role, the live engines' pools) sizes them."""
    system = SYSTEM_OF[setup.name]
    roles = p.scn.system(system)["roles"]
    split = {"prefill": 1, "decode": 1, **({"relay": 1} if "relay" in roles else {})}
    inp = p.scn.sim_input(system, split, rate, run.arrays, run.unit, seed=run.seed, trace=run.trace)
    if inp.wan is not None:
        inp.wan = replace(inp.wan, bandwidth_gbps=inp.wan.per_flow_gbps * split["prefill"], jitter_sigma=0.0,
                          throughput_sigma=0.0)
        # the router's view of that line, as the live fleet's (launch/emulate.py emulated_policy)
        inp.policy = inp.policy.model_copy(update={"wan_flows": inp.wan.concurrent_transfers})
    inp.first_token_from_prefill = not setup.holds_first_token
    inp.drc = inp.drc and setup.md_cache
    if run.trace is None:
        inp.md_cached = run.md_cached
        inp.route_max_tokens = run.arrays.output  # the sessions' client sends each output length as max_tokens
    inp.after = run.after
    inp.heartbeat_s = p.heartbeat_s  # the router reads P's WAN backlog as often as the live one does
    if capacity:
        inp.prefill_cache_tokens = capacity[Role.PREFILL]
        inp.decode = inp.decode.with_(kv_capacity_tokens=capacity[Role.MAIN_DECODE])
        if inp.relay is not None:
            inp.relay = inp.relay.with_(kv_capacity_tokens=capacity[Role.RELAY])
    return inp


def sim_figures(p: Plan, setup: live.Setup, run: Run, rate: float, d: float,
                capacity: dict[str, int] | None = None) -> tuple[dict[str, Any], SimResult]:
    """The simulator's figures of one live run (times x dilation), and its result (per request)."""
    inp = sim_input(p, setup, run, rate, capacity)
    res = simulate(inp)
    ok = res.ok
    ttft = res.ttft[ok] * d
    tpot = res.tpot[ok] * d

    def q(x: np.ndarray, scale: float = 1.0) -> dict[str, float | None]:
        if not x.size:
            return {"mean": None, "p50": None, "p90": None}
        return {"mean": round(float(x.mean()) * scale, 4), "p50": round(float(np.percentile(x, 50)) * scale, 4),
                "p90": round(float(np.percentile(x, 90)) * scale, 4)}

    figs = {"requests": len(ok), "completed": int(ok.sum()), "ttft_s": q(ttft), "tpot_ms": q(tpot, 1000),
            "wan_bytes": float(res.wan_bytes), "slo_attainment": round(attainment(res, p.slo), 4),
            "rld_token_share": round(res.tokens_relay / max(1.0, res.tokens_relay + res.tokens_main), 4),
            "turn_hold_s": round(float(np.mean(res.arrival - inp.arrivals)) * d, 4)}
    if run.trace is not None:  # MD's hits where MD was asked for the KV (as its engine counts them), P's on all
        to_md = np.isin(res.pipeline, (P_MD, P_RLD_MD))
        figs["p_hit_tokens"], figs["md_hit_tokens"] = int(res.p_cached.sum()), int(res.md_cached[to_md].sum())
        figs["p_cache_evictions"], figs["md_cache_evictions"] = res.p_evictions, res.md_evictions
    return figs, res


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
CHUNK_TOKENS = emulate.CHUNK_TOKENS
KV_LAG_MIN_CHUNKS = 4  # the KV-ready lag is judged on transfers of at least this many prefill chunks
BLOCK_SIZE = 16  # the live engines' KV block: prefix caches hold whole blocks
# keys of the engine's stats() (engine/core/paged_engine.py), as its /health gives them
TOTAL_BLOCKS, FREE_BLOCKS, CACHED_BLOCKS = "total_blocks", "free_blocks", "cached_blocks"
HIT_TOKENS, RUNNING, WAITING = "cache_hit_tokens", "running", "waiting"
IDLE_TIMEOUT_S = 300.0  # the longest a run's leftover KV transfers may take to land (a backlog on the emulated WAN)


def setup_config(setup: live.Setup, p: Plan, args: argparse.Namespace, spans_path: Path) -> dict:
    """One setup's deployment: emulated engines timed as its system's chips, the scenario's policy (anomalous
    thresholds scaled with the lengths; the masking threshold x dilation) and its link as emulated."""
    from pdd.transports import ucx_available

    wan_opts: dict[str, Any] = {"streams": 2}
    if setup.cross_site:  # with --wan-codec the shaper's wire_ratio emulates the codec (module docstring)
        wan_opts["shape"] = p.link.shape()
    router: dict[str, Any] = {"request_timeout_s": 900, "first_token_after_kv": setup.holds_first_token}
    if setup.forced:
        router["forced_pipeline"] = setup.forced.value
    return {
        "model": {"path": args.model, "backend": EMULATED_BACKEND, "block_size": BLOCK_SIZE, "max_num_seqs": 256,
                  "max_prefill_tokens": CHUNK_TOKENS, "prefill_chunk_tokens": CHUNK_TOKENS},
        "emulation": {"scenario": str(p.path), "system": SYSTEM_OF[setup.name], "kv_scale": args.kv_scale,
                      "time_dilation": args.time_dilation, "oracle_seed": args.oracle_seed},
        **two_site_layout(main_decode_site="site-b" if setup.cross_site else "site-a"),
        "transports": {"fast": {"name": "ucx" if ucx_available() else "zmq", "options": {}},
                       "wan": {"name": "zmq", "codec": "none", "options": wan_opts}},
        "router": router,
        "policy": emulate.emulated_policy(p.scn, p.link, args.time_dilation),
        "service": {"heartbeat_ms": HEARTBEAT_MS, "drain_timeout_s": 5},
        "telemetry": {"exporter": "jsonl", "jsonl_path": str(spans_path), "log_format": "json"},
    }


class EmulatedSystem(live.System):
    """bench/pipelines.py's System (a LocalCluster, P's WAN bytes) with the emulated setup's config."""

    def __init__(self, setup: live.Setup, run_dir: Path, p: Plan, args: argparse.Namespace):
        self.setup = setup
        self.spans_path = run_dir / "spans.jsonl"
        no_cache = {} if setup.md_cache else {"md-0": {"PDD__MODEL__ENABLE_PREFIX_CACHE": "false"}}
        self.cluster = LocalCluster(run_dir, setup_config(setup, p, args, self.spans_path),
                                    instance_env=no_cache)

    def pacing(self) -> dict[str, Any]:
        """Each engine's emulated pacing (its /health engine block): steps, overrun steps and share."""
        out: dict[str, Any] = {}
        for m in self.cluster.engine_members():
            e = m.health().get("engine") or {}
            out[m.instance_id] = {k: e.get(k) for k in ("steps", "overrun_steps", "overrun_share", "overrun_seconds")}
        steps = sum(v["steps"] or 0 for v in out.values())
        over = sum(v["overrun_steps"] or 0 for v in out.values())
        return {"overrun_share": round(over / steps, 4) if steps else None, "steps": steps, "overrun_steps": over,
                "engines": out}

    def engine_stats(self, key: str) -> dict[str, Any]:
        """One figure of each engine's /health engine block (its ``stats()``), by role (one instance each)."""
        return {str(Role(m.role)): (m.health().get("engine") or {}).get(key) for m in self.cluster.engine_members()}

    def capacities(self) -> dict[str, int]:
        """Each engine's KV pool in tokens (total blocks x block size), as it runs: the simulator's capacities."""
        return {role: int(blocks) * BLOCK_SIZE for role, blocks in self.engine_stats(TOTAL_BLOCKS).items()}

    def wait_idle(self, timeout_s: float = IDLE_TIMEOUT_S) -> float:
        """Wait until no engine runs, queues or holds KV outside its cache: every KV transfer of the run has
        landed or been dropped (a relay that finished a request first leaves its WAN transfer going, and P's
        WAN byte counter moves when a transfer ends). Returns the seconds waited (a warning past the limit: an
        engine that leaks blocks must not hang the benchmark)."""
        t0 = time.monotonic()
        while True:
            busy = [m.instance_id for m in self.cluster.engine_members()
                    if (e := m.health().get("engine") or {}) and
                    (e.get(RUNNING) or e.get(WAITING) or e.get(FREE_BLOCKS, 0) + e.get(CACHED_BLOCKS, 0)
                     != e.get(TOTAL_BLOCKS, 0))]
            if not busy:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                print(f"  warning: engines {busy} still busy {timeout_s:.0f}s after the run's last stream ended",
                      flush=True)
                return time.monotonic() - t0
            time.sleep(0.2)

    def hit_tokens(self) -> dict[str, int]:
        """Prompt tokens each engine's prefix cache has served so far (the engine's own count, at once)."""
        return {role: int(v or 0) for role, v in self.engine_stats(HIT_TOKENS).items()}


async def warm_prefix(base_url: str, prompt: list[int]) -> None:
    """One untimed request with the sessions' shared prefix over P-MD: P's and MD's caches hold it, as the
    scenario's hit rates assume of a warm system."""
    from pdd.loadgen.client import stream

    if not prompt:
        return
    body = {**live.request_body(prompt, 2), "stream": False}
    body.pop("stream_options")
    body["pdd"]["pipeline"] = Pipeline.P_MD
    async with live.client_session() as client:
        s = await stream(client, base_url + "/v1/completions", body, timeout_s=600.0)
    if s.status != 200 or s.exception is not None or s.timed_out:
        raise RuntimeError(f"warm-prefix request failed: {s.status} {s.body_text[:300] or s.exception}")


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=(EMULATED_BACKEND,), default=EMULATED_BACKEND)
    ap.add_argument("--model", default="default", help="whose tokenizer the router uses (no weights are loaded)")
    ap.add_argument("--scenario", default="report", help="a simulator scenario (name under sim/scenarios or a path) "
                                                         "with systems baseline, naive and pdd")
    ap.add_argument("--kv-scale", type=float, default=EmulationSettings.model_fields["kv_scale"].default,
                    help="real KV bytes = modeled / this (rounded to the pool's granule; the JSON states the "
                         "effective scale)")
    ap.add_argument("--time-dilation", type=float, default=1.0, help="every modeled duration x this")
    ap.add_argument("--oracle-seed", type=int, default=0)
    ap.add_argument("--context-tokens", type=int, default=None, help="the workload's context (default: the scenario's)")
    ap.add_argument("--output-tokens", type=int, default=0,
                    help="output tokens per normal request (0: the scenario's, the report's 1024: a full run takes "
                         "~29 min on 2 cores; e.g. 128 for a quicker look)")
    ap.add_argument("--load", type=float, default=None,
                    help="offered load as a share of naive's capacity (default: the scenario's comparison.ttft_load)")
    ap.add_argument("--rate", type=float, default=None, help="modeled req/s offered to the live fleet (overrides "
                                                              "the scenario's comparison rate x fraction)")
    ap.add_argument("--seeds", type=int, default=None, help="repeats (one workload seed each; default 2, with "
                                                             "--trace 1: the slice once, its hash ids fresh each time)")
    ap.add_argument("--requests", type=int, default=16, help="requests per repeat (whole sessions interleaved)")
    ap.add_argument("--goodput-requests", type=int, default=None,
                    help="requests per goodput probe (default 12; with --trace the slice's first N lines, default all)")
    ap.add_argument("--goodput-steps", type=int, default=2, help="bisection probes (the lowest only if all fail)")
    ap.add_argument("--goodput-range", default="0.5:4",
                    help="goodput search, as multiples of the repeats' rate")
    ap.add_argument("--setups", default=",".join(live.SETUPS))
    ap.add_argument("--wan-codec", choices=tuple(codec_bench.MEASURED_BF16_RATIO), default="none",
                    help="the WAN link's KV codec for every setup that crosses it, charged at the ratio "
                         "pdd.bench.codec measured on real bf16 KV (live: by the shaper; sim: the link's ratio)")
    ap.add_argument("--run-dir", default=None, help="logs/config/spans (default: a temp dir, kept)")
    trace_mode.add_arguments(ap, BLOCK_SIZE)
    args = ap.parse_args(argv)
    if args.output_tokens == 0:
        args.output_tokens = None
    problem = trace_mode.check_arguments(args, BLOCK_SIZE)
    if problem:
        ap.error(problem)
    if args.seeds is None:
        args.seeds = 1 if args.trace else 2
    if args.goodput_requests is None and not args.trace:
        args.goodput_requests = 12
    return args


class Bench:
    def __init__(self, args: argparse.Namespace, run_root: Path):
        self.args = args
        self.run_root = run_root
        self.plan = plan(args, run_root)
        self.systems: list[EmulatedSystem] = []
        self.setups: dict[str, dict[str, Any]] = {}
        self.runs: dict[int, Run] = {}
        self.capacity: dict[str, dict[str, int]] = {}  # per setup: its live engines' KV pools (tokens), for the sim

    def run_for(self, seed: int, n: int | None) -> Run:
        """Seed ``seed``'s run: the scenario's sessions (``n`` requests), or with --trace the slice (its first
        ``n`` lines; None: all) with hash ids of run ``seed``'s own."""
        if seed not in self.runs:
            self.runs[seed] = (build_trace_run(self.plan, seed, n) if self.plan.trace
                               else build_run(self.plan, n, seed, self.args))
        return self.runs[seed]

    def repeat_requests(self) -> int | None:
        """Requests per repeat: --requests of the sessions; with --trace the whole slice (None)."""
        return None if self.plan.trace else self.args.requests

    def open(self, setup: live.Setup) -> EmulatedSystem:
        system = EmulatedSystem(setup, self.run_root / setup.name, self.plan, self.args)
        self.systems.append(system)
        startup = system.start()
        asyncio.run(live.warm_up(system.base_url, sorted(set(self.plan.to_id.values()))))
        self.capacity[setup.name] = system.capacities()
        if self.plan.trace:
            asyncio.run(check_token_pool(system.base_url, self.plan.trace.pool))
        print(f"  [{setup.name}] ready in {startup:.1f}s; KV pools (tokens) {self.capacity[setup.name]}", flush=True)
        return system

    def close(self, system: EmulatedSystem) -> None:
        system.stop()
        self.systems.remove(system)

    def one_run(self, system: EmulatedSystem, run: Run, rate: float,
                hits: dict[str, int] | None = None) -> tuple[list[live.Result], float, float]:
        """Warm the shared prefix, then the run's requests at its arrival times (modeled rate, x dilation), each
        turn after its session's previous one. ``hits``, when given, gets each engine's prefix-hit tokens of the
        run (the engines' own counts; the run's streams have all ended, so have its prefills)."""
        asyncio.run(warm_prefix(system.base_url, run.warm))
        system.wait_idle()
        wan0 = system.wan_bytes()
        hits0 = system.hit_tokens() if hits is not None else {}
        d = self.args.time_dilation
        arrivals = (run.unit / rate * d).tolist()
        results, makespan = asyncio.run(live.run_at(system.base_url, run.planned, arrivals, run.after.tolist()))
        system.wait_idle()  # transfers still landing count in this run's WAN bytes, and delay no later run
        if hits is not None:
            hits.update({role: v - hits0.get(role, 0) for role, v in system.hit_tokens().items()})
        return results, makespan, system.wan_bytes() - wan0

    def within_slo(self, results: list[live.Result]) -> float:
        d, slo = self.args.time_dilation, self.plan.slo
        good = [r for r in results if r.ok and r.positions and r.positions.ttft <= slo.ttft_s * d
                and (r.positions.mean_itl or 0.0) <= slo.tpot_s * d]
        return len(good) / max(1, len(results))

    def repeats(self, system: EmulatedSystem, setup: live.Setup) -> list[dict[str, Any]]:
        out = []
        p, d = self.plan, self.args.time_dilation
        for seed in range(self.args.seeds):
            run = self.run_for(seed, self.repeat_requests())
            hits: dict[str, int] = {}
            results, makespan, wan = self.one_run(system, run, p.rate, hits)
            s = live.summarize(results, makespan)
            s["hit_tokens"] = hits
            s["wan_bytes_metric"] = wan
            s["wan_bytes_modeled"] = wan * p.scale
            s["slo_attainment"] = round(self.within_slo(results), 4)
            # how long turns waited for their session's previous answer past their Poisson time, on average
            s["turn_hold_s"] = round(float(np.mean([r.sent - a for r, a in zip(results, run.unit / p.rate * d)])), 4)
            s["request_ids"] = [r.request_id for r in results if r.request_id]
            s["_results"] = results
            s["sim"], s["_sim"] = sim_figures(p, setup, run, p.rate, d, self.capacity.get(setup.name))
            out.append(s)
            print(f"  [{setup.name}] seed {seed}: {s['completed']}/{s['requests']} ok in {makespan:.1f}s; TTFT p50 "
                  f"{s['ttft_s']['p50']}s (sim {s['sim']['ttft_s']['p50']}s), mean {s['ttft_s']['mean']}s (sim "
                  f"{s['sim']['ttft_s']['mean']}s); WAN {s['wan_bytes_modeled'] / 1e9:.2f} GB (sim "
                  f"{s['sim']['wan_bytes'] / 1e9:.2f}); turns held {s['turn_hold_s']}s "
                  f"(sim {s['sim']['turn_hold_s']}s); "
                  f"{s['pipeline_mix']}{trace_hits_line(s) if run.trace is not None else ''}", flush=True)
        return out

    def goodput(self, system: EmulatedSystem | None, setup: live.Setup) -> Bisection:
        """The goodput search, live (``system``) or simulated (None) on the same probes: probe k is seed 1000 + k
        at its rate, in both."""
        lo, hi = (float(x) * self.plan.rate for x in self.args.goodput_range.split(":"))
        step = [0]
        target = self.plan.slo.attainment

        def passes(rate: float) -> bool:
            step[0] += 1
            run = open_loop(self.run_for(1000 + step[0], self.args.goodput_requests))
            if system is None:
                res = simulate(sim_input(self.plan, setup, run, rate, self.capacity.get(setup.name)))
                return attainment(res, self.plan.slo) >= target
            results, makespan, _ = self.one_run(system, run, rate)
            share = self.within_slo(results)
            print(f"  [{setup.name}] goodput probe {rate:.3f} req/s (modeled): {share:.0%} within SLO "
                  f"({sum(r.ok for r in results)}/{len(results)} ok, {makespan:.0f}s)", flush=True)
            return share >= target

        return highest_passing(passes, lo, hi, self.args.goodput_steps)

    def run_setup(self, setup: live.Setup) -> dict[str, Any]:
        system = self.open(setup)
        try:
            reps = self.repeats(system, setup)
            good = self.goodput(system, setup)
            pacing = system.pacing()
        finally:
            self.close(system)
        sim_good = self.goodput(None, setup)
        time.sleep(0.5)
        spans = live.read_spans(system.spans_path, {i for rep in reps for i in rep["request_ids"]})
        d = self.args.time_dilation
        if self.plan.trace:
            self.trace_rows(setup, reps, spans)
        return {"rule": setup.rule, "repeats": reps, "goodput": good, "sim_goodput": sim_good,
                "slo": (self.plan.slo.ttft_s * d, self.plan.slo.tpot_s * d),
                "calibration_ttft_p50": reps[0]["ttft_s"]["p50"], "fast_path": live.fast_path(spans),
                "kv_ready_lag": kv_ready_lag(spans, self.plan.link, CHUNK_TOKENS),
                "profile": live.span_profile(spans), "pacing": pacing}

    def trace_rows(self, setup: live.Setup, reps: list[dict[str, Any]], spans: list[dict]) -> None:
        """Per request of each repeat, live beside sim (hits, pipeline, TTFT; written to the run dir), their
        totals in the repeat, and its pipeline mix from the spans (a client that hangs up gets no final info)."""
        by_rid = trace_mode.span_hits(spans)
        for k, rep in enumerate(reps):
            rows = trace_mode.per_request(rep["_results"], rep["_sim"], by_rid, self.args.time_dilation,
                                          self.plan.scale)
            rep["pipeline_mix"] = trace_mode.live_pipeline_mix(rows)
            rep["trace_hits"] = trace_mode.hit_summary(rows, setup.forced is None and setup.cross_site)
            path = self.run_root / f"per_request_{setup.name}_{k}.json"
            path.write_text(json.dumps(rows, indent=0))
            rep["per_request_file"] = str(path)


def kv_ready_lag(spans: list[dict], link: emulate.EmulatedLink, chunk_tokens: int,
                 min_chunks: int = KV_LAG_MIN_CHUNKS) -> dict[str, Any]:
    """Per WAN transfer to main decode: how long after P's prefill ended MD's KV was ready (its `kv.receive`
    ended), over two bounds. ``bound`` is the issue's: the link's per-transfer delay (latency + setup) plus
    max(the last chunk's bytes at the link's rate, the whole transfer's minus the prefill's time). ``floor`` is the
    streamed export's own: the delay plus when one flow at the link's rate could finish sending the blocks in order
    as the prefill made them final (``streamed_floor``). Over the transfers of at least ``min_chunks`` chunks'
    worth of bytes (the prompt past what MD holds).
    The prefill's time is its span's (queueing at P included), so the bound is if anything too tight; and neither
    has a queue, so ``isolated`` also gives the figures over the transfers no other WAN transfer overlapped."""
    by_rid: dict[str, dict[str, dict]] = {}
    for s in spans:
        name, rid = s.get("name"), (s.get("attributes") or {}).get("request_id")
        if name in ("prefill", "kv.transfer.wan") or (name == "kv.receive" and s.get("service") == "pdd-main-decode"):
            by_rid.setdefault(rid, {})[name] = s
    wan_all = [f["kv.transfer.wan"] for f in by_rid.values() if "kv.transfer.wan" in f]
    bps = link.rate_bits / 8
    ratios: dict[str, list[float]] = {"bound": [], "floor": [], "isolated": [], "isolated_floor": []}
    for found in by_rid.values():
        if len(found) < 3:
            continue
        pf, wan, ready = found["prefill"], found["kv.transfer.wan"], found["kv.receive"]
        pa, wa = pf["attributes"], wan["attributes"]
        prompt, p_hit, md_hit = pa["prompt_tokens"], pa.get("cached_tokens", 0), wa.get("cached_tokens_at_peer", 0)
        nbytes = wa.get("bytes") or 0
        if nbytes <= 0 or math.ceil((prompt - md_hit) / chunk_tokens) < min_chunks:
            continue
        computed = prompt - p_hit
        last_chunk_tokens = computed - ((computed - 1) // chunk_tokens) * chunk_tokens
        last_bytes = min(nbytes, last_chunk_tokens * nbytes / (prompt - md_hit))
        prefill_s = (pf["end_ns"] - pf["start_ns"]) / 1e9
        lag_s = (ready["end_ns"] - pf["end_ns"]) / 1e9
        bound = link.delay_s + max(last_bytes / bps, nbytes / bps - prefill_s)
        floor = link.delay_s + streamed_floor(pf, md_hit, nbytes / bps)
        ratios["bound"].append(lag_s / bound)
        ratios["floor"].append(lag_s / floor)
        if not any(o is not wan and o["start_ns"] < wan["end_ns"] and o["end_ns"] > wan["start_ns"] for o in wan_all):
            ratios["isolated"].append(lag_s / bound)
            ratios["isolated_floor"].append(lag_s / floor)

    def quantiles(vals: list[float]) -> dict[str, Any]:
        return {"p50": round(pct(vals, 50), 3) if vals else None, "p90": round(pct(vals, 90), 3) if vals else None,
                "requests": len(vals)}
    return {**quantiles(ratios["bound"]), "isolated": quantiles(ratios["isolated"]),
            "over_floor": {**quantiles(ratios["floor"]), "isolated": quantiles(ratios["isolated_floor"])},
            "min_chunks": min_chunks, "chunk_tokens": chunk_tokens}


def streamed_floor(prefill: dict, md_hit: int, send_s: float) -> float:
    """Seconds after the prefill's end at which one flow could have finished sending what MD lacks, each piece
    starting no earlier than the prefill made it final and the pieces in order: max over pieces of (final at +
    the rest's send time) - end. P's cached prefix is final at the span's start; each step that made more final is
    a `kv.blocks_final` event (``tokens`` final by then); the whole prompt at the span's end."""
    prompt, p_hit = prefill["attributes"]["prompt_tokens"], prefill["attributes"].get("cached_tokens", 0)
    marks = [(prefill["start_ns"], p_hit)]
    marks += sorted((e["ts_ns"], e["attributes"]["tokens"]) for e in prefill.get("events") or []
                    if e.get("name") == BLOCKS_FINAL_EVENT)
    marks.append((prefill["end_ns"], prompt))
    per_token_s = send_s / (prompt - md_hit)
    sent, finish_ns = md_hit, prefill["end_ns"]
    for ts_ns, final in marks:
        if final > sent:
            finish_ns = max(finish_ns, ts_ns + (prompt - sent) * per_token_s * 1e9)
            sent = final
    return (finish_ns - prefill["end_ns"]) / 1e9


def trace_hits_line(rep: dict[str, Any]) -> str:
    """A trace repeat's prefix hits, live (the engines' counts) and sim, for the progress line."""
    hits, sim = rep["hit_tokens"], rep["sim"]
    return (f"; hit tokens P {hits.get(Role.PREFILL)} (sim {sim['p_hit_tokens']}), MD {hits.get(Role.MAIN_DECODE)} "
            f"(sim {sim['md_hit_tokens']})")


async def check_token_pool(base_url: str, pool: list[int]) -> None:
    """The setup's router gives the prompts' token pool as planned (replay.py's /tokenize question)."""
    from pdd.loadgen.replay import token_pool
    from pdd.loadgen.runner import list_models

    cards = await list_models(base_url, None)
    served, _ = await token_pool(base_url, cards[0]["id"])
    if served != pool:
        raise RuntimeError(f"{base_url}/tokenize gives another token pool ({len(served)} ids) than the trace's "
                           f"prompts were built from ({len(pool)}): the router's tokenizer is not --model's")


# ---------------------------------------------------------------------------------------------
# figures: bench/pipelines.py's report, then the emulated run's statements and the sim_* figures
# ---------------------------------------------------------------------------------------------
def rel_err(live_v: float | None, sim_v: float | None) -> float | None:
    if live_v is None or sim_v is None or not sim_v or not math.isfinite(sim_v) or not math.isfinite(live_v):
        return None
    return round(live_v / sim_v - 1, 4)


def comparison(setup: dict[str, Any], scale: float) -> dict[str, dict[str, float | None]]:
    """Live beside sim, mean over the repeats, with the relative error: TTFT P50/P90/mean, goodput, WAN bytes
    per request (modeled), TPOT (mean ITL) P50, and how long turns waited for their session's previous answer."""
    reps = setup["repeats"]

    def mean(vals: list) -> float | None:
        vals = [v for v in vals if v is not None]
        return round(float(np.mean(vals)), 4) if vals else None

    out: dict[str, dict[str, float | None]] = {}
    for stat in ("p50", "p90", "mean"):
        lv, sv = mean([r["ttft_s"][stat] for r in reps]), mean([r["sim"]["ttft_s"][stat] for r in reps])
        out[f"ttft_{stat}_s"] = {"live": lv, "sim": sv, "rel_err": rel_err(lv, sv)}
    lv, sv = mean([r["mean_itl_ms"]["p50"] for r in reps]), mean([r["sim"]["tpot_ms"]["p50"] for r in reps])
    out["tpot_p50_ms"] = {"live": lv, "sim": sv, "rel_err": rel_err(lv, sv)}
    lv, sv = mean([r["turn_hold_s"] for r in reps]), mean([r["sim"]["turn_hold_s"] for r in reps])
    out["turn_hold_s"] = {"live": lv, "sim": sv, "rel_err": rel_err(lv, sv)}
    n = max(1, sum(r["requests"] for r in reps))
    lv = sum(r["wan_bytes_metric"] for r in reps) * scale / n
    sv = sum(r["sim"]["wan_bytes"] for r in reps) / n
    out["wan_bytes_per_request"] = {"live": round(lv), "sim": round(sv), "rel_err": rel_err(lv, sv)}
    lv, sv = setup["goodput"].value, setup["sim_goodput"].value
    out["goodput_rps"] = {"live": round(lv, 4), "sim": round(sv, 4), "rel_err": rel_err(lv, sv)}
    return out


def rate_how(p: Plan, args: argparse.Namespace) -> str:
    """How the offered rate was set, for the JSON."""
    if p.trace:
        return f"the trace slice's own rate ({p.trace.rate:.4g} req/s) / time scale {p.trace.time_scale:g}"
    if args.rate is None:
        return "scenario comparison rate (comparison.ttft_load x naive's capacity at its split) x instance fraction"
    return "--rate"


def trace_capacities(bench: Bench) -> dict[str, Any]:
    """The simulator's capacities (the live engines' pools as they ran) beside the cost models' own."""
    p = bench.plan
    out: dict[str, Any] = {"how": "each engine's /health total_blocks x block size after start, given to the "
                                  "simulator as P's cache (prefill_cache_tokens) and MD's / RLD's KV "
                                  "(kv_capacity_tokens); the cost model's figure beside it"}
    for name, cap in bench.capacity.items():
        inp = sim_input(p, live.SETUPS[name], bench.run_for(0, bench.repeat_requests()), p.rate)
        model = {Role.PREFILL: inp.prefill.kv_capacity_tokens, Role.MAIN_DECODE: inp.decode.kv_capacity_tokens}
        if inp.relay is not None:
            model[Role.RELAY] = inp.relay.kv_capacity_tokens
        out[name] = {"live": {str(k): v for k, v in cap.items()}, "cost_model": {str(k): v for k, v in model.items()}}
    return out


def trace_comparison(setup: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """P's and MD's prefix-hit tokens, live (the engines' own counts) beside sim, summed over the repeats."""
    reps = setup["repeats"]
    out: dict[str, dict[str, Any]] = {}
    for role, key in ((Role.PREFILL, "p_hit_tokens"), (Role.MAIN_DECODE, "md_hit_tokens")):
        lv = sum(r["hit_tokens"].get(role, 0) for r in reps)
        sv = sum(r["sim"][key] for r in reps)
        out[key] = {"live": lv, "sim": sv, "rel_err": rel_err(lv, sv)}
    return out


def build_report(bench: Bench, shape: dict, elapsed: float) -> dict[str, Any]:
    p, args = bench.plan, bench.args
    wan = {"mbit": p.link.rate_bits / 1e6, "delay_ms": round(p.link.delay_s * 1e3, 3),
           "how": f"from the scenario, not calibrated: {p.link.why}"}
    report = live.build_report(bench.setups, args.seeds, args.model, wan, shape, elapsed)
    d = args.time_dilation
    report.update({
        "backend": EMULATED_BACKEND, "scenario": args.scenario, "scenario_overrides": p.overrides,
        "kv_scale": round(p.scale, 3), "kv_scale_requested": args.kv_scale, "time_dilation": d,
        "instance_fraction": round(p.fraction, 4),
        "instances": {"live": {"prefill": 1, "relay": 1, "main-decode": 1},
                      "scenario_pdd_split": p.scenario_split},
        "rate_rps": {"modeled": round(p.rate, 4), "wall": round(p.rate / d, 4),
                     "scenario_comparison_rate": round(p.scenario_rate, 4),
                     "how": rate_how(p, args)},
        "slo": {"ttft_s": p.slo.ttft_s, "tpot_s": p.slo.tpot_s, "attainment": p.slo.attainment,
                "wall": "x time dilation"},
        "chips": {n: SYSTEM_OF[n] for n in bench.setups},
        "timing_rules": list(TIMING_RULES),
        "overrun_share": {n: s["pacing"]["overrun_share"] for n, s in bench.setups.items()},
        "wan_bytes_units": "wan_bytes_metric: real bytes; wan_bytes_modeled and sim: modeled (x kv_scale); all "
                           "wire bytes, after the WAN codec",
        "wan_codec": p.codec,
    })
    if p.trace:
        report["trace"] = {**p.trace.describe(), "capacity_tokens": trace_capacities(bench)}
    fp = report.get("fast_path_mb_per_s_p50")
    report["fast_path_mb_per_s_p50"] = round(fp * p.scale, 1) if fp else None  # modeled bytes, as the goal's
    report["goals"] = live.goals(report)
    for name, setup in bench.setups.items():
        r = report["setups"][name]
        r["slo"] = {"ttft_s": round(setup["slo"][0], 4), "tpot_ms": round(setup["slo"][1] * 1000, 3),
                    "attainment": p.slo.attainment}
        r["chips"] = SYSTEM_OF[name]
        r["pacing"] = setup["pacing"]
        r["kv_ready_lag_over_bound"] = setup["kv_ready_lag"]
        r["overrun_share"] = setup["pacing"]["overrun_share"]
        r["sim_goodput_rps"] = round(setup["sim_goodput"].value, 4)
        r["sim_goodput_search"] = {"note": setup["sim_goodput"].note, "probes": setup["sim_goodput"].probes}
        cmp_ = comparison(setup, p.scale)
        if p.trace:
            cmp_.update(trace_comparison(setup))
            r["per_request_vs_sim"] = [rep.get("trace_hits") for rep in setup["repeats"]]
        r["vs_sim"] = cmp_
        for key, v in cmp_.items():
            r[f"sim_{key}"] = v["sim"]
            r[f"rel_err_{key}"] = v["rel_err"]
    s = bench.setups
    if "naive" in s and "pdd" in s:  # the headline ratios as the simulator gives them for the same runs
        def red(key: str, stat: str, sim: bool) -> float | None:
            def get(rep):
                return rep["sim"]["ttft_s"][stat] if sim else rep[key][stat]
            vals = [live.reduction(get(a), get(b)) for a, b in zip(s["naive"]["repeats"], s["pdd"]["repeats"])]
            return mean_ci95(vals)["mean"]

        for stat in ("mean", "p90"):
            key = f"ttft_{stat}_reduction_vs_naive"
            report[f"sim_{key}"] = red("ttft_s", stat, True)
            report[f"rel_err_{key}"] = rel_err(report.get(key), report[f"sim_{key}"])
        sn = sum(r["sim"]["wan_bytes"] for r in s["naive"]["repeats"])
        sp = sum(r["sim"]["wan_bytes"] for r in s["pdd"]["repeats"])
        report["sim_wan_bytes_ratio_naive_over_pdd"] = round(sn / sp, 3) if sp else None
        report["rel_err_wan_bytes_ratio_naive_over_pdd"] = rel_err(report.get("wan_bytes_ratio_naive_over_pdd"),
                                                                   report["sim_wan_bytes_ratio_naive_over_pdd"])
        if p.codec and p.codec["codec"] != "none":  # the goal's figure: naive sending its KV uncoded
            wire = p.codec["wire_ratio"]
            ln = sum(r["wan_bytes_metric"] for r in s["naive"]["repeats"])
            lp = sum(r["wan_bytes_metric"] for r in s["pdd"]["repeats"])
            key = "wan_bytes_ratio_naive_uncoded_over_pdd"
            report[key] = round(ln / wire / lp, 3) if lp else None
            report[f"sim_{key}"] = round(sn / wire / sp, 3) if sp else None
            report[f"{key}_how"] = ("naive's WAN bytes without the codec (its wire bytes / wire_ratio: the same KV "
                                    "crosses, the emulated codec charges exactly wire_ratio per KV byte) over pdd's "
                                    f"wire bytes with {p.codec['codec']}")
            report["goals"][key] = {"value": report[key], "target": WAN_CODEC_GOAL,
                                    "met": report[key] is not None and report[key] >= WAN_CODEC_GOAL}
        # the ratio's ceiling on these requests: what moves if only the KV main decode lacks crosses (the
        # workload's own token-weighted hit h gives 1 / (1 - h); the goal's 10x is h = 0.90)
        runs = [bench.run_for(seed, bench.repeat_requests()) for seed in range(args.seeds)]
        prompt = sum(int(r.arrays.prompt.sum()) for r in runs)
        missing = sum(int((r.arrays.prompt - r.md_cached).sum()) for r in runs)
        report["workload_md_hit"] = round(1 - missing / prompt, 4) if prompt else None
        report["wan_bytes_ratio_if_only_missing_kv"] = round(prompt / missing, 3) if missing else None
        lag = s["pdd"]["kv_ready_lag"]  # the streamed export's goal is PDD's (every setup streams alike)
        report["kv_ready_lag_over_bound_p50"], report["kv_ready_lag_over_bound_p90"] = lag["p50"], lag["p90"]
        report["kv_ready_lag_over_bound_requests"] = lag["requests"]
        report["kv_ready_lag_over_floor_p50"], report["kv_ready_lag_over_floor_p90"] = (lag["over_floor"]["p50"],
                                                                                       lag["over_floor"]["p90"])
        gn, gp = s["naive"]["sim_goodput"].value, s["pdd"]["sim_goodput"].value
        report["sim_goodput_gain_vs_naive"] = round(gp / gn - 1, 4) if gn else None
    return report


def _f(v: Any, nd: int = 3) -> str:
    return live.fmt(v, nd)


def codec_line(c: dict[str, Any]) -> str:
    """Which WAN codec, its ratio and where the ratio came from, for the banner and the printout."""
    if c["codec"] == "none":
        return "none (every setup sends the KV uncoded)"
    return (f"{c['codec']} on every setup that crosses the WAN, ratio {c['ratio_kv_per_wire_byte']:g} (wire ratio "
            f"{c['wire_ratio']:.4f}), {c['source']}; {c['how']}; coding {c['coding']}")


def print_report(report: dict, bench: Bench) -> None:
    args = bench.args
    live.print_report(report, f"{report['wan']['delay_ms']:g} ms one-way, no jitter")
    print(f"\nEmulated: scenario {report['scenario']} (overrides {report['scenario_overrides']}); KV scale 1/"
          f"{report['kv_scale']:.0f}; time dilation x{report['time_dilation']:g}; instances 1 P, 1 RLD, 1 MD = "
          f"fraction {report['instance_fraction']:g} of the pdd system's {report['instances']['scenario_pdd_split']}; "
          f"rate {report['rate_rps']['modeled']:.3f} req/s modeled ({report['rate_rps']['how']}); SLO TTFT "
          f"{report['slo']['ttft_s']} s, TPOT {report['slo']['tpot_s'] * 1000:g} ms (x dilation), attainment "
          f"{report['slo']['attainment']:.0%}")
    print(f"WAN codec: {codec_line(report['wan_codec'])}")
    if report.get("trace"):
        t = report["trace"]
        print(f"Trace: {t['file']}, {t['slice']} ({t['requests']} replayed, {t['skipped_too_long']} too long for "
              f"{t['max_context_tokens']} tokens), blocks of {t['block_tokens']} tokens, max_tokens {t['max_tokens']}, "
              f"time scale {t['time_scale']:g} ({t['time_scale_how']}); unbounded-cache hit {t['hit_unbounded']:.3f}")
    print("Chips: " + ", ".join(f"{n} -> system {c}" for n, c in report["chips"].items())
          + "; overrun share (steps past their deadline): "
          + ", ".join(f"{n} {_f(v, 4)}" for n, v in report["overrun_share"].items()))
    cols = list(report["setups"])
    print(f"\nLive beside `pdd sim` of the same requests (mean over {args.seeds} repeats; rel. err = live / sim - 1)")
    print(f"{'':26s}" + "".join(f" {c:>30s}" for c in cols))
    for key, label in (("ttft_p50_s", "TTFT P50 s"), ("ttft_p90_s", "TTFT P90 s"), ("ttft_mean_s", "TTFT mean s"),
                       ("tpot_p50_ms", "TPOT P50 ms"), ("goodput_rps", "goodput req/s (modeled)"),
                       ("wan_bytes_per_request", "WAN MB/request (modeled)"),
                       ("turn_hold_s", "turn held for its session s"),
                       ("p_hit_tokens", "P hit tokens (K)"), ("md_hit_tokens", "MD hit tokens (K)")):
        if key not in report["setups"][cols[0]]["vs_sim"]:
            continue
        cells = []
        for c in cols:
            v = report["setups"][c]["vs_sim"][key]
            k = 1e-6 if key.startswith("wan") else 1e-3 if key.endswith("hit_tokens") else 1.0
            lv = None if v["live"] is None else v["live"] * k
            sv = None if v["sim"] is None else v["sim"] * k
            err = "-" if v["rel_err"] is None else f"{v['rel_err']:+.0%}"
            cells.append(f"{_f(lv, 2)} / {_f(sv, 2)} ({err})")
        print(f"{label:26s}" + "".join(f" {x:>30s}" for x in cells))
    for key in ("ttft_mean_reduction_vs_naive", "ttft_p90_reduction_vs_naive", "wan_bytes_ratio_naive_over_pdd",
                "wan_bytes_ratio_naive_uncoded_over_pdd", "goodput_gain_vs_naive"):
        if f"sim_{key}" in report:
            print(f"  {key:38s} live {_f(report.get(key))}  sim {_f(report[f'sim_{key}'])}")
    if report.get("wan_bytes_ratio_if_only_missing_kv"):
        print("  WAN ratio if only the KV main decode lacks crossed: "
              f"{_f(report['wan_bytes_ratio_if_only_missing_kv'])} "
              f"(these requests' token-weighted hit {_f(report['workload_md_hit'], 4)}; 10x is a hit of 0.90)")
    for name, setup in report["setups"].items():
        lag = setup.get("kv_ready_lag_over_bound") or {}
        if lag.get("requests"):
            iso = lag["isolated"]
            print(f"  KV-ready lag / bound, {name} (transfers of >= {lag['min_chunks']} chunks): p50 {_f(lag['p50'])} "
                  f"p90 {_f(lag['p90'])} over {lag['requests']}; with no other transfer in flight p50 "
                  f"{_f(iso['p50'])} p90 {_f(iso['p90'])} over {iso['requests']}")
            fl = lag["over_floor"]
            print(f"  KV-ready lag / streamed floor (chunks sent in order as they become final), {name}: p50 "
                  f"{_f(fl['p50'])} p90 {_f(fl['p90'])}; with no other transfer in flight p50 "
                  f"{_f(fl['isolated']['p50'])} p90 {_f(fl['isolated']['p90'])}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    run_root = Path(args.run_dir or tempfile.mkdtemp(prefix="pdd-bench-emulated-"))
    run_root.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.setups.split(",") if n]
    unknown = [n for n in names if n not in live.SETUPS]
    if unknown:
        print(f"--setups: unknown {unknown}", file=sys.stderr)
        return 2
    bench = Bench(args, run_root)
    p = bench.plan
    shape = live.workload_shape([r for seed in range(args.seeds)
                                 for r in bench.run_for(seed, bench.repeat_requests()).planned])
    what = (f"trace {p.trace.path.name} ({shape['requests'] // args.seeds} requests of its first {p.trace.lines} "
            f"lines, {p.trace.skipped_too_long} too long; blocks of {p.trace.block_tokens} tokens; max_tokens "
            f"{p.trace.rule}; time scale {p.trace.time_scale:g}: {p.trace.time_scale_how})" if p.trace
            else f"{args.requests} requests")
    print(f"pipelines benchmark, emulated: scenario {args.scenario}, setups {names}, {args.seeds} seeds x "
          f"{what}; KV scale 1/{p.scale:.0f}, dilation x{args.time_dilation:g}; 1 P, 1 RLD, 1 MD "
          f"(fraction {p.fraction:g} of {p.scenario_split}); rate {p.rate:.3f} req/s modeled ({rate_how(p, args)}); "
          f"WAN {p.link.rate_bits / 1e6:.2f} Mbit/s, "
          f"{p.link.delay_s * 1e3:g} ms ({p.link.why}); WAN codec {codec_line(p.codec)}; run dir {run_root}",
          flush=True)
    with live.setups_running(bench.systems):
        for name in names:
            print(f"[{name}] system {SYSTEM_OF[name]}: repeats, goodput", flush=True)
            bench.setups[name] = bench.run_setup(live.SETUPS[name])
    report = build_report(bench, shape, time.monotonic() - t_start)
    print_report(report, bench)
    live.emit(report, run_root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
