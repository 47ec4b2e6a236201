"""kernels/cpu_attention.c through paged_attention: the exact rows (decode tokens, extends of output tokens)
match torch's float64 attention, and a row's bits depend only on its query and context: alone or in a
batch, as a decode token or inside an extend."""

import pytest
import torch

from pdd.kernels import attention, build_attention_metadata, native, paged_attention

pytestmark = pytest.mark.skipif(native.lib() is None, reason=f"C kernels unavailable: {native.unavailable_reason()}")

BLOCK, HKV, HQ, DIM = 4, 2, 6, 16
SCALE = DIM ** -0.5


def _pool(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(64, BLOCK, HKV, DIM, generator=g).to(dtype)
    v = torch.randn(64, BLOCK, HKV, DIM, generator=g).to(dtype)
    return k, v, g


def _attend(meta, q, k_new, v_new, k_cache, v_cache):
    return paged_attention(q, k_new, v_new, k_cache.clone(), v_cache.clone(), meta, SCALE).view(-1, HQ, DIM)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_exact_rows_match_torch_float64(kv_dtype, monkeypatch):
    k_cache, v_cache, g = _pool(kv_dtype)
    tables = [[3, 9, 1, 20, 7], [11, 12], [30, 31, 32, 33, 34, 35]]
    decode_lens = [17, 5]  # contexts including the new token
    specs = [(tables[2], 13, 6)]  # an extend of 6 known tokens over 13 cached positions
    meta = build_attention_metadata(BLOCK, tables[:2], decode_lens, specs)
    assert meta.exact is not None and meta.exact.segments == {0}
    tokens = 2 + 6
    q = torch.randn(tokens, HQ, DIM, generator=g)
    k_new = torch.randn(tokens, HKV, DIM, generator=g)
    v_new = torch.randn(tokens, HKV, DIM, generator=g)
    ours = _attend(meta, q, k_new, v_new, k_cache, v_cache)
    monkeypatch.setattr(attention.native, "lib", lambda: None)  # torch's float64 route, same metadata rules
    theirs = _attend(build_attention_metadata(BLOCK, tables[:2], decode_lens, specs), q, k_new, v_new,
                     k_cache, v_cache)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_a_row_is_the_same_bits_alone_in_a_batch_and_inside_an_extend():
    k_cache, v_cache, g = _pool(torch.float32, seed=1)
    table = [5, 6, 7, 8]
    q = torch.randn(4, HQ, DIM, generator=g)
    k_new = torch.randn(4, HKV, DIM, generator=g)
    v_new = torch.randn(4, HKV, DIM, generator=g)
    # an extend of 4 tokens at positions 10..13 writes their K/V and attends causally
    extend = _attend(build_attention_metadata(BLOCK, [], [], [(table, 10, 4)]), q, k_new, v_new, k_cache, v_cache)
    # the token at position 12, decoded alone once positions 10, 11 are in the pool
    pool_k, pool_v = k_cache.clone(), v_cache.clone()
    attention.write_kv(pool_k, pool_v, torch.tensor([7 * BLOCK + 2, 7 * BLOCK + 3]), k_new[:2], v_new[:2])
    alone = _attend(build_attention_metadata(BLOCK, [table], [13], []), q[2:3], k_new[2:3], v_new[2:3],
                    pool_k, pool_v)
    assert torch.equal(alone[0], extend[2])
    # the same decode token behind two batch mates of other lengths
    mates = [[40, 41, 42], [50]]
    batch = _attend(build_attention_metadata(BLOCK, [*mates, table], [9, 3, 13], []),
                    torch.cat([torch.randn(2, HQ, DIM, generator=g), q[2:3]]),
                    torch.cat([torch.randn(2, HKV, DIM, generator=g), k_new[2:3]]),
                    torch.cat([torch.randn(2, HKV, DIM, generator=g), v_new[2:3]]), pool_k, pool_v)
    assert torch.equal(batch[2], extend[2])


def test_prompt_extends_and_fp32_mode_stay_on_torch():
    meta = build_attention_metadata(BLOCK, [], [], [([1, 2, 3], 4, 4, True), ([4, 5], 0, 4)])
    assert meta.exact is None  # a prompt-only extend (fp32) and a fresh prompt: no exact rows
    meta = build_attention_metadata(BLOCK, [[1, 2]], [6], [], decode_accum=torch.float32)
    assert meta.exact is None


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 38])  # 38: the 32-column accumulators, one 4-column chunk and a 2-column tail
def test_grouped_and_per_head_work_items_give_the_same_bits(kv_dtype, dim, monkeypatch):
    """Many rows take (row, kv head) items over a dense copy of the context, few rows (row, query head) items
    straight from the pool (cpu_attention.c): a row's bits are the same on either route."""
    g = torch.Generator().manual_seed(7)
    k_cache = torch.randn(64, BLOCK, HKV, dim, generator=g).to(kv_dtype)
    v_cache = torch.randn(64, BLOCK, HKV, dim, generator=g).to(kv_dtype)
    tables = [[i, 20 + i, 40 + i] for i in range(8)]
    lens = [3 + i for i in range(8)]  # 3..10 positions, new token included
    q = torch.randn(8, HQ, dim, generator=g)
    k_new = torch.randn(8, HKV, dim, generator=g)
    v_new = torch.randn(8, HKV, dim, generator=g)

    def attend(rows):
        meta = build_attention_metadata(BLOCK, [tables[r] for r in rows], [lens[r] for r in rows], [])
        out = paged_attention(q[rows], k_new[rows], v_new[rows], k_cache.clone(), v_cache.clone(), meta, dim ** -0.5)
        return out.view(len(rows), HQ, dim)

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # 8 rows x 2 kv heads >= 4 x 1 thread: grouped
    batch = attend(list(range(8)))
    for r in range(8):
        assert torch.equal(attend([r])[0], batch[r]), r  # 1 row x 2 kv heads: per query head
