"""Correctness anchor: logits equal Hugging Face transformers (fp32, max abs diff <= 1e-4) for
prefill and every decode step through the paged cache, in mixed batches, chunked prefill, and
with prefix-cache hits."""

from __future__ import annotations

import random

import pytest
import torch

from pdd.engine import SamplingParams

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
