"""Chained hashes of whole token blocks: the key the engines' radix caches report and the router's
prefix index looks up. Here, not in the engine, so the router hashes prompts without loading the
engine (or torch)."""

from __future__ import annotations

import numpy as np
import xxhash

ROOT_HASH = 0


def block_hash(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """Hash of one block chained on its parent: equal hashes mean equal whole prefixes."""
    h = xxhash.xxh64(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.intdigest()


def prefix_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of token_ids (what a router computes for lookups); ``block_hash``
    chained, with the ids converted to bytes once (a 64K-token prompt: ~3 ms instead of ~6)."""
    n = len(token_ids) // block_size
    data = memoryview(np.asarray(token_ids[: n * block_size], dtype=np.int64).tobytes())
    step = block_size * 8
    out, parent = [], ROOT_HASH
    for i in range(n):
        h = xxhash.xxh64(parent.to_bytes(8, "little"))
        h.update(data[i * step : (i + 1) * step])
        parent = h.intdigest()
        out.append(parent)
    return out
