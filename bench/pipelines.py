"""PDD end-to-end benchmark: one agentic multi-turn workload, three deployments, one run.

Setups, started one after another on this machine (real processes: nats-server, router, P, RLD, MD):
  1. colocated  P and MD in one site: no WAN shaping; pipeline forced P-MD; MD keeps its
                Decode-side RadixCache (DRC).
  2. naive      cross-site PD: always P->MD (forced), WAN shaped, MD without DRC
                (PDD__MODEL__ENABLE_PREFIX_CACHE=false on MD only), so the full prompt KV crosses
                the WAN on every turn.
  Both baselines are conventional PD (router.first_token_after_kv): the client's first token
  arrives once the decoder has the KV, as in vLLM/SGLang PD; PDD streams it from P at once.
  3. pdd        the router's policy chooses the pipeline per request (no forced pipeline), MD with
                DRC, relay available, WAN shaped.

Workload (identical prompts in all three setups, greedy decoding): agent sessions whose next turn
is the previous prompt + the previous answer (the returned token ids) + new user/tool tokens; every
session starts with a shared system prompt plus a long fresh task (the low-hit requests); a minority
of turns carry a long tool output (mid-hit). Client-side TTFT/ITL come from the SSE stream (each
chunk's arrival time). Model: built-in SmolLM2-135M-Instruct, fp32 KV = 46,080 B/token.

Run: python bench/pipelines.py [--sessions 6 --turns 10 --rate 300mbit ...]   (no args: a few minutes)
Last stdout line: one JSON object with every figure and ratio.

Why one module: it is one benchmark, read top to bottom (setups, workload, figures, report); the
parts share its per-request records and arguments and mean nothing apart. The client, the metrics
parser and the cluster it uses are the shared ones (loadgen/client.py, loadgen/scrape.py,
services/launch/local_cluster.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd.loadgen.workload import WORDS as _WORDS  # one-token English words
from pdd.services.launch.local_cluster import LocalCluster, two_site_layout
from pdd.shared.pipelines import HandoffMode, Pipeline

SETUPS = ("colocated", "naive", "pdd")
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M fp32: 46,080 B/token


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
class System:
    """nats-server + router + P + RLD + MD for one setup (a LocalCluster with this setup's config)."""

    def __init__(self, name: str, run_dir: Path, args: argparse.Namespace):
        self.name = name
        self.run_dir = run_dir
        self.args = args
        self.spans_path = run_dir / "spans.jsonl"
        env = {} if args.ucx_python_future else {"UCXPY_ENABLE_PYTHON_FUTURE": "0"}
        naive_md = {"md-0": {"PDD__MODEL__ENABLE_PREFIX_CACHE": "false"}} if name == "naive" else {}
        self.cluster = LocalCluster(run_dir, self.config(), env=env, instance_env=naive_md)

    @property
    def base_url(self) -> str:
        return self.cluster.base_url

    def config(self) -> dict:
        a = self.args
        wan_opts: dict[str, Any] = {"streams": 2}
        if self.name != "colocated":
            wan_opts["shape"] = {"rate": a.rate, "delay": a.delay, "jitter": a.jitter}
        from pdd.transports.units import rate_bits

        policy = {"handoff_catch_up_threshold": a.catch_up_threshold,
                  "default_wan_gbps": rate_bits(a.rate) / 1e9}
        from pdd.transports import ucx_available

        fast = "ucx" if ucx_available() else "zmq"
        return {
            "model": {"path": a.model, "kv_memory_mb": a.kv_memory_mb, "block_size": 16, "max_num_seqs": 32,
                      "threads": a.threads, "max_prefill_tokens": 2048},
            **two_site_layout(main_decode_site="site-a" if self.name == "colocated" else "site-b"),
            "transports": {"fast": {"name": fast, "options": {}}, "wan": {"name": "zmq", "options": wan_opts}},
            # the baselines are conventional PD: the client's first token waits for the decoder's KV
            "router": {"request_timeout_s": 600, "first_token_after_kv": self.name != "pdd"},
            "policy": policy,
            "service": {"heartbeat_ms": 250, "drain_timeout_s": 5},
            "telemetry": {"exporter": "jsonl", "jsonl_path": str(self.spans_path), "log_format": "json"},
        }

    def start(self, timeout: float = 300.0) -> float:
        return self.cluster.start(timeout)

    def pids(self) -> list[int]:
        return [m.proc.pid for m in self.cluster.members.values()] + [self.cluster.nats.pid]

    def metrics_url(self, iid: str) -> str | None:
        return self.base_url + "/metrics" if iid == "router-0" else self.cluster.members[iid].metrics_url

    def stop(self) -> None:
        self.cluster.stop()


# ---------------------------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------------------------
@dataclass
class SessionPlan:
    sid: int
    start_at: float  # seconds after the run starts
    first_prompt: list[int]  # shared system prompt + fresh task
    new_tokens: list[list[int]]  # per later turn: new user/tool tokens appended
    think_s: list[float]


def word_ids(model_path: str) -> tuple[list[int], int]:
    from pdd.shared.model_files import resolve_model_path
    from pdd.shared.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path(model_path))
    ids = []
    for w in _WORDS:
        enc = tok.encode(" " + w, add_special_tokens=False)
        if len(enc) == 1:
            ids.append(enc[0])
    return sorted(set(ids)), len(tok)


def build_workload(args: argparse.Namespace, vocab_ids: list[int]) -> list[SessionPlan]:
    rng = random.Random(args.seed)

    def text(n: int) -> list[int]:
        return [rng.choice(vocab_ids) for _ in range(n)]

    system = text(args.system_tokens)
    plans = []
    for s in range(args.sessions):
        task = text(rng.randint(int(args.task_tokens * 0.8), int(args.task_tokens * 1.2)))
        news, thinks = [], []
        for _ in range(args.turns - 1):
            if rng.random() < args.long_tool_fraction:
                news.append(text(rng.randint(args.long_tool_tokens // 2, args.long_tool_tokens)))
            else:
                news.append(text(rng.randint(args.new_tokens // 2, args.new_tokens * 3 // 2)))
            thinks.append(rng.uniform(0.5 * args.think_s, 1.5 * args.think_s))
        plans.append(SessionPlan(s, s * args.stagger_s, system + task, news, thinks))
    return plans


@dataclass
class Result:
    session: int
    turn: int
    prompt_tokens: int
    reuse_tokens: int  # prefix a warm cache could hold: previous prompt + previous answer
    ok: bool = False
    error: str = ""
    t_send: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, chars) per content chunk
    output_tokens: int = 0
    info: dict = field(default_factory=dict)
    request_id: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.t_send if self.chunks else None

    @property
    def tt2(self) -> float | None:
        """Time to the second streamed chunk: the first token a decoder (not P) produced."""
        return self.chunks[1][0] - self.t_send if len(self.chunks) > 1 else None

    @property
    def e2e(self) -> float | None:
        return self.chunks[-1][0] - self.t_send if self.chunks else None

    @property
    def gaps(self) -> list[float]:
        return [b[0] - a[0] for a, b in zip(self.chunks, self.chunks[1:])]

    @property
    def mean_itl(self) -> float | None:
        if self.output_tokens < 2 or len(self.chunks) < 2:
            return None
        return (self.chunks[-1][0] - self.chunks[0][0]) / (self.output_tokens - 1)

    @property
    def hit(self) -> float:
        return self.reuse_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def request_body(prompt: list[int], max_tokens: int, pipeline: str | None, stream: bool = True) -> dict:
    pdd: dict[str, Any] = {"return_token_ids": True}
    if pipeline:
        pdd["pipeline"] = pipeline
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
            "pdd": pdd}
    if stream:  # usage on every chunk: the token count each chunk carries (positions, not chunks)
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


async def stream_one(session, base_url: str, body: dict, res: Result) -> list[int]:
    """One streamed request into ``res``: each content chunk's arrival and size, the `pdd` info;
    returns the output token ids (empty on failure)."""
    from pdd.loadgen.client import stream

    s = await stream(session, base_url + "/v1/completions", body)
    res.t_send = s.t_send
    res.request_id = s.id
    res.chunks = [(c.t, len(c.text)) for c in s.content_chunks]
    res.info = s.info
    if s.exception is not None:
        res.error = f"{type(s.exception).__name__}: {s.exception}"[:300]
        return []
    if s.status != 200:
        res.error = f"HTTP {s.status}: {s.body_text[:300]}"
        return []
    if s.error is not None:
        res.error = json.dumps(s.error)[:300]
        return []
    ids = s.token_ids
    res.output_tokens = len(ids)
    res.ok = bool(ids)
    return ids


def client_session():
    import aiohttp

    # no total limit (the router's request_timeout_s ends a request); 600 s without a byte is a failure
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=600, sock_read=600))


async def run_workload(base_url: str, plans: list[SessionPlan], args: argparse.Namespace, pipeline: str | None,
                       progress: str) -> tuple[list[Result], float]:
    results: list[Result] = []
    total = sum(1 + len(p.new_tokens) for p in plans)
    done = [0]

    async def session(client, plan: SessionPlan, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + plan.start_at - time.perf_counter()))
        prompt, reuse = list(plan.first_prompt), 0
        for turn in range(1 + len(plan.new_tokens)):
            res = Result(plan.sid, turn, len(prompt), reuse)
            answer = await stream_one(client, base_url, request_body(prompt, args.output_tokens, pipeline), res)
            results.append(res)
            done[0] += 1
            if done[0] % max(1, total // 10) == 0 or done[0] == total:
                print(f"  [{progress}] {done[0]}/{total} requests", flush=True)
            if not res.ok or turn == len(plan.new_tokens):
                return
            await asyncio.sleep(plan.think_s[turn])
            reuse = len(prompt) + len(answer)
            prompt = prompt + answer + plan.new_tokens[turn]

    async with client_session() as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(session(client, p, t0) for p in plans))
        makespan = time.perf_counter() - t0
    return results, makespan


async def warm_up(base_url: str, args: argparse.Namespace, vocab_ids: list[int], pipelines: list[str | None]) -> None:
    """Open every link (ucx/zmq) and warm kernels on prompts that share nothing with the workload."""
    from pdd.loadgen.client import stream

    rng = random.Random(12345)
    async with client_session() as client:
        for i, pipe in enumerate(pipelines):
            prompt = [rng.choice(vocab_ids) for _ in range(40 + 20 * i)]
            s = await stream(client, base_url + "/v1/completions", request_body(prompt, 24, pipe, stream=False),
                             timeout_s=300.0)
            if s.status != 200 or s.exception is not None or s.timed_out:
                raise RuntimeError(f"warm-up request failed: {s.status} {s.body_text[:300] or s.exception}")


# ---------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    if len(vals) == 1:
        return vals[0]
    k = (len(vals) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def metric_totals(samples: dict) -> dict[str, Any]:
    """The figures this bench reads, from one instance's parsed /metrics (loadgen.scrape samples)."""
    out: dict[str, Any] = {}
    for (name, labels), value in samples.items():
        name = name.replace("pdd_", "pdd:", 1) if name.startswith("pdd_") else name
        if name in ("pdd:wan_bytes_total", "pdd:rld_tokens_total", "pdd:generated_tokens_total",
                    "pdd:fast_path_bytes_total"):
            out[name] = out.get(name, 0.0) + value
        elif name == "pdd:pipeline_requests_total":
            pipe = dict(labels).get("pipeline", "?")
            out.setdefault("pipelines", {})
            out["pipelines"][pipe] = out["pipelines"].get(pipe, 0.0) + value
        elif name.startswith("pdd:handoff_total"):
            mode = dict(labels).get("mode", "?")
            out.setdefault("handoffs", {})
            out["handoffs"][mode] = out["handoffs"].get(mode, 0.0) + value
    return out


def scrape_all(system: System) -> dict[str, dict]:
    from pdd.loadgen.scrape import scrape_sync

    out = {}
    for iid in ("router-0", "p-0", "rld-0"):
        url = system.metrics_url(iid)
        samples = scrape_sync(url) if url else None
        out[iid] = metric_totals(samples) if samples else {}
    return out


def cpu_sample(pids: list[int]) -> tuple[float, float, float]:
    """(wall, machine busy CPU seconds, CPU seconds of our processes) — to show what else loads the box."""
    hz = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)) / hz  # minus idle, iowait
    mine = sum(os.times()[:2])
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
            mine += (int(parts[11]) + int(parts[12])) / hz
        except (OSError, IndexError, ValueError):
            pass
    return time.monotonic(), busy, mine


def cpu_use(before: tuple, after: tuple, pids_note: str = "") -> dict[str, float]:
    wall = max(1e-9, after[0] - before[0])
    mine = (after[2] - before[2]) / wall
    busy = (after[1] - before[1]) / wall
    return {"bench_cores": round(mine, 2), "other_cores": round(max(0.0, busy - mine), 2),
            "cpus": os.cpu_count() or 0}


def delta(after: dict, before: dict, key: str) -> float:
    return float(after.get(key, 0.0)) - float(before.get(key, 0.0))


def span_profile(spans_path: Path, request_ids: set[str]) -> dict[str, Any]:
    """Where time goes, from the setup's span file: per stage mean / p90 (ms) over the workload."""
    stages: dict[str, list[float]] = {}
    wan_gbps: list[float] = []
    if not spans_path.exists():
        return {}
    for line in spans_path.read_text(errors="replace").splitlines():
        try:
            s = json.loads(line)
        except json.JSONDecodeError:
            continue
        rid = (s.get("attributes") or {}).get("request_id")
        if rid not in request_ids:
            continue
        dur = (s.get("end_ns", 0) - s.get("start_ns", 0)) / 1e6
        key = f"{s.get('name')}@{s.get('service', '?').replace('pdd-', '')}"
        stages.setdefault(key, []).append(dur)
        if s.get("name") == "kv.transfer.wan":
            g = (s.get("attributes") or {}).get("gbps")
            if g:
                wan_gbps.append(float(g))
    prof = {k: {"n": len(v), "mean_ms": round(statistics.fmean(v), 1), "p90_ms": round(pct(v, 90), 1),
                "max_ms": round(max(v), 1)} for k, v in sorted(stages.items())}
    if wan_gbps:
        prof["wan_gbps_p50"] = round(pct(wan_gbps, 50), 3)
    return prof


def summarize(name: str, results: list[Result], makespan: float, before: dict, after: dict,
              profile: dict) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    tt2 = [r.tt2 for r in ok if r.tt2 is not None]
    e2e = [r.e2e for r in ok]
    gaps = [g for r in ok for g in r.gaps]
    mitl = [r.mean_itl for r in ok if r.mean_itl is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    chunks = sum(len(r.chunks) for r in ok)
    resp_wan = [float(r.info.get("wan_bytes", 0) or 0) for r in ok]
    rld_resp = sum(int(r.info.get("rld_tokens", 0) or 0) for r in ok)
    pipes: dict[str, int] = {}
    for r in ok:
        pipes[r.info.get("pipeline", "?")] = pipes.get(r.info.get("pipeline", "?"), 0) + 1
    p_wan = delta(after.get("p-0", {}), before.get("p-0", {}), "pdd:wan_bytes_total")
    router_rld = delta(after.get("router-0", {}), before.get("router-0", {}), "pdd:rld_tokens_total")
    router_gen = delta(after.get("router-0", {}), before.get("router-0", {}), "pdd:generated_tokens_total")
    hand_before = before.get("rld-0", {}).get("handoffs", {})
    handoffs = {k: v - hand_before.get(k, 0.0) for k, v in after.get("rld-0", {}).get("handoffs", {}).items()}
    md_hits = [int(r.info["md_cached_tokens"]) / r.prompt_tokens for r in ok if "md_cached_tokens" in r.info]

    # stall around a handoff: the stream's max gap / its median gap, for handed-over requests
    ratios: dict[str, list[float]] = {}
    for r in ok:
        mode = r.info.get("handoff_mode")
        if mode and len(r.gaps) >= 3:
            med = statistics.median(r.gaps)
            if med > 0:
                ratios.setdefault(mode, []).append(max(r.gaps) / med)

    def q3(vals: list[float], scale: float = 1.0) -> dict[str, float | None]:
        return {f"p{q}": (round(v * scale, 4) if (v := pct(vals, q)) is not None else None) for q in (50, 90, 99)}

    return {
        "setup": name, "requests": len(results), "completed": len(ok),
        "errors": [r.error for r in results if not r.ok][:5],
        "makespan_s": round(makespan, 2),
        "ttft_s": q3(ttft), "tt2_s": q3(tt2), "e2e_s": q3(e2e), "itl_ms": q3(gaps, 1000.0),
        "mean_itl_ms": q3(mitl, 1000.0),
        "output_tokens": out_tokens, "tokens_per_chunk": round(out_tokens / max(1, chunks), 3),
        "wan_bytes_per_request_resp": round(statistics.fmean(resp_wan), 1) if resp_wan else 0.0,
        "wan_bytes_per_request_metric": round(p_wan / max(1, len(results)), 1),
        "wan_bytes_total_metric": p_wan,
        "rld_tokens_resp": rld_resp, "rld_tokens_metric": router_rld, "generated_tokens_metric": router_gen,
        "rld_token_share": round(rld_resp / max(1, out_tokens), 4),
        "pipeline_mix": pipes, "handoffs": handoffs,
        "md_hit_mean": round(statistics.fmean(md_hits), 4) if md_hits else None,
        "handoff_max_over_median": {m: {"n": len(v), "max": round(max(v), 3), "p90": round(pct(v, 90), 3),
                                        "p50": round(pct(v, 50), 3)} for m, v in ratios.items()},
        "by_pipeline": {pipe: {"n": len(rs), "hit_mean": round(statistics.fmean(r.hit for r in rs), 3),
                               "ttft_p50": round(pct([r.ttft for r in rs], 50), 3),
                               "tt2_p50": round(pct([r.tt2 for r in rs if r.tt2], 50) or 0, 3),
                               "tt2_p90": round(pct([r.tt2 for r in rs if r.tt2], 90) or 0, 3),
                               "wan_mb_mean": round(statistics.fmean(float(r.info.get("wan_bytes", 0) or 0)
                                                                     for r in rs) / 1e6, 2)}
                        for pipe in pipes for rs in [[r for r in ok if r.info.get("pipeline") == pipe]]},
        "handoff_gaps_ms": [{"mode": r.info.get("handoff_mode"), "rld_tokens": r.info.get("rld_tokens"),
                             "max_gap_ms": round(max(r.gaps) * 1000, 1),
                             "median_gap_ms": round(statistics.median(r.gaps) * 1000, 1),
                             "argmax": r.gaps.index(max(r.gaps)) + 1}
                            for r in ok if r.info.get("handoff_mode") and len(r.gaps) >= 3],
        "profile": profile,
    }


def goodput(results: list[Result], makespan: float, ttft_slo: float, itl_slo: float,
            first: str = "ttft") -> tuple[float, float]:
    """Requests per second that met the SLO (over the setup's makespan), and the fraction that did."""
    ok = [r for r in results if r.ok and getattr(r, first) is not None and getattr(r, first) <= ttft_slo
          and (r.mean_itl is None or r.mean_itl <= itl_slo)]
    return len(ok) / makespan, len(ok) / max(1, len(results))


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="'default' = SmolLM2-135M-Instruct")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8, help="turns per session (the first one is low-hit)")
    ap.add_argument("--system-tokens", type=int, default=256, help="system prompt shared by all sessions")
    ap.add_argument("--task-tokens", type=int, default=800, help="fresh task tokens of a session's first turn")
    ap.add_argument("--new-tokens", type=int, default=32, help="new user/tool tokens per later turn (mean)")
    ap.add_argument("--long-tool-fraction", type=float, default=0.12, help="later turns with a long tool output")
    ap.add_argument("--long-tool-tokens", type=int, default=320)
    ap.add_argument("--output-tokens", type=int, default=32, help="max_tokens per turn (ignore_eos)")
    ap.add_argument("--think-s", type=float, default=0.5, help="mean tool/think time between turns")
    ap.add_argument("--stagger-s", type=float, default=3.0, help="session start spacing")
    ap.add_argument("--rate", default="200mbit", help="emulated WAN rate (shaper)")
    ap.add_argument("--delay", default="20ms")
    ap.add_argument("--jitter", default="2ms")
    ap.add_argument("--catch-up-threshold", type=int, default=4,
                    help="policy.handoff_catch_up_threshold for the pdd setup (report: 64 at GPU speed)")
    ap.add_argument("--no-ucx-python-future", dest="ucx_python_future", action="store_false",
                    help="leave ucxx's default request polling (busy-polls a core share per endpoint here)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine process")
    ap.add_argument("--kv-memory-mb", type=int, default=768)
    ap.add_argument("--slo-factor", type=float, default=1.5,
                    help="SLO = factor x the colocated run's p90 (TTFT and per-request mean ITL)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--run-dir", default=None, help="logs/config/spans (default: a temp dir, kept)")
    return ap.parse_args(argv)


def fmt(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    run_root = Path(args.run_dir or tempfile.mkdtemp(prefix="pdd-bench-"))
    run_root.mkdir(parents=True, exist_ok=True)
    setups = [s for s in args.setups.split(",") if s]
    vocab_ids, _ = word_ids(args.model)
    plans = build_workload(args, vocab_ids)
    n_req = sum(1 + len(p.new_tokens) for p in plans)
    print(f"PDD benchmark: {args.sessions} sessions x {args.turns} turns = {n_req} requests, "
          f"{args.output_tokens} output tokens each; WAN {args.rate} delay {args.delay}±{args.jitter} "
          f"(in-process shaper); KV {KV_BYTES_PER_TOKEN} B/token; run dir {run_root}", flush=True)

    systems: list[System] = []
    stopping = {"sig": None}

    def on_signal(signum, _frame):
        stopping["sig"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    summaries: dict[str, dict] = {}
    raw: dict[str, tuple[list[Result], float]] = {}
    try:
        for name in setups:
            system = System(name, run_root / name, args)
            systems.append(system)
            print(f"[{name}] starting nats-server, router, P, RLD, MD ...", flush=True)
            startup = system.start()
            print(f"[{name}] ready in {startup:.1f}s; warming links", flush=True)
            asyncio.run(warm_up(system.base_url, args, vocab_ids,
                                [Pipeline.P_MD] if name != "pdd" else [Pipeline.P_MD, Pipeline.P_RLD_MD]))
            before = scrape_all(system)
            pids = system.pids()
            cpu0 = cpu_sample(pids)
            pipeline = None if name == "pdd" else Pipeline.P_MD
            results, makespan = asyncio.run(run_workload(system.base_url, plans, args, pipeline, name))
            cpu1 = cpu_sample(pids)
            time.sleep(0.5)
            after = scrape_all(system)
            system.stop()
            time.sleep(0.5)  # the span exporter flushes on stop
            profile = span_profile(system.spans_path, {r.request_id for r in results if r.request_id})
            summaries[name] = summarize(name, results, makespan, before, after, profile)
            summaries[name]["startup_s"] = round(startup, 1)
            summaries[name]["cpu"] = cpu_use(cpu0, cpu1)
            raw[name] = (results, makespan)
            s = summaries[name]
            print(f"[{name}] done: {s['completed']}/{s['requests']} ok in {makespan:.1f}s; "
                  f"TTFT p90 {fmt(s['ttft_s']['p90'])}s, pipelines {s['pipeline_mix']}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: stopping every process", file=sys.stderr, flush=True)
        return 130
    finally:
        for system in systems:
            system.stop()

    report = build_report(args, summaries, raw, plans, time.monotonic() - t_start, run_root)
    print(json.dumps(report, sort_keys=True))
    return 0


def build_report(args, summaries: dict, raw: dict, plans, elapsed: float, run_root: Path) -> dict:
    col = raw.get("colocated")
    report: dict[str, Any] = {"bench": "pdd", "wan_rate": args.rate, "wan_delay": args.delay,
                              "wan_jitter": args.jitter, "sessions": args.sessions, "turns": args.turns,
                              "output_tokens": args.output_tokens, "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
                              "run_dir": str(run_root)}
    # workload hit profile (what a warm cache could reuse), from the colocated run's actual prompts
    any_results = next(iter(raw.values()))[0] if raw else []
    hits = [r.hit for r in any_results]
    if hits:
        report["workload_hit_mean"] = round(statistics.fmean(hits), 4)
        report["workload_share_hit_gt_95"] = round(sum(h > 0.95 for h in hits) / len(hits), 4)
        report["workload_prompt_tokens_mean"] = round(statistics.fmean(r.prompt_tokens for r in any_results), 1)
        bins = [(0, 0.5), (0.5, 0.9), (0.9, 0.95), (0.95, 0.98), (0.98, 1.01)]
        report["workload_hit_bins"] = {f"{lo:.2f}-{min(hi, 1):.2f}": sum(lo <= h < hi for h in hits) for lo, hi in bins}

    # SLO from the colocated distribution
    if col:
        c = summaries["colocated"]
        ttft_slo = args.slo_factor * c["ttft_s"]["p90"]
        itl_slo = args.slo_factor * c["mean_itl_ms"]["p90"] / 1000.0
        report["slo"] = {"ttft_s": round(ttft_slo, 4), "mean_itl_ms": round(itl_slo * 1000, 2),
                         "rule": f"{args.slo_factor} x colocated p90 of TTFT and of per-request mean ITL"}
        tt2_slo = args.slo_factor * c["tt2_s"]["p90"]
        report["slo_tt2"] = {"tt2_s": round(tt2_slo, 4), "mean_itl_ms": round(itl_slo * 1000, 2),
                             "rule": f"{args.slo_factor} x colocated p90 of time-to-2nd-token and of mean ITL"}
        for name, (results, makespan) in raw.items():
            g, frac = goodput(results, makespan, ttft_slo, itl_slo)
            summaries[name]["goodput_rps"] = round(g, 4)
            summaries[name]["slo_attainment"] = round(frac, 4)
            g2, frac2 = goodput(results, makespan, tt2_slo, itl_slo, first="tt2")
            summaries[name]["goodput_tt2_rps"] = round(g2, 4)
            summaries[name]["slo_tt2_attainment"] = round(frac2, 4)
    report["setups"] = summaries
    print_table(summaries, report)

    n, p = summaries.get("naive"), summaries.get("pdd")
    if n and p:
        def red(key: str, q: str = "p90") -> float | None:
            a, b = n[key][q], p[key][q]
            return round(1 - b / a, 4) if a and b is not None else None

        report["ttft_p90_reduction_vs_naive"] = red("ttft_s")
        report["ttft_p50_reduction_vs_naive"] = red("ttft_s", "p50")
        report["tt2_p90_reduction_vs_naive"] = red("tt2_s")
        report["e2e_p90_reduction_vs_naive"] = red("e2e_s")
        report["wan_bytes_ratio_naive_over_pdd"] = (
            round(n["wan_bytes_total_metric"] / p["wan_bytes_total_metric"], 3)
            if p["wan_bytes_total_metric"] else None)
        report["wan_bytes_ratio_naive_over_pdd_resp"] = (
            round(n["wan_bytes_per_request_resp"] / p["wan_bytes_per_request_resp"], 3)
            if p["wan_bytes_per_request_resp"] else None)
        if "goodput_tt2_rps" in p:
            report["goodput_gain_vs_naive_tt2_slo"] = (round(p["goodput_tt2_rps"] / n["goodput_tt2_rps"] - 1, 4)
                                                      if n.get("goodput_tt2_rps") else None)
        if "goodput_rps" in p and n.get("goodput_rps"):
            report["goodput_gain_vs_naive"] = round(p["goodput_rps"] / n["goodput_rps"] - 1, 4)
        elif "goodput_rps" in p:
            report["goodput_gain_vs_naive"] = None
        cu = p["handoff_max_over_median"].get(HandoffMode.CATCH_UP)
        report["handoff_max_itl_over_median"] = cu["max"] if cu else None
        report["handoff_max_itl_over_median_p90"] = cu["p90"] if cu else None
        report["handoff_catch_up_requests"] = cu["n"] if cu else 0
        os_ = p["handoff_max_over_median"].get(HandoffMode.ONE_SHOT)
        report["handoff_one_shot_max_itl_over_median"] = os_["max"] if os_ else None
        report["rld_token_share"] = p["rld_token_share"]
        report["goals"] = goals(report)
        explain(report, summaries)
    report["elapsed_s"] = round(elapsed, 1)
    print(f"elapsed {elapsed:.0f}s; logs, configs and spans under {run_root}")
    return report


def goals(report: dict) -> dict[str, Any]:
    def check(key: str, target: float, higher: bool = True) -> dict:
        v = report.get(key)
        return {"value": v, "target": target, "met": (v is not None and (v >= target if higher else v <= target))}

    return {
        "ttft_p90_reduction_vs_naive": check("ttft_p90_reduction_vs_naive", 0.515),
        "wan_bytes_ratio_naive_over_pdd": check("wan_bytes_ratio_naive_over_pdd", 10.0),
        "goodput_gain_vs_naive": check("goodput_gain_vs_naive", 0.278),
        "handoff_max_itl_over_median": check("handoff_max_itl_over_median", 1.5, higher=False),
    }


def explain(report: dict, summaries: dict) -> None:
    missed = [k for k, g in report["goals"].items() if not g["met"]]
    print()
    print("Goals (issue 5):")
    for k, g in report["goals"].items():
        print(f"  {k:34s} {fmt(g['value'])}  target {'<=' if k.startswith('handoff') else '>='} {g['target']}"
              f"  {'MET' if g['met'] else 'MISSED'}")
    print()
    print("Per pipeline (PDD): " + "; ".join(
        f"{k}: n={v['n']} hit={v['hit_mean']} TTFT p50 {v['ttft_p50']}s 2nd-token p50/p90 {v['tt2_p50']}/{v['tt2_p90']}s "
        f"WAN {v['wan_mb_mean']} MB" for k, v in summaries.get("pdd", {}).get("by_pipeline", {}).items()))
    for name in ("naive", "colocated"):
        for k, v in summaries.get(name, {}).get("by_pipeline", {}).items():
            print(f"  {name}: {k} n={v['n']} TTFT p50 {v['ttft_p50']}s 2nd-token p50/p90 {v['tt2_p50']}/{v['tt2_p90']}s"
                  f" WAN {v['wan_mb_mean']} MB")
    gaps = summaries.get("pdd", {}).get("handoff_gaps_ms", [])
    if gaps:
        print("Handoffs (PDD): " + "; ".join(f"{g['mode']} rld={g['rld_tokens']} max {g['max_gap_ms']}ms at gap "
                                             f"{g['argmax']} / median {g['median_gap_ms']}ms" for g in gaps))
    if not missed:
        return
    print()
    print("Where the time goes (span files; mean / p90 ms per stage):")
    for name, s in summaries.items():
        prof = s.get("profile") or {}
        parts = [f"{k} {v['mean_ms']:.0f}/{v['p90_ms']:.0f}" for k, v in prof.items() if isinstance(v, dict)]
        print(f"  {name:9s} " + "; ".join(parts))
        if "wan_gbps_p50" in prof:
            print(f"  {'':9s} measured WAN transfer rate p50 {prof['wan_gbps_p50']} Gbit/s")


def print_table(summaries: dict, report: dict) -> None:
    print()
    if "workload_hit_mean" in report:
        print(f"Workload: mean prefix-reuse (hit) rate {report['workload_hit_mean']:.3f}; "
              f"{report['workload_share_hit_gt_95']:.0%} of requests > 95% hit; bins {report['workload_hit_bins']}; "
              f"mean prompt {report['workload_prompt_tokens_mean']:.0f} tokens")
    if "slo_tt2" in report:
        print(f"2nd-token SLO: time to 2nd token <= {report['slo_tt2']['tt2_s']:.3f} s and mean ITL <= "
              f"{report['slo_tt2']['mean_itl_ms']:.1f} ms ({report['slo_tt2']['rule']})")
    if "slo" in report:
        print(f"SLO: TTFT <= {report['slo']['ttft_s']:.3f} s and mean ITL <= {report['slo']['mean_itl_ms']:.1f} ms "
              f"({report['slo']['rule']})")
    cols = list(summaries)
    rows = [
        ("completed", lambda s: f"{s['completed']}/{s['requests']}"),
        ("makespan s", lambda s: fmt(s["makespan_s"], 1)),
    ]
    for label, key, scale in (("TTFT s", "ttft_s", 1), ("2nd token s", "tt2_s", 1), ("ITL ms", "itl_ms", 1),
                              ("mean ITL ms", "mean_itl_ms", 1), ("E2E s", "e2e_s", 1)):
        for q in ("p50", "p90", "p99"):
            rows.append((f"{label} {q}", lambda s, key=key, q=q: fmt(s[key][q], 3)))
    rows += [
        ("goodput req/s (SLO)", lambda s: fmt(s.get("goodput_rps"), 4)),
        ("SLO attainment", lambda s: fmt(s.get("slo_attainment"), 3)),
        ("goodput req/s (2nd-token SLO)", lambda s: fmt(s.get("goodput_tt2_rps"), 4)),
        ("2nd-token SLO attainment", lambda s: fmt(s.get("slo_tt2_attainment"), 3)),
        ("WAN MB/request (P metric)", lambda s: fmt(s["wan_bytes_per_request_metric"] / 1e6, 2)),
        ("WAN MB/request (resp)", lambda s: fmt(s["wan_bytes_per_request_resp"] / 1e6, 2)),
        ("MD hit rate mean", lambda s: fmt(s["md_hit_mean"], 3)),
        ("RLD token share", lambda s: fmt(s["rld_token_share"], 4)),
        ("pipeline mix", lambda s: " ".join(f"{k}:{v}" for k, v in sorted(s["pipeline_mix"].items()))),
        ("handoffs", lambda s: " ".join(f"{k}:{int(v)}" for k, v in sorted(s["handoffs"].items())) or "-"),
        (f"{HandoffMode.CATCH_UP} max/median ITL (max)",
         lambda s: fmt((s["handoff_max_over_median"].get(HandoffMode.CATCH_UP) or {}).get("max"), 2)),
        (f"{HandoffMode.ONE_SHOT} max/median ITL (max)",
         lambda s: fmt((s["handoff_max_over_median"].get(HandoffMode.ONE_SHOT) or {}).get("max"), 2)),
        ("tokens per SSE chunk", lambda s: fmt(s["tokens_per_chunk"], 3)),
        ("CPU cores: bench / others", lambda s: f"{s['cpu']['bench_cores']:.2f} / {s['cpu']['other_cores']:.2f}"),
    ]
    width = max(len(r[0]) for r in rows) + 2
    print(f"{'':{width}s}" + "".join(f" {c:>19s}" for c in cols))
    for label, fn in rows:
        print(f"{label:{width}s}" + "".join(f" {fn(summaries[c]):>19s}" for c in cols))


if __name__ == "__main__":
    sys.exit(main())
