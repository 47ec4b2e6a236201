"""`pdd sim`: run a scenario, reproduce the report, calibrate against `pdd bench` runs."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sim_command", metavar="ACTION")
    run = sub.add_parser("run", help="simulate one system of a scenario at one offered rate")
    run.add_argument("--scenario", default="report", help="YAML path or the name of a packaged scenario (pdd/scenarios: report, small)")
    run.add_argument("--system", default="pdd")
    run.add_argument("--rate", type=float, required=True, help="offered requests/s")
    run.add_argument("--num-requests", type=int, default=None)
    run.add_argument("--split", default=None, help="role counts, e.g. prefill=4,relay=1,decode=4")
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--save-bench-json", default=None, help="write the run in `pdd bench` JSON schema")

    rep = sub.add_parser("report", help="the report's figures vs simulated, with sensitivity")
    rep.add_argument("--scenario", default="report")
    rep.add_argument("--num-requests", type=int, default=None)
    rep.add_argument("--sensitivity-requests", type=int, default=600)
    rep.add_argument("--no-sensitivity", action="store_true")
    rep.add_argument("--out-dir", default="sim_out", help="where the PNGs and JSON go")
    rep.add_argument("--seed", type=int, default=1)

    tr = sub.add_parser("trace", help="a production trace (Mooncake JSONL) through baseline, naive and PDD")
    tr.add_argument("trace", help="trace file: one JSON object per line (timestamp, input_length, output_length, "
                                  "hash_ids; optional session_id, max_tokens)")
    tr.add_argument("--scenario", default="report", help="deployment: YAML path or a packaged scenario name")
    tr.add_argument("--rate-scale", type=float, default=1.0,
                    help="offered rate as a multiple of the trace's own (2 = timestamps halved)")
    tr.add_argument("--max-tokens", default="none",
                    help="what clients send: none (default: the router knows only the model's context), output "
                         "(the trace's output length, an oracle), or a cap N")
    tr.add_argument("--trace-block-tokens", type=int, default=512,
                    help="tokens per trace block (512 as recorded; smaller to scale prompts down)")
    tr.add_argument("--num-prompts", type=int, default=None, help="the first N requests (default: all)")
    tr.add_argument("--seed", type=int, default=1)
    tr.add_argument("--out", default=None, help="also write the JSON result to this file")

    cal = sub.add_parser("calibrate", help="fit cost-model coefficients to bench JSON; predict another run")
    cal.add_argument("--fit", nargs="+", required=True, help="pdd bench JSON files to fit on")
    cal.add_argument("--predict", required=True, help="hold-out pdd bench JSON to predict")
    cal.add_argument("--n-prefill", type=int, default=1)
    cal.add_argument("--n-decode", type=int, default=1)
    cal.add_argument("--transfer-s", type=float, default=0.0, help="fixed KV hand-over time inside TTFT")
    cal.add_argument("--first-token-from-prefill", action="store_true",
                     help="the first token is streamed from the prefill instance (PDD), not the decoder")
    cal.add_argument("--service-noise", action="store_true",
                     help="keep the measured spread of prefill service time (p_noise) so TTFT has its tail")
    cal.add_argument("--ttft-field", choices=("ttft", "ttfe"), default="ttft",
                     help="per-request TTFT column: first visible text (ttft) or first stream event (ttfe)")


def run(args: argparse.Namespace) -> int:
    action = getattr(args, "sim_command", None)
    if action == "run":
        return _run(args)
    if action == "report":
        return _report(args)
    if action == "calibrate":
        return _calibrate(args)
    if action == "trace":
        return _trace(args)
    print("usage: pdd sim {run,report,trace,calibrate} ...", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    from .calibrate import to_bench_json
    from .event_loop import simulate
    from .metrics import Slo, summary
    from .report import np_clean
    from .scenario import Scenario, load_yaml, unit_poisson

    data = load_yaml(args.scenario)
    scn = Scenario.from_dict(data)
    split = ({k: int(v) for k, v in (kv.split("=") for kv in args.split.split(","))} if args.split
             else scn.splits(args.system)[0])
    wl = scn.arrays(args.num_requests)
    inp = scn.sim_input(args.system, split, args.rate, wl, unit_poisson(len(wl), args.seed), args.seed)
    res = simulate(inp)
    out = summary(res, Slo(**data.get("slo", {})))
    for k, v in out.items():
        print(f"{k:>28}: {v}")
    if args.save_bench_json:
        Path(args.save_bench_json).write_text(json.dumps(to_bench_json(inp, res)))
    print(json.dumps(np_clean({"system": args.system, "split": split, "rate": args.rate, **out})))
    return 0


def _report(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from pdd.loadgen.plots import plot_ttft_cdf

    from .bathtub import BathtubInputs, bathtub, plot_bathtub
    from .report import FIGURES, Reproduction, fmt, np_clean, sensitivity, within
    from .scenario import load_yaml

    console = Console(stderr=False, width=160)
    data = load_yaml(args.scenario)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rep = Reproduction(data, n=args.num_requests, seed=args.seed)
    figs = rep.figures()
    targets = data.get("targets", {})

    table = Table(title="PDD report figures: report vs simulated (from the stated setup, nothing fitted)")
    for col in ("figure", "report", "simulated", "within ±15%"):
        table.add_column(col)
    for f in FIGURES:
        t = targets.get(f)
        table.add_row(f, fmt(t), fmt(figs[f]), "yes" if t is not None and within(t, figs[f]) else "no")
    console.print(table)
    d = figs["details"]
    console.print(f"comparison load: {d['comparison_rate_rps']:.2f} req/s; best splits: {d['splits']}")
    console.print(f"goodput (req/s): {json.dumps(np_clean(d['goodput_rps']))}; "
                  f"vs naive cross-DC: {fmt(d['goodput_gain_vs_naive'])}; cost/token change: "
                  f"{fmt(d['cost_per_token_change'])}; BCR: {json.dumps(np_clean(d['bcr']))}")
    console.print(f"TTFT p50/p90/p99 (s, with the same-site offset of {d['ttft_offset_s']:.2f} s): "
                  f"{json.dumps(np_clean(d['ttft_p50_p90_p99_s']))}; P50 TTFT reduction "
                  f"{fmt(d['p50_ttft_reduction'])}; mean reduction without the offset "
                  f"{fmt(d['ttft_reduction_without_offset'])}; PDD mix {d['pdd_pipeline_mix']}")
    console.print(f"hardware cost change for B at +20%..+30%: {fmt(d['hw_cost_change_b_price_range'])}")

    plot_ttft_cdf({k: r.ttft for k, r in rep._results.items()}, out_dir / "sim_ttft_cdf.png",
                  title=f"Simulated TTFT at {d['comparison_rate_rps']:.2f} req/s")
    scn = rep.scn
    hits = np.linspace(0.0, 1.0, 41)
    roles = scn.system("pdd")["roles"]  # the bathtub prices PDD's own prefill and decode instances
    chip_p, chip_d = roles["prefill"], roles["decode"]
    per_p, per_d = scn.instance_chips("pdd", "prefill"), scn.instance_chips("pdd", "decode")
    pre, dec = scn.cost_model(chip_p, per_p), scn.cost_model(chip_d, per_d)
    curves = {}
    for disc in (0.10, 0.25):
        prices = {"input": 0.60, "cached_input": 0.60 * disc, "output": 2.50}
        b_in = BathtubInputs(pre, dec, scn.chips[chip_p].price * per_p, scn.chips[chip_d].price * per_d,
                             scn.workload.context_tokens, scn.workload.output_tokens,
                             decode_batch=dec.kv_capacity_tokens / (scn.workload.context_tokens + scn.workload.output_tokens))
        curves[f"cached input billed at {disc:.0%}"] = bathtub(b_in, hits, prices)
    png = plot_bathtub(hits, curves, out_dir / "bathtub.png")
    console.print(f"plots: {out_dir / 'sim_ttft_cdf.png'}, {png}")

    rows = []
    if not args.no_sensitivity:
        with _sweep_progress() as progress:
            rows = sensitivity(data, rep, args.sensitivity_requests, progress=progress)
        st = Table(title=f"Sensitivity (each assumption moved alone; {args.sensitivity_requests} requests)")
        st.add_column("parameter", no_wrap=True)
        st.add_column("value", no_wrap=True)
        for f in FIGURES:
            st.add_column(f.replace("_", " "), no_wrap=True)
        base = Reproduction(data, n=args.sensitivity_requests, seed=args.seed, splits=rep.splits).figures()
        st.add_row("(nominal)", "", *(fmt(base[f]) for f in FIGURES))
        for row in rows:
            st.add_row(row["param"], _shown(row["value"]), *(fmt(row[f]) for f in FIGURES))
        console.print(st)
    result = {f: figs[f] for f in FIGURES}
    (out_dir / "report.json").write_text(json.dumps(np_clean({**figs, "sensitivity": rows}), indent=1))
    print(json.dumps(np_clean(result)))
    return 0


def _trace(args: argparse.Namespace) -> int:
    from pdd.loadgen.trace import MaxTokensRule, read_trace, trace_arrays

    from .report import np_clean
    from .scenario import Scenario, load_yaml
    from .trace_report import trace_figures

    if args.rate_scale <= 0:
        print(f"pdd sim trace: --rate-scale must be > 0 (got {args.rate_scale})", file=sys.stderr)
        return 2
    if args.trace_block_tokens < 1:
        print(f"pdd sim trace: --trace-block-tokens must be >= 1 (got {args.trace_block_tokens})", file=sys.stderr)
        return 2
    try:
        rule = MaxTokensRule.parse(args.max_tokens)
        reqs = read_trace(args.trace, args.num_prompts)
        data = load_yaml(args.scenario)
        scn = Scenario.from_dict(data)
    except (ValueError, OSError) as exc:
        print(f"pdd sim trace: {exc}", file=sys.stderr)
        return 2
    arrays = trace_arrays(reqs, rule, scn.model.max_context_tokens, args.trace_block_tokens)
    if len(arrays) == 0:
        print(f"pdd sim trace: every request is longer than the model's context "
              f"({scn.model.max_context_tokens} tokens)", file=sys.stderr)
        return 2
    figs = trace_figures(data, arrays, rule, args.rate_scale, args.seed)
    figs = {"trace": Path(args.trace).name, "scenario": args.scenario, **figs}
    for name, row in figs["systems"].items():
        print(f"{name:>9}: goodput {figs['goodput_rps'][name]:.3g} req/s at split {figs['splits'][name]}; "
              f"at {figs['comparison_rate_rps']:.3g} req/s: TTFT mean {row['mean_ttft_s']:.3g} s, "
              f"p90 {row['p90_ttft_s']:.3g} s; WAN {row['wan_gbytes']:.4g} GB; hit P {row['mean_hit_p']:.3f}")
    print(f"skipped (longer than the context): {figs['skipped_too_long']}; max_tokens rule: {figs['max_tokens_rule']}")
    line = json.dumps(np_clean(figs))
    if args.out:
        Path(args.out).write_text(line)
    print(line)
    return 0


def _shown(value: Any) -> str:
    """A sweep value in a table cell or a progress line."""
    if isinstance(value, tuple):
        return "/".join(f"{v:g}" for v in value)
    if isinstance(value, dict):
        return value.get("name") or ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


@contextmanager
def _sweep_progress() -> Iterator[Callable[[int, int, str, Any], None]]:
    """Progress of the sensitivity sweep (minutes) on stderr, since stdout carries the results: a rich bar
    on a terminal, else one line per point (logs, CI)."""
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = (TextColumn("sensitivity"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn(), TextColumn("{task.description}"))
        with Progress(*columns, console=Console(stderr=True)) as bar:
            task = bar.add_task("", total=None)
            yield lambda done, total, param, value: bar.update(
                task, completed=done, total=total, description=f"{param}={_shown(value)}")
        return
    start = time.monotonic()

    def line(done: int, total: int, param: str, value: Any) -> None:
        print(f"sensitivity {done}/{total}: {param}={_shown(value)} ({time.monotonic() - start:.0f} s)",
              file=sys.stderr, flush=True)

    yield line


def _calibrate(args: argparse.Namespace) -> int:
    from .calibrate import BenchRun, compare, fit, predict
    from .report import np_clean

    runs = [BenchRun.load(p, args.ttft_field) for p in args.fit]
    cm = fit(runs, transfer_s=args.transfer_s, first_token_from_prefill=args.first_token_from_prefill,
             service_noise=args.service_noise)
    hold = BenchRun.load(args.predict, args.ttft_field)
    pred = predict(cm, hold, args.n_prefill, args.n_decode, args.transfer_s,
                   first_token_from_prefill=args.first_token_from_prefill)
    cmp = compare(pred, hold)
    shown = ("p0", "p_tok", "p_attn", "p_sigma", "d0", "d_seq", "d_ctx")
    print("fitted coefficients:", json.dumps(np_clean({k: v for k, v in cm.to_dict().items() if k in shown})))
    for k, v in cmp.items():
        print(f"{k:>18}: {v:.4g}")
    print(json.dumps(np_clean({"coefficients": cm.to_dict(), **cmp})))
    return 0
