"""Live calibration hold-out: fit the simulator on two live `pdd bench` runs, predict a third.

Issue #7 acceptance: "Live vs simulated TTFT p50/p90 within ±20% on a calibration hold-out run
(tiny model, emulated WAN)".

What runs (real processes, launch/local_cluster.py): nats-server, router, prefill (P), relay (RLD)
at site-a and main decode (MD) at site-b, on a tiny seeded model (or ``--model PATH``), one torch
thread each. The WAN transport is zmq behind the in-process shaper (``--wan-rate``/``--wan-delay``).
`pdd bench` (loadgen, called in-process) drives it open loop (Poisson arrivals, so TTFT includes
queueing) with three workloads of the `random` dataset on /v1/chat/completions:

- fit-a and fit-b: two rates, lengths and seeds; the cost model is fitted on these two only;
- hold-out: a third rate, length mix and seed, never seen by the fit; only predicted.

Then `pdd sim calibrate` (sim/calibrate.py: ``fit`` on fit-a + fit-b, ``predict`` on the hold-out's
arrivals and token counts) gives simulated TTFT p50/p90, compared with the live hold-out figures.

Run: python -m pdd.bench.calibration_holdout [--out-dir DIR] [--num-prompts N]
Last stdout line: one JSON object with predicted/observed TTFT p50/p90, their errors, the fitted
coefficients, the machine's load average during each run, and "within_20pct".
The bench JSON files stay in --out-dir, so the same check is `pdd sim calibrate --fit A B --predict H
--n-prefill 1 --n-decode 1 --transfer-s 0 --first-token-from-prefill --service-noise
--ttft-field ttfe`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

# Topology flags for the simulator, matching the live deployment started below:
# - n_prefill=1: one prefill instance (p-0). In PDD the first token is sampled by P and streamed to
#   the client at once (roles/prefill.py publishes PrefillResult before any KV transfer; the
#   router does not hold it back: router.first_token_after_kv is false), so TTFT is P's queue plus
#   P's service time plus the fixed request path (HTTP, tokenizer, router, NATS), all inside p0.
# - first_token_from_prefill=True: for that reason; no decode step and no KV hand-over sit in TTFT.
# - transfer_s=0: the KV transfers (fast to RLD, shaped WAN to MD) start after the first token went
#   out, so none of it is inside TTFT.
# - n_decode=1: one decoder takes each request's remaining tokens (RLD and/or MD; they only shape
#   TPOT/E2EL, which this check does not compare).
# - service_noise=True: on a shared machine the TTFT of requests that found P idle spreads by a
#   log-sigma of ~0.3-0.5 (OS scheduling, the other processes of this system and other tenants on
#   the same cores); a deterministic service time has no tail, so the fit also takes that spread
#   (p_noise: idle requests' TTFT over the fitted line, resampled by the simulator as service-time
#   multipliers). Fitted on fit-a and fit-b only.
#   (Chosen by cross-predicting fit-a <-> fit-b, never the hold-out: it cut the p90 error there.
#   The measured multipliers replaced a fitted lognormal the same way: on a quiet machine they are a
#   tight core plus stragglers, and cross-prediction errors fell from 9.1 % to 7.8 % mean |error|;
#   a linear "prefill slows per request decoding" term for the shared CPUs was tried the same way
#   and dropped: its positive feedback blew cross-predictions up by several times.)
TOPOLOGY = {"n_prefill": 1, "n_decode": 1, "transfer_s": 0.0, "first_token_from_prefill": True,
            "service_noise": True}

# TTFT is taken at the first stream event (`ttfe`: the chat stream's role chunk, which the router sends
# as soon as it has the first token), not at the first chunk with visible text: the random tiny model
# often starts with byte tokens that are partial UTF-8, and the router rightly holds that text back
# until a whole character exists, which can be several decode steps (or the whole answer) later.
# That delay is a property of the random weights, not of serving; the cost model predicts the time
# to the first token. The text-based figures are reported too.
TTFT_FIELD = "ttfe"

# Workloads: (name, request rate req/s, input words, output tokens, range ratio, seed). A word is
# ~3.3 tokens of the tiny byte-level BPE tokenizer.
# fit-a/fit-b span a low and a higher load and two length mixes; the hold-out sits between them in
# rate but has its own lengths and seed (the fit never sees its arrivals or token counts). They run
# in this order, the hold-out between the fit runs, so slow drift of the machine's other load
# touches fit and hold-out alike.
WORKLOADS = (
    ("fit-a", 1.0, 60, 16, 0.5, 11),
    ("holdout", 1.75, 100, 32, 0.6, 13),
    ("fit-b", 2.5, 140, 24, 0.5, 12),
)


def cluster_config(model: str, wan_rate: str, wan_delay: str) -> dict[str, Any]:
    from pdd.launch.local_cluster import two_site_layout

    return {
        "model": {"path": model, "kv_memory_mb": 16, "block_size": 16, "max_num_seqs": 32, "threads": 1},
        **two_site_layout(),
        "transports": {
            "fast": {"name": "zmq"},
            "wan": {"name": "zmq", "options": {"streams": 2, "shape": {"rate": wan_rate, "delay": wan_delay}}},
        },
        "service": {"heartbeat_ms": 500, "missed_heartbeats": 6, "drain_timeout_s": 5},
        "telemetry": {"exporter": "none", "log_format": "json"},
    }


def bench_args(base_url: str, served: str, name: str, rate: float, input_len: int, output_len: int, ratio: float,
               seed: int, n: int, warmup: int, out: Path) -> argparse.Namespace:
    from pdd.loadgen.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([
        "--base-url", base_url, "--model", served, "--endpoint", "/v1/chat/completions", "--label", name,
        "--dataset", "random",
        "--num-prompts", str(n), "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--random-range-ratio", str(ratio), "--request-rate", str(rate), "--warmup", str(warmup),
        "--seed", str(seed), "--timeout", "120", "--metrics-url", "none", "--no-progress",
        "--metric-percentiles", "90,99",
        "--save-json", str(out),
    ])


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from pdd.loadgen.cli import bench

    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    summary = asyncio.run(bench(args))
    summary["machine"] = {"loadavg_1m_before": load0, "loadavg_1m_after": os.getloadavg()[0],
                          "cpus": os.cpu_count(), "wall_s": time.monotonic() - t0}
    Path(args.save_json).write_text(json.dumps(summary, indent=1))
    return summary


def calibrate(fit_paths: list[Path], holdout_path: Path) -> dict[str, Any]:
    import numpy as np

    from pdd.sim.calibrate import BenchRun, compare, fit, predict

    runs = [BenchRun.load(p, TTFT_FIELD) for p in fit_paths]
    hold = BenchRun.load(holdout_path, TTFT_FIELD)
    ftp = TOPOLOGY["first_token_from_prefill"]
    cm = fit(runs, transfer_s=TOPOLOGY["transfer_s"], first_token_from_prefill=ftp,
             service_noise=TOPOLOGY["service_noise"])
    pred = predict(cm, hold, TOPOLOGY["n_prefill"], TOPOLOGY["n_decode"], TOPOLOGY["transfer_s"],
                   first_token_from_prefill=ftp)
    coef = {k: v for k, v in cm.to_dict().items()
            if k in ("p0", "p_tok", "p_attn", "p_sigma", "d0", "d_seq", "d_ctx")}
    # reference: the plain model (dedicated hardware, deterministic service), same fit runs
    plain = fit(runs, transfer_s=TOPOLOGY["transfer_s"], first_token_from_prefill=ftp)
    plain_cmp = compare(predict(plain, hold, TOPOLOGY["n_prefill"], TOPOLOGY["n_decode"], TOPOLOGY["transfer_s"],
                                first_token_from_prefill=ftp), hold)
    text = BenchRun.load(holdout_path)  # first visible text, for reference only
    return {"coefficients": coef, **compare(pred, hold), "ttft_field": TTFT_FIELD,
            "plain_model": {k: v for k, v in plain_cmp.items() if "sim" in k or "error" in k},
            "holdout_text_ttft_p50_s": float(np.percentile(text.ttft, 50)),
            "holdout_text_ttft_p90_s": float(np.percentile(text.ttft, 90))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: build a tiny seeded one)")
    ap.add_argument("--out-dir", default="calibration_out")
    ap.add_argument("--num-prompts", type=int, default=200, help="measured requests per run")
    ap.add_argument("--warmup", type=int, default=4, help="per run, left out of the results")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="multiplies every workload's request rate")
    ap.add_argument("--wan-rate", default="200mbit")
    ap.add_argument("--wan-delay", default="10ms")
    ap.add_argument("--seed", type=int, default=0, help="tiny model seed")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)

    out = Path(args.out_dir)
    shutil.rmtree(out / "run", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from pdd.engine.torch_backend.tiny import build_tiny_checkpoint

        model = build_tiny_checkpoint(out / "model", seed=args.seed, max_position_embeddings=2048)
    from pdd.launch.local_cluster import LocalCluster

    paths: dict[str, Path] = {}
    machine: dict[str, Any] = {}
    with LocalCluster(out / "run", cluster_config(str(model), args.wan_rate, args.wan_delay)) as cluster:
        print(f"cluster ready in {cluster.start(args.start_timeout):.1f}s at {cluster.base_url}", flush=True)
        for name, rate, in_len, out_len, ratio, seed in WORKLOADS:
            path = out / f"{name}.json"
            summary = run_bench(bench_args(cluster.base_url, Path(model).name, name, rate * args.rate_scale, in_len,
                                           out_len, ratio, seed, args.num_prompts, args.warmup, path))
            machine[name] = summary["machine"]
            if not summary["completed"]:
                print(json.dumps({"error": f"{name}: no request completed ({summary['pdd'].get('errors')})",
                                  "machine": machine}))
                return 1
            ttfe = sorted(r["ttfe"] for r in summary["requests"] if r["success"])
            print(f"{name}: rate {rate * args.rate_scale:g}/s, completed {summary['completed']}, failed "
                  f"{summary['failed']}, TTFE p50 {ttfe[len(ttfe) // 2] * 1e3:.1f} ms, text TTFT p50 "
                  f"{summary['median_ttft_ms']:.1f} ms p90 {summary['p90_ttft_ms']:.1f} ms, load avg "
                  f"{machine[name]['loadavg_1m_before']:.1f}->{machine[name]['loadavg_1m_after']:.1f}", flush=True)
            paths[name] = path
            cluster.wait_idle(30)
    res = calibrate([paths["fit-a"], paths["fit-b"]], paths["holdout"])
    print("fitted coefficients:", json.dumps(res["coefficients"]))
    for q in (50, 90):
        print(f"TTFT p{q}: predicted {res[f'ttft_p{q}_sim_s'] * 1e3:.1f} ms, observed "
              f"{res[f'ttft_p{q}_obs_s'] * 1e3:.1f} ms, error {res[f'ttft_p{q}_error']:+.1%}")
    errors = [res["ttft_p50_error"], res["ttft_p90_error"]]
    cmd = (f"pdd sim calibrate --fit {paths['fit-a']} {paths['fit-b']} --predict {paths['holdout']} "
           f"--n-prefill {TOPOLOGY['n_prefill']} --n-decode {TOPOLOGY['n_decode']} "
           f"--transfer-s {TOPOLOGY['transfer_s']} --first-token-from-prefill --service-noise "
           f"--ttft-field {TTFT_FIELD}")
    print("same check from the saved runs:", cmd)
    result = {
        **res, "topology": TOPOLOGY, "workloads": [dict(zip(("name", "rate", "input_words", "output_tokens",
                                                              "range_ratio", "seed"), w)) for w in WORKLOADS],
        "rate_scale": args.rate_scale, "num_prompts": args.num_prompts, "machine": machine,
        "within_20pct": all(math.isfinite(e) and abs(e) <= 0.2 for e in errors),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
