"""Continuous-batching scheduler: picks each step's decode tokens and prefill/extend chunks.

Policy (per step): every running request advances — one token if it is decoding, otherwise a
chunk of its pending tokens (chunked prefill or extend) within the step's prefill-token
budget and at most ``prefill_chunk_tokens`` per request; then waiting requests are admitted in
arrival order while the batch has room and the pool has blocks for their whole prompt (free
blocks plus evictable cache). The per-request cap keeps a long prompt from holding the whole
budget for several steps: the requests queued behind it get their chunks in the same step (vLLM's
long_prefill_token_threshold; measured on P in bench/pipelines.py, docs/BENCHMARKS.md). When a
running request cannot get a block, the newest running request is preempted: its computed KV goes
to the radix cache and it is queued again, so it resumes by recompute (mostly a cache hit).
"""

from __future__ import annotations

from collections import deque

from pdd.engine.kv_pool import BlockAllocator
from pdd.engine.radix_cache import RadixCache
from pdd.engine.request import Request, Status

# The most tokens one request computes per step unless configured: a 512-token chunk of SmolLM2 takes
# ~1 s on one core, so a request queued behind a 2,400-token prompt waits about that, not its whole prefill.
DEFAULT_PREFILL_CHUNK_TOKENS = 512


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        cache: RadixCache,
        block_size: int,
        max_num_seqs: int,
        max_prefill_tokens: int,
        enable_prefix_cache: bool = True,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
    ) -> None:
        self.allocator = allocator
        self.cache = cache
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_chunk_tokens = min(prefill_chunk_tokens, max_prefill_tokens)
        self.enable_prefix_cache = enable_prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- block bookkeeping ----------------------------------------------------------------
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

    def preempt(self, req: Request) -> None:
        self.release(req, insert=True)
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def remove(self, req: Request) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)

    # ---- the step plan --------------------------------------------------------------------
    def schedule(self) -> tuple[list[Request], list[tuple[Request, int]]]:
        """Returns (decode requests, [(prefill/extend request, number of new tokens)])."""
        decode: list[Request] = []
        prefill: list[tuple[Request, int]] = []
        budget = self.max_prefill_tokens
        i = 0
        while i < len(self.running):
            req = self.running[i]
            pending = req.num_pending
            # a paused request only extends known tokens: always a chunk, never a decode (no sampling)
            n = 1 if pending == 1 and not req.paused else min(pending, budget, self.prefill_chunk_tokens)
            if n <= 0:
                i += 1
                continue
            need = self.blocks_for(req.num_computed + n) - len(req.block_table)
            while need > 0 and not self.can_allocate(need) and self.running[-1] is not req:
                self.preempt(self.running.pop())
            if need > 0 and not self.can_allocate(need):
                self.running.pop(i)  # req is the newest: preempt itself
                self.preempt(req)
                continue
            self.grow(req, req.num_computed + n)
            if pending == 1 and not req.paused:
                decode.append(req)
            else:
                prefill.append((req, n))
                budget -= n
            i += 1
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            if not req.block_table:
                self.attach_prefix(req, len(req.tokens) - 1)
            need = self.blocks_for(len(req.tokens)) - len(req.block_table)
            if not self.can_allocate(need):
                self.release(req, insert=False)  # do not pin cache entries while queued
                break
            self.grow(req, len(req.tokens))
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            n = min(req.num_pending, budget, self.prefill_chunk_tokens)
            prefill.append((req, n))
            budget -= n
        return decode, prefill
