"""Run summary with `vllm bench serve`'s keys and definitions, plus PDD's own figures under "pdd".

Definitions (as vLLM's benchmarks/serve.py): over successful requests, ``request_throughput`` =
completed / duration, ``output_throughput`` = output tokens / duration, TPOT per request =
(E2EL - TTFT) / (output tokens - 1) for requests of more than one token (the first token excluded),
ITL = every inter-token gap of every request pooled (per output position when the server says how
many tokens each chunk carried, else per chunk), ``request_goodput`` = requests meeting every
``--goodput`` SLO / duration (TPOT counted 0 for one-token requests). Percentiles are linear
(loadgen/stats.py, numpy's default, as vLLM). Empty series give None, not vLLM's 0.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from .client import RequestResult
from .stats import pct

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl"  # vLLM's default for generative models
DEFAULT_METRIC_PERCENTILES = "99"


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """`ttft:MS tpot:MS e2el:MS` -> {"ttft": seconds, ...}; unknown keys are an error."""
    out: dict[str, float] = {}
    for item in items or []:
        key, _, ms = item.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = -1.0
        if key not in ("ttft", "tpot", "e2el") or value < 0:
            raise ValueError(f"bad --goodput item {item!r}: use ttft:MS, tpot:MS or e2el:MS (MS >= 0)")
        out[key] = value / 1000.0
    return out


def parse_percentile_metrics(text: str) -> list[str]:
    """``--percentile-metrics ttft,tpot`` -> ["ttft", "tpot"]; unknown names are an error."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PERCENTILE_METRICS]
    if bad or not names:
        raise ValueError(f"bad --percentile-metrics {text!r}: choose from {','.join(PERCENTILE_METRICS)}")
    return names


def parse_metric_percentiles(text: str) -> list[float]:
    """``--metric-percentiles 50,90,99`` -> [50.0, 90.0, 99.0], each in [0, 100]."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"bad --metric-percentiles {text!r}: comma-separated numbers in [0, 100]")
    return values


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _stats(name: str, values: list[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    """mean/median/std and each percentile, in ms, under vLLM's key names."""
    ms = [v * 1000.0 for v in values]
    out: dict[str, float | None] = {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else None,
        f"median_{name}_ms": statistics.median(ms) if ms else None,
        f"std_{name}_ms": statistics.pstdev(ms) if ms else None,  # numpy's std: population
    }
    for p in percentiles:
        out[f"p{_p_word(p)}_{name}_ms"] = pct(ms, p)
    return out


def token_times(r: RequestResult) -> list[float]:
    """Arrival of each output position (ITL per token) or text chunk, seconds since the run began."""
    if r.ttft is None:
        return []
    t = r.start + r.ttft
    times = [t]
    for gap in r.itl:
        t += gap
        times.append(t)
    return times


def _peaks(ok: Sequence[RequestResult]) -> tuple[float, int]:
    """Peak output tokens in any one-second bucket, and the peak number of requests in flight."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start for r in ok)
    buckets: dict[int, int] = {}
    for r in ok:
        for t in token_times(r):
            buckets[int(t - t0)] = buckets.get(int(t - t0), 0) + 1
    events = sorted([(r.start, 1) for r in ok] + [(r.start + (r.e2el or 0.0), -1) for r in ok])
    level = peak = 0
    for _, delta in events:  # a departure sorts before an arrival at the same instant
        level += delta
        peak = max(peak, level)
    return float(max(buckets.values(), default=0)), peak


def summarize(results: Sequence[RequestResult], duration_s: float, slo: dict[str, float] | None = None,
              percentiles: Sequence[float] = (99.0,),
              percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl")) -> dict[str, Any]:
    """One measured run in `vllm bench serve`'s result keys; PDD's extras go under "pdd"."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    series = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.e2el for r in ok if r.e2el is not None],
    }
    good = [r for r in ok if _meets(r, slo)] if slo else []
    peak_tokens, peak_requests = _peaks(ok)
    summary: dict[str, Any] = {
        "duration": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur, "request_goodput": len(good) / dur if slo else None,
        "output_throughput": out_tokens / dur, "total_token_throughput": (in_tokens + out_tokens) / dur,
        "max_output_tokens_per_s": peak_tokens, "max_concurrent_requests": peak_requests,
    }
    for name in percentile_metrics:
        summary.update(_stats(name, series[name], percentiles))
    pdd: dict[str, Any] = {
        "itl_per_token": all(r.itl_per_token for r in ok) if ok else None,
        "spec_hit_rate_mean": statistics.fmean(r.cached_tokens / max(1, r.prompt_tokens) for r in ok) if ok else None,
    }
    ttfe = [r.ttfe for r in ok if r.ttfe is not None]
    pdd.update(_stats("ttfe", ttfe, percentiles))
    if slo:
        pdd["slo_ms"] = {k: v * 1000 for k, v in slo.items()}
        pdd["slo_attainment"] = len(good) / len(results) if results else None
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            kind = r.error.split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1
    if errors:
        pdd["errors"] = errors
    summary["pdd"] = pdd
    return summary


def _meets(r: RequestResult, slo: dict[str, float]) -> bool:
    vals = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2el": r.e2el}
    return all(vals[k] is not None and vals[k] <= lim for k, lim in slo.items())


def detailed(results: Sequence[RequestResult]) -> dict[str, Any]:
    """vLLM's per-request arrays (``--save-detailed``) plus PDD's per-request records."""
    return {
        "input_lens": [r.prompt_tokens for r in results], "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "start_times": [r.start for r in results], "errors": [r.error for r in results],
        "requests": [r.to_dict() for r in results],
    }


def print_table(summary: dict[str, Any], title: str = "pdd bench") -> None:
    """Readable table on the terminal (rich)."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in summary.items():
        if isinstance(v, float):
            t.add_row(k, f"{v:,.3f}" if math.isfinite(v) else str(v))
        elif isinstance(v, dict):
            t.add_row(k, ", ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in v.items()))
        else:
            t.add_row(k, str(v))
    Console(stderr=True).print(t)
