"""The router's request lifecycle: pick instances and a pipeline, submit, emit tokens in order.

It keeps each request's prompt and every emitted token id (what any decoder needs to resume it by
extend/recompute), enforces the deadline, and cancels everywhere when the client goes away.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from pdd.services.router.ownership import OwnershipTracker
from pdd.services.router.prefix_index import PrefixIndex
from pdd.services.router.types import GenerationError, GenerationRequest, TokenEvent
from pdd.shared import metrics
from pdd.shared.bus import Bus, BusError, Envelope
from pdd.shared.config import PDDConfig
from pdd.shared.policy import Pipeline, RouteInputs, choose_pipeline, instance_cost
from pdd.shared.protocol import (
    Announce, CacheQuery, CacheQueryReply, Cancel, ErrorReply, Message, PrefillResult, Subjects, SubmitRequest,
    TokenChunk,
)
from pdd.shared.registry import Registry
from pdd.shared.telemetry import get_logger

log = get_logger("pdd.router")
tracer = trace.get_tracer("pdd.router")
CACHE_QUERY_TIMEOUT_S = 0.5


@dataclass
class Route:
    pipeline: str
    reason: str
    prefill: Announce
    relay: Announce | None
    decode: Announce | None
    p_cached: int
    md_cached: int
    wan_bytes_estimate: int


@dataclass
class InFlight:
    request: GenerationRequest
    route: Route
    tracker: OwnershipTracker
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    emitted: list[int] = field(default_factory=list)  # every token id sent to the client
    meta: dict[str, Any] = field(default_factory=dict)
    p_cached: int = 0
    held: list[int] = field(default_factory=list)  # first token held back (first_token_after_kv)


class Orchestrator:
    def __init__(self, config: PDDConfig, bus: Bus, registry: Registry, router_id: str):
        self.config = config
        self.bus = bus
        self.registry = registry
        self.router_id = router_id
        self.events_subject = Subjects.router_events(router_id)
        self.index = PrefixIndex()
        self.inflight: dict[str, InFlight] = {}

    async def start(self) -> None:
        await self.index.start(self.bus)
        await self.bus.subscribe(self.events_subject, self._on_event,
                                 expect=(PrefillResult, TokenChunk, ErrorReply))

    # -- instance and pipeline choice ---------------------------------------------------------------
    async def _cached_tokens(self, inst: Announce, prompt_ids: list[int], hashes: list[int], block_size: int) -> int:
        if self.index.knows(inst.instance_id):
            return self.index.overlap_tokens(inst.instance_id, hashes, block_size)
        try:
            reply = await self.bus.request(Subjects.instance(inst.instance_id, "cache_query"),
                                           CacheQuery(prompt_ids=prompt_ids), timeout=CACHE_QUERY_TIMEOUT_S,
                                           expect=CacheQueryReply)
            return reply.cached_tokens  # type: ignore[union-attr]
        except BusError:
            return 0

    async def _best(self, role: str, prompt_ids: list[int]) -> tuple[Announce | None, int]:
        candidates = self.registry.instances(role)
        if not candidates:
            return None, 0
        block_size = int(candidates[0].cache_summary.get("block_size", self.config.model.block_size))
        hashes = self.index.hashes(prompt_ids, block_size)
        cached = await asyncio.gather(*(self._cached_tokens(c, prompt_ids, hashes, block_size) for c in candidates))
        costs = [instance_cost(hit, len(prompt_ids), c.load) for c, hit in zip(candidates, cached)]
        best = min(range(len(candidates)), key=lambda i: (costs[i], candidates[i].instance_id))
        return candidates[best], cached[best]

    async def route(self, req: GenerationRequest) -> Route:
        (prefill, p_cached), (decode, md_cached) = await asyncio.gather(
            self._best("prefill", req.prompt_ids), self._best("decode", req.prompt_ids))
        relays = self.registry.instances("relay")
        relay = min(relays, key=lambda r: (r.load, r.instance_id)) if relays else None
        if prefill is None:
            raise GenerationError(503, "no_prefill", "no prefill instance is available; retry later")
        kv_bytes_per_token = int(prefill.cache_summary.get("kv_bytes_per_token", 0))
        forced = req.forced_pipeline or self.config.router.forced_pipeline
        if forced:
            decision_pipeline, reason = forced, "forced"
            wan_bytes = max(0, len(req.prompt_ids) - md_cached) * kv_bytes_per_token
        else:
            wan_rate = float(decode.cache_summary.get("wan_bytes_per_s", 0.0)) if decode else 0.0
            decision = choose_pipeline(RouteInputs(
                prompt_tokens=len(req.prompt_ids), max_tokens=req.sampling.max_tokens, p_cached_tokens=p_cached,
                md_cached_tokens=md_cached, kv_bytes_per_token=kv_bytes_per_token, wan_bandwidth_bps=wan_rate,
                wan_up=decode is not None, rld_available=relay is not None,
                rld_load=relay.load if relay else 1.0), self.config.policy)
            decision_pipeline, reason, wan_bytes = decision.pipeline.value, decision.reason, decision.wan_bytes
        if decision_pipeline in (Pipeline.P_MD.value, Pipeline.P_RLD_MD.value) and decode is None:
            raise GenerationError(503, "no_decode", "no main-decode instance is available; retry later")
        if decision_pipeline in (Pipeline.P_RLD.value, Pipeline.P_RLD_MD.value) and relay is None:
            raise GenerationError(503, "no_relay", f"pipeline {decision_pipeline} needs a relay; none is available")
        return Route(decision_pipeline, reason, prefill, relay, decode, p_cached, md_cached, wan_bytes)

    # -- the request ------------------------------------------------------------------------------
    def max_context(self) -> int:
        limits = [i.max_context for i in self.registry.instances() if i.max_context]
        return min(limits) if limits else 0

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Async generator of token events; closing it early cancels the request everywhere."""
        arrival = time.monotonic()
        with tracer.start_as_current_span("router.request", attributes={
                "request_id": req.request_id, "prompt_tokens": len(req.prompt_ids)}) as span:
            t_route = time.monotonic()
            route = await self.route(req)
            span.set_attribute("route_ms", round((time.monotonic() - t_route) * 1000, 2))
            span.set_attributes({"pipeline": route.pipeline, "prefill": route.prefill.instance_id,
                                 "relay": route.relay.instance_id if route.relay else "",
                                 "decode": route.decode.instance_id if route.decode else ""})
            metrics.PIPELINE.labels(route.pipeline, route.reason).inc()
            metrics.PROMPT_TOKENS.inc(len(req.prompt_ids))
            state = InFlight(req, route, OwnershipTracker(route.pipeline))
            self.inflight[req.request_id] = state
            metrics.RUNNING.inc()
            finished = False
            try:
                await self.bus.publish(Subjects.instance(route.prefill.instance_id, "submit"), SubmitRequest(
                    request_id=req.request_id, prompt_ids=req.prompt_ids, sampling=req.sampling,
                    pipeline=route.pipeline, events_subject=self.events_subject, deadline_unix=req.deadline_unix,
                    rld_instance=route.relay.instance_id if route.relay else None,
                    md_instance=route.decode.instance_id if route.decode else None,
                    handoff_mode=req.forced_handoff or self.config.router.forced_handoff))
                last = None
                while True:
                    remaining = req.deadline_unix - time.time()
                    if remaining <= 0:
                        raise GenerationError(504, "deadline_exceeded",
                                              f"request {req.request_id} did not finish before its deadline")
                    try:
                        item = await asyncio.wait_for(state.queue.get(), timeout=remaining)
                    except asyncio.TimeoutError:
                        continue
                    if isinstance(item, GenerationError):
                        raise item
                    now = time.monotonic()
                    boundary = state.tracker.relay_until
                    if (item.token_ids and boundary is not None and last is not None
                            and len(state.emitted) <= boundary + 1 < len(state.emitted) + len(item.token_ids)):
                        stall = now - last  # the gap in which ownership moved from the relay to MD
                        metrics.HANDOFF_STALL.observe(stall)
                        span.set_attribute("handoff_stall_ms", round(stall * 1000, 2))
                    if item.token_ids:
                        if not state.emitted:
                            metrics.TTFT.labels(route.pipeline).observe(now - arrival)
                            span.add_event("first_token")
                        elif last is not None:
                            metrics.ITL.labels(route.pipeline).observe(now - last)
                        last = now
                        state.emitted.extend(item.token_ids)
                        if len(state.emitted) <= 64:  # the stream's start: where eager tokens show (spans cap events)
                            span.add_event("tokens", {"count": len(item.token_ids), "emitted": len(state.emitted),
                                                      "relay_tokens": state.tracker.relay_tokens})
                    if item.finish_reason is not None:
                        finished = True
                        item.info = self._info(state)
                        self._record_finish(state, item.finish_reason, now - arrival)
                        span.set_attributes({"output_tokens": len(state.emitted),
                                             "rld_tokens": state.tracker.relay_tokens})
                    yield item
                    if finished:
                        return
            except GenerationError as exc:
                metrics.REQUEST_ERRORS.labels(exc.code).inc()
                span.set_attribute("error", exc.code)
                raise
            finally:
                self.inflight.pop(req.request_id, None)
                metrics.RUNNING.dec()
                if not finished:
                    try:
                        await self.bus.publish(Subjects.CANCEL, Cancel(req.request_id, reason="client gone or failed"))
                    except Exception as exc:
                        log.warning("cancel_publish_failed", request_id=req.request_id, error=str(exc))

    def _info(self, state: InFlight) -> dict[str, Any]:
        r = state.route
        info = {"pipeline": r.pipeline, "reason": r.reason, "prefill": r.prefill.instance_id,
                "relay": r.relay.instance_id if r.relay and r.pipeline != "P-MD" else None,
                "decode": r.decode.instance_id if r.decode and r.pipeline != "P-RLD" else None,
                "prompt_tokens": len(state.request.prompt_ids), "p_cached_tokens": state.p_cached,
                "rld_tokens": state.tracker.relay_tokens}
        info.update(state.meta)
        if state.request.return_token_ids:
            info["token_ids"] = list(state.emitted)
        prompt = max(1, len(state.request.prompt_ids))
        info["p_hit_rate"] = round(state.p_cached / prompt, 4)
        if "md_cached_tokens" in info:
            info["md_hit_rate"] = round(info["md_cached_tokens"] / prompt, 4)
        return info

    def _record_finish(self, state: InFlight, reason: str, e2e: float) -> None:
        prompt = max(1, len(state.request.prompt_ids))
        metrics.REQUEST_HIT_RATIO.labels("P").observe(state.p_cached / prompt)
        if "md_cached_tokens" in state.meta:
            metrics.REQUEST_HIT_RATIO.labels("MD").observe(state.meta["md_cached_tokens"] / prompt)
        if "wan_bytes" in state.meta:
            metrics.REQUEST_WAN_BYTES.observe(state.meta["wan_bytes"])
        metrics.E2E.labels(state.route.pipeline).observe(e2e)
        metrics.REQUESTS.labels(reason).inc()
        metrics.GENERATED_TOKENS.inc(len(state.emitted))
        metrics.RLD_TOKENS.inc(state.tracker.relay_tokens)

    async def _on_event(self, message: Message, _: Envelope) -> None:
        rid = getattr(message, "request_id", None)
        state = self.inflight.get(rid) if rid else None
        if state is None:
            return
        if isinstance(message, ErrorReply):
            status = 503 if message.retryable else (400 if message.code == "invalid_request" else 500)
            state.queue.put_nowait(GenerationError(status, message.code, message.message))
            return
        if isinstance(message, PrefillResult):
            state.p_cached = message.cached_tokens
            emission = state.tracker.accept("prefill", 0, [message.first_token], message.finish_reason)
        else:
            assert isinstance(message, TokenChunk)
            state.meta.update(message.meta)
            emission = state.tracker.accept(message.role, message.start, message.token_ids, message.finish_reason,
                                            message.owner_until)
        tokens = emission.token_ids
        if self.config.router.first_token_after_kv and state.route.pipeline != "P-RLD" and not emission.finish_reason:
            if len(tokens) == 1 and state.tracker.next_position == 1 and not state.emitted and not state.held:
                state.held = tokens  # conventional PD: the first token waits for the decoder's stream
                return
        if state.held:
            tokens, state.held = state.held + tokens, []
        if tokens or emission.finish_reason:
            state.queue.put_nowait(TokenEvent(tokens, emission.finish_reason))
