"""`pdd sim trace`: one production trace through the colocated baseline, naive cross-DC and PDD.

Why apart from report.py: the report's figures are read against its stated workload and a same-site anchor;
a trace is judged raw, at its own timestamps (times a rate scale), with hits from the simulated caches and
only what a live router can know (the replay's max_tokens rule).
"""

from __future__ import annotations

from typing import Any

from pdd.loadgen.trace import MaxTokensRule, TraceArrays, hit_tokens

from .metrics import summary
from .report import Reproduction

SYSTEMS = ("baseline", "naive", "pdd")


def _gain(a: float, b: float) -> float | None:
    """a over b, minus one; None where b's goodput is 0 (no ratio to give)."""
    return a / b - 1 if b > 0 else None


def trace_figures(data: dict[str, Any], trace: TraceArrays, rule: MaxTokensRule, rate_scale: float = 1.0,
                  seed: int = 1, systems: tuple[str, ...] = SYSTEMS) -> dict[str, Any]:
    """Each system at its best role split (by goodput on this trace), then all three at the trace's rate x
    ``rate_scale``: TTFT, goodput, WAN bytes, hits, the pipeline mix."""
    rep = Reproduction(data, seed=seed, trace=trace)
    goodput = {name: rep.best_goodput(name)[0] for name in systems}
    rate = rep.trace_rate * rate_scale
    results = {name: rep.run(name, rep.splits[name], rate, record_itl=True) for name in systems}
    rows = {name: summary(r, rep.slo) for name, r in results.items()}
    pdd, naive = rows.get("pdd", {}), rows.get("naive", {})
    out: dict[str, Any] = {
        "requests": len(trace), "skipped_too_long": trace.skipped_too_long, "block_tokens": trace.block_tokens,
        "max_tokens_rule": str(rule), "trace_rate_rps": rep.trace_rate, "rate_scale": rate_scale,
        "comparison_rate_rps": rate,
        "mean_hit_unbounded": float(hit_tokens(trace.chains, trace.prompt, trace.block_tokens).sum())
        / max(1.0, float(trace.prompt.sum())),
        "goodput_rps": goodput, "splits": rep.splits,
        "hardware_cost": {name: rep.scn.hardware_cost(name) for name in systems},
        "slo": vars(rep.slo),
    }
    if pdd:
        out.update({"mean_hit_p": pdd["mean_hit_p"], "mean_hit_md": pdd["mean_hit_md"],
                    "pdd_pipeline_mix": pdd["pipeline_mix"], "rld_token_share": pdd["rld_token_share"]})
    if pdd and naive:
        out.update({
            "ttft_mean_reduction_vs_naive": 1 - pdd["mean_ttft_s"] / naive["mean_ttft_s"],
            "ttft_p90_reduction_vs_naive": 1 - pdd["p90_ttft_s"] / naive["p90_ttft_s"],
            "goodput_gain_vs_naive": _gain(goodput["pdd"], goodput["naive"]),
            "wan_bytes_ratio_naive_over_pdd": results["naive"].wan_bytes / results["pdd"].wan_bytes
            if results["pdd"].wan_bytes else None,
        })
    if "pdd" in goodput and "baseline" in goodput:
        out["goodput_gain_vs_baseline"] = _gain(goodput["pdd"], goodput["baseline"])
    keys = ("completed", "failed", "mean_ttft_s", "p50_ttft_s", "p90_ttft_s", "p99_ttft_s", "mean_tpot_s",
            "p90_tpot_s", "slo_attainment", "wan_gbytes", "mean_hit_p", "mean_hit_md", "p_cache_evictions", "md_cache_evictions")
    out["systems"] = {name: {k: row[k] for k in keys} for name, row in rows.items()}
    return out
