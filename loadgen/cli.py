"""`pdd bench`: load-test any OpenAI-compatible endpoint (ours, vLLM, SGLang) and report like vLLM."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

from .workload import AgenticConfig, HitDistribution, RequestSpec, agentic_sessions, random_specs, sharegpt_specs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--base-url", default="http://127.0.0.1:8000")
    a("--endpoint", default="/v1/chat/completions", help="/v1/chat/completions or /v1/completions")
    a("--model", default="default")
    a("--api-key", default=None)
    a("--label", default="pdd", help="name of this setup (legend of the TTFT CDF)")
    a("--dataset", choices=("agentic", "random", "sharegpt"), default="agentic")
    a("--dataset-path", default=None, help="ShareGPT JSON file (--dataset sharegpt)")
    a("--num-prompts", type=int, default=100)
    a("--context-tokens", type=int, default=2048, help="agentic: prompt length target")
    a("--output-tokens", type=int, default=128, help="agentic: output length")
    a("--turns-per-session", type=int, default=8)
    a("--hit-weights", type=float, nargs=6, default=None,
      help="agentic: weights of hit bins 0-90,90-95,95-97,97-98,98-99,99-100 %% (default: report-like)")
    a("--anomalous-fraction", type=float, default=0.0)
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=128)
    a("--random-range-ratio", type=float, default=0.0)
    a("--random-prefix-len", type=int, default=0)
    a("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    a("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    a("--max-concurrency", type=int, default=None, help="closed loop: at most this many in flight")
    a("--warmup", type=int, default=0, help="requests sent first and left out of the results")
    a("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLO, e.g. ttft:2000 tpot:50")
    a("--seed", type=int, default=0)
    a("--timeout", type=float, default=600.0)
    a("--metrics-url", default=None, help="Prometheus endpoint (default: BASE_URL/metrics; 'none' to skip)")
    a("--save-json", default=None, help="write summary + per-request records here")
    a("--plot", default=None, help="TTFT CDF PNG path (this run plus every --compare file)")
    a("--compare", nargs="*", default=[], help="earlier --save-json files to draw on the same CDF")
    a("--no-progress", action="store_true")


def make_specs(args: argparse.Namespace) -> list[RequestSpec]:
    n = args.num_prompts + args.warmup
    if args.dataset == "random":
        return random_specs(n, args.random_input_len, args.random_output_len, args.random_range_ratio,
                            args.random_prefix_len, args.seed)
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise SystemExit("--dataset sharegpt needs --dataset-path")
        return sharegpt_specs(args.dataset_path, n, args.seed, max_output=args.output_tokens * 16)
    hits = HitDistribution(weights=tuple(args.hit_weights)) if args.hit_weights else HitDistribution()
    cfg = AgenticConfig(num_requests=n, context_tokens=args.context_tokens, output_tokens=args.output_tokens,
                        hits=hits, turns_per_session=args.turns_per_session,
                        anomalous_fraction=args.anomalous_fraction, seed=args.seed)
    return agentic_sessions(cfg)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from .report import parse_goodput, summarize
    from .runner import LoadConfig, run_load
    from .scrape import pdd_figures, scrape

    slo = parse_goodput(args.goodput)
    specs = make_specs(args)
    base = args.base_url.rstrip("/")
    metrics_url = None if args.metrics_url == "none" else (args.metrics_url or base + "/metrics")
    cfg = LoadConfig(url=base + args.endpoint, model=args.model, request_rate=args.request_rate,
                     burstiness=args.burstiness, max_concurrency=args.max_concurrency, warmup=args.warmup,
                     seed=args.seed, timeout_s=args.timeout, api_key=args.api_key)
    before = await scrape(metrics_url) if metrics_url else None
    progress, task = None, None
    if not args.no_progress:
        from rich.progress import Progress

        progress = Progress(transient=True)
        progress.start()
        task = progress.add_task("requests", total=len(specs) - args.warmup)
    try:
        results, duration = await run_load(
            specs, cfg, on_done=(lambda r: progress.advance(task)) if progress else None)
    finally:
        if progress:
            progress.stop()
    after = await scrape(metrics_url) if metrics_url else None
    summary = summarize(results, duration, slo)
    summary["pdd"] = pdd_figures(before, after, summary["completed"])
    summary["setup"] = {
        "label": args.label, "url": cfg.url, "model": args.model, "dataset": args.dataset,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "warmup": args.warmup,
        "seed": args.seed,
    }
    summary["requests"] = [r.to_dict() for r in results]
    return summary


def run(args: argparse.Namespace) -> int:
    from .report import print_table

    try:
        summary = asyncio.run(bench(args))
    except ValueError as exc:
        print(f"pdd bench: {exc}", file=sys.stderr)
        return 2
    head = {k: v for k, v in summary.items() if k != "requests"}
    print_table({k: v for k, v in head.items() if k not in ("setup",)}, title=f"pdd bench: {args.label}")
    if args.save_json:
        Path(args.save_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save_json).write_text(json.dumps(summary, indent=1))
    if args.plot:
        from .plots import plot_ttft_cdf

        curves = {args.label: [r["ttft"] for r in summary["requests"] if r["success"]]}
        for path in args.compare:
            other = json.loads(Path(path).read_text())
            label = other.get("setup", {}).get("label", Path(path).stem)
            curves[label] = [r["ttft"] for r in other.get("requests", []) if r.get("success")]
        plot_ttft_cdf(curves, args.plot)
    print(json.dumps(head, default=str))
    return 0 if summary["completed"] else 1
