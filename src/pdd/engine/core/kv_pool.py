"""Paged KV pool: per-layer K/V block tensors sized from a memory budget, plus a refcounting allocator.

A block is freed when its last holder (a request, or the radix cache) lets go of it, so a
prefix shared by several requests and the cache lives exactly as long as somebody uses it.
"""

from __future__ import annotations

from collections import deque

import torch

from pdd.engine.core.errors import OutOfBlocks
from pdd.shared.kv_layout import KVLayout


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.refcount[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.refcount[b] <= 0:
                raise RuntimeError(f"incref of free block {b}")
            self.refcount[b] += 1

    def decref(self, blocks: list[int]) -> None:
        for b in blocks:
            rc = self.refcount[b] - 1
            if rc < 0:
                raise RuntimeError(f"double free of block {b}")
            self.refcount[b] = rc
            if rc == 0:
                self._free.append(b)


class KVPool:
    """K and V tensors per layer of [num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu") -> None:
        if num_blocks < 1:
            raise ValueError("KV pool needs at least one block; raise kv_memory_bytes")
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (num_blocks, layout.block_size, layout.kv_heads, layout.head_dim)
        dtype = layout.torch_dtype
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]
        self.allocator = BlockAllocator(num_blocks)

    @staticmethod
    def blocks_for_budget(layout: KVLayout, memory_bytes: int) -> int:
        per_block = 2 * layout.num_layers * layout.bytes_per_block_per_tensor
        return int(memory_bytes // per_block)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)
