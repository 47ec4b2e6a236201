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

from pdd.engine.core.blocks import BlockBook
from pdd.engine.core.kv_pool import BlockAllocator
from pdd.engine.core.radix_cache import RadixCache
from pdd.engine.core.request import Request, Status

# The most tokens one request computes per step unless configured: a 512-token chunk of SmolLM2 takes
# ~1 s on one core, so a request queued behind a 2,400-token prompt waits about that, not its whole prefill.
DEFAULT_PREFILL_CHUNK_TOKENS = 512


class Scheduler(BlockBook):
    """The step plan over a ``BlockBook``: the waiting queue, the running batch, preemption."""

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
        super().__init__(allocator, cache, block_size, enable_prefix_cache)
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_chunk_tokens = min(prefill_chunk_tokens, max_prefill_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

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
    def chunk(self, req: Request, budget: int) -> int:
        """How many pending tokens ``req`` computes this step: within the budget and the per-request cap, and
        never past the end of its prompt. A recompute (known outputs of a migrated request, a preempted
        request) thus runs its prompt as a prompt and its outputs as an extend of output tokens, as the run
        that produced them did (a fresh prompt's pass attends in fp32, an extend of outputs in float64:
        kernels/attention.py); one pass over both attended the outputs in fp32, and the bf16 tokens drifted."""
        n = min(req.num_pending, budget, self.prefill_chunk_tokens)
        if req.num_computed < req.prompt_len:
            n = min(n, req.prompt_len - req.num_computed)
        return n

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
            n = 1 if pending == 1 and not req.paused else self.chunk(req, budget)
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
            n = self.chunk(req, budget)
            prefill.append((req, n))
            budget -= n
        return decode, prefill
