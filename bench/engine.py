"""Engine benchmark: decode tok/s at 1/8/32 concurrent requests (128 greedy tokens each) and
prefill tok/s (8 x 512), versus Hugging Face transformers `generate` (batched, left-padded) on
the same checkpoint (SmolLM2-135M from the packaged GGUF), fp32, same thread count, one run.

Run: python bench/engine.py [--threads N] [--new-tokens 128] [--batches 1,8,32]
Last stdout line: one JSON object with every figure and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt length for the decode runs")
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=512)
    args = ap.parse_args()
    import torch  # after the arguments: --help stays fast

    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from pdd.engine import Engine
    from pdd.shared.model_files import default_model_path

    path = default_model_path()
    batches = [int(b) for b in args.batches.split(",")]
    kv_tokens = max(max(batches) * (args.prompt_len + args.new_tokens), args.prefill_batch * args.prefill_len)
    t0 = time.perf_counter()
    engine = Engine.from_model(path, dtype="float32", num_threads=args.threads, enable_prefix_cache=False,
                               kv_memory_bytes=0, num_blocks=(kv_tokens + 15) // 16 + 64,
                               max_num_seqs=max(batches), max_prefill_tokens=args.prefill_batch * args.prefill_len)
    load_engine = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    load_hf = time.perf_counter() - t0
    vocab = engine.config.vocab_size
    # warm both (first-call allocations, thread pools)
    _engine_generate(engine, _prompts(vocab, 2, 16, 0), 4)
    _hf_generate(hf, _prompts(vocab, 2, 16, 0), 4)

    figures: dict[str, float] = {"threads": args.threads, "load_engine_s": round(load_engine, 2),
                                 "load_hf_s": round(load_hf, 2)}
    rows = []
    for b in batches:
        prompts = _prompts(vocab, b, args.prompt_len, b)
        ours = b * args.new_tokens / _engine_generate(engine, prompts, args.new_tokens)
        theirs = b * args.new_tokens / _hf_generate(hf, prompts, args.new_tokens)
        figures[f"engine_tok_s_batch{b}"] = round(ours, 1)
        figures[f"hf_tok_s_batch{b}"] = round(theirs, 1)
        figures[f"ratio_vs_hf_batch{b}"] = round(ours / theirs, 3)
        rows.append((f"decode batch {b}", ours, theirs))
    prompts = _prompts(vocab, args.prefill_batch, args.prefill_len, 999)
    n = args.prefill_batch * args.prefill_len
    ours = n / _engine_generate(engine, prompts, 1)
    theirs = n / _hf_generate(hf, prompts, 1)
    figures["engine_prefill_tok_s"] = round(ours, 1)
    figures["hf_prefill_tok_s"] = round(theirs, 1)
    figures["prefill_ratio_vs_hf"] = round(ours / theirs, 3)
    rows.append((f"prefill {args.prefill_batch}x{args.prefill_len}", ours, theirs))
    figures["kv_pool_bytes"] = engine.kv_pool_bytes()
    figures["kv_pool_blocks"] = engine.num_total_blocks()
    figures["kv_bytes_per_token"] = engine.layout.bytes_per_token

    print(f"{'run':<20}{'engine tok/s':>14}{'HF tok/s':>12}{'ratio':>8}")
    for name, a, b in rows:
        print(f"{name:<20}{a:>14.1f}{b:>12.1f}{a / b:>8.2f}")
    print(f"KV pool: {figures['kv_pool_bytes'] / 2**20:.1f} MiB ({figures['kv_pool_blocks']} blocks of 16 tokens)")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
