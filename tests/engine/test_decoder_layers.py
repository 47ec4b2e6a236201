"""kernels/cpu_decoder.c: a pass of exact rows through every layer in one C call gives the logits of the
per-op route bit for bit (llama; qwen2's qkv bias; qwen3's q/k norms; fp32 and bf16 weights and KV), so a
request's tokens do not depend on which route a step took."""

from __future__ import annotations

import pytest
import torch

from pdd.engine import SamplingParams
from pdd.engine.torch_backend.engine import TorchEngine
from pdd.kernels import native

from .conftest import make_engine

pytestmark = pytest.mark.skipif(native.lib() is None, reason=f"C kernels unavailable: {native.unavailable_reason()}")

GREEDY = SamplingParams(ignore_eos=True)
PROMPTS = [[(11 * i + 3 * j) % 250 + 3 for j in range(5 + 13 * i)] for i in range(3)]  # 5, 18, 31 tokens


def _decode(engine: TorchEngine) -> tuple[dict[str, list[torch.Tensor]], int]:
    """Each request's logits per output position, and how many passes took the one-call route."""
    fused = engine.model.decoder_layers
    calls = 0
    if fused is not None:
        run = fused.run

        def counted(*args, **kw):
            nonlocal calls
            calls += 1
            return run(*args, **kw)

        fused.run = counted
    engine.capture_logits = True
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY, max_new_tokens=12)
    while engine.has_work():
        engine.step()
    return {rid: engine.captured_logits.pop(rid) for rid in [f"r{i}" for i in range(len(PROMPTS))]}, calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_one_call_route_equals_per_op_route_bitwise(tiny_paths, arch, dtype):
    engine = make_engine(tiny_paths[arch], dtype=dtype, enable_prefix_cache=False)
    assert engine.model.decoder_layers is not None
    got, calls = _decode(engine)
    assert calls >= 10  # the decode steps took it (prefill passes cannot: fresh prompts attend by SDPA)
    reference = make_engine(tiny_paths[arch], dtype=dtype, enable_prefix_cache=False)
    reference.model.decoder_layers = None
    want, _ = _decode(reference)
    for rid in want:
        assert len(got[rid]) == len(want[rid]) == 12
        for pos, (a, b) in enumerate(zip(got[rid], want[rid])):
            assert torch.equal(a, b), f"{arch} {dtype} {rid} output {pos}: max diff {(a - b).abs().max().item():.3g}"


def test_bad_slot_is_a_clear_error_and_the_pool_is_untouched(tiny_paths):
    from pdd.kernels import build_attention_metadata

    engine = make_engine(tiny_paths["llama"], dtype="float32", enable_prefix_cache=False)
    model, pool = engine.model, engine.pool
    blocks = pool.k_cache[0].shape[0]
    meta = build_attention_metadata(4, [[blocks + 5]], [1], [])  # a block outside the pool
    assert model.decoder_layers.takes(meta, 1, pool.k_cache)
    before = [t.clone() for t in pool.k_cache]
    with pytest.raises(RuntimeError, match="status -2"):
        model.forward(torch.tensor([5]), torch.tensor([0]), meta, pool.k_cache, pool.v_cache, torch.tensor([0]))
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_cache))


def test_bad_residual_stream_or_pool_list_is_a_clear_error(tiny_paths):
    from pdd.kernels import build_attention_metadata

    engine = make_engine(tiny_paths["llama"], dtype="float32", enable_prefix_cache=False)
    layers, pool = engine.model.decoder_layers, engine.pool
    meta = build_attention_metadata(4, [[3]], [1], [])
    cos, sin = engine.model.rotary.lookup(torch.tensor([0]))
    hidden = torch.zeros(1, engine.config.hidden_size)
    with pytest.raises(ValueError, match="hidden must be contiguous float32"):
        layers.run(hidden.double(), cos, sin, meta, pool.k_cache, pool.v_cache)
    with pytest.raises(ValueError, match="hidden must be contiguous float32"):
        layers.run(torch.zeros(1, 2 * engine.config.hidden_size)[:, ::2], cos, sin, meta, pool.k_cache, pool.v_cache)
    with pytest.raises(ValueError, match="KV pools for"):
        layers.run(hidden, cos, sin, meta, pool.k_cache[:-1], pool.v_cache[:-1])
    assert not any(t.any() for t in pool.k_cache)  # nothing was written
