"""Soak test: a whole PDD system under mixed load with random client aborts, checked for leaks.

Issue #8 acceptance: "10-minute soak with random client aborts: after drain every instance reports
100% KV blocks free; RSS growth <= 10% after warm-up".

What runs (real processes, launch/local_cluster.py): nats-server, router, prefill (P), relay (RLD)
and main decode (MD) on a tiny seeded model (or ``--model PATH``); the WAN transport is zmq behind
the in-process shaper (``--wan-rate``/``--wan-delay``). The router chooses every pipeline itself; the
policy thresholds below are scaled to the tiny model's 512 B/token KV so that the mix of prompts
(short, shared-prefix, long fresh, very long with short output; completions and chat) makes P-MD,
P-RLD-MD and P-RLD all occur (the router's ``pdd:pipeline_requests_total`` counters are reported).

Load: ``--workers`` concurrent clients (aiohttp), each sending one request after another, streaming
or not, for ``--seconds`` (or until ``--requests`` were sent). ``--abort-share`` of the valid requests
are closed by the client at a random point: streams after a random number of streamed tokens
(loadgen/client.py: the chunks' token counts, else one per content chunk, which is what PDD's
router gives today; 0 = right after the first event), non-streaming ones after a random delay; a
stream that ends before its abort point counts as completed. ``--bad-share`` are malformed/invalid requests (they
must be answered 4xx).
A request without a complete answer ``--hang-s`` seconds after it was sent counts as hung.

Memory: after the warm-up (default: 10% of the run, at most 60 s) every process's RSS is the
baseline; it is sampled every ``--sample-interval`` s. At the end the load stops, in-flight requests
finish, the cluster drains (``LocalCluster.wait_idle``) and every instance reports the KV blocks that
are neither free nor reclaimable cache ("leaked": must be 0) and its RSS growth over the baseline.
An engine that does not answer that health read has no count: it is listed as unanswered and fails
the run (never "0 leaked").

Run: python -m pdd.bench.soak --seconds 600      (exit code 0 only when ok)
Last stdout line: one JSON object with every figure; "ok" is true only if every engine answered and
leaked no block, no process grew more than --max-growth % (default 2), no request hung and no process died.

Why one module: it is one benchmark, read top to bottom (configuration, request mix, outcomes,
samplers, report); the parts share its tally and arguments. The client, the metrics parser and the
cluster start/stop it uses are the shared ones (loadgen/client.py, loadgen/scrape.py,
launch/local_cluster.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd.shared.pipelines import ROUTABLE
from pdd.shared.protocol import WAN_RATE_KEY
from pdd.shared.roles import Role

# Policy scaled to the tiny model (2 layers x 2 KV heads x 16 dims, fp32: 512 B/token): a prompt whose
# missing KV would take over 3 ms on the WAN (at MD's measured rate, which the 5 ms shaper delay keeps
# well under 1 Gbit/s) goes through the relay; >= 640-token prompts with short output are "anomalous"
# and finish on the relay (P-RLD).
TINY_POLICY = {"wan_masking_threshold_s": 0.003, "anomalous_min_prompt_tokens": 640, "default_wan_gbps": 0.2,
               "handoff_final_gap": 2}
PIPELINES = ROUTABLE
NO_INFO = "no-info"  # a stop string ended the answer in the HTTP layer: it carries no pipeline info


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdd.bench.soak", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seconds", type=float, default=600.0, help="load duration (warm-up included)")
    p.add_argument("--requests", type=int, default=0,
                   help="stop sending after this many requests even before --seconds (0: no limit)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds (default: min(60, 10%% of run))")
    p.add_argument("--workers", type=int, default=8, help="concurrent client workers")
    p.add_argument("--abort-share", type=float, default=0.2, help="share of requests the client aborts")
    p.add_argument("--bad-share", type=float, default=0.05, help="share of malformed/invalid requests")
    p.add_argument("--stream-share", type=float, default=0.6, help="share of (valid) requests that stream")
    p.add_argument("--sample-interval", type=float, default=5.0, help="RSS sampling period, seconds")
    p.add_argument("--max-growth", type=float, default=2.0, help="allowed RSS growth after warm-up, percent")
    p.add_argument("--hang-s", type=float, default=90.0, help="a request without an answer by then is hung")
    p.add_argument("--request-timeout", type=float, default=60.0, help="router request deadline, seconds")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="how long to wait for idle engines")
    p.add_argument("--model", default=None, help="model path (default: a tiny seeded checkpoint)")
    p.add_argument("--max-context", type=int, default=1024, help="tiny model's max_position_embeddings")
    p.add_argument("--kv-memory-mb", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads per instance")
    p.add_argument("--fast", default="zmq", help="in-site transport (P -> RLD)")
    p.add_argument("--wan-rate", default="1gbit", help="shaped WAN rate ('' = unshaped)")
    p.add_argument("--wan-delay", default="5ms")
    p.add_argument("--wan-jitter", default="0ms")
    p.add_argument("--policy", default=None, help="policy JSON (default: thresholds scaled to the tiny model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default=None, help="folder for config and logs (default: a fresh temp folder)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    return p


def cluster_config(args: argparse.Namespace, model_path: str) -> dict:
    from pdd.launch.local_cluster import two_site_layout

    wan_opts: dict[str, Any] = {"streams": 2}
    if args.wan_rate or args.wan_delay:
        shape: dict[str, Any] = {"delay": args.wan_delay or "0ms", "jitter": args.wan_jitter or "0ms",
                                 "seed": args.seed}
        if args.wan_rate:
            shape["rate"] = args.wan_rate
        wan_opts["shape"] = shape
    policy = json.loads(args.policy) if args.policy else (dict(TINY_POLICY) if args.model is None else {})
    return {
        "model": {"path": model_path, "kv_memory_mb": args.kv_memory_mb, "block_size": 16,
                  "max_num_seqs": args.max_num_seqs, "threads": args.threads},
        **two_site_layout(),
        "transports": {"fast": {"name": args.fast, "options": {}}, "wan": {"name": "zmq", "options": wan_opts}},
        "router": {"request_timeout_s": args.request_timeout},
        "policy": policy,
        "service": {"heartbeat_ms": 500, "missed_heartbeats": 6, "drain_timeout_s": 5},
        "telemetry": {"exporter": "none", "log_format": "json"},
    }


# ---------------------------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------------------------
@dataclass
class Spec:
    kind: str  # short | shared | long | anomalous | chat | text | bad:<what>
    path: str
    body: Any  # dict, or raw bytes for malformed bodies
    stream: bool = False
    abort_after: int | None = None  # streaming: close after this many streamed tokens
    abort_delay: float | None = None  # non-streaming: close after this many seconds
    method: str = "POST"


class Workload:
    """Seeded request mix; token-id prompts give exact lengths, chat/text go through the tokenizer."""

    def __init__(self, args: argparse.Namespace, vocab: int, max_context: int, seed: int):
        self.args = args
        self.rng = random.Random(seed)
        self.valid = 0  # valid requests drawn so far (the abort schedule)
        self.lo, self.hi = 5, max(16, min(vocab, 32000) - 4)
        self.max_context = max_context
        self.prefixes = [self.ids(self.rng.randrange(192, 321)) for _ in range(6)]
        from pdd.loadgen.workload import WORDS

        self.words = WORDS
        self.systems = [" ".join(self.rng.choice(WORDS) for _ in range(self.rng.randrange(60, 140)))
                        for _ in range(4)]

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.lo, self.hi) for _ in range(n)]

    def text(self, n: int) -> str:
        return " ".join(self.rng.choice(self.words) for _ in range(n))

    def sampling(self, max_tokens: int) -> dict:
        r = self.rng
        body: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": r.random() < 0.7}
        if r.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=0.8, top_p=0.95, seed=r.randrange(1 << 30))
        return body

    def next(self) -> Spec:
        r = self.rng
        if r.random() < self.args.bad_share:
            return self.bad()
        kind = r.choices(("short", "shared", "long", "anomalous", "chat", "text"),
                         weights=(20, 30, 15, 10, 15, 10))[0]
        path = "/v1/completions"
        cap = self.max_context
        if kind == "short":
            body = {"prompt": self.ids(r.randrange(8, 65)), **self.sampling(r.randrange(16, 97))}
        elif kind == "shared":
            prompt = r.choice(self.prefixes) + self.ids(r.randrange(4, 25))
            body = {"prompt": prompt, **self.sampling(r.randrange(16, 129))}
        elif kind == "long":
            n = min(r.randrange(360, 601), cap - 200)
            body = {"prompt": self.ids(n), **self.sampling(r.randrange(32, 161))}
        elif kind == "anomalous":
            n = min(r.randrange(660, 801), cap - 64)
            body = {"prompt": self.ids(n), **self.sampling(r.randrange(8, 49))}
        elif kind == "chat":
            path = "/v1/chat/completions"
            msgs = [{"role": "system", "content": r.choice(self.systems)},
                    {"role": "user", "content": self.text(r.randrange(4, 40))}]
            if r.random() < 0.3:
                msgs += [{"role": "assistant", "content": self.text(r.randrange(4, 30))},
                         {"role": "user", "content": self.text(r.randrange(4, 20))}]
            body = {"messages": msgs, **self.sampling(r.randrange(16, 129))}
            if r.random() < 0.2:  # a stop string ends some early: the router closes the backend itself
                body["stop"] = [r.choice(self.words[:20])]
        else:
            body = {"prompt": self.text(r.randrange(8, 80)), **self.sampling(r.randrange(16, 97))}
            if r.random() < 0.2:
                body["stop"] = [" " + r.choice(self.words[:20])]
        stream = r.random() < self.args.stream_share
        body["stream"] = stream
        if stream and r.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
        spec = Spec(kind, path, body, stream)
        # exactly abort_share of the valid requests, spread evenly; where and how each aborts is random
        n, share = self.valid, self.args.abort_share
        self.valid += 1
        if int((n + 1) * share) > int(n * share):
            if stream:
                spec.abort_after = r.randrange(0, max(2, body["max_tokens"]))
                # the abort point is a token count: each chunk says how many it carries (under load the router
                # sends tokens that arrived together as one chunk)
                body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
            else:
                spec.abort_delay = r.uniform(0.01, 1.5)
        return spec

    def bad(self) -> Spec:
        r = self.rng
        ok_prompt = self.ids(16)
        cases: list[tuple[str, str, Any]] = [
            ("invalid_json", "/v1/completions", b'{"prompt": [1, 2,'),
            ("empty_body", "/v1/completions", b""),
            ("no_prompt", "/v1/completions", {"max_tokens": 8}),
            ("wrong_model", "/v1/completions", {"model": "no-such-model", "prompt": ok_prompt, "max_tokens": 8}),
            ("context_exceeded", "/v1/completions", {"prompt": ok_prompt, "max_tokens": self.max_context * 4}),
            ("prompt_too_long", "/v1/completions", {"prompt": self.ids(self.max_context + 8), "max_tokens": 4}),
            ("token_out_of_vocab", "/v1/completions", {"prompt": [1, 2, 10**7], "max_tokens": 8}),
            ("n_2", "/v1/completions", {"prompt": ok_prompt, "max_tokens": 8, "n": 2}),
            ("negative_max_tokens", "/v1/completions", {"prompt": ok_prompt, "max_tokens": -3}),
            ("bad_temperature", "/v1/completions", {"prompt": ok_prompt, "max_tokens": 8, "temperature": -1}),
            ("empty_messages", "/v1/chat/completions", {"messages": [], "max_tokens": 8}),
            ("bad_role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}),
            ("not_an_object", "/v1/chat/completions", b"[1, 2, 3]"),
        ]
        what, path, body = r.choice(cases)
        if isinstance(body, dict) and r.random() < 0.5:
            body["stream"] = True
        return Spec(f"bad:{what}", path, body, bool(isinstance(body, dict) and body.get("stream")))


# ---------------------------------------------------------------------------------------------
# client
# ---------------------------------------------------------------------------------------------
@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    aborted: int = 0
    abort_planned: int = 0  # valid requests the client meant to abort (the rest finished first)
    hung: int = 0
    bad_rejected: int = 0  # malformed requests answered 4xx, as they should be
    errored: Counter = field(default_factory=Counter)  # valid requests: "<status>[:<code>]" -> count
    bad_unexpected: Counter = field(default_factory=Counter)  # malformed requests not answered 4xx
    pipelines: Counter = field(default_factory=Counter)  # completed requests, from the answer's "pdd" info
    kinds: Counter = field(default_factory=Counter)
    hung_examples: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"sent": self.sent, "completed": self.completed, "aborted": self.aborted,
                "abort_planned": self.abort_planned,
                "errored": sum(self.errored.values()), "errored_by_status": dict(self.errored),
                "hung": self.hung, "bad_rejected": self.bad_rejected,
                "bad_unexpected": dict(self.bad_unexpected), "client_pipelines": dict(self.pipelines),
                "kinds": dict(self.kinds)}


async def _one(session: Any, base: str, spec: Spec, args: argparse.Namespace, tally: Tally) -> str:
    """One request; returns its outcome label and updates the tally's details."""
    import aiohttp

    from pdd.loadgen.client import stream

    bad = spec.kind.startswith("bad:")
    s = await stream(session, base + spec.path, spec.body, method=spec.method, abort_after_tokens=spec.abort_after,
                     abort_after_s=spec.abort_delay, timeout_s=args.hang_s)
    if s.aborted:
        return "aborted"
    if s.timed_out:
        return "hung"
    if s.exception is not None:
        if isinstance(s.exception, aiohttp.ClientError):
            return f"error:conn:{type(s.exception).__name__}"
        if isinstance(s.exception, (ValueError, asyncio.TimeoutError)):  # an unparsable answer, a connect timeout
            return f"error:client:{type(s.exception).__name__}"
        raise s.exception
    if s.status != 200:
        if bad and 400 <= s.status < 500:
            return "bad_rejected"
        return f"error:{s.status}" + (f":{s.error_code}" if s.error_code else "")
    if bad:
        return f"error:{s.status}:accepted"
    if not spec.stream:
        tally.pipelines[s.info.get("pipeline", NO_INFO)] += 1
        return "completed"
    if s.error is not None:
        return f"error:stream:{(s.error if isinstance(s.error, dict) else {}).get('code', '?')}"
    if s.done and s.finish_reason:
        tally.pipelines[s.info.get("pipeline", NO_INFO)] += 1
        return "completed"
    return "error:stream:truncated"


async def run_load(base: str, args: argparse.Namespace, workload: Workload, stop_at: float,
                   tally: Tally) -> None:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # one connection per request
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def worker(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i)
            while time.monotonic() < stop_at and not (args.requests and tally.sent >= args.requests):
                spec = workload.next()
                tally.sent += 1
                tally.kinds[spec.kind.split(":")[0]] += 1
                tally.abort_planned += spec.abort_after is not None or spec.abort_delay is not None
                sent_at = time.time()
                outcome = await _one(session, base, spec, args, tally)
                if outcome == "completed":
                    tally.completed += 1
                elif outcome == "aborted":
                    tally.aborted += 1
                elif outcome == "hung":
                    tally.hung += 1
                    if len(tally.hung_examples) < 5:
                        tally.hung_examples.append({"kind": spec.kind, "stream": spec.stream,
                                                    "sent_unix": round(sent_at, 3)})
                elif outcome == "bad_rejected":
                    tally.bad_rejected += 1
                elif spec.kind.startswith("bad:"):
                    tally.bad_unexpected[f"{spec.kind[4:]}:{outcome[6:]}"] += 1
                else:
                    tally.errored[outcome[6:]] += 1
                await asyncio.sleep(rng.uniform(0, 0.05))

        await asyncio.gather(*(worker(i) for i in range(args.workers)))


# ---------------------------------------------------------------------------------------------
# memory and fleet state
# ---------------------------------------------------------------------------------------------
class Sampler:
    """Samples every member's RSS on a thread; notes deaths."""

    def __init__(self, cluster: Any, interval: float):
        self.cluster = cluster
        self.interval = interval
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.died: dict[str, int | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self.t0 = time.monotonic()

    def sample(self) -> dict[str, int]:
        rss = {}
        for iid, m in self.cluster.members.items():
            if m.alive:
                rss[iid] = m.rss_bytes()
            elif iid not in self.died:
                self.died[iid] = m.proc.returncode
        self.samples.append((time.monotonic() - self.t0, rss))
        return rss

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def router_pipelines(base: str) -> tuple[dict[str, int], dict[str, int]]:
    """pdd:pipeline_requests_total from the router's /metrics: by pipeline, and by "pipeline: reason"."""
    from pdd.loadgen.scrape import samples_of, scrape_sync

    samples = scrape_sync(base + "/metrics")
    if samples is None:
        return {}, {}
    out: Counter = Counter()
    reasons: Counter = Counter()
    for labels, value in samples_of(samples, "pdd:pipeline_requests_total"):
        out[labels.get("pipeline", "?")] += int(value)
        reasons[f'{labels.get("pipeline", "?")}: {labels.get("reason", "?")}'] += int(value)
    return {p: out.get(p, 0) for p in (*PIPELINES, *sorted(set(out) - set(PIPELINES)))}, dict(reasons)


def announced_summaries(nats_url: str, wait_s: float = 1.2) -> dict[str, dict]:
    """Each instance's latest heartbeat cache_summary (MD's measured WAN rate drives the pipeline mix)."""
    from pdd.shared.protocol import Announce, decode

    async def listen() -> dict[str, dict]:
        import nats

        seen: dict[str, dict] = {}
        nc = await nats.connect(nats_url)
        try:
            async def on_msg(msg: Any) -> None:
                try:
                    a = decode(msg.data, expect=Announce)
                except Exception:  # noqa: BLE001
                    return
                seen[a.instance_id] = dict(a.cache_summary)  # type: ignore[union-attr]
            await nc.subscribe("pdd.announce", cb=on_msg)
            await asyncio.sleep(wait_s)
        finally:
            await nc.close()
        return seen

    try:
        return asyncio.run(listen())
    except Exception as exc:  # noqa: BLE001 - informative only
        return {"error": {"error": str(exc)}}


def leak_accounting(roles: dict[str, str], reading: dict[str, int]) -> dict[str, Any]:
    """Per engine instance (``roles``: instance id -> role), the KV blocks it still holds once idle.

    ``reading`` is ``LocalCluster.wait_idle``'s: a negative value means the instance did not answer its
    health read, and a live engine missing from it was not alive to ask. Either way nobody counted its
    blocks, so it is a failure ("unanswered"), never "0 leaked". Returns ``leaked`` (id -> blocks, None
    where unanswered), ``unanswered`` (sorted ids) and ``ok`` (every engine answered and holds 0)."""
    engines = [iid for iid, role in roles.items() if role != Role.ROUTER]
    leaked = {iid: reading[iid] if reading.get(iid, -1) >= 0 else None for iid in engines}
    unanswered = sorted(iid for iid, v in leaked.items() if v is None)
    return {"leaked": leaked, "unanswered": unanswered,
            "ok": not unanswered and all(v == 0 for v in leaked.values())}


def instance_state(cluster: Any) -> dict[str, dict]:
    """Per live instance: in-flight requests and (engines) running/waiting sequences."""
    out = {}
    for iid, m in cluster.members.items():
        if not m.alive:
            continue
        h = m.health()
        eng = h.get("engine") or {}
        out[iid] = {"in_flight": h.get("in_flight"), "running": eng.get("running"), "waiting": eng.get("waiting"),
                    "free_blocks": eng.get("free_blocks"), "total_blocks": eng.get("total_blocks"),
                    "evictable_blocks": eng.get("evictable_blocks")}
    return out


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def _mib(n: int | None) -> str:
    return "-" if not n else f"{n / 2**20:8.1f}"


def run(args: argparse.Namespace) -> dict:
    """Start the system, soak it, drain it; returns the result dict (see module docstring)."""
    from pdd.launch.local_cluster import LocalCluster

    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="pdd-soak-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.model:
        model_path = args.model
    else:
        from pdd.engine.torch_backend.tiny import build_tiny_checkpoint

        model_path = build_tiny_checkpoint(run_dir / "model", seed=args.seed,
                                           max_position_embeddings=args.max_context)
    model_cfg = json.loads((Path(model_path) / "config.json").read_text()) \
        if (Path(model_path) / "config.json").exists() else {}
    vocab = int(model_cfg.get("vocab_size", 384))
    warmup = args.warmup if args.warmup is not None else min(60.0, 0.1 * args.seconds)
    cluster = LocalCluster(run_dir / "run", cluster_config(args, model_path))
    result: dict[str, Any] = {"ok": False, "run_dir": str(run_dir), "seconds": args.seconds, "warmup_s": warmup,
                              "workers": args.workers, "abort_share": args.abort_share}
    tally = Tally()
    try:
        startup = cluster.start(args.startup_timeout)
        log(f"system up in {startup:.1f}s at {cluster.base_url}; logs in {cluster.run_dir}")
        result["startup_s"] = round(startup, 1)
        max_context = min(args.max_context, int(model_cfg.get("max_position_embeddings", args.max_context)))
        workload = Workload(args, vocab, max_context, args.seed)
        sampler = Sampler(cluster, args.sample_interval)
        sampler.start()
        t0 = time.monotonic()
        baseline: dict[str, int] = {}

        def take_baseline() -> None:
            baseline.update(sampler.sample())
            log(f"warm-up over ({tally.sent} requests sent); RSS baseline "
                + ", ".join(f"{k}={v / 2**20:.0f}MiB" for k, v in baseline.items()))

        def progress() -> None:
            log(f"t={time.monotonic() - t0:5.0f}s sent={tally.sent} completed={tally.completed} "
                f"aborted={tally.aborted} errored={sum(tally.errored.values())} hung={tally.hung}")

        async def main_load() -> None:
            loop = asyncio.get_running_loop()
            loop.call_later(warmup, take_baseline)
            handles = [loop.call_later(t, progress) for t in range(30, int(args.seconds) + 1, 30)]
            try:
                await run_load(cluster.base_url, args, workload, t0 + args.seconds, tally)
            finally:
                for h in handles:
                    h.cancel()
            if not baseline:
                take_baseline()

        asyncio.run(main_load())
        load_s = time.monotonic() - t0
        log(f"load stopped after {load_s:.1f}s (in-flight requests finished); draining")
        t_drain = time.monotonic()
        accounting = leak_accounting({iid: m.role for iid, m in cluster.members.items()},
                                     cluster.wait_idle(args.drain_timeout))
        result["drain_s"] = round(time.monotonic() - t_drain, 1)
        time.sleep(0.5)  # let freed Python/torch memory settle before the last sample
        final = sampler.sample()
        sampler.stop()
        states = instance_state(cluster)
        pipelines, reasons = router_pipelines(cluster.base_url)
        md_rate = {iid: s.get(WAN_RATE_KEY) for iid, s in
                   announced_summaries(cluster.nats.url if cluster.nats else "").items() if WAN_RATE_KEY in s}
        died = dict(sampler.died)
        for iid, m in cluster.members.items():
            if not m.alive and iid not in died:
                died[iid] = m.proc.returncode
        peak: dict[str, int] = {}
        for _, rss in sampler.samples:
            for iid, v in rss.items():
                peak[iid] = max(peak.get(iid, 0), v)
        instances = {}
        for iid, m in cluster.members.items():
            base_rss, end_rss = baseline.get(iid, 0), final.get(iid, 0)
            growth = (end_rss - base_rss) / base_rss * 100 if base_rss and end_rss else None
            instances[iid] = {"role": m.role, "alive": m.alive, "leaked_blocks": accounting["leaked"].get(iid),
                              "rss_warm_bytes": base_rss, "rss_end_bytes": end_rss, "rss_max_bytes": peak.get(iid, 0),
                              "rss_growth_pct": None if growth is None else round(growth, 2),
                              **{f"after_drain_{k}": v for k, v in states.get(iid, {}).items() if v is not None}}
        growth_ok = all(i["rss_growth_pct"] is not None and i["rss_growth_pct"] <= args.max_growth
                        for i in instances.values())
        result.update({
            "load_s": round(load_s, 1),
            "requests": tally.as_dict(),
            "router_pipelines": pipelines,
            "router_pipeline_reasons": reasons,
            "md_wan_bytes_per_s": md_rate,
            "instances": instances,
            "died": died,
            "hung_examples": tally.hung_examples,
            "rss_samples": len(sampler.samples),
            "health_unanswered": accounting["unanswered"],
            "checks": {"no_leaks": accounting["ok"], "health_answered": not accounting["unanswered"],
                       "rss_growth_ok": growth_ok, "no_hung": tally.hung == 0, "none_died": not died},
        })
        result["ok"] = all(result["checks"].values())
        return result
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["requests"] = tally.as_dict()
        exc.soak_result = result  # type: ignore[attr-defined]  (main() still reports what is known)
        raise
    finally:
        t_stop = time.monotonic()
        # drained and logged service_stopped is a clean stop; interpreter teardown is not waited for
        result["stopped_cleanly"] = cluster.stop(timeout=30.0, until_exit=False)
        result["stop_s"] = round(time.monotonic() - t_stop, 1)


def print_report(result: dict) -> None:
    req = result.get("requests", {})
    print(f"\nPDD soak: {result.get('load_s', 0):.0f}s of load ({result.get('warmup_s', 0):.0f}s warm-up), "
          f"{result.get('workers')} workers, abort share {result.get('abort_share')}; "
          f"startup {result.get('startup_s', '?')}s, drain {result.get('drain_s', '?')}s")
    print(f"requests: sent {req.get('sent', 0)}  completed {req.get('completed', 0)}  "
          f"aborted {req.get('aborted', 0)} (of {req.get('abort_planned', 0)} planned)  errored {req.get('errored', 0)} {req.get('errored_by_status', {})}  "
          f"hung {req.get('hung', 0)}  bad rejected {req.get('bad_rejected', 0)}  "
          f"bad unexpected {req.get('bad_unexpected', {})}")
    print(f"pipelines (router): {result.get('router_pipelines', {})}   "
          f"(completed, client view): {req.get('client_pipelines', {})}")
    for reason, n in sorted((result.get("router_pipeline_reasons") or {}).items()):
        print(f"  {n:7d}  {reason}")
    print(f"MD measured WAN rate (B/s): {result.get('md_wan_bytes_per_s')}")
    print(f"\n{'instance':<10} {'role':<8} {'alive':<5} {'leaked':>6} {'RSS warm':>9} {'RSS end':>9} "
          f"{'growth%':>8} {'RSS max':>9}   (MiB)")
    for iid, i in (result.get("instances") or {}).items():
        leaked = "-" if i["role"] == Role.ROUTER else "no answer" if i["leaked_blocks"] is None \
            else str(i["leaked_blocks"])
        growth = "-" if i["rss_growth_pct"] is None else f"{i['rss_growth_pct']:+.2f}"
        print(f"{iid:<10} {i['role']:<8} {i['alive']!s:<5} {leaked:>6} {_mib(i['rss_warm_bytes']):>9} "
              f"{_mib(i['rss_end_bytes']):>9} {growth:>8} {_mib(i['rss_max_bytes']):>9}")
    if result.get("died"):
        print(f"DIED: {result['died']}")
    if result.get("health_unanswered"):
        print(f"no health answer (blocks not counted, a failure): {result['health_unanswered']}")
    if result.get("stopped_cleanly") and not all(result["stopped_cleanly"].values()):
        print(f"did not stop gracefully: {[k for k, v in result['stopped_cleanly'].items() if not v]}")
    if result.get("hung_examples"):
        print(f"hung examples: {result['hung_examples']}")
    print(f"\nchecks: {result.get('checks')}  ->  {'OK' if result.get('ok') else 'NOT OK'}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = run(args)
    except Exception as exc:  # noqa: BLE001 - still one JSON line and a non-zero exit
        result = getattr(exc, "soak_result", None) or {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print_report(result)
    print(json.dumps(result), flush=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
