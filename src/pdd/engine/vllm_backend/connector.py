"""PDD's KV connector for vLLM: copies a request's KV between vLLM's paged cache and PDD's staging pool.

vLLM loads it by name through its public KV-connector API (``KVTransferConfig(kv_connector="PDDConnector",
kv_connector_module_path="pdd.engine.vllm_backend.connector")``); nothing of vLLM is patched. The engine
(engine/vllm_backend/engine.py) embeds vLLM in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
both halves of the connector (vLLM builds one for its scheduler and one for its worker) reach the engine's
``StagingBook`` through the registry below, named by ``kv_connector_extra_config["pdd_book"]``.

The staging pool is an ordinary PDD KV pool (per layer, K and V of ``[blocks, block_size, kv_heads,
head_dim]``): PDD's transports register it and move its blocks, PDD's radix cache indexes it. The connector
only moves KV between it and vLLM's cache, whole blocks at a time: one block size for both, and a block's
values kept in the order vLLM's attention kernel wrote them (on CPU a packed order per ISA; the layout's
``backend`` names it, so only engines that agree exchange pages):

- *load* (RLD, MD; P on a staging prefix hit): the tokens ``[vLLM's own prefix hit, plan.load_tokens)`` are
  copied from staging into the blocks vLLM allocated, before the forward (``start_load_kv``); vLLM is told
  they are computed (``get_num_new_matched_tokens``, synchronous) and computes only the rest: at MD, the
  first token and the relay's tokens, in one extend pass.
- *save* (P: the prompt, partial last block included, for export; MD: every full block as it is computed,
  for the decode-side prefix cache): after the forward (``wait_for_save``), the tokens whose KV is in vLLM's
  cache and not yet in staging are copied out, before vLLM can free or reuse their blocks.

vLLM's CPU cache layout (``[blocks, kv_heads, block_size, 2 * head_dim]``: per head, a block's K values then
its V values) and the CUDA flash-attention one (``[2, blocks, block_size, kv_heads, head_dim]``) are both
understood; another raises at registration.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from pdd.shared.telemetry import get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = get_logger("pdd.vllm_connector")

BOOK_KEY = "pdd_book"  # kv_connector_extra_config: which engine's StagingBook
RID_KEY = "pdd_rid"  # a request's kv_transfer_params: PDD's request id (vLLM appends a suffix to its own)


class ConnectorError(RuntimeError):
    """The connector was asked for something its state cannot serve (a bug or a corrupt plan)."""


@dataclass
class TransferPlan:
    """What the connector does for one request, set by the engine before vLLM sees the request.

    ``staging_blocks`` covers the tokens ``[0, len * block_size)`` in staging. ``load_tokens``: leading tokens
    whose KV staging holds for vLLM to load. ``save_until``: copy computed KV into staging up to this token
    (P: the prompt length); ``None``: every full staging block as it is computed (``grow`` adds blocks; when it
    cannot, saving stops there). ``saved_through``: tokens already in staging.
    """

    rid: str
    staging_blocks: list[int]
    load_tokens: int = 0
    save_until: int | None = 0
    saved_through: int = 0
    vllm_blocks: list[int] = field(default_factory=list)  # scheduler side: the request's vLLM block table
    pending_load: tuple[int, int] | None = None  # scheduler side: token range to load at its next schedule
    failed: str | None = None  # worker side: a save that could not be done (the engine fails an export)


@dataclass
class StagingBook:
    """One engine's staging pool and its requests' plans, shared by the engine and the connector's halves."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int
    grow: Callable[[TransferPlan, int], bool]  # add staging blocks for a caching save (engine thread); False: none
    plans: dict[str, TransferPlan] = field(default_factory=dict)  # by PDD request id


_BOOKS: dict[str, StagingBook] = {}
_BOOKS_LOCK = threading.Lock()


def register_book(name: str, book: StagingBook) -> None:
    with _BOOKS_LOCK:
        _BOOKS[name] = book


def _book(name: str) -> StagingBook:
    with _BOOKS_LOCK:
        book = _BOOKS.get(name)
    if book is None:
        raise ConnectorError(f"no PDD staging book named {name!r} in this process: the PDD connector runs only "
                             "inside PDD's vLLM engine (engine/vllm_backend), with VLLM_ENABLE_V1_MULTIPROCESSING=0")
    return book


@dataclass
class CopyOp:
    """Copy the KV of tokens ``[start, end)`` between vLLM's blocks and staging's (``to_staging``: a save)."""

    rid: str
    start: int
    end: int
    vllm_blocks: list[int]
    staging_blocks: list[int]
    to_staging: bool


@dataclass
class PDDConnectorMetadata(KVConnectorMetadata):
    loads: list[CopyOp] = field(default_factory=list)
    saves: list[CopyOp] = field(default_factory=list)


def block_range(blocks: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """The entries of a block table that hold tokens ``[start, end)``. Raises ``ConnectorError`` when the table
    is too short (a block-count mismatch: copying would touch another request's blocks) or the range is bad."""
    if start < 0 or end < start or start % block_size:
        raise ConnectorError(f"tokens [{start}, {end}) do not start on a block of {block_size}")
    last = -(-end // block_size)
    if last > len(blocks):
        raise ConnectorError(f"tokens [{start}, {end}) need {last} blocks; the block table has {len(blocks)}")
    return torch.tensor(blocks[start // block_size:last], dtype=torch.long)


class PagedView:
    """One layer of vLLM's KV cache as whole blocks: K and V of a block, each ``[kv_heads x block_size x
    head_dim]`` values in the order vLLM's attention kernel stores them (opaque to PDD; equal on equal
    platforms, which the layout's ``backend`` names)."""

    def __init__(self, cache: torch.Tensor, kv_heads: int, head_dim: int, block_size: int) -> None:
        shape = tuple(cache.shape)
        half = block_size * head_dim
        if cache.dim() == 4 and shape[1:] == (kv_heads, block_size, 2 * head_dim):  # vLLM CPU: [B, H, N, 2C]
            flat = cache.view(shape[0], kv_heads, 2 * half)  # per head: the block's K values, then its V values
            self.k = lambda: flat[:, :, :half]
            self.v = lambda: flat[:, :, half:]
        elif cache.dim() == 5 and shape[0] == 2 and shape[2:] == (block_size, kv_heads, head_dim):  # [2,B,N,H,C]
            self.k = lambda: cache[0]
            self.v = lambda: cache[1]
        else:
            raise ConnectorError(f"vLLM KV cache layer of shape {shape} is not a layout the PDD connector reads "
                                 f"(CPU [blocks, {kv_heads}, {block_size}, {2 * head_dim}] or flash-attention "
                                 f"[2, blocks, {block_size}, {kv_heads}, {head_dim}])")
        self.device = cache.device

    def read(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = blocks.to(self.device)
        return self.k()[b], self.v()[b]

    def write(self, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        b = blocks.to(self.device)
        kk, vv = self.k(), self.v()
        kk[b] = k.to(self.device).reshape((len(b), *kk.shape[1:]))
        vv[b] = v.to(self.device).reshape((len(b), *vv.shape[1:]))


_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def layer_index(name: str) -> int:
    """The decoder layer a vLLM attention layer name belongs to (``model.layers.7.self_attn.attn`` -> 7)."""
    found = _LAYER_INDEX.search(name)
    if found is None:
        raise ConnectorError(f"vLLM KV cache layer {name!r} names no decoder layer")
    return int(found.group(1))


class PDDConnector(KVConnectorBase_V1):
    """Scheduler half: which tokens each request loads from / saves to staging. Worker half: the copies."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.book = _book(self._kv_transfer_config.get_from_extra_config(BOOK_KEY, ""))
        self.vllm_block_size = vllm_config.cache_config.block_size
        self.by_vllm_id: dict[str, TransferPlan] = {}  # scheduler side
        self.layers: list[PagedView] = []  # worker side, by decoder layer
        self._load_errors: set[int] = set()  # worker side: vLLM blocks a load could not fill (vLLM recomputes)

    # ---- scheduler side ------------------------------------------------------------------------
    def _plan(self, request: Request) -> TransferPlan | None:
        plan = self.by_vllm_id.get(request.request_id)
        if plan is None:
            rid = (request.kv_transfer_params or {}).get(RID_KEY)
            plan = self.book.plans.get(rid) if isinstance(rid, str) else None
            if plan is not None:
                self.by_vllm_id[request.request_id] = plan
        return plan

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        plan = self._plan(request)
        if plan is None or plan.load_tokens <= num_computed_tokens:
            return 0, False
        if plan.load_tokens > len(plan.staging_blocks) * self.book.block_size:  # never planned so: recompute
            log.error("pdd_connector_bad_plan", request_id=plan.rid, load_tokens=plan.load_tokens,
                      staging_blocks=len(plan.staging_blocks))
            return 0, False
        # at least one token must be computed by vLLM to sample from: the engine never plans a whole-prompt load
        return plan.load_tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        plan = self._plan(request)
        if plan is not None and num_external_tokens > 0:
            plan.pending_load = (plan.load_tokens - num_external_tokens, plan.load_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PDDConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            plan = self.by_vllm_id.get(new.req_id)
            if plan is None:
                continue
            plan.vllm_blocks = list(new.block_ids[0])
            self._ops(plan, meta, new.num_computed_tokens, scheduler_output.num_scheduled_tokens.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            plan = self.by_vllm_id.get(req_id)
            if plan is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted and scheduled again: a new block table
                plan.vllm_blocks = list(new_blocks[0]) if new_blocks is not None else []
            elif new_blocks is not None:
                plan.vllm_blocks.extend(new_blocks[0])
            self._ops(plan, meta, cached.num_computed_tokens[i], scheduler_output.num_scheduled_tokens.get(req_id, 0))
        return meta

    def _ops(self, plan: TransferPlan, meta: PDDConnectorMetadata, computed: int, scheduled: int) -> None:
        if plan.pending_load is not None:
            start, end = plan.pending_load
            plan.pending_load = None
            meta.loads.append(CopyOp(plan.rid, start, end, list(plan.vllm_blocks), list(plan.staging_blocks), False))
        after = computed + scheduled  # tokens whose KV is in vLLM's cache once this step ran
        if plan.save_until is None:
            target = after // self.book.block_size * self.book.block_size
            needed = -(-target // self.book.block_size)
            if needed > len(plan.staging_blocks) and not self.book.grow(plan, needed):
                plan.save_until = plan.saved_through  # staging full: the cache keeps what it has
                target = plan.saved_through
        else:
            target = min(after, plan.save_until)
        if target > plan.saved_through:
            meta.saves.append(CopyOp(plan.rid, plan.saved_through, target, list(plan.vllm_blocks),
                                     list(plan.staging_blocks), True))
            plan.saved_through = target

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.by_vllm_id.pop(request.request_id, None)
        return False, None

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kv_heads, head_dim = self.book.k[0].shape[2], self.book.k[0].shape[3]
        by_layer = {layer_index(name): cache for name, cache in kv_caches.items()}
        if sorted(by_layer) != list(range(len(self.book.k))):
            raise ConnectorError(f"vLLM has KV caches for layers {sorted(by_layer)}; staging has {len(self.book.k)}")
        if self.vllm_block_size != self.book.block_size:
            raise ConnectorError(f"vLLM's block size {self.vllm_block_size} != staging's {self.book.block_size}")
        self.layers = [PagedView(by_layer[i], kv_heads, head_dim, self.book.block_size)
                       for i in range(len(self.book.k))]

    def _copy(self, op: CopyOp) -> None:
        """Whole blocks: a partial last block carries stale values past ``end``, which vLLM overwrites as it
        computes those positions (a load) or nobody reads (a save: the prompt's tail)."""
        bs = self.book.block_size
        vb = block_range(op.vllm_blocks, bs, op.start, op.end)
        sb = block_range(op.staging_blocks, bs, op.start, op.end)
        for layer, view in enumerate(self.layers):
            k_stage, v_stage = self.book.k[layer], self.book.v[layer]
            if op.to_staging:
                k, v = view.read(vb)
                k_stage[sb] = k.reshape((len(sb), *k_stage.shape[1:])).to(k_stage.device)
                v_stage[sb] = v.reshape((len(sb), *v_stage.shape[1:])).to(v_stage.device)
            else:
                view.write(vb, k_stage[sb], v_stage[sb])

    def _copy_or_report(self, op: CopyOp) -> None:
        """A copy that cannot be done must not stop vLLM's step (every request of the batch would die):
        a failed load names its blocks for vLLM to recompute; a failed save marks the plan, which fails
        an export (a cache save just stops)."""
        try:
            self._copy(op)
        except (ConnectorError, IndexError, RuntimeError) as exc:
            log.error("pdd_connector_copy_failed", request_id=op.rid, save=op.to_staging, start=op.start,
                      end=op.end, error=str(exc))
            if op.to_staging:
                plan = self.book.plans.get(op.rid)
                if plan is not None:
                    plan.failed = str(exc)
            else:
                first = op.start // self.book.block_size
                self._load_errors.update(op.vllm_blocks[first:first + -(-(op.end - op.start) // self.book.block_size)])

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PDDConnectorMetadata)
        for op in meta.loads:
            self._copy_or_report(op)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous: done in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved for all layers at once after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PDDConnectorMetadata)
        for op in meta.saves:
            self._copy_or_report(op)
