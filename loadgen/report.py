"""Run summary in `vllm bench serve`'s vocabulary, plus goodput, JSON and a readable table."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .client import RequestResult


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """`ttft:MS tpot:MS e2el:MS` -> {"ttft": seconds, ...}; unknown keys are an error."""
    out: dict[str, float] = {}
    for item in items or []:
        key, _, ms = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not ms:
            raise ValueError(f"bad --goodput item {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        out[key] = float(ms) / 1000.0
    return out


def _stats(prefix: str, values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"mean_{prefix}_ms": None, f"median_{prefix}_ms": None, f"p90_{prefix}_ms": None,
                f"p99_{prefix}_ms": None}
    a = np.asarray(values) * 1000.0
    return {f"mean_{prefix}_ms": float(a.mean()), f"median_{prefix}_ms": float(np.median(a)),
            f"p90_{prefix}_ms": float(np.percentile(a, 90)), f"p99_{prefix}_ms": float(np.percentile(a, 99))}


def summarize(results: Sequence[RequestResult], duration_s: float, slo: dict[str, float] | None = None) -> dict[str, Any]:
    """Completed/failed, throughput, latency percentiles and goodput over one measured run."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "request_throughput": len(ok) / dur, "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "spec_hit_rate_mean": float(np.mean([r.cached_tokens / max(1, r.prompt_tokens) for r in ok])) if ok else None,
    }
    summary.update(_stats("ttft", [r.ttft for r in ok if r.ttft is not None]))
    summary.update(_stats("tpot", [r.tpot for r in ok if r.tpot is not None]))
    summary.update(_stats("itl", [x for r in ok for x in r.itl]))
    summary.update(_stats("e2el", [r.e2el for r in ok if r.e2el is not None]))
    if slo:
        good = [r for r in ok if _meets(r, slo)]
        summary["goodput"] = len(good) / dur
        summary["slo"] = {k: v * 1000 for k, v in slo.items()}
        summary["slo_attainment"] = len(good) / len(results) if results else None
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error.split(":")[0]] = errors.get(r.error.split(":")[0], 0) + 1
    if errors:
        summary["errors"] = errors
    return summary


def _meets(r: RequestResult, slo: dict[str, float]) -> bool:
    vals = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2el": r.e2el}
    return all(vals[k] is not None and vals[k] <= lim for k, lim in slo.items())


def print_table(summary: dict[str, Any], title: str = "pdd bench") -> None:
    """Readable table on the terminal (rich)."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in summary.items():
        if isinstance(v, float):
            t.add_row(k, f"{v:,.3f}")
        elif isinstance(v, dict):
            t.add_row(k, ", ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in v.items()))
        else:
            t.add_row(k, str(v))
    Console(stderr=True).print(t)
