"""What the torch and emulated engines share: the request table and every request call of the engine
interface over one paged KV pool, one radix cache and one scheduler. A backend adds how a step computes
(``step``: the torch engine's forward pass, the emulated engine's cost-model wait and oracle tokens).

Lifecycle of a request (docs/ENGINE.md): add_request -> step()* -> finished StepOutput. Disaggregation hooks:
hold_kv + request_blocks + release (export side), prepare_import + commit_import (import side),
extend_known + stop_at (relay -> main handoff). The services see only the members engine/interface.py's
``EngineBackend`` states.

Why one module: ``PagedEngine`` is one object with one job, the request API over parts that live apart (the
pool, the radix cache, the scheduler, validation); every method reads or changes the same request table,
pool and scheduler queues on the one worker thread, so its invariants stay readable in one place.
"""

from __future__ import annotations

import abc
import itertools
from typing import TYPE_CHECKING, Any

from pdd.engine.core.dtypes import DtypeChoice
from pdd.engine.core.errors import EngineInputError, OutOfBlocks, PromptTooLongError, UnknownRequestError
from pdd.engine.core.kv_pool import KVPool
from pdd.engine.core.radix_cache import CacheEvent, RadixCache
from pdd.engine.core.request import ImportReservation, Request, Status, StepOutput
from pdd.engine.core.sampling_params import SamplingParams
from pdd.engine.core.scheduler import DEFAULT_PREFILL_CHUNK_TOKENS, Scheduler
from pdd.engine.core.validation import check_commit, check_new_request, check_token_ids, checked_params
from pdd.shared.kv_layout import KVLayout

if TYPE_CHECKING:
    import torch


class PagedEngine(abc.ABC):
    """The request API of engine/interface.py over a paged pool, a radix cache and a continuous-batching
    scheduler; subclasses implement ``step`` (and may add to ``stats``)."""

    dtype_choice: DtypeChoice

    def __init__(self, layout: KVLayout, num_blocks: int, *, position_limit: int, vocab_size: int,
                 eos_token_ids: list[int], tokenizer: Any = None, max_num_seqs: int = 64,
                 max_prefill_tokens: int = 4096, prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
                 enable_prefix_cache: bool = True, cache_finished: bool = True) -> None:
        """``prefill_chunk_tokens``: the most tokens one request computes per step (at most the step budget,
        ``max_prefill_tokens``): a long prompt shares each step with the requests queued behind it.
        ``tokenizer``: only for ``stop`` strings (None: they are not matched)."""
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}")
        block_size = layout.block_size
        self.layout = layout
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.pool = KVPool(layout, num_blocks)
        self.cache = RadixCache(self.pool.allocator, block_size)
        self.scheduler = Scheduler(
            self.pool.allocator, self.cache, block_size, max_num_seqs, max_prefill_tokens, enable_prefix_cache,
            prefill_chunk_tokens,
        )
        self.max_context = min(position_limit, num_blocks * block_size)
        self.enable_prefix_cache = enable_prefix_cache
        self.cache_finished = cache_finished
        self.eos_token_ids: list[int] = eos_token_ids
        self.requests: dict[str, Request] = {}
        self._pending: list[StepOutput] = []
        self.num_forward_tokens = 0

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @abc.abstractmethod
    def step(self) -> list[StepOutput]:
        """One batch: the backend's compute over ``self.scheduler.schedule()`` (engine/interface.py)."""

    @property
    @abc.abstractmethod
    def linear_kernel(self) -> str:
        """What computes the projections (logged at startup)."""

    def describe(self) -> dict[str, Any]:
        return {}

    def kv_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The pool's per-layer K and V tensors (what a transport registers); see engine/interface.py."""
        return self.pool.k_cache, self.pool.v_cache

    def has_request(self, rid: str) -> bool:
        return rid in self.requests

    def drain_cache_events(self) -> list[CacheEvent]:
        """The radix cache's stored/removed block events since the last call (empties its queue)."""
        return self.cache.drain_events()

    def num_free_blocks(self) -> int:
        return self.pool.allocator.num_free

    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    def kv_pool_bytes(self) -> int:
        return self.pool.nbytes

    def has_work(self) -> bool:
        idle = all(r.paused and r.num_pending == 0 for r in self.scheduler.running)
        return bool(not idle or self.scheduler.waiting or self._pending)

    def cached_prefix_len(self, token_ids: list[int]) -> int:
        """Leading tokens of token_ids held in the radix cache (block aligned); no locking."""
        return self.cache.match_len(list(token_ids)) if self.enable_prefix_cache else 0

    def stats(self) -> dict[str, Any]:
        s = self.cache.stats
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "free_blocks": self.num_free_blocks(),
            "total_blocks": self.num_total_blocks(),
            "cached_blocks": self.cache.cached_blocks,
            "evictable_blocks": self.cache.evictable_blocks,
            "cache_queries": s.queries,
            "cache_hit_tokens": s.hit_tokens,
            "cache_query_tokens": s.query_tokens,
            "cache_hit_rate": s.hit_rate,
            "preemptions": self.scheduler.num_preemptions,
            # what holds KV right now, by request (the first 16): where a leak shows which request and state
            "held_requests": {rid: req.status.name for rid, req in itertools.islice(self.requests.items(), 16)},
        }

    def _get(self, rid: str) -> Request:
        req = self.requests.get(rid)
        if req is None:
            raise UnknownRequestError(f"unknown request id {rid!r}")
        return req

    # ---- normal path ------------------------------------------------------------------------
    def add_request(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        max_new_tokens: int = 16,
        hold_kv: bool = False,
        known_outputs: list[int] | None = None,
    ) -> None:
        """Queue a request: prefix match, (chunked) prefill, then decode until a stop condition.

        hold_kv: when it finishes, keep its KV blocks pinned for export (request_blocks/release).
        known_outputs: output tokens another engine already produced (request migration): they are
        recomputed with the prompt and sampling continues at output position len(known_outputs).
        """
        prompt_ids = list(prompt_ids)
        check_new_request(rid, prompt_ids, self.requests, self.vocab_size, self.max_context, max_new_tokens)
        params = checked_params(params)
        known = list(known_outputs or [])
        if known:
            check_token_ids(known, self.vocab_size, "known outputs")
            if len(prompt_ids) + len(known) >= self.max_context:
                raise PromptTooLongError(f"request {rid!r}: prompt plus {len(known)} known outputs reach the "
                                         f"context limit {self.max_context}")
        req = Request(rid, prompt_ids + known, len(prompt_ids), params, max_new_tokens, hold_kv=hold_kv)
        if known and self._known_finish_reason(req):
            raise EngineInputError(f"request {rid!r} already finished: its known outputs end it")
        self.requests[rid] = req
        self.scheduler.waiting.append(req)

    def abort(self, rid: str) -> None:
        """Drop a request in any state and free everything it holds (no-op for unknown ids)."""
        req = self.requests.pop(rid, None)
        if req is None:
            return
        self.scheduler.remove(req)
        self.scheduler.release(req, insert=False)

    def finish_to_cache(self, rid: str) -> None:
        """Finish a request now, storing its computed KV in the radix cache before freeing."""
        req = self._get(rid)
        self.scheduler.remove(req)
        self.requests.pop(rid)
        self.scheduler.release(req, insert=True)

    # ---- export (P side) --------------------------------------------------------------------
    def request_blocks(self, rid: str) -> list[int]:
        """Block ids covering the prompt tokens of a request, in order (read these to export)."""
        req = self._get(rid)
        if req.num_computed < req.prompt_len:
            raise EngineInputError(f"request {rid!r} has not finished its prefill")
        return list(req.block_table[: self.scheduler.blocks_for(req.prompt_len)])

    def computed_prompt_blocks(self, rid: str) -> list[int]:
        """The leading blocks of the prompt whose KV is final, for an export that streams while the prefill runs:
        every full block computed so far (a cached prefix included), all of them once the prefill is done.
        Safe to read while later chunks compute: a prefill's blocks are all allocated at admission, and P's
        requests (one output token) never decode, so nothing preempts them (an exporter checks the ids stay)."""
        req = self._get(rid)
        if req.status is Status.WAITING:
            return []
        done = min(req.num_computed, req.prompt_len)
        n = self.scheduler.blocks_for(done) if done == req.prompt_len else done // self.block_size
        return list(req.block_table[:n])

    def release(self, rid: str) -> None:
        """Unpin a held request: store its KV in the radix cache (if enabled) and free it."""
        req = self._get(rid)
        self.scheduler.remove(req)
        self.requests.pop(rid)
        self.scheduler.release(req, insert=self.cache_finished)

    # ---- import (RLD / MD side) -------------------------------------------------------------
    def prepare_import(self, rid: str, prompt_ids: list[int], use_cache: bool = True) -> ImportReservation:
        """Reserve blocks for an incoming prompt KV transfer; reuse (and lock) the cached prefix.

        Raises OutOfBlocks when the pool cannot hold the prompt even after cache eviction.
        """
        prompt_ids = list(prompt_ids)
        check_new_request(rid, prompt_ids, self.requests, self.vocab_size, self.max_context, 1)
        req = Request(rid, prompt_ids, len(prompt_ids), SamplingParams(), 1, status=Status.IMPORTING)
        self.scheduler.attach_prefix(req, len(prompt_ids), use_cache=use_cache)
        first_new = len(req.block_table)
        need = self.scheduler.blocks_for(len(prompt_ids)) - first_new
        if not self.scheduler.can_allocate(need):
            self.scheduler.release(req, insert=False)
            raise OutOfBlocks(
                f"cannot import request {rid!r}: needs {need} KV blocks, "
                f"{self.num_free_blocks()} free + {self.cache.evictable_blocks} evictable"
            )
        self.scheduler.grow(req, len(prompt_ids))
        req.num_computed = 0
        self.requests[rid] = req
        return ImportReservation(req.cached_tokens, list(req.block_table[first_new:]), list(req.block_table))

    def commit_import(
        self,
        rid: str,
        prompt_ids: list[int],
        output_ids_so_far: list[int],
        params: SamplingParams | None = None,
        max_new_tokens: int = 16,
    ) -> None:
        """The prompt's KV has landed: continue the request from output position len(output_ids_so_far).

        output_ids_so_far (at least the first token, from P) have no KV yet: the next step runs
        one extend pass over them, then decoding continues.
        """
        req = self._get(rid)
        check_commit(req, prompt_ids, output_ids_so_far, max_new_tokens, self.vocab_size)
        req.params = checked_params(params)
        req.max_new_tokens = max_new_tokens
        req.num_computed = req.prompt_len
        req.tokens.extend(int(t) for t in output_ids_so_far)
        req.check_known = True
        req.status = Status.RUNNING
        self.scheduler.running.append(req)

    # ---- handoff ----------------------------------------------------------------------------
    def extend_known(self, rid: str, token_ids: list[int], start_position: int | None = None) -> None:
        """Append known output tokens (computed in one pass at the next step).

        start_position: output index of token_ids[0]; outputs from there on that this engine
        produced itself are replaced (default: append after the current outputs).
        """
        req = self._get(rid)
        if req.status not in (Status.RUNNING, Status.WAITING):
            raise EngineInputError(f"request {rid!r} is not running")
        check_token_ids(list(token_ids), self.vocab_size, "extend tokens")
        if start_position is not None:
            if start_position < 0 or start_position > req.num_outputs:
                raise EngineInputError(
                    f"start_position {start_position} leaves a gap: request {rid!r} has {req.num_outputs} outputs"
                )
            keep = req.prompt_len + start_position
            del req.tokens[keep:]
            req.num_computed = min(req.num_computed, keep)
        req.tokens.extend(int(t) for t in token_ids)
        if len(req.tokens) >= self.max_context:
            raise PromptTooLongError(f"request {rid!r} would exceed the context limit {self.max_context}")
        req.check_known = True

    def pause(self, rid: str) -> None:
        """Keep extending known tokens but sample nothing (MD while catch-up batches arrive)."""
        self._get(rid).paused = True

    def resume(self, rid: str) -> None:
        """Sample again from the next output position (no-op when not paused)."""
        req = self._get(rid)
        if not req.paused:
            return
        req.paused = False
        if req.num_pending == 0 and req.num_computed > req.prompt_len:
            req.num_computed -= 1  # re-run the last known token to get the logits of the next one

    def stop_at(self, rid: str, position: int) -> None:
        """Produce only outputs with index < position, then finish with reason 'length'."""
        req = self._get(rid)
        req.stop_position = int(position)
        req.check_known = True

    # ---- the step ---------------------------------------------------------------------------
    def _finishes_before_step(self) -> list[StepOutput]:
        """Outputs queued since the last step, plus the requests whose known tokens already end them
        (``stop_at``, a stop in handed-over ids): every backend's step starts with these."""
        outputs, self._pending = self._pending, []
        for req in [r for r in self.scheduler.running if r.check_known]:
            req.check_known = False
            reason = self._known_finish_reason(req)
            if reason:
                self._finish(req, reason)
                outputs.append(StepOutput(req.rid, [], req.num_outputs, True, reason))
        return outputs

    def _known_finish_reason(self, req: Request) -> str | None:
        if req.stop_position is not None and req.num_outputs >= req.stop_position:
            return "length"
        if req.num_outputs and not req.params.ignore_eos and req.tokens[-1] in self.eos_token_ids:
            return "stop"
        if req.num_outputs >= req.max_new_tokens or len(req.tokens) >= self.max_context:
            return "length"
        return None

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            return "stop"
        if p.stop and req.num_outputs > p.min_tokens and self.tokenizer is not None and self._hits_stop_string(req):
            return "stop"
        if req.num_outputs >= req.max_new_tokens or len(req.tokens) >= self.max_context:
            return "length"
        if req.stop_position is not None and req.num_outputs >= req.stop_position:
            return "length"
        return None

    def _hits_stop_string(self, req: Request) -> bool:
        longest = max(len(s) for s in req.params.stop)
        tail = req.output_ids[-(longest + 8) :]
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        return any(s in text for s in req.params.stop)

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.running.remove(req)
        if req.hold_kv:
            req.status = Status.HELD
            if self.cache_finished:
                self.scheduler.share_prompt(req)
            return
        self.requests.pop(req.rid, None)
        self.scheduler.release(req, insert=self.cache_finished)

    # ---- convenience ------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | None = None, max_new_tokens: int = 16
    ) -> list[list[int]]:
        """Run prompts to completion (tests, CLI, benchmark); returns output ids per prompt."""
        base = len(self.requests)
        rids = [f"gen-{id(self)}-{base}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(rids, prompts):
            self.add_request(rid, prompt, params, max_new_tokens)
        out: dict[str, list[int]] = {rid: [] for rid in rids}
        while any(rid in self.requests for rid in rids):
            for o in self.step():
                if o.rid in out:
                    out[o.rid].extend(o.token_ids)
        return [out[rid] for rid in rids]
