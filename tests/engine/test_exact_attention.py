"""Bitwise batch invariance of the batch-invariant mode (tiny llama, fp32 and bf16).

A request's logits at every output position are bit-identical whether it decodes alone, inside a
batch of other requests of other lengths, after its output tokens were extended in one pass, or after
another engine imported its prompt KV and extended them: what makes a P-RLD-MD handoff's output equal to
an undisturbed run. The contrast case shows the mode is what does it: with fp32 accumulation the same
extend differs from decode steps.
"""

from __future__ import annotations

import pytest
import torch

from pdd.engine import SamplingParams
from pdd.engine.torch_backend.engine import TorchEngine

from .conftest import make_engine

GREEDY = SamplingParams(ignore_eos=True)
N = 24  # output positions compared
PROMPT = [(13 * i + 5) % 200 + 3 for i in range(37)]  # 37 tokens: blocks of 4 end mid-block


def _logits(engine: TorchEngine, rid: str) -> list[torch.Tensor]:
    while engine.has_work():
        engine.step()
    return engine.captured_logits.pop(rid)


def _alone(engine: TorchEngine) -> tuple[list[int], list[torch.Tensor]]:
    engine.add_request("alone", PROMPT, GREEDY, max_new_tokens=N)
    engine.capture_logits = True
    logits = _logits(engine, "alone")
    return [int(row.argmax()) for row in logits], logits


def _assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for pos, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {pos}: max diff {(a - b).abs().max().item():.3g}"


@pytest.fixture(params=["float32", "bfloat16"])
def engine(request, llama_path) -> TorchEngine:
    # no prefix cache: a prompt resumed from cached blocks is extended, not prefilled (docs/ENGINE.md)
    return make_engine(llama_path, dtype=request.param, num_blocks=256, enable_prefix_cache=False)


def test_batch_mates_leave_logits_bitwise_equal(engine):
    _, want = _alone(engine)
    mates = [[(7 * j + i) % 200 + 3 for j in range(3 + 9 * i)] for i in range(7)]  # 3..57 tokens
    for i, p in enumerate(mates[:4]):
        engine.add_request(f"m{i}", p, GREEDY, max_new_tokens=N + 10)
    for _ in range(3):
        engine.step()
    engine.add_request("target", PROMPT, GREEDY, max_new_tokens=N)
    for i, p in enumerate(mates[4:], start=4):
        engine.add_request(f"m{i}", p, GREEDY, max_new_tokens=N - 5)
    _assert_bitwise(_logits(engine, "target"), want)


@pytest.mark.parametrize("k", [1, 6])
def test_extend_then_decode_is_bitwise_equal_to_decode(engine, k):
    tokens, want = _alone(engine)
    engine.add_request("ext", PROMPT, GREEDY, max_new_tokens=N)
    while "ext" not in engine.captured_logits:
        engine.step()
    engine.extend_known("ext", tokens[1 : 1 + k])
    got = _logits(engine, "ext")
    _assert_bitwise(got, want[:1] + want[1 + k :])


def test_imported_kv_extended_is_bitwise_equal(engine):
    """A second engine (as main decode) imports the prompt KV and extends 5 known tokens (the relay's)."""
    tokens, want = _alone(engine)
    decoder = TorchEngine(engine.model, engine.tokenizer, num_blocks=64, block_size=4, enable_prefix_cache=False)
    engine.add_request("x", PROMPT, GREEDY, max_new_tokens=1, hold_kv=True)
    while engine.has_work():
        engine.step()
    src = engine.request_blocks("x")
    plan = decoder.prepare_import("x", PROMPT, use_cache=False)
    for layer in range(engine.layout.num_layers):
        decoder.k_cache[layer][plan.dst_blocks] = engine.k_cache[layer][src]
        decoder.v_cache[layer][plan.dst_blocks] = engine.v_cache[layer][src]
    engine.release("x")
    decoder.capture_logits = True
    decoder.commit_import("x", PROMPT, tokens[:6], GREEDY, max_new_tokens=N)
    _assert_bitwise(_logits(decoder, "x"), want[6:])


def test_fp32_accumulation_is_not_exact(llama_path):
    """Contrast: without the mode, the same extend differs from decode steps (so the mode is needed)."""
    engine = make_engine(llama_path, dtype="float32", num_blocks=256, enable_prefix_cache=False, batch_invariant=False)
    tokens, want = _alone(engine)
    engine.add_request("ext", PROMPT, GREEDY, max_new_tokens=N)
    while "ext" not in engine.captured_logits:
        engine.step()
    engine.extend_known("ext", tokens[1:7])
    got = _logits(engine, "ext")
    assert any(not torch.equal(a, b) for a, b in zip(got[1:], want[7:]))


def test_prompt_extends_accumulate_as_fresh_prompts_do(llama_path):
    """A prefix-cache hit extends the rest of the prompt in fp32 in either mode: no decode ever recomputes
    prompt tokens, and float64 took 2.7x as long there. So the first token's logits equal those of the fp32
    mode bitwise, while the decode steps after it (float64 in the mode) do not."""
    logits = {}
    for mode in (True, False):
        engine = make_engine(llama_path, dtype="float32", num_blocks=256, batch_invariant=mode)
        engine.add_request("warm", PROMPT[:24], GREEDY, max_new_tokens=1)
        while engine.has_work():
            engine.step()
        engine.capture_logits = True
        engine.add_request("hit", PROMPT, GREEDY, max_new_tokens=6)
        logits[mode] = _logits(engine, "hit")
        assert engine.cache.stats.hit_tokens >= 20  # the prompt was extended over cached blocks
    assert torch.equal(logits[True][0], logits[False][0])
    assert any(not torch.equal(a, b) for a, b in zip(logits[True][1:], logits[False][1:]))
