"""The router's request lifecycle: pick instances and a pipeline, submit, emit tokens in order.

It keeps each request's prompt and every emitted token id (what any decoder needs to resume it by
extend/recompute), enforces the deadline, and cancels everywhere when the client goes away.

Failover: an instance the request depends on leaves the registry (missed heartbeats), its decoder
goes silent past ``stall_timeout_s``, or a retryable error arrives -> the request migrates under a
fresh attempt id: with no token out yet it starts over on another prefill; otherwise another decode
instance resumes it from prompt + emitted tokens (recompute, no KV), so the client's stream goes on
with no position lost or repeated. A failed WAN transfer in P-RLD-MD leaves the relay to finish.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from pdd.services.router.ownership import OwnershipTracker
from pdd.services.router.prefix_index import PrefixIndex
from pdd.services.router.types import GenerationError, GenerationRequest, TokenEvent
from pdd.services.router.wan_health import WanHealth
from pdd.shared import metrics
from pdd.shared.bus import Bus, BusError, Envelope
from pdd.shared.config import PDDConfig
from pdd.shared.policy import Pipeline, RouteInputs, choose_pipeline, instance_cost
from pdd.shared.protocol import (
    Announce, CacheQuery, CacheQueryReply, Cancel, ErrorReply, Message, PrefillResult, SamplingSpec, Subjects,
    SubmitRequest, TokenChunk,
)
from pdd.shared.registry import Registry
from pdd.shared.telemetry import get_logger

log = get_logger("pdd.router")
tracer = trace.get_tracer("pdd.router")
CACHE_QUERY_TIMEOUT_S = 0.5
WATCH_INTERVAL_S = 0.25  # how often a waiting request checks its instances' health
EXCLUDE_ON_ERROR = ("draining",)  # the sender itself cannot take this request now
WAN_ERRORS = ("wan_transfer_failed", "wan_transfer_refused")  # P's WAN transfer to MD did not complete


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
class Failure:
    """Something went wrong with the current attempt; the request may migrate."""

    code: str
    message: str
    exclude: str | None = None  # an instance that should not get this request again


@dataclass
class InFlight:
    request: GenerationRequest
    route: Route
    tracker: OwnershipTracker
    attempt_id: str  # the request's id on the bus for the current attempt
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    flushed: list[int] = field(default_factory=list)  # every token id queued for the client (resume point)
    sent: int = 0  # how many of them the client has been given
    meta: dict[str, Any] = field(default_factory=dict)
    p_cached: int = 0
    held: list[int] = field(default_factory=list)  # first token held back (first_token_after_kv)
    migrations: int = 0
    excluded: set[str] = field(default_factory=set)
    resumed_on: str | None = None
    wan_fallback: bool = False  # P-RLD-MD whose WAN transfer failed: the relay finishes it
    last_progress: float = field(default_factory=time.monotonic)


class Orchestrator:
    def __init__(self, config: PDDConfig, bus: Bus, registry: Registry, router_id: str):
        self.config = config
        self.bus = bus
        self.registry = registry
        self.router_id = router_id
        self.events_subject = Subjects.router_events(router_id)
        self.index = PrefixIndex()
        self.inflight: dict[str, InFlight] = {}  # by attempt id
        self.wan = WanHealth(self._probe_wan, config.router.wan_probe_interval_s)
        self._probes: dict[str, asyncio.Future] = {}
        self._bus_down_at = float("-inf")

    async def start(self) -> None:
        await self.index.start(self.bus)
        await self.bus.subscribe(self.events_subject, self._on_event,
                                 expect=(PrefillResult, TokenChunk, ErrorReply))

    async def stop(self) -> None:
        await self.wan.stop()

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

    async def _best(self, role: str, prompt_ids: list[int], exclude: set[str] = frozenset(),
                    wan_required: bool = False) -> tuple[Announce | None, int]:
        candidates = [c for c in self.registry.instances(role) if c.instance_id not in exclude]
        if wan_required:  # decode instances behind a down WAN link only when there is no other
            candidates = [c for c in candidates if self.wan.is_up(c.instance_id)] or candidates
        if not candidates:
            return None, 0
        block_size = int(candidates[0].cache_summary.get("block_size", self.config.model.block_size))
        hashes = self.index.hashes(prompt_ids, block_size)
        cached = await asyncio.gather(*(self._cached_tokens(c, prompt_ids, hashes, block_size) for c in candidates))
        costs = [instance_cost(hit, len(prompt_ids), c.load) for c, hit in zip(candidates, cached)]
        best = min(range(len(candidates)), key=lambda i: (costs[i], candidates[i].instance_id))
        return candidates[best], cached[best]

    async def route(self, req: GenerationRequest, exclude: set[str] = frozenset()) -> Route:
        (prefill, p_cached), (decode, md_cached) = await asyncio.gather(
            self._best("prefill", req.prompt_ids, exclude), self._best("decode", req.prompt_ids, exclude, True))
        relays = [r for r in self.registry.instances("relay") if r.instance_id not in exclude]
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
                wan_up=decode is not None and self.wan.is_up(decode.instance_id), rld_available=relay is not None,
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
            self._note_route(span, route)
            metrics.PROMPT_TOKENS.inc(len(req.prompt_ids))
            state = InFlight(req, route, OwnershipTracker(route.pipeline), attempt_id=req.request_id)
            self.inflight[state.attempt_id] = state
            metrics.RUNNING.inc()
            finished = False
            try:
                await self._submit(state)
                last = None
                while True:
                    remaining = req.deadline_unix - time.time()
                    if remaining <= 0:
                        raise GenerationError(504, "deadline_exceeded",
                                              f"request {req.request_id} did not finish before its deadline")
                    try:
                        item = await asyncio.wait_for(state.queue.get(), timeout=min(remaining, WATCH_INTERVAL_S))
                    except asyncio.TimeoutError:
                        problem = self._health_problem(state)
                        if problem is not None:
                            await self._migrate(state, problem, span)
                        continue
                    if isinstance(item, GenerationError):
                        raise item
                    if isinstance(item, Failure):
                        await self._migrate(state, item, span)
                        continue
                    now = time.monotonic()
                    boundary = state.tracker.relay_until
                    if (item.token_ids and boundary is not None and last is not None
                            and state.sent <= boundary + 1 < state.sent + len(item.token_ids)):
                        stall = now - last  # the gap in which ownership moved from the relay to MD
                        metrics.HANDOFF_STALL.observe(stall)
                        span.set_attribute("handoff_stall_ms", round(stall * 1000, 2))
                    if item.token_ids:
                        if not state.sent:
                            metrics.TTFT.labels(route.pipeline).observe(now - arrival)
                            span.add_event("first_token")
                        elif last is not None:
                            metrics.ITL.labels(route.pipeline).observe(now - last)
                        last = now
                        state.sent += len(item.token_ids)
                        if state.sent <= 64:  # the stream's start: where eager tokens show (spans cap events)
                            span.add_event("tokens", {"count": len(item.token_ids), "emitted": state.sent,
                                                      "relay_tokens": state.tracker.relay_tokens})
                    if item.finish_reason is not None:
                        finished = True
                        item.info = self._info(state)
                        self._record_finish(state, item.finish_reason, now - arrival)
                        span.set_attributes({"output_tokens": state.sent,
                                             "rld_tokens": state.tracker.relay_tokens})
                    yield item
                    if finished:
                        return
            except GenerationError as exc:
                metrics.REQUEST_ERRORS.labels(exc.code).inc()
                span.set_attribute("error", exc.code)
                raise
            finally:
                self.inflight.pop(state.attempt_id, None)
                metrics.RUNNING.dec()
                if not finished:
                    await self._cancel(state.attempt_id, "client gone or failed")

    def _note_route(self, span: trace.Span, route: Route) -> None:
        span.set_attributes({"pipeline": route.pipeline, "prefill": route.prefill.instance_id,
                             "relay": route.relay.instance_id if route.relay else "",
                             "decode": route.decode.instance_id if route.decode else ""})
        metrics.PIPELINE.labels(route.pipeline, route.reason).inc()

    async def _submit(self, state: InFlight) -> None:
        req, route = state.request, state.route
        await self.bus.publish(Subjects.instance(route.prefill.instance_id, "submit"), SubmitRequest(
            request_id=state.attempt_id, prompt_ids=req.prompt_ids, sampling=req.sampling,
            pipeline=route.pipeline, events_subject=self.events_subject, deadline_unix=req.deadline_unix,
            rld_instance=route.relay.instance_id if route.relay else None,
            md_instance=route.decode.instance_id if route.decode else None,
            handoff_mode=req.forced_handoff or self.config.router.forced_handoff))

    async def _cancel(self, attempt_id: str, reason: str) -> None:
        try:
            await self.bus.publish(Subjects.CANCEL, Cancel(attempt_id, reason=reason))
        except Exception as exc:
            log.warning("cancel_publish_failed", request_id=attempt_id, error=str(exc))

    # -- failover ---------------------------------------------------------------------------------
    def _depends_on(self, state: InFlight) -> list[str]:
        """Instances whose loss stalls this request now (a later owner is not yet needed)."""
        if state.resumed_on is not None:
            return [state.resumed_on]
        route, tracker = state.route, state.tracker
        deps = [route.prefill.instance_id] if tracker.next_position <= 1 else []  # P until a decoder streams
        relay_owns = tracker.relay_until is None or tracker.next_position <= tracker.relay_until
        if route.relay and route.pipeline != "P-MD" and relay_owns:
            deps.append(route.relay.instance_id)
        md_needed = route.pipeline == "P-MD" or (route.pipeline == "P-RLD-MD" and tracker.relay_until is not None)
        if route.decode and md_needed and not state.wan_fallback:
            deps.append(route.decode.instance_id)
        return deps

    def _health_problem(self, state: InFlight) -> Failure | None:
        now = time.monotonic()
        if not self.bus.is_connected:
            self._bus_down_at = now
        service = self.config.service
        grace = service.missed_heartbeats * service.heartbeat_ms / 1000 + self.config.nats.reconnect_settle_s
        if now - self._bus_down_at < grace:  # blind while NATS is away, and until heartbeats are back
            return None
        for instance_id in self._depends_on(state):
            if self.registry.get(instance_id) is None:
                return Failure("instance_lost", f"{instance_id} stopped answering", exclude=instance_id)
        # a stream silent since before a NATS outage lost its chunks with the old server: do not wait the
        # whole stall timeout for it once the fleet is visible again
        lost_in_outage = state.last_progress < self._bus_down_at
        silent = now - max(state.last_progress, self._bus_down_at + grace)
        limit = grace if lost_in_outage else self.config.router.stall_timeout_s
        if state.flushed and silent > limit:
            owner = state.resumed_on or (self._depends_on(state) or [None])[-1]
            return Failure("stalled", f"no output for {silent:.1f}s", exclude=owner)
        return None

    async def _migrate(self, state: InFlight, failure: Failure, span: trace.Span) -> None:
        """Move the request to healthy instances under a new attempt id, or fail it with a clear error."""
        rid = state.request.request_id
        if state.migrations >= self.config.router.max_migrations:
            raise GenerationError(503, "failover_exhausted", f"request {rid} failed after {state.migrations} "
                                  f"failover(s): {failure.code}: {failure.message}")
        state.migrations += 1
        if failure.exclude:
            state.excluded.add(failure.exclude)
        self.inflight.pop(state.attempt_id, None)
        await self._cancel(state.attempt_id, f"migrating: {failure.code}")
        if state.held:  # the client gets the held first token now: it is part of the resume point
            state.queue.put_nowait(TokenEvent(state.held))
            state.flushed.extend(state.held)
            state.held = []
        state.attempt_id = f"{rid}-m{state.migrations}"
        self.inflight[state.attempt_id] = state
        state.last_progress = time.monotonic()
        if not state.flushed:
            kind = "retry"
            state.route = await self.route(state.request, exclude=state.excluded)
            state.tracker = OwnershipTracker(state.route.pipeline)
            state.wan_fallback, state.resumed_on = False, None
            self._note_route(span, state.route)
            await self._submit(state)
            target = state.route.prefill.instance_id
        else:
            kind = "resume"
            target = self._resume_target(state, prefer_relay=failure.code in WAN_ERRORS)
            state.tracker = OwnershipTracker("resume", next_position=len(state.flushed),
                                             relay_tokens=state.tracker.relay_tokens)
            state.resumed_on = target
            req = state.request
            await self.bus.publish(Subjects.instance(target, "resume"), SubmitRequest(
                request_id=state.attempt_id, prompt_ids=req.prompt_ids, sampling=req.sampling, pipeline="resume",
                events_subject=self.events_subject, deadline_unix=req.deadline_unix,
                output_ids=list(state.flushed)))
        metrics.MIGRATIONS.labels(kind).inc()
        state.meta["migrations"] = state.migrations
        log.warning("request_migrated", request_id=rid, kind=kind, reason=failure.code, detail=failure.message,
                    to=target, resume_at=len(state.flushed))
        span.add_event("migrated", {"kind": kind, "reason": failure.code, "to": target,
                                    "resume_at": len(state.flushed)})

    def _resume_target(self, state: InFlight, prefer_relay: bool) -> str:
        """Another decoder for the rest: MD (its DRC likely holds the prefix) or, after a WAN failure, a relay."""
        def pick(role: str) -> Announce | None:
            options = [i for i in self.registry.instances(role) if i.instance_id not in state.excluded]
            if role == "relay":
                options = [i for i in options if i.load < self.config.policy.rld_max_load] or options
            return min(options, key=lambda i: (i.load, i.instance_id)) if options else None

        order = ("relay", "decode") if prefer_relay else ("decode", "relay")
        for role in order:
            chosen = pick(role)
            if chosen is not None:
                return chosen.instance_id
        raise GenerationError(503, "no_decode", "no decode instance is left to resume the request on")

    # -- WAN probing ------------------------------------------------------------------------------
    async def _probe_wan(self, decode_id: str) -> bool:
        """A real two-token request over the link to ``decode_id``: true when MD's token comes back."""
        decode = self.registry.get(decode_id)
        prefills = self.registry.instances("prefill")
        if decode is None:
            self.wan.forget(decode_id)
            return False
        if not prefills:
            return False
        block_size = int(decode.cache_summary.get("block_size", self.config.model.block_size))
        prompt = [random.randrange(1, 256) for _ in range(block_size + 1)]  # fresh: MD cannot have it cached
        probe_id = f"wan-probe-{decode_id}-{random.getrandbits(48):012x}"
        done = asyncio.get_running_loop().create_future()
        self._probes[probe_id] = done
        prefill = min(prefills, key=lambda i: (i.load, i.instance_id))
        timeout = max(5.0, self.config.router.stall_timeout_s)
        try:
            await self.bus.publish(Subjects.instance(prefill.instance_id, "submit"), SubmitRequest(
                request_id=probe_id, prompt_ids=prompt, sampling=SamplingSpec(max_tokens=2, ignore_eos=True),
                pipeline="P-MD", events_subject=self.events_subject, deadline_unix=time.time() + timeout,
                md_instance=decode_id))
            return await asyncio.wait_for(done, timeout)
        except (asyncio.TimeoutError, BusError):
            return False
        finally:
            self._probes.pop(probe_id, None)
            if not done.done() or not done.result():
                await self._cancel(probe_id, "wan probe over")

    def _on_probe_event(self, message: Message) -> None:
        done = self._probes.get(getattr(message, "request_id", ""))
        if done is None or done.done():
            return
        if isinstance(message, ErrorReply):
            done.set_result(False)
        elif isinstance(message, TokenChunk) and message.role == "decode" and message.token_ids:
            done.set_result(True)

    def _info(self, state: InFlight) -> dict[str, Any]:
        r = state.route
        info = {"pipeline": r.pipeline, "reason": r.reason, "prefill": r.prefill.instance_id,
                "relay": r.relay.instance_id if r.relay and r.pipeline != "P-MD" else None,
                "decode": r.decode.instance_id if r.decode and r.pipeline != "P-RLD" else None,
                "prompt_tokens": len(state.request.prompt_ids), "p_cached_tokens": state.p_cached,
                "rld_tokens": state.tracker.relay_tokens}
        info.update(state.meta)
        if state.request.return_token_ids:
            info["token_ids"] = list(state.flushed)  # at the finish, every queued token has been sent
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
        metrics.GENERATED_TOKENS.inc(len(state.flushed))
        metrics.RLD_TOKENS.inc(state.tracker.relay_tokens)

    async def _on_event(self, message: Message, _: Envelope) -> None:
        rid = getattr(message, "request_id", None)
        if rid in self._probes:
            self._on_probe_event(message)
            return
        state = self.inflight.get(rid) if rid else None
        if state is None:
            return  # unknown, finished, or from an attempt the request migrated away from
        state.last_progress = time.monotonic()
        if isinstance(message, ErrorReply):
            self._on_error(state, message)
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
            if len(tokens) == 1 and state.tracker.next_position == 1 and not state.flushed and not state.held:
                state.held = tokens  # conventional PD: the first token waits for the decoder's stream
                return
        if state.held:
            tokens, state.held = state.held + tokens, []
        if tokens or emission.finish_reason:
            state.flushed.extend(tokens)
            state.queue.put_nowait(TokenEvent(tokens, emission.finish_reason))

    def _on_error(self, state: InFlight, error: ErrorReply) -> None:
        route = state.route
        if error.code in WAN_ERRORS and route.decode is not None and state.resumed_on is None:
            if error.code == "wan_transfer_failed":
                self.wan.mark_down(route.decode.instance_id, error.message)
            relay_owns = route.pipeline == "P-RLD-MD" and state.tracker.relay_until is None
            if relay_owns and route.relay is not None and self.registry.get(route.relay.instance_id) is not None:
                state.wan_fallback = True  # the relay keeps decoding to the end (P-RLD); MD got a cancel
                state.meta["wan_fallback"] = "relay_finishes"
                metrics.WAN_FALLBACKS.labels("relay_finishes").inc()
                return
            metrics.WAN_FALLBACKS.labels("resume").inc()
        if not error.retryable:
            status = 400 if error.code == "invalid_request" else 500
            state.queue.put_nowait(GenerationError(status, error.code, error.message))
            return
        exclude = error.instance_id if error.code in EXCLUDE_ON_ERROR else None
        state.queue.put_nowait(Failure(error.code, error.message, exclude=exclude))
