"""Paged attention over a block-organised KV pool (torch, and our C kernel for the exact rows).

The pool of one layer is ``k_cache``/``v_cache`` of [num_blocks, block_size, kv_heads, head_dim].
A forward pass carries a flat token batch: first the decode tokens (one per sequence), then the
prefill/extend segments (several new tokens of one sequence each). Metadata is built once per
pass and shared by every layer, so per-layer work is only tensor ops:

* decode: gather each sequence's blocks into [B, L, kv_heads, head_dim] with one index_select,
  mask the padding, and run one batched scaled_dot_product_attention with the query heads of a
  KV group folded into the query-length axis (GQA without repeating K/V);
* prefill/extend: per segment, causal attention of the new tokens over the cached prefix plus
  themselves (a fresh prompt attends its own K/V directly, no gather). Consecutive fresh prompts
  of equal length are merged into one segment and run as one batched causal SDPA.

Where kernels/cpu_attention.c is built, the decode tokens and the extends of output tokens (the rows
that must agree bit for bit, ``paged_attention`` says why) go to it instead, read straight from the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdd.kernels import native

NATIVE_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # pool dtype -> the C kernel's kv_bf16 flag


@dataclass
class PrefillSegment:
    """New tokens [token_start, token_start+num_new) of one sequence whose first new position is ctx_start.

    A fresh segment (ctx_start == 0) may cover num_seqs consecutive sequences of num_new tokens each.
    """

    token_start: int
    num_new: int
    ctx_start: int
    block_ids: torch.Tensor | None  # blocks covering positions [0, ctx_start+num_new); None if ctx_start == 0
    mask: torch.Tensor | None  # [num_new, ctx_start+num_new] bool, None if ctx_start == 0
    num_seqs: int = 1
    accum: torch.dtype = torch.float32  # an extend's accumulation dtype (paged_attention says which and why)


@dataclass
class ExactRows:
    """The rows our C kernel attends (kernels/cpu_attention.c): decode tokens and extends of output tokens."""

    rows: torch.Tensor  # [R] token index in the pass
    tables: torch.Tensor  # block tables of the rows' sequences, concatenated
    offsets: torch.Tensor  # [R] where row r's table starts in ``tables``
    lens: torch.Tensor  # [R] context length of row r (its position + 1)
    segments: frozenset[int]  # indices into ``AttentionMetadata.prefills`` whose rows are listed


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot (block*block_size+offset) per new token
    num_decode: int = 0
    decode_block_index: torch.Tensor | None = None  # [B*max_blocks] block ids, padded
    decode_max_blocks: int = 0
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks*block_size] True = attend
    decode_len0: int = 0  # context length of the first decode sequence
    prefills: list[PrefillSegment] = field(default_factory=list)
    # decode tokens and extends of output tokens accumulate in this dtype (paged_attention says why)
    decode_accum: torch.dtype = torch.float64
    exact: ExactRows | None = None  # those rows, for the C kernel (float64 accumulation, kernel built)


def build_attention_metadata(
    block_size: int,
    decode_tables: list[list[int]],
    decode_lens: list[int],
    prefill_specs: list[tuple[list[int], int, int] | tuple[list[int], int, int, bool]],
    decode_accum: torch.dtype = torch.float64,
) -> AttentionMetadata:
    """Build per-pass metadata.

    decode_tables/decode_lens: block table and context length (including the new token) of each
    decode sequence. prefill_specs: (block table, ctx_start, num_new[, prompt_only]) of each
    prefill/extend segment; ``prompt_only`` (default False) marks an extend of prompt tokens only, which
    accumulates in fp32 instead of ``decode_accum``. Token order in the pass is decode tokens first, then
    the segments in order.
    """
    slots: list[int] = []
    for table, length in zip(decode_tables, decode_lens):
        pos = length - 1
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode=len(decode_tables),
                             decode_accum=decode_accum)
    exact = decode_accum == torch.float64 and native.lib() is not None
    exact_rows: list[int] = []
    exact_tables: list[int] = []
    exact_offsets: list[int] = []
    exact_lens: list[int] = []
    exact_segments: set[int] = set()
    if exact:
        for i, (table, length) in enumerate(zip(decode_tables, decode_lens)):
            exact_rows.append(i)
            exact_offsets.append(len(exact_tables))
            exact_tables.extend(table)
            exact_lens.append(length)
    if decode_tables:
        max_blocks = max((n + block_size - 1) // block_size for n in decode_lens)
        padded = [t[:max_blocks] + [0] * (max_blocks - min(len(t), max_blocks)) for t in decode_tables]
        meta.decode_block_index = torch.tensor(padded, dtype=torch.long).reshape(-1)
        meta.decode_max_blocks = max_blocks
        meta.decode_len0 = decode_lens[0]
        lens = torch.tensor(decode_lens, dtype=torch.long)
        meta.decode_mask = (torch.arange(max_blocks * block_size)[None, :] < lens[:, None]).view(
            len(decode_tables), 1, 1, -1
        )
    token_start = len(decode_tables)
    for table, ctx_start, num_new, *prompt_only in prefill_specs:
        positions = torch.arange(ctx_start, ctx_start + num_new)
        blocks = torch.tensor(table, dtype=torch.long)
        slots.extend((blocks[positions // block_size] * block_size + positions % block_size).tolist())
        if ctx_start == 0:
            last = meta.prefills[-1] if meta.prefills else None
            if last is not None and last.ctx_start == 0 and last.num_new == num_new:
                last.num_seqs += 1  # consecutive fresh prompts of one length: one batched SDPA
                token_start += num_new
                continue
            seg = PrefillSegment(token_start, num_new, 0, None, None)
        else:
            total = ctx_start + num_new
            nblocks = (total + block_size - 1) // block_size
            mask = torch.arange(total)[None, :] <= positions[:, None]
            accum = torch.float32 if prompt_only and prompt_only[0] else decode_accum
            seg = PrefillSegment(token_start, num_new, ctx_start, blocks[:nblocks], mask, accum=accum)
            if exact and accum == torch.float64:
                exact_segments.add(len(meta.prefills))
                offset = len(exact_tables)
                exact_tables.extend(table[:nblocks])
                exact_rows.extend(range(token_start, token_start + num_new))
                exact_offsets.extend([offset] * num_new)
                exact_lens.extend(range(ctx_start + 1, ctx_start + num_new + 1))
        meta.prefills.append(seg)
        token_start += num_new
    meta.slot_mapping = torch.tensor(slots, dtype=torch.long)
    if exact_rows:
        meta.exact = ExactRows(*(torch.tensor(v, dtype=torch.long) for v in
                                 (exact_rows, exact_tables, exact_offsets, exact_lens)), frozenset(exact_segments))
    return meta


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store new K/V rows [T, kv_heads, head_dim] into their pool slots (rows may be strided views)."""
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    lib = native.lib()
    if (lib is not None and k_cache.dtype in NATIVE_KV_DTYPES and k_cache.is_contiguous() and v_cache.is_contiguous()
            and slot_mapping.dtype == torch.long and k.shape[0] == v.shape[0] == slot_mapping.shape[0]
            and all(_native_rows(t, heads, dim) for t in (k, v))):
        slots = slot_mapping.contiguous()
        for src, pool in ((k, k_cache), (v, v_cache)):
            status = lib.pdd_store_rows(src.data_ptr(), src.stride(0), src.shape[0], heads * dim, slots.data_ptr(),
                                        pool.data_ptr(), pool.shape[0] * pool.shape[1], NATIVE_KV_DTYPES[pool.dtype])
            if status != 0:
                raise IndexError(f"KV slot outside the pool of {pool.shape[0] * pool.shape[1]} slots")
        return
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _native_rows(t: torch.Tensor, heads: int, dim: int) -> bool:
    """float32 CPU rows of [heads, dim] contiguous vectors, the rows themselves at any stride."""
    return (t.dtype == torch.float32 and t.device.type == "cpu" and t.shape[1:] == (heads, dim) and t.stride(2) == 1
            and t.stride(1) == dim)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return cache.index_select(0, block_ids).to(dtype)


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """One query token per sequence over its gathered blocks. q [B, Hq, D] -> [B, Hq, D]."""
    nd, hq, dim = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    length = meta.decode_max_blocks * k_cache.shape[1]
    kg = _gather(k_cache, meta.decode_block_index, meta.decode_accum).view(nd, length, hkv, dim)
    vg = _gather(v_cache, meta.decode_block_index, meta.decode_accum).view(nd, length, hkv, dim)
    qg = q.to(meta.decode_accum).view(nd, hkv, group, dim)
    if nd == 1:
        # a single sequence needs no padding mask: plain matmul attention over its exact length
        n = meta.decode_len0
        scores = torch.matmul(qg, kg[:, :n].permute(0, 2, 3, 1)).mul_(scale)
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, vg[:, :n].transpose(1, 2))
    else:
        out = F.scaled_dot_product_attention(
            qg, kg.transpose(1, 2), vg.transpose(1, 2), attn_mask=meta.decode_mask, scale=scale
        )
    return out.reshape(nd, hq, dim)


def _exact_attention(
    q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, exact: ExactRows,
    scale: float,
) -> None:
    """The exact rows through our C kernel, straight from the pool, into their rows of ``out``."""
    hq, dim = q.shape[1], q.shape[2]
    if q.stride(2) != 1 or q.stride(1) != dim:
        q = q.contiguous()
    status = native.lib().pdd_paged_attention(
        q.data_ptr(), q.stride(0), out.data_ptr(), hq, k_cache.shape[2], dim, k_cache.data_ptr(), v_cache.data_ptr(),
        NATIVE_KV_DTYPES[k_cache.dtype], k_cache.shape[1], exact.rows.data_ptr(), exact.tables.data_ptr(),
        exact.offsets.data_ptr(), exact.lens.data_ptr(), exact.rows.shape[0], scale, torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"paged attention kernel failed (status {status}: -1 no memory, -2 bad sizes)")


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write the new K/V into the pool and attend. q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq*D] (q's dtype).

    K/V are read as stored in the pool (so a fresh prompt sees the values an extend gathers), and the
    reductions run wider than the model dtype, which is what makes a handoff exact (docs/ENGINE.md):
    * decode tokens and extends of output tokens (a handoff's known tokens, a preempted request's recompute)
      accumulate in ``meta.decode_accum``: float64 in the
      batch-invariant mode (the default; fp32 when a deployment turns it off for speed). The BLAS behind torch takes a
      different reduction order for one query row than for n rows, and for one sequence than for a batch
      (up to 1e-5 apart in fp32 scores), so the same position computed by a decode step, inside a larger
      batch, or in main decode's extend over the relay's tokens came out ~1e-7 apart in fp32 and flipped
      bf16 roundings of the residual stream (greedy tokens drifted after 20-150 outputs). In float64 those
      differences are ~1e-16 and vanish in the rounding to the model dtype: the rows are bit-identical.
      Where our C kernel is built (kernels/cpu_attention.c) and q is fp32, these rows go to it instead:
      float64 in one fixed order per row, read straight from the pool (no gather, no float64 copies of
      K/V), so decode and extend give the same bits by construction, and a batch-32 step skips the
      gather and conversions that cost it ~38 ms (docs/ENGINE.md).
    * a fresh prompt (no cached context) runs fp32 SDPA: every path prefills a prompt the same way, so
      nothing needs to agree with it but itself. So does an extend of prompt tokens only (a prefix-cache
      hit, a long prompt's later chunks): no decode ever recomputes them, and in float64 the masked SDPA
      of such an extend took 2.7x the fp32 time (1,800 new tokens over 2,400: 23 s vs 8.5 s per pass).
    """
    write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
    num_tokens, hq, dim = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    nd = meta.num_decode
    out = torch.empty(num_tokens, hq, dim, dtype=q.dtype)
    exact = meta.exact if q.dtype == torch.float32 and k_cache.dtype in NATIVE_KV_DTYPES else None
    if exact is not None:
        _exact_attention(q, out, k_cache, v_cache, exact, scale)
    elif nd:
        out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, meta, scale)
    for index, seg in enumerate(meta.prefills):
        if exact is not None and index in exact.segments:
            continue
        s, n = seg.token_start, seg.num_new
        if seg.ctx_start == 0:
            b = seg.num_seqs
            stored_k, stored_v = k[s : s + b * n].to(k_cache.dtype), v[s : s + b * n].to(v_cache.dtype)
            qs = q[s : s + b * n].float().view(b, n, hq, dim).transpose(1, 2)  # [b, Hq, n, D]
            ks = stored_k.float().view(b, n, hkv, dim).transpose(1, 2)
            vs = stored_v.float().view(b, n, hkv, dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=group > 1)
            out[s : s + b * n] = o.transpose(1, 2).reshape(b * n, hq, dim)
            continue
        qs = q[s : s + n].to(seg.accum).transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        total = seg.ctx_start + n
        ks = _gather(k_cache, seg.block_ids, seg.accum).view(-1, hkv, dim)[:total]
        vs = _gather(v_cache, seg.block_ids, seg.accum).view(-1, hkv, dim)[:total]
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=seg.mask, scale=scale, enable_gqa=group > 1
        )
        out[s : s + n] = o[0].transpose(0, 1)
    return out.reshape(num_tokens, hq * dim)
