"""`pdd bench`: load-test any OpenAI-compatible endpoint (ours, vLLM, SGLang) with `vllm bench serve`'s
flags and result keys, so scripts written for one carry over to the other.

Without ``--model`` the first model of ``GET /v1/models`` is used, as vLLM does. The result JSON has
vLLM's keys (``completed``, ``request_throughput``, ``mean_ttft_ms``, ``p99_itl_ms``, ``request_goodput``
...; see loadgen/report.py for the definitions); PDD's own figures (pipeline mix, WAN bytes, relay
token share from /metrics, TTFE, SLO attainment) sit under ``"pdd"``. Differences from vLLM, kept on
purpose: the default endpoint is chat completions, ``--num-prompts`` defaults to 100, and an
``agentic`` dataset (multi-turn sessions with a skewed prefix-hit mix) is there beside ``random`` and
``sharegpt``.

Replaying a production trace: ``--dataset-name mooncake_trace --dataset-path FILE`` sends the first
``--num-prompts`` requests of a Mooncake JSONL trace (timestamp, input_length, output_length, hash_ids) at
their recorded times, relative to the first request replayed, times ``--trace-time-scale`` (default 1; 0.5
replays twice as fast, 0 sends all at once). ``--request-rate`` and ``--burstiness`` are errors with a trace
(the trace sets the arrivals), and so is ``--num-warmups`` > 0 (warm-up requests would fill the prefix cache
whose reuse the trace measures); ``--max-concurrency`` still caps the requests in flight, delaying sends
past their recorded time. Prompts go to ``/v1/completions`` as token ids (the default endpoint with a
trace; a chat endpoint is an error): one fixed block of the served model's own ordinary tokens per hash id
(the pool: the distinct ids ``POST /tokenize`` gives for a fixed text, without special tokens; a server
without /tokenize is an error), so equal hash ids are identical token blocks and the trace's prefix reuse
reaches the server's prefix caches. ``--trace-block-tokens B`` (default 512, Mooncake's block) scales each
512-token block to B tokens, for models with a small context; a trace's partial last block keeps its
fraction. B need not be a multiple of the engine's KV block: a shared prefix then hits only its whole engine
blocks (rounded down). ``--max-tokens`` says what the client sends: ``none`` (default) sends no max_tokens,
as chat clients do, and closes the stream after the trace's output length (the server cancels the rest; the
request counts as a success of exactly that many tokens); ``output`` sends the trace's output length; a
number N sends N and reads min(N, output length). A line's own ``max_tokens`` field (Mooncake's traces have
none) is sent under every rule, capped by N (loadgen/trace.py `MaxTokensRule`).
``ignore_eos`` is always sent. A prompt that leaves no room for one output token in the model's context
(``max_model_len`` of /v1/models, else of /tokenize) is skipped and counted, never truncated; one that fits
but whose sent max_tokens does not is sent and fails with the server's context error. A bad trace
line is an error naming the line and the field (exit 2), before any request is sent. The result's
``pdd.trace`` block names the file, the requests replayed, the time scale, the block size (and whether
blocks were scaled), the max_tokens rule, the skipped count and the context used; ``request_rate`` is
``"trace"``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from .trace import TRACE_BLOCK_TOKENS, MaxTokensRule
from .workload import AgenticConfig, HitDistribution, RequestSpec, agentic_sessions, random_specs, sharegpt_specs

TRACE_DATASET = "mooncake_trace"
DATASETS = ("random", "sharegpt", "agentic", TRACE_DATASET)
TRACE_RATE = "trace"  # the result's request_rate (and file name) of a replay: the trace sets the arrivals
TRACE_FLAGS = {"trace_time_scale": "--trace-time-scale", "trace_block_tokens": "--trace-block-tokens",
               "max_tokens": "--max-tokens"}
BACKEND_ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a("--backend", choices=tuple(BACKEND_ENDPOINTS), default=None,
      help="vLLM's backend names: openai/vllm -> /v1/completions, openai-chat -> /v1/chat/completions")
    a("--endpoint", default=None, help="API path (default: from --backend, else /v1/chat/completions)")
    a("--model", default=None, help="model to request (default: the first one GET /v1/models lists)")
    a("--served-model-name", default=None, help="name sent as the request's model (default: --model)")
    a("--api-key", default=None)
    a("--label", default="pdd", help="name of this setup (legend of the plots, result file name)")
    a("--dataset-name", "--dataset", dest="dataset_name", choices=DATASETS, default="random")
    a("--dataset-path", default=None, help="ShareGPT JSON file, or the trace of --dataset-name mooncake_trace")
    a("--trace-time-scale", type=float, default=None,
      help="mooncake_trace: send at recorded time x this (default 1; 0: all at once)")
    a("--trace-block-tokens", type=int, default=None,
      help=f"mooncake_trace: tokens per trace block (default {TRACE_BLOCK_TOKENS}; smaller for small models)")
    a("--max-tokens", default=None, metavar="none|output|N",
      help="mooncake_trace: max_tokens sent (default none: left out, stream closed at the trace's output length)")
    a("--num-prompts", type=int, default=100)
    a("--input-len", type=int, default=None, help="sets --random-input-len and --context-tokens")
    a("--output-len", type=int, default=None, help="sets --random-output-len and --output-tokens")
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0)
    a("--random-prefix-len", type=int, default=0)
    a("--context-tokens", type=int, default=2048, help="agentic: prompt length target")
    a("--output-tokens", type=int, default=128, help="agentic: output length")
    a("--turns-per-session", type=int, default=8)
    a("--hit-weights", type=float, nargs=6, default=None,
      help="agentic: weights of hit bins 0-90,90-95,95-97,97-98,98-99,99-100 %% (default: report-like)")
    a("--anomalous-fraction", type=float, default=0.0)
    a("--request-rate", type=float, default=None, help="requests/s (default inf: all at once)")
    a("--burstiness", type=float, default=None,
      help="gamma shape of arrival gaps (default 1 = Poisson, < 1 burstier)")
    a("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    a("--num-warmups", "--warmup", dest="warmup", type=int, default=0,
      help="requests sent first and left out of the results")
    a("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 (ms)")
    a("--percentile-metrics", default="ttft,tpot,itl", help="comma-separated: ttft,tpot,itl,e2el")
    a("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    a("--seed", type=int, default=0)
    a("--timeout", type=float, default=600.0)
    a("--metrics-url", default=None, help="Prometheus endpoint (default: BASE_URL/metrics; 'none' to skip)")
    a("--save-result", action="store_true", help="write the result JSON (vLLM's file name unless --result-filename)")
    a("--save-detailed", action="store_true", help="with the per-request arrays and records")
    a("--result-dir", default=None)
    a("--result-filename", default=None)
    a("--save-json", default=None, metavar="PATH",
      help="PDD shorthand: --save-result --save-detailed --result-filename PATH")
    a("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="extra keys for the result JSON")
    a("--plot", default=None, help="PNG path: TTFT, TPOT and ITL CDFs (this run plus every --compare file)")
    a("--compare", nargs="*", default=[], help="earlier detailed result files to draw on the same plots")
    a("--disable-tqdm", "--no-progress", dest="no_progress", action="store_true")


def make_specs(args: argparse.Namespace) -> list[RequestSpec]:
    n = args.num_prompts + args.warmup
    if args.dataset_name == "random":
        return random_specs(n, args.random_input_len, args.random_output_len, args.random_range_ratio,
                            args.random_prefix_len, args.seed)
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path")
        return sharegpt_specs(args.dataset_path, n, args.seed, max_output=args.output_tokens * 16)
    hits = HitDistribution(weights=tuple(args.hit_weights)) if args.hit_weights else HitDistribution()
    cfg = AgenticConfig(num_requests=n, context_tokens=args.context_tokens, output_tokens=args.output_tokens,
                        hits=hits, turns_per_session=args.turns_per_session,
                        anomalous_fraction=args.anomalous_fraction, seed=args.seed)
    return agentic_sessions(cfg)


def _default_backend(args: argparse.Namespace) -> str:
    """Chat completions, as PDD's default; completions for a trace replay (its prompts are token ids)."""
    return "openai" if args.dataset_name == TRACE_DATASET else "openai-chat"


def _check_trace(args: argparse.Namespace) -> None:
    """A replay's flags: the trace sets arrivals, so rate flags and warm-ups are errors; fills the defaults."""
    if not args.dataset_path:
        raise ValueError(f"--dataset-name {TRACE_DATASET} needs --dataset-path (a Mooncake JSONL trace)")
    for name, flag in (("request_rate", "--request-rate"), ("burstiness", "--burstiness")):
        if getattr(args, name) is not None:
            raise ValueError(f"{flag} cannot be used with --dataset-name {TRACE_DATASET}: the trace's timestamps "
                             "set the arrivals (scale them with --trace-time-scale)")
    if args.warmup:
        raise ValueError(f"--num-warmups must be 0 with --dataset-name {TRACE_DATASET}: warm-up requests would "
                         "fill the prefix cache whose reuse the trace measures")
    endpoint = args.endpoint or BACKEND_ENDPOINTS[args.backend or _default_backend(args)]
    if endpoint.endswith("/chat/completions"):
        flag = "--endpoint" if args.endpoint else "--backend"
        raise ValueError(f"{flag}: a trace replay sends token ids, which only /v1/completions takes (got {endpoint})")
    scale = 1.0 if args.trace_time_scale is None else args.trace_time_scale
    if not (math.isfinite(scale) and scale >= 0):
        raise ValueError(f"--trace-time-scale must be a finite number >= 0 (got {scale})")
    block = TRACE_BLOCK_TOKENS if args.trace_block_tokens is None else args.trace_block_tokens
    if block < 1:
        raise ValueError(f"--trace-block-tokens must be >= 1 (got {block})")
    args.trace_time_scale, args.trace_block_tokens = scale, block
    args.max_tokens_rule = MaxTokensRule.parse(args.max_tokens)
    args.endpoint, args.request_rate, args.burstiness = endpoint, math.inf, 1.0


def _check(args: argparse.Namespace) -> None:
    """Flag errors before any request is sent; each names its flag."""
    if args.dataset_name == TRACE_DATASET:
        _check_trace(args)
    else:
        given = [flag for name, flag in TRACE_FLAGS.items() if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{given[0]} applies to --dataset-name {TRACE_DATASET} only")
        args.request_rate = math.inf if args.request_rate is None else args.request_rate
        args.burstiness = 1.0 if args.burstiness is None else args.burstiness
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1 (got {args.num_prompts})")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1 (got {args.max_concurrency})")
    if args.input_len is not None:
        args.random_input_len = args.context_tokens = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.output_tokens = args.output_len
    if args.save_json:
        args.save_result, args.save_detailed, args.result_filename = True, True, args.save_json
    for item in args.metadata or []:
        if "=" not in item:
            raise ValueError(f"bad --metadata item {item!r}: use KEY=VALUE")


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns the result dict (vLLM's keys, "pdd", and the detailed arrays)."""
    from .replay import prepare_replay, trace_summary
    from .report import detailed, parse_goodput, parse_metric_percentiles, parse_percentile_metrics, summarize
    from .runner import LoadConfig, first_model, run_load
    from .scrape import pdd_figures, scrape
    from .trace import read_trace

    _check(args)
    slo = parse_goodput(args.goodput)
    metrics = parse_percentile_metrics(args.percentile_metrics)
    percentiles = parse_metric_percentiles(args.metric_percentiles)
    replaying = args.dataset_name == TRACE_DATASET
    trace = read_trace(args.dataset_path, args.num_prompts) if replaying else None  # bad lines: before any request
    specs = [] if replaying else make_specs(args)
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or BACKEND_ENDPOINTS[args.backend or _default_backend(args)]
    model_id = args.model or await first_model(base, args.api_key)
    metrics_url = None if args.metrics_url == "none" else (args.metrics_url or base + "/metrics")
    cfg = LoadConfig(url=base + endpoint, model=args.served_model_name or model_id, request_rate=args.request_rate,
                     burstiness=args.burstiness, max_concurrency=args.max_concurrency, warmup=args.warmup,
                     seed=args.seed, timeout_s=args.timeout, api_key=args.api_key)
    plan = None
    if trace is not None:
        plan = await prepare_replay(base, cfg.model, trace, args.max_tokens_rule, args.trace_block_tokens,
                                    args.trace_time_scale, args.api_key)
        specs = list(plan.specs)
    before = await scrape(metrics_url) if metrics_url else None
    progress, task = None, None
    if not args.no_progress:
        from rich.progress import Progress

        progress = Progress(transient=True)
        progress.start()
        task = progress.add_task("requests", total=len(specs) - args.warmup)
    try:
        results, duration = await run_load(specs, cfg, on_done=(lambda r: progress.advance(task)) if progress else None,
                                           arrivals=plan.arrivals if plan else None)
    finally:
        if progress:
            progress.stop()
    after = await scrape(metrics_url) if metrics_url else None
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend or _default_backend(args),
        "label": args.label, "model_id": model_id, "num_prompts": args.num_prompts, "request_rate": _rate(args),
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
    }
    for item in args.metadata or []:
        key, _, value = item.partition("=")
        result[key.strip()] = value.strip()
    result.update(summarize(results, duration, slo, percentiles, metrics))
    result["pdd"].update(pdd_figures(before, after, result["completed"]))
    result["pdd"].update({"url": cfg.url, "dataset_name": args.dataset_name, "warmup": args.warmup,
                          "seed": args.seed})
    if plan is not None:
        result["pdd"]["trace"] = trace_summary(args.dataset_path, plan, args.max_tokens_rule, args.trace_block_tokens,
                                               args.trace_time_scale)
    result.update(detailed(results))
    return result


def _rate(args: argparse.Namespace) -> float | str:
    """The result's request_rate: the flag's value, "inf", or "trace" for a replay."""
    if args.dataset_name == TRACE_DATASET:
        return TRACE_RATE
    return args.request_rate if math.isfinite(args.request_rate) else "inf"


def result_path(args: argparse.Namespace, model_id: str, date: str) -> Path:
    """vLLM's default name: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json, in --result-dir."""
    rate = TRACE_RATE if args.dataset_name == TRACE_DATASET else args.request_rate
    name = args.result_filename or (
        f"{args.label}-{rate}qps"
        f"{f'-concurrency{args.max_concurrency}' if args.max_concurrency is not None else ''}"
        f"-{model_id.split('/')[-1]}-{date}.json")
    return Path(args.result_dir) / name if args.result_dir else Path(name)


DETAIL_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "errors", "requests")


def latency_series(result: dict[str, Any]) -> dict[str, list[float]]:
    """TTFT, TPOT and ITL values (seconds) of a detailed result: PDD's records, else vLLM's arrays."""
    records = [r for r in result.get("requests", []) if r.get("success")]
    if records:
        return {"ttft": [r["ttft"] for r in records], "tpot": [r["tpot"] for r in records if r.get("tpot")],
                "itl": [x for r in records for x in r.get("itl", [])]}
    return {"ttft": [t for t in result.get("ttfts", []) if t], "tpot": [],
            "itl": [x for itl in result.get("itls", []) or [] for x in itl]}


def run(args: argparse.Namespace) -> int:
    from .report import print_table

    try:
        result = asyncio.run(bench(args))
    except ValueError as exc:
        print(f"pdd bench: {exc}", file=sys.stderr)
        return 2
    head = {k: v for k, v in result.items() if k not in DETAIL_KEYS}
    print_table(head, title=f"pdd bench: {args.label}")
    if args.save_result:
        path = result_path(args, result["model_id"], result["date"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result if args.save_detailed else head, indent=1))
    if args.plot:
        from .plots import plot_latency_cdfs

        runs = {args.label: latency_series(result)}
        for other_path in args.compare:
            other = json.loads(Path(other_path).read_text())
            runs[other.get("label") or Path(other_path).stem] = latency_series(other)
        plot_latency_cdfs(runs, args.plot, title=f"pdd bench: {result['model_id']}")
    print(json.dumps(head, default=str))
    return 0 if result["completed"] else 1
