"""Correctness anchor: logits equal Hugging Face transformers (fp32, max abs diff <= 1e-4) for
prefill and every decode step through the paged cache, in mixed batches, chunked prefill, and
with prefix-cache hits; and the default model (SmolLM2-135M GGUF) on 1-2K-token prompts: fp32 within
SMOL_FP32_TOL, bf16 top-1 agreement with transformers' fp32 >= 99 % of positions."""

from __future__ import annotations

import os
import random

import pytest
import torch

from pdd.engine import SamplingParams
from pdd.engine.torch_backend.engine import TorchEngine
from pdd.kernels import build_attention_metadata

from .conftest import make_engine, run_all

TOL = 1e-4


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _check(engine, hf, prompts: dict[str, list[int]], outputs: dict[str, list[int]]) -> None:
    for rid, prompt in prompts.items():
        out = outputs[rid]
        got = torch.stack(engine.captured_logits[rid])
        assert got.shape[0] == len(out), rid
        ref = _hf_logits(hf, prompt + out[:-1])[len(prompt) - 1 :]
        diff = (got - ref).abs().max().item()
        assert diff <= TOL, f"{rid}: max abs logit diff {diff}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_mixed_batch_chunked_and_prefix_hits(arch, tiny_paths, hf_models):
    hf = hf_models[arch]
    engine = make_engine(tiny_paths[arch], max_prefill_tokens=24)
    engine.capture_logits = True
    rng = random.Random(1)
    vocab = engine.config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(21)]
    prompts = {f"a{i}": [rng.randrange(vocab) for _ in range(n)] for i, n in enumerate([3, 9, 17, 30])}
    # staggered arrival: later requests join while earlier ones decode (mixed prefill+decode steps)
    engine.add_request("a0", prompts["a0"], SamplingParams(ignore_eos=True), max_new_tokens=6)
    first = engine.step()
    for rid in ("a1", "a2", "a3"):
        engine.add_request(rid, prompts[rid], SamplingParams(ignore_eos=True), max_new_tokens=6)
    engine.add_request("s0", shared + [1, 2, 3], SamplingParams(ignore_eos=True), max_new_tokens=5)
    prompts["s0"] = shared + [1, 2, 3]
    outputs = run_all(engine)
    outputs["a0"] = [t for o in first for t in o.token_ids] + outputs["a0"]
    _check(engine, hf, prompts, outputs)
    # second wave: prefix-cache hits on the shared prefix and on a finished request's output
    hits_before = engine.cache.stats.hit_tokens
    wave2 = {
        "s1": shared + [4, 5],
        "s2": shared[:13],
        "c0": prompts["a3"] + outputs["a3"][:4] + [7],
    }
    for rid, p in wave2.items():
        engine.add_request(rid, p, SamplingParams(ignore_eos=True), max_new_tokens=5)
    outputs2 = run_all(engine)
    assert engine.cache.stats.hit_tokens > hits_before
    _check(engine, hf, wave2, outputs2)
    assert engine.num_free_blocks() + engine.cache.cached_blocks == engine.num_total_blocks()


# ---- SmolLM2-135M (the default model) on 1-2K-token prompts, against transformers on the same GGUF ----
SMOL_FP32_TOL = 1e-3  # max abs logit diff; measured <= 1.8e-4 prefill, <= 9.5e-5 decode (1K, 2K)
SMOL_BF16_MIN_TOP1 = 0.99  # engine in bf16 vs transformers in fp32: argmax agreement over all positions
# (the goal). Measured 0.9961 / 0.9955 (1K / 2K) with bf16 weights and KV and fp32 activations (our
# kernel); 0.9775 on the 1K prompt with bf16 activations, where transformers' own bf16 reaches 0.9746.
SMOL_PROMPTS = {"1k": ("compound", 1024), "2k": ("specialnames", 2000)}  # pydoc_data topic, tokens


@pytest.fixture(scope="module")
def smollm2_hf():
    from transformers import AutoModelForCausalLM

    from pdd.shared.model_files import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def _smol_prompt(engine, name: str) -> list[int]:
    """Real text that is fixed per Python version: a topic of Python's own reference manual."""
    from pydoc_data.topics import topics

    topic, n = SMOL_PROMPTS[name]
    ids = engine.tokenizer(topics[topic]).input_ids[:n]
    assert len(ids) == n
    return ids


def _prompt_logits(engine, ids: list[int], chunk: int = 512) -> torch.Tensor:
    """Logits at every prompt position through the engine's model and paged KV pool, prefilled in chunks
    as the scheduler does (the first chunk a fresh causal prefill, the rest extends over cached blocks)."""
    blocks = engine.pool.allocator.allocate(-(-len(ids) // engine.block_size))
    out = []
    try:
        for start in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - start)
            meta = build_attention_metadata(engine.block_size, [], [], [(blocks, start, n)])
            out.append(engine.model.forward(torch.tensor(ids[start : start + n]), torch.arange(start, start + n),
                                            meta, engine.k_cache, engine.v_cache, torch.arange(n)))
    finally:
        engine.pool.allocator.decref(blocks)
    return torch.cat(out)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SMOL_PROMPTS))
def test_smollm2_fp32_logits_match_transformers(smollm2_hf, name):
    """Every prompt position (chunked prefill) and 16 decode steps, within SMOL_FP32_TOL."""
    engine = TorchEngine.from_model("default", dtype="float32", kv_memory_bytes=128 << 20, enable_prefix_cache=False)
    ids = _smol_prompt(engine, name)
    prefill = _prompt_logits(engine, ids)
    engine.capture_logits = True
    engine.add_request("r", ids, SamplingParams(ignore_eos=True), max_new_tokens=16)
    out = run_all(engine)["r"]
    ref = _hf_logits(smollm2_hf, ids + out[:-1])
    prefill_diff = (prefill - ref[: len(ids)]).abs().max().item()
    decode_diff = (torch.stack(engine.captured_logits["r"]) - ref[len(ids) - 1 :]).abs().max().item()
    print(f"smollm2 fp32 {name}: max abs logit diff prefill {prefill_diff:.2e} decode {decode_diff:.2e}")
    assert prefill_diff <= SMOL_FP32_TOL and decode_diff <= SMOL_FP32_TOL


@pytest.mark.slow  # ~40 s each with the transformers reference; on CPUs without native bf16 or our kernel, minutes
@pytest.mark.parametrize("name", list(SMOL_PROMPTS))
def test_smollm2_bf16_top1_agrees_with_transformers_fp32(smollm2_hf, name):
    engine = TorchEngine.from_model("default", dtype="bfloat16", kv_memory_bytes=128 << 20, enable_prefix_cache=False)
    ids = _smol_prompt(engine, name)
    ours = _prompt_logits(engine, ids)
    ref = _hf_logits(smollm2_hf, ids)
    differ = ours.argmax(-1) != ref.argmax(-1)
    agree = 1.0 - differ.float().mean().item()
    top2 = ref.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1])[differ]  # how close the fp32 reference was to a tie where bf16 flips
    print(f"smollm2 bf16 {name}: top-1 agreement {agree:.4f}, max abs logit diff {(ours - ref).abs().max().item():.2e}, "
          f"fp32 top-2 margin at flips max {margins.max().item() if len(margins) else 0.0:.3f}")
    assert agree >= SMOL_BF16_MIN_TOP1
