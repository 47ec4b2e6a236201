"""Summaries of a run: latency percentiles, SLO attainment, goodput search, WAN use, BCR."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .event_loop import P_MD, P_RLD_MD, PIPELINE_NAMES, SimResult


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 5.0
    tpot_s: float = 0.05
    attainment: float = 0.9


def pct(x: np.ndarray, q: float) -> float:
    x = x[~np.isnan(x)]
    return float(np.percentile(x, q)) if x.size else float("nan")


def weighted_pct(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """Token-weighted percentile (decoder ITL segments carry a token count each)."""
    if values.size == 0:
        return float("nan")
    order = np.argsort(values)
    cw = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cw, q / 100 * cw[-1])])


def attainment(r: SimResult, slo: Slo) -> float:
    good = r.ok & (r.ttft <= slo.ttft_s) & (r.tpot <= slo.tpot_s)
    return float(good.sum()) / max(1, len(r.ok))


def summary(r: SimResult, slo: Slo) -> dict[str, float | int | dict]:
    """The numbers `pdd sim run` prints, in `pdd bench`'s vocabulary."""
    total_out = float(r.output[r.ok].sum())
    mix = {PIPELINE_NAMES[k]: int((r.pipeline[r.ok] == k).sum()) for k in PIPELINE_NAMES}
    return {
        "completed": r.completed, "failed": r.failed,
        "request_throughput": r.completed / r.makespan if r.makespan else 0.0,
        "output_throughput": total_out / r.makespan if r.makespan else 0.0,
        "mean_ttft_s": float(np.nanmean(r.ttft)) if r.completed else float("nan"),
        "p50_ttft_s": pct(r.ttft, 50), "p90_ttft_s": pct(r.ttft, 90), "p99_ttft_s": pct(r.ttft, 99),
        "mean_tt2_s": float(np.nanmean(r.tt2)) if np.isfinite(r.tt2).any() else float("nan"),
        "p90_tt2_s": pct(r.tt2, 90),
        "mean_tpot_s": float(np.nanmean(r.tpot)) if r.completed else float("nan"),
        "p90_tpot_s": pct(r.tpot, 90),
        "p50_itl_s": weighted_pct(r.itl_values, r.itl_weights, 50),
        "p99_itl_s": weighted_pct(r.itl_values, r.itl_weights, 99),
        "max_itl_s": float(r.itl_values.max()) if r.itl_values.size else float("nan"),
        "slo_attainment": attainment(r, slo),
        "wan_gbytes": r.wan_bytes / 1e9, "wan_gbps_mean": r.wan_bandwidth_gbps,
        "wan_bytes_ratio_vs_full_kv": r.wan_bytes / r.wan_bytes_naive if r.wan_bytes_naive else float("nan"),
        "rld_token_share": r.tokens_relay / max(1.0, r.tokens_relay + r.tokens_main),
        "pipeline_mix": mix,
        **hit_rates(r),
    }


def hit_rates(r: SimResult) -> dict[str, float]:
    """Token-weighted prefix hits: at P over every request, at MD over the requests routed to MD (0 where no
    decode-side cache, NaN where none went there)."""
    to_md = (r.pipeline == P_MD) | (r.pipeline == P_RLD_MD)
    md_prompt = float(r.prompt[to_md].sum())
    return {"mean_hit_p": float(r.p_cached.sum()) / max(1.0, float(r.prompt.sum())),
            "mean_hit_md": float(r.md_cached[to_md].sum()) / md_prompt if md_prompt else float("nan"),
            "p_cache_evictions": r.p_evictions, "md_cache_evictions": r.md_evictions}


def goodput(run_at: Callable[[float], SimResult], slo: Slo, hi: float, iters: int = 9,
            max_doublings: int = 20) -> float:
    """Largest offered rate (req/s) whose SLO attainment stays >= slo.attainment (bisection).

    A finite request set can meet a loose SLO at any rate (all arrivals at once still pass); after
    ``max_doublings`` passing doublings the last passing rate is returned as a lower bound.
    """
    if attainment(run_at(hi * 1e-3), slo) < slo.attainment:
        return 0.0
    lo = hi * 1e-3
    for _ in range(max_doublings):
        if attainment(run_at(hi), slo) < slo.attainment:
            break
        lo, hi = hi, hi * 2
    else:
        return lo
    for _ in range(iters):
        mid = (lo + hi) / 2
        if attainment(run_at(mid), slo) >= slo.attainment:
            lo = mid
        else:
            hi = mid
    return lo
