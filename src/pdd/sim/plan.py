"""`pdd plan --trace F`: which system to deploy for this traffic, with which instance split, at one budget.

For the colocated baseline, naive cross-DC and PDD it tries every way to spend the same hardware budget on the
scenario's chips (for the two-site systems the A:B mix too, for PDD also the prefill:relay split), ranks them
by the analytic stage capacity, searches the goodput of the best few on the trace, and reports TTFT, TT2 and
WAN bytes at the trace's own rate for each system's best. It repeats this for each ``max_tokens`` rule asked
for, since what clients send decides what the router can do (real clients rarely send the true length).

Why a separate module: the report and `pdd sim trace` judge fixed deployments; a plan chooses one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pdd.loadgen.trace import MaxTokensRule, TraceArrays, read_trace, trace_arrays

from .metrics import goodput, summary
from .report import Reproduction, np_clean
from .scenario import Scenario, load_yaml, set_path, stage_capacity

SYSTEMS = ("baseline", "naive", "pdd")


def deployments(scn: Scenario, name: str, budget: float) -> list[tuple[dict[str, int], dict[str, int]]]:
    """(chips, split) pairs for system ``name`` that spend at most ``budget``: every instance count of each role
    a chip type can hold, whole instances only."""
    s = scn.system(name)
    roles = s["roles"]
    per = {role: scn.instance_chips(name, role) for role in roles}
    price = {chip: scn.chips[chip].price for chip in set(roles.values())}
    budget -= s.get("leased_lines", 0) * scn.raw.get("leased_line_cost", 0.0)
    chip_p, chip_d = roles["prefill"], roles["decode"]
    out: list[tuple[dict[str, int], dict[str, int]]] = []
    if chip_p == chip_d and "relay" not in roles:  # one site, one chip: only the P:D split varies
        chips = int(budget // price[chip_p])
        for p in range(1, chips // per["prefill"]):
            d = (chips - p * per["prefill"]) // per["decode"]
            if d >= 1:
                out.append(({chip_p: chips}, {"prefill": p, "decode": d}))
        return out
    relay_per = per.get("relay", 0)
    for a_inst in range(1, int(budget // (price[chip_p] * per["prefill"])) + 1):
        relays = range(1, a_inst) if "relay" in roles else (0,)
        for r in relays:
            p = a_inst - r
            a_chips = p * per["prefill"] + r * relay_per
            left = budget - a_chips * price[chip_p]
            d = int(left // (price[chip_d] * per["decode"]))
            if d < 1 or p < 1:
                continue
            split = {"prefill": p, "decode": d, **({"relay": r} if r else {})}
            out.append(({chip_p: a_chips, chip_d: d * per["decode"]}, split))
    return out


def plan_system(data: dict[str, Any], trace: TraceArrays, name: str, budget: float, rate_scale: float,
                top: int, seed: int) -> dict[str, Any]:
    """The best deployment of one system on this trace: its split, goodput, and latency at the trace's rate."""
    scn = Scenario.from_dict(data)
    scored = []
    for chips, split in deployments(scn, name, budget):
        varied = set_path(set_path(data, f"systems.{name}.chips", chips), f"systems.{name}.split", split)
        rep = Reproduction(varied, seed=seed, trace=trace)
        inp = rep.scn.sim_input(name, split, 1.0, rep.wl, rep.unit, trace=trace)
        cap = stage_capacity(inp)
        scored.append((min(cap.values()), chips, split, rep, cap))
    if not scored:
        raise ValueError(f"system {name!r}: no deployment fits a budget of {budget:g}")
    scored.sort(key=lambda row: -row[0])
    best: dict[str, Any] = {"goodput_rps": -1.0}
    for _, chips, split, rep, cap in scored[:top]:
        g = goodput(lambda r, rep=rep, split=split: rep.run(name, split, r), rep.slo, hi=max(1e-3, min(cap.values())))
        if g > best["goodput_rps"]:
            best = {"goodput_rps": g, "chips": chips, "split": split, "rep": rep, "capacity": cap}
    rep = best.pop("rep")
    rate = rep.trace_rate * rate_scale
    row = summary(rep.run(name, best["split"], rate), rep.slo)
    cap = best.pop("capacity")
    return {**best, "hardware_cost": rep.scn.hardware_cost(name), "bottleneck": min(cap, key=cap.get),
            "stage_capacity_rps": cap, "candidates": len(scored), "rate_rps": rate,
            **{k: row[k] for k in ("mean_ttft_s", "p90_ttft_s", "mean_tt2_s", "p90_tt2_s", "slo_attainment",
                                   "wan_gbytes", "mean_hit_p", "mean_hit_md", "pipeline_mix")}}


def recommend(rows: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """The system to deploy (best goodput at the same budget; ties to the lower mean TTFT) and why."""
    name = max(rows, key=lambda k: (rows[k]["goodput_rps"], -rows[k]["mean_ttft_s"]))
    best = rows[name]
    others = "; ".join(f"{k} {r['goodput_rps']:.3g} req/s (bound by {r['bottleneck']})"
                       for k, r in rows.items() if k != name)
    why = (f"{name} serves {best['goodput_rps']:.3g} req/s within the SLO at split {best['split']} (bound by "
           f"{best['bottleneck']}); {others}")
    return name, why


def plot_plan(plans: dict[str, dict[str, Any]], path: Path) -> Path:
    """Goodput and TTFT per system, one group of bars per max_tokens rule, with each system's chosen split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_g, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(plans))
    for k, (rule, plan) in enumerate(plans.items()):
        rows = plan["systems"]
        xs = [i + k * width for i in range(len(rows))]
        bars = ax_g.bar(xs, [r["goodput_rps"] for r in rows.values()], width, label=f"max_tokens: {rule}")
        for bar, r in zip(bars, rows.values()):
            ax_g.annotate(",".join(f"{role[0]}{n}" for role, n in r["split"].items()),
                          (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
        ax_t.bar(xs, [r["mean_ttft_s"] for r in rows.values()], width, label=f"mean, {rule}")
        ax_t.scatter(xs, [r["p90_ttft_s"] for r in rows.values()], marker="_", s=200, color="k")
    names = list(next(iter(plans.values()))["systems"])
    for ax, title in ((ax_g, "goodput (req/s) at its best split"), (ax_t, "TTFT (s) at the trace's rate; - = p90")):
        ax.set_xticks([i + width * (len(plans) - 1) / 2 for i in range(len(names))], names)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--trace", required=True, help="Mooncake-format JSONL trace of your traffic")
    a("--scenario", default="report", help="deployment facts: YAML path or a packaged scenario name")
    a("--budget", type=float, default=None, help="hardware cost to spend (default: the scenario's pdd system)")
    a("--max-tokens", default="none,output", help="comma-separated rules to compare: none, output, or a cap N")
    a("--rate-scale", type=float, default=1.0, help="traffic as a multiple of the trace's own rate")
    a("--trace-block-tokens", type=int, default=512)
    a("--num-prompts", type=int, default=None, help="the first N requests (default: all)")
    a("--top", type=int, default=3, help="deployments per system whose goodput is searched (by capacity)")
    a("--seed", type=int, default=1)
    a("--plot", default="plan.png", help="PNG of goodput and TTFT per system ('none' to skip)")


def run(args: argparse.Namespace) -> int:
    try:
        rules = [MaxTokensRule.parse(r.strip()) for r in args.max_tokens.split(",") if r.strip()]
        if args.rate_scale <= 0 or args.top < 1:
            raise ValueError("--rate-scale must be > 0 and --top >= 1")
        reqs = read_trace(args.trace, args.num_prompts)
        data = load_yaml(args.scenario)
        scn = Scenario.from_dict(data)
        budget = args.budget if args.budget is not None else scn.hardware_cost("pdd")
        plans: dict[str, dict[str, Any]] = {}
        for rule in rules:
            trace = trace_arrays(reqs, rule, scn.model.max_context_tokens, args.trace_block_tokens)
            if len(trace) == 0:
                raise ValueError(f"every request is longer than the model's context ({scn.model.max_context_tokens})")
            rows = {name: plan_system(data, trace, name, budget, args.rate_scale, args.top, args.seed)
                    for name in SYSTEMS}
            choice, why = recommend(rows)
            plans[str(rule)] = {"deploy": choice, "why": why, "systems": rows,
                                "skipped_too_long": trace.skipped_too_long}
    except (ValueError, OSError) as exc:
        print(f"pdd plan: {exc}", file=sys.stderr)
        return 2
    for rule, plan in plans.items():
        print(f"max_tokens {rule}: deploy {plan['deploy']}. {plan['why']}")
        for name, r in plan["systems"].items():
            print(f"  {name:>9}: split {r['split']} chips {r['chips']} cost {r['hardware_cost']:.3g}; goodput "
                  f"{r['goodput_rps']:.3g} req/s; at {r['rate_rps']:.3g} req/s TTFT mean/p90 {r['mean_ttft_s']:.3g}/"
                  f"{r['p90_ttft_s']:.3g} s, TT2 {r['mean_tt2_s']:.3g}/{r['p90_tt2_s']:.3g} s, WAN {r['wan_gbytes']:.4g} GB")
    if args.plot != "none":
        print(f"plot: {plot_plan(plans, Path(args.plot))}")
    print(json.dumps(np_clean({"trace": Path(args.trace).name, "scenario": args.scenario, "budget": budget,
                               "rate_scale": args.rate_scale, "plans": plans})))
    return 0
