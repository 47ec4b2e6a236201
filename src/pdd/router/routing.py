"""Where a request goes: the prefill, relay and main-decode instances and the pipeline joining them.

Kept apart from the request loop because choosing is a pure question of the fleet's state (the
registry, the prefix index, which WAN links are up, the policy): it sends nothing but cache
queries, and it is asked again, with instances excluded, when a request that has emitted nothing
yet fails over.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pdd.router.prefix_index import PrefixIndex
from pdd.router.registry import Registry
from pdd.router.types import GenerationError, GenerationRequest
from pdd.router.wan_health import WanHealth
from pdd.shared.bus import Bus, BusError
from pdd.shared.config import PDDConfig
from pdd.shared.links import KVLink, link_between
from pdd.shared.pipelines import Pipeline, spec
from pdd.shared.policy import RouteInputs, choose_pipeline, instance_cost
from pdd.shared.protocol import (
    WAN_RATE_KEY,
    Announce,
    CacheQuery,
    CacheQueryReply,
    Subjects,
)
from pdd.shared.roles import Role
from pdd.shared.wan_backlog import reported_figure, site_queue_seconds

CACHE_QUERY_TIMEOUT_S = 0.5
# 503 codes of a role with no live instance: the orchestrator waits for one (router.instance_wait_s)
NO_PREFILL, NO_DECODE, NO_RELAY = "no_prefill", "no_decode", "no_relay"
NO_INSTANCE = frozenset({NO_PREFILL, NO_DECODE, NO_RELAY})


class _Hashes:
    """A prompt's block hashes, computed once per route for both roles (milliseconds for a long prompt)."""

    def __init__(self, index: PrefixIndex, prompt_ids: list[int]):
        self._index, self._prompt_ids = index, prompt_ids
        self._by_block_size: dict[int, list[int]] = {}

    def of(self, block_size: int) -> list[int]:
        if block_size not in self._by_block_size:
            self._by_block_size[block_size] = self._index.hashes(self._prompt_ids, block_size)
        return self._by_block_size[block_size]


@dataclass
class Route:
    pipeline: Pipeline
    reason: str
    prefill: Announce
    relay: Announce | None
    main_decode: Announce | None
    p_cached: int
    md_cached: int
    wan_bytes_estimate: int
    md_link: KVLink = KVLink.WAN  # FAST where main decode shares prefill's site and takes KV inside it


class Routing:
    """Picks instances by cache hit and load, then the pipeline by ``policy.choose_pipeline``."""

    def __init__(self, config: PDDConfig, bus: Bus, registry: Registry, index: PrefixIndex, wan: WanHealth):
        self.config = config
        self.bus = bus
        self.registry = registry
        self.index = index
        self.wan = wan

    async def cached_tokens(self, inst: Announce, prompt_ids: list[int], hashes: list[int], block_size: int) -> int:
        """How much of the prompt ``inst`` holds: from the prefix index, or asked directly while it is cold
        (this router has seen none of its cache events yet) and its last announce did not say it holds nothing.
        Asking sends the whole prompt over the bus: tens of ms for a 64K-token prompt, on the TTFT path."""
        if self.index.knows(inst.instance_id):
            return self.index.overlap_tokens(inst.instance_id, hashes, block_size)
        if inst.cache_summary.get("cached_blocks") == 0:
            return 0
        try:
            reply = await self.bus.request(Subjects.instance(inst.instance_id, "cache_query"),
                                           CacheQuery(prompt_ids=prompt_ids), timeout=CACHE_QUERY_TIMEOUT_S,
                                           expect=CacheQueryReply)
            return reply.cached_tokens  # type: ignore[union-attr]
        except BusError:
            return 0

    async def best(self, role: Role, prompt_ids: list[int], hashes: _Hashes, exclude: set[str] = frozenset(),
                   wan_required: bool = False) -> tuple[Announce | None, int]:
        """The cheapest instance of ``role`` for this prompt and how many of its tokens it holds."""
        candidates = [c for c in self.registry.instances(role) if c.instance_id not in exclude]
        if wan_required:  # decode instances behind a down WAN link only when there is no other
            candidates = [c for c in candidates if self.wan.is_up(c.instance_id)] or candidates
        if not candidates:
            return None, 0
        block_size = int(candidates[0].cache_summary.get("block_size", self.config.model.block_size))
        hashes = hashes.of(block_size)
        cached = await asyncio.gather(*(self.cached_tokens(c, prompt_ids, hashes, block_size) for c in candidates))
        costs = [instance_cost(hit, len(prompt_ids), c.load) for c, hit in zip(candidates, cached)]
        best = min(range(len(candidates)), key=lambda i: (costs[i], candidates[i].instance_id))
        return candidates[best], cached[best]

    def wan_queue_s(self, site: str) -> float:
        """Seconds of KV the prefill instances of ``site`` have queued on the WAN, by their own heartbeats."""
        return site_queue_seconds([p.cache_summary for p in self.registry.instances(Role.PREFILL) if p.site == site],
                                  self.config.policy)

    async def route(self, req: GenerationRequest, exclude: set[str] = frozenset()) -> Route:
        """The request's route; GenerationError 503 when a role its pipeline needs has no instance."""
        hashes = _Hashes(self.index, req.prompt_ids)
        (prefill, p_cached), (main_decode, md_cached) = await asyncio.gather(
            self.best(Role.PREFILL, req.prompt_ids, hashes, exclude),
            self.best(Role.MAIN_DECODE, req.prompt_ids, hashes, exclude, True))
        relays = [r for r in self.registry.instances(Role.RELAY) if r.instance_id not in exclude]
        relay = min(relays, key=lambda r: (r.load, r.instance_id)) if relays else None
        if prefill is None:
            raise GenerationError(503, NO_PREFILL, f"no {Role.PREFILL} instance is available; retry later")
        kv_bytes_per_token = int(prefill.cache_summary.get("kv_bytes_per_token", 0))
        forced = req.forced_pipeline or self.config.router.forced_pipeline
        if forced:
            decision_pipeline, reason = forced, "forced"
            wan_bytes = max(0, len(req.prompt_ids) - md_cached) * kv_bytes_per_token
        else:
            wan_rate = reported_figure(main_decode.cache_summary.get(WAN_RATE_KEY)) if main_decode else 0.0
            decision = choose_pipeline(RouteInputs(
                prompt_tokens=len(req.prompt_ids), max_tokens=req.sampling.max_tokens, p_cached_tokens=p_cached,
                md_cached_tokens=md_cached, kv_bytes_per_token=kv_bytes_per_token, wan_bandwidth_bps=wan_rate,
                wan_up=main_decode is not None and self.wan.is_up(main_decode.instance_id), rld_available=relay is not None,
                rld_load=relay.load if relay else 1.0, wan_queue_s=self.wan_queue_s(prefill.site)), self.config.policy)
            decision_pipeline, reason, wan_bytes = decision.pipeline, decision.reason, decision.wan_bytes
        needs = spec(decision_pipeline).roles
        if Role.MAIN_DECODE in needs and main_decode is None:
            raise GenerationError(503, NO_DECODE, f"no {Role.MAIN_DECODE} instance is available; retry later")
        if Role.RELAY in needs and relay is None:
            raise GenerationError(503, NO_RELAY, f"pipeline {decision_pipeline} needs a {Role.RELAY}; none is available")
        md_link = link_between(prefill.site, main_decode.site) if main_decode else KVLink.WAN
        if md_link not in (main_decode.endpoints if main_decode else ()):  # a decoder without that transport
            md_link = KVLink.WAN
        return Route(decision_pipeline, reason, prefill, relay, main_decode, p_cached, md_cached,
                     wan_bytes if md_link == KVLink.WAN else 0, md_link)
