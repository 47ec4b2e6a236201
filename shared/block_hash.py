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
    """Chained hashes of every full block of token_ids (what a router computes for lookups)."""
    out, parent = [], ROOT_HASH
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        out.append(parent)
    return out
