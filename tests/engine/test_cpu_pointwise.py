"""kernels/cpu_pointwise.c through rms_norm, apply_rotary_, silu_mul and write_kv: each matches its torch
route (the reference), works on strided views of a fused projection, is row-invariant, and the bf16 KV
store gives torch's rounding bit for bit (the fresh-prompt attention rounds the same values with torch)."""

import pytest
import torch

from pdd.kernels import RotaryEmbedding, apply_rotary_, native, rms_norm, silu_mul, write_kv

pytestmark = pytest.mark.skipif(native.lib() is None, reason=f"C kernels unavailable: {native.unavailable_reason()}")


def _torch_route(monkeypatch):
    monkeypatch.setattr(native, "lib", lambda: None)


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("dim", [576, 64, 13])
def test_rms_norm_matches_torch_on_strided_rows(dim, monkeypatch):
    fused = _rand(7, 3 * dim, seed=dim, scale=3.0)
    x = fused[:, dim : 2 * dim]  # a strided view, as q/k/v slices of the qkv output are
    w = _rand(dim, seed=1)
    ours = rms_norm(x, w, 1e-5)
    assert not x.is_contiguous() and ours.is_contiguous()
    _torch_route(monkeypatch)
    ref = rms_norm(x, w, 1e-5)
    torch.testing.assert_close(ours, ref, rtol=2e-6, atol=2e-6)


def test_rms_norm_per_head_groups(monkeypatch):
    qkv = _rand(5, 4 + 2 + 2, 16, seed=3)
    w = _rand(16, seed=4)
    ours = rms_norm(qkv[:, :4], w, 1e-6)
    _torch_route(monkeypatch)
    torch.testing.assert_close(ours, rms_norm(qkv[:, :4], w, 1e-6), rtol=2e-6, atol=2e-6)


def test_rms_norm_row_alone_equals_row_in_batch():
    x, w = _rand(33, 576, seed=5), _rand(576, seed=6)
    batch = rms_norm(x, w, 1e-5)
    for r in (0, 17, 32):
        assert torch.equal(rms_norm(x[r : r + 1], w, 1e-5)[0], batch[r])


@pytest.mark.parametrize("dim", [64, 20])
def test_rotary_in_place_matches_torch(dim, monkeypatch):
    rope = RotaryEmbedding(dim, 256, 10000.0, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64})
    positions = torch.tensor([0, 5, 200, 31])
    cos, sin = rope.lookup(positions)
    qkv = _rand(4, 5, dim, seed=7)
    ours = qkv.clone()
    out = apply_rotary_(ours[:, :3], cos, sin)
    assert out.data_ptr() == ours.data_ptr()  # in place, through the strided view
    assert torch.equal(ours[:, 3:], qkv[:, 3:])  # the heads outside the view are untouched
    _torch_route(monkeypatch)
    ref = qkv.clone()
    apply_rotary_(ref[:, :3], cos, sin)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_silu_mul_matches_torch_including_extremes(monkeypatch):
    inter = 37  # a tail after the 8-wide loop
    gate_up = _rand(6, 2 * inter, seed=8, scale=4.0)
    gate_up[0, :6] = torch.tensor([0.0, -100.0, 100.0, -87.5, 88.9, -1e-30])
    ours = silu_mul(gate_up)
    _torch_route(monkeypatch)
    ref = silu_mul(gate_up)
    torch.testing.assert_close(ours, ref, rtol=3e-7, atol=1e-30)


def test_silu_mul_row_alone_equals_row_in_batch():
    gate_up = _rand(9, 2 * 1536, seed=9, scale=3.0)
    batch = silu_mul(gate_up)
    assert torch.equal(silu_mul(gate_up[4:5])[0], batch[4])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_kv_store_gives_torch_bits(kv_dtype, monkeypatch):
    blocks, block_size, heads, dim = 6, 4, 2, 8
    qkv = _rand(5, 2 + 2 * heads, dim, seed=10, scale=5.0)
    # bf16 rounding edge cases: ties to even both ways, the largest finite, inf, NaN, a subnormal
    qkv[0, 2, :6] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.3895e38, float("inf"), float("nan"), 1e-40])
    k, v = qkv[:, 2 : 2 + heads], qkv[:, 2 + heads :]
    slots = torch.tensor([3, 0, 22, 9, 10])
    pools = []
    for route in ("native", "torch"):
        if route == "torch":
            _torch_route(monkeypatch)
        kc = torch.zeros(blocks, block_size, heads, dim, dtype=kv_dtype)
        vc = torch.zeros_like(kc)
        write_kv(kc, vc, slots, k, v)
        pools.append((kc, vc))
    for ours, ref in zip(pools[0], pools[1]):
        assert torch.equal(ours.view(torch.int16 if kv_dtype == torch.bfloat16 else torch.int32),
                           ref.view(torch.int16 if kv_dtype == torch.bfloat16 else torch.int32)) or (
            kv_dtype == torch.bfloat16  # NaN payloads may differ between torch's scalar and vector paths
            and torch.equal(ours.isnan(), ref.isnan()) and torch.equal(ours.nan_to_num(), ref.nan_to_num()))


def test_kv_store_refuses_a_slot_outside_the_pool():
    kc = torch.zeros(2, 4, 1, 8)
    vc = torch.zeros_like(kc)
    k = _rand(2, 1, 8, seed=11)
    with pytest.raises(IndexError, match="outside the pool"):
        write_kv(kc, vc, torch.tensor([1, 8]), k, k)
    assert not kc.any() and not vc.any()  # nothing written
