"""The engine: one model, one paged KV pool, one radix cache, one scheduler, and the API the
prefill, relay and main-decode services drive from a single worker thread.

Lifecycle of a request (see docs/ENGINE.md): add_request -> step()* -> finished StepOutput.
Disaggregation hooks: hold_kv + request_blocks + release (export side), prepare_import +
commit_import (import side), extend_known + stop_at (relay -> main handoff). The services see only
the members engine/interface.py's ``EngineBackend`` states.

Why one module: ``Engine`` is one object with one job, the request API over parts that already live
apart (kv_pool, radix_cache, scheduler, sampling, model); every method reads or changes the same
request table, pool and scheduler queues on the one worker thread, so its invariants stay readable
in one place.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pdd.engine.config import ModelConfig
from pdd.engine.cpu_features import DtypeChoice, resolve_dtypes
from pdd.engine.dtype_probe import probe_dtype
from pdd.engine.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    EngineInputError,
    OutOfBlocks,
    PromptTooLongError,
    UnknownRequestError,
)
from pdd.engine.kv_pool import KVPool
from pdd.engine.model import CausalLM
from pdd.engine.radix_cache import CacheEvent, RadixCache
from pdd.engine.request import ImportReservation, Request, Status, StepOutput
from pdd.engine.sampling import SamplingParams, sample_rows, token_logprobs
from pdd.engine.scheduler import DEFAULT_PREFILL_CHUNK_TOKENS, Scheduler
from pdd.kernels import build_attention_metadata
from pdd.shared.backends import Backend
from pdd.shared.kv_layout import KVLayout, dtype_from_name

DEFAULT_KV_MEMORY_BYTES = 512 * 1024 * 1024


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Any = None,
        *,
        kv_memory_bytes: int = DEFAULT_KV_MEMORY_BYTES,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_prefill_tokens: int = 4096,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        max_model_len: int | None = None,
        enable_prefix_cache: bool = True,
        cache_finished: bool = True,
        dtype_choice: DtypeChoice | None = None,
        batch_invariant: bool = True,
    ) -> None:
        """``batch_invariant``: decode-phase attention accumulates in float64, so a request's tokens do not
        depend on its batch mates or on extend vs decode (kernels/attention.py; what makes a handoff exact).
        ``prefill_chunk_tokens``: the most tokens one request computes per step (at most the step budget,
        ``max_prefill_tokens``): a long prompt shares each step with the requests queued behind it."""
        cfg = model.config
        self.model = model
        self.config: ModelConfig = cfg
        self.tokenizer = tokenizer
        weights_dtype = _dtype_name(model.dtype)
        self.dtype_choice = dtype_choice or DtypeChoice(weights_dtype, weights_dtype, "set by the caller")
        self.layout = KVLayout(
            num_layers=cfg.num_layers,
            block_size=block_size,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype_choice.kv_dtype,
            backend=Backend.TORCH.value,
        )
        if num_blocks is None:
            num_blocks = KVPool.blocks_for_budget(self.layout, kv_memory_bytes)
        limit = cfg.max_position_embeddings if max_model_len is None else min(max_model_len, cfg.max_position_embeddings)
        eos = list(cfg.eos_token_ids)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in eos:
            eos.append(int(tok_eos))
        self._init_serving(num_blocks, limit, eos, max_num_seqs, max_prefill_tokens, prefill_chunk_tokens,
                           enable_prefix_cache, cache_finished)
        self.decode_accum = torch.float64 if batch_invariant else torch.float32

    def _init_serving(self, num_blocks: int, position_limit: int, eos_token_ids: list[int], max_num_seqs: int,
                      max_prefill_tokens: int, prefill_chunk_tokens: int, enable_prefix_cache: bool,
                      cache_finished: bool) -> None:
        """Everything but the model, on ``self.layout``: pool, prefix cache, scheduler, the request table.
        Shared with the emulated backend (engine/emulated.py), which has no model."""
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}")
        block_size = self.layout.block_size
        self.pool = KVPool(self.layout, num_blocks)
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
        self.capture_logits = False  # tests: keep each sampled row's logits in captured_logits
        self.captured_logits: dict[str, list[torch.Tensor]] = {}

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_model(
        cls,
        path: str = "default",
        dtype: str = "float32",
        *,
        kv_dtype: str = "auto",
        load_tokenizer: bool = True,
        num_threads: int | None = None,
        **kwargs: Any,
    ) -> "Engine":
        """Load a HF checkpoint folder, a .gguf file, or "default" (the packaged SmolLM2 GGUF).

        ``dtype``/``kv_dtype``: "auto" resolves by timing the model's layer shapes in both dtypes on this CPU
        (engine/dtype_probe.py, cached); ``engine.dtype_choice`` says what was picked and why.
        """
        from pdd.engine.loader import load_checkpoint
        from pdd.shared.model_files import resolve_model_path
        from pdd.shared.tokenizer import load_tokenizer as _load_tok

        if num_threads is None:
            num_threads = int(os.environ.get("PDD_NUM_THREADS", 0)) or os.cpu_count() or 1
        torch.set_num_threads(num_threads)
        path = resolve_model_path(path)
        config, weights = load_checkpoint(path)
        choice = resolve_dtypes(dtype, kv_dtype, probe=lambda: probe_dtype(config))
        model = CausalLM(config, weights, dtype_from_name(choice.dtype))
        del weights
        tokenizer = _load_tok(path) if load_tokenizer else None
        return cls(model, tokenizer, dtype_choice=choice, **kwargs)

    # ---- introspection ----------------------------------------------------------------------
    @property
    def k_cache(self) -> list[torch.Tensor]:
        return self.pool.k_cache

    @property
    def v_cache(self) -> list[torch.Tensor]:
        return self.pool.v_cache

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def linear_kernel(self) -> str:
        return self.model.linear_kernel

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
        }

    # ---- validation -------------------------------------------------------------------------
    def _check_new(self, rid: str, prompt_ids: list[int], params: SamplingParams | None, max_new_tokens: int) -> SamplingParams:
        if rid in self.requests:
            raise DuplicateRequestError(f"request id {rid!r} is already in use")
        if not prompt_ids:
            raise EmptyPromptError("prompt is empty: at least one token is required")
        vocab = self.config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_ids):
            raise EngineInputError(f"prompt contains token ids outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_context:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens; the context limit is {self.max_context} "
                "(prompt plus at least one generated token)"
            )
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise EngineInputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        params = params or SamplingParams()
        params.validate()
        return params.with_seed()

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
        params = self._check_new(rid, prompt_ids, params, max_new_tokens)
        known = list(known_outputs or [])
        if known:
            self._check_tokens(known)
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
        self._check_new(rid, prompt_ids, None, 1)
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
        if req.status is not Status.IMPORTING:
            raise EngineInputError(f"request {rid!r} is not awaiting an import")
        if list(prompt_ids) != req.prompt_ids:
            raise EngineInputError(f"commit_import for {rid!r}: prompt differs from prepare_import")
        if not output_ids_so_far:
            raise EngineInputError("output_ids_so_far must hold at least the first generated token")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise EngineInputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        self._check_tokens(output_ids_so_far)
        params = params or SamplingParams()
        params.validate()
        req.params = params.with_seed()
        req.max_new_tokens = max_new_tokens
        req.num_computed = req.prompt_len
        req.tokens.extend(int(t) for t in output_ids_so_far)
        req.check_known = True
        req.status = Status.RUNNING
        self.scheduler.running.append(req)

    def _check_tokens(self, token_ids: list[int]) -> None:
        vocab = self.config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in token_ids):
            raise EngineInputError(f"token ids outside the vocabulary [0, {vocab})")

    # ---- handoff ----------------------------------------------------------------------------
    def extend_known(self, rid: str, token_ids: list[int], start_position: int | None = None) -> None:
        """Append known output tokens (computed in one pass at the next step).

        start_position: output index of token_ids[0]; outputs from there on that this engine
        produced itself are replaced (default: append after the current outputs).
        """
        req = self._get(rid)
        if req.status not in (Status.RUNNING, Status.WAITING):
            raise EngineInputError(f"request {rid!r} is not running")
        self._check_tokens(list(token_ids))
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

    def step(self) -> list[StepOutput]:
        """Run one forward pass over the scheduled batch; return new tokens and finishes."""
        outputs = self._finishes_before_step()
        decode, prefill = self.scheduler.schedule()
        if not decode and not prefill:
            return outputs
        input_ids: list[int] = [r.tokens[r.num_computed] for r in decode]
        positions: list[int] = [r.num_computed for r in decode]
        sample_reqs: list[Request] = list(decode)
        rows: list[int] = list(range(len(decode)))
        specs = []
        offset = len(decode)
        for req, n in prefill:
            start = req.num_computed
            input_ids.extend(req.tokens[start : start + n])
            positions.extend(range(start, start + n))
            specs.append((req.block_table, start, n, start + n <= req.prompt_len))  # prompt only: fp32 attention
            offset += n
            if start + n == len(req.tokens) and not req.paused:
                sample_reqs.append(req)
                rows.append(offset - 1)
        meta = build_attention_metadata(
            self.block_size, [r.block_table for r in decode], [r.num_computed + 1 for r in decode], specs,
            self.decode_accum,
        )
        logits = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            meta,
            self.pool.k_cache,
            self.pool.v_cache,
            torch.tensor(rows, dtype=torch.long),
        )
        self.num_forward_tokens += len(input_ids)
        for r in decode:
            r.num_computed += 1
        for req, n in prefill:
            req.num_computed += n
        if sample_reqs:
            params = [r.params for r in sample_reqs]
            tokens = sample_rows(logits, params, [r.num_outputs for r in sample_reqs],
                                 [(r.tokens, r.prompt_len) for r in sample_reqs], self.eos_token_ids)
            logprobs = token_logprobs(logits, tokens, [p.logprobs for p in params])
            if self.capture_logits:
                for i, req in enumerate(sample_reqs):
                    self.captured_logits.setdefault(req.rid, []).append(logits[i].clone())
            for req, tok, lp in zip(sample_reqs, tokens, logprobs):
                position = req.num_outputs
                req.tokens.append(tok)
                reason = self._finish_reason(req, tok)
                if reason:
                    self._finish(req, reason)
                outputs.append(StepOutput(req.rid, [tok], position, reason is not None, reason,
                                          None if lp is None else [lp]))
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


def _dtype_name(dtype: torch.dtype) -> str:
    from pdd.shared.kv_layout import dtype_name

    return dtype_name(dtype)


__all__ = ["Engine"]
