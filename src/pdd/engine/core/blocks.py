"""Per-request block bookkeeping over the pool's allocator and the radix cache: one implementation for every
backend (the torch and emulated engines' scheduler is one; the vLLM backend keeps its staging blocks with one).

A request's ``block_table`` holds its blocks in order; a cached prefix it starts from is referenced (the
allocator's refcount) and its radix node locked, so eviction never takes blocks a request still reads.
"""

from __future__ import annotations

from pdd.engine.core.kv_pool import BlockAllocator
from pdd.engine.core.radix_cache import RadixCache
from pdd.engine.core.request import Request


class BlockBook:
    """Blocks for requests: allocate (evicting unlocked cache entries), attach a cached prefix, give back."""

    def __init__(self, allocator: BlockAllocator, cache: RadixCache, block_size: int,
                 enable_prefix_cache: bool = True) -> None:
        self.allocator = allocator
        self.cache = cache
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, n: int) -> bool:
        return n <= self.allocator.num_free + self.cache.evictable_blocks

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, evicting unlocked cache entries if needed (raises OutOfBlocks)."""
        short = n - self.allocator.num_free
        if short > 0:
            self.cache.evict(short)
        return self.allocator.allocate(n)

    def grow(self, req: Request, num_tokens: int) -> None:
        need = self.blocks_for(num_tokens) - len(req.block_table)
        if need > 0:
            req.block_table.extend(self.allocate(need))

    def attach_prefix(self, req: Request, limit: int, use_cache: bool = True) -> None:
        """Start req's block table with the cached prefix of tokens[:limit] (locked, referenced)."""
        if not (use_cache and self.enable_prefix_cache):
            return
        match = self.cache.match(req.tokens[:limit])
        if match.num_tokens:
            self.cache.lock(match.node)
            self.allocator.incref(match.blocks)
            req.cache_node = match.node
            req.block_table = list(match.blocks)
            req.num_computed = req.cached_tokens = match.num_tokens

    def share_prompt(self, req: Request) -> None:
        """Store req's computed prompt KV in the radix cache now, locked until its ``release``: a held request
        (P keeping the KV for a transfer) serves prefix hits while the transfer runs, as SGLang caches an
        unfinished request. Without it, a session's next turn that reached P before the previous turn's KV
        had crossed the WAN missed that whole prompt."""
        if not self.enable_prefix_cache or not req.num_computed:
            return
        prompt = req.tokens[: min(req.num_computed, req.prompt_len)]
        self.cache.insert(prompt, req.block_table)
        match = self.cache.match(prompt, record=False)
        if not match.num_tokens:
            return
        self.cache.lock(match.node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = match.node

    def release(self, req: Request, insert: bool) -> None:
        """Drop every block and lock of req; optionally first store its computed KV in the cache."""
        if insert and self.enable_prefix_cache and req.num_computed:
            self.cache.insert(req.tokens[: req.num_computed], req.block_table)
        self.allocator.decref(req.block_table)
        req.block_table = []
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
            req.cache_node = None
        req.num_computed = req.cached_tokens = 0
