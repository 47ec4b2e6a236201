"""The router's request loop: route, submit, emit tokens in order, migrate on failure, cancel on exit.

It keeps each request's prompt and every emitted token id (``InFlight``: what any decoder needs to
resume it by extend/recompute), enforces the deadline, holds the first token of a WAN pipeline until
the decoder's stream starts (``first_token_after_kv``), and cancels everywhere when the client goes
away. Tokens go from the bus callback straight to the client's event queue, whose consumer (the HTTP
layer's SSE writer, router/sse.py) writes them without a task switch; the request loop wakes only for
what is not a token: a quiet stream's health check (one watchdog for the router), a failure, the
deadline (one timer per request), the finish.
The decisions it ties together live beside it: routing.py (instances and pipeline),
failover.py (when and where a request moves), wan_health.py (WAN link state and probes),
reporting.py (metrics, spans, the final event's info).
"""

from __future__ import annotations

import asyncio
import time

from opentelemetry import trace

from pdd.router import failover, reporting
from pdd.router.failover import WAN_ERRORS, WATCH_INTERVAL_S, Failure, HealthWatch
from pdd.router.inflight import CHECK, InFlight
from pdd.router.ownership import OwnershipTracker
from pdd.router.playout import HandoverCosts, Playout
from pdd.router.prefix_index import PrefixIndex
from pdd.router.registry import Registry
from pdd.router.routing import NO_INSTANCE, Route, Routing
from pdd.router.types import EventQueue, Generation, GenerationError, GenerationRequest, TokenEvent
from pdd.router.wan_health import WanHealth, WanProbe
from pdd.shared import metrics
from pdd.shared.bus import Bus, Envelope
from pdd.shared.config import PDDConfig
from pdd.shared.pipelines import Pipeline, spec
from pdd.shared.protocol import Cancel, ErrorReply, Message, PrefillResult, Subjects, SubmitRequest, TokenChunk
from pdd.shared.roles import Role
from pdd.shared.telemetry import get_logger

log = get_logger("pdd.router")
tracer = trace.get_tracer("pdd.router")
DEADLINE_MARGIN_S = 0.01  # the deadline's timer runs on the loop's clock, the deadline is wall time: fire after it


class Orchestrator:
    def __init__(self, config: PDDConfig, bus: Bus, registry: Registry, router_id: str):
        self.config = config
        self.bus = bus
        self.registry = registry
        self.router_id = router_id
        self.events_subject = Subjects.router_events(router_id)
        self.index = PrefixIndex()
        self.inflight: dict[str, InFlight] = {}  # by attempt id
        self.probes = WanProbe(config, bus, registry, self.events_subject, self._cancel,
                               forget=lambda decode_id: self.wan.forget(decode_id))
        self.wan = WanHealth(self.probes.probe, config.router.wan_probe_interval_s)
        self.routing = Routing(config, bus, registry, self.index, self.wan)
        self.health = HealthWatch(config, bus, registry)
        self.waiting = 0  # requests waiting for an instance of a role that has none live
        self.handover_costs = HandoverCosts()  # what the playout buffers pace by (router/playout.py)
        self._watchdog: asyncio.Task | None = None
        self._envelope: Envelope | None = None  # the bus message whose items _on_event is taking now
        self._envelope_at = 0.0  # when the router began taking it (time.monotonic())

    async def start(self) -> None:
        await self.index.start(self.bus)
        await self.bus.subscribe(self.events_subject, self._on_event,
                                 expect=(PrefillResult, TokenChunk, ErrorReply))
        self._watchdog = asyncio.create_task(self._watch(), name="router-watchdog")

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self.wan.stop()

    async def _watch(self) -> None:
        """Wake every request that has heard nothing for ``WATCH_INTERVAL_S`` so it checks its instances' health.
        One timer for the router instead of one per wait: a request waits once per token of its stream."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S / 2)
            quiet_since = time.monotonic() - WATCH_INTERVAL_S
            for state in list(self.inflight.values()):
                if state.last_progress <= quiet_since and not state.check_queued:
                    state.check_queued = True
                    state.control.put_nowait(CHECK)

    async def route(self, req: GenerationRequest, exclude: set[str] = frozenset()) -> Route:
        """The request's route; where a role it needs has no live instance (all suspected, restarting), wait for
        one up to ``router.instance_wait_s`` inside the deadline, then 503; 429 when too many already wait.
        Both carry Retry-After: never an error while an instance may come back within the wait."""
        outcome = await self._route_or_refusal(req, exclude)
        if not isinstance(outcome, GenerationError):
            return outcome
        cfg = self.config.router
        if self.waiting >= cfg.max_waiting_requests:
            raise GenerationError(429, "too_many_waiting", f"{self.waiting} requests already wait for an instance "
                                  f"({outcome.message})", retry_after_s=max(1.0, cfg.instance_wait_s))
        wait_s = max(0.0, min(cfg.instance_wait_s, req.deadline_unix - time.time()))
        until = time.monotonic() + wait_s
        self.waiting += 1
        try:
            while (left := until - time.monotonic()) > 0:
                changed = self.registry.changed
                try:  # a change can slip in before the wait starts: look again at least twice a second
                    async with asyncio.timeout(min(left, 0.5)):
                        await changed.wait()
                except TimeoutError:
                    pass
                outcome = await self._route_or_refusal(req, exclude)
                if not isinstance(outcome, GenerationError):
                    return outcome
        finally:
            self.waiting -= 1
        raise GenerationError(503, outcome.code, f"{outcome.message} (waited {wait_s:.0f} s)",
                              retry_after_s=max(1.0, cfg.instance_wait_s))

    async def _route_or_refusal(self, req: GenerationRequest, exclude: set[str]) -> Route | GenerationError:
        """The route, or the refusal of a role with no live instance (worth waiting for); other errors raise."""
        try:
            return await self.routing.route(req, exclude)
        except GenerationError as exc:
            if exc.code not in NO_INSTANCE:
                raise
            return exc

    def max_context(self) -> int:
        limits = [i.max_context for i in self.registry.instances() if i.max_context]
        return min(limits) if limits else 0

    def generate(self, req: GenerationRequest) -> Generation:
        """Start the request: its events go straight from the bus callback to the HTTP layer's queue; cancelling
        the generation's task (the client left) cancels the request everywhere."""
        events = EventQueue()
        return Generation(events, asyncio.create_task(self._serve(req, events), name=f"pdd-req-{req.request_id}"))

    async def _serve(self, req: GenerationRequest, events: asyncio.Queue) -> None:
        try:
            await self._run(req, events)
        except Exception as exc:  # noqa: BLE001 - handed to the HTTP layer, which maps it to an HTTP error
            events.put_nowait(exc)

    async def _run(self, req: GenerationRequest, events: asyncio.Queue) -> None:
        """The request loop: route, submit, then act on what is not a token (a quiet stream's health check, a
        failure to migrate from, the deadline) until the last token went out (``_emit``)."""
        arrival = time.monotonic()
        with tracer.start_as_current_span("router.request", attributes={
                "request_id": req.request_id, "prompt_tokens": len(req.prompt_ids)}) as span:
            t_route = time.monotonic()
            route = await self.route(req)
            span.set_attribute("route_ms", round((time.monotonic() - t_route) * 1000, 2))
            reporting.note_route(span, route)
            model = self.config.model.served_name
            metrics.PROMPT_TOKENS.labels(model).inc(len(req.prompt_ids))
            report = reporting.StreamReport(span, route.pipeline, arrival, model)
            state = InFlight(req, route, OwnershipTracker(route.pipeline), attempt_id=req.request_id, report=report,
                             out=events)
            state.playout = Playout(lambda tokens, logprobs: self._emit(state, tokens, None, logprobs,
                                                                          time.monotonic()), self.handover_costs)
            self.inflight[state.attempt_id] = state
            metrics.IN_FLIGHT.labels(model).inc()
            at_deadline = asyncio.get_running_loop().call_later(  # one timer per request, none per token
                max(0.0, req.deadline_unix - time.time()) + DEADLINE_MARGIN_S, state.control.put_nowait, CHECK)
            finished = False
            try:
                await self._submit(state)
                report.submit(time.monotonic())
                while True:
                    item = await state.control.get()
                    if state.finished:  # whatever else was queued (a check, a failure) came too late to matter
                        finished = True
                        return
                    if time.time() >= req.deadline_unix:
                        raise GenerationError(504, "deadline_exceeded",
                                              f"request {req.request_id} did not finish before its deadline")
                    if item is CHECK:  # quiet for WATCH_INTERVAL_S (the watchdog), or the deadline
                        state.check_queued = False
                        problem = self.health.problem(state)
                        if problem is not None:
                            await self._migrate(state, problem)
                    elif isinstance(item, Failure):
                        await self._migrate(state, item)
                    else:
                        raise item  # a GenerationError
            except GenerationError as exc:
                report.error(exc)
                raise
            finally:
                at_deadline.cancel()
                state.playout.close()
                self.inflight.pop(state.attempt_id, None)
                metrics.IN_FLIGHT.labels(model).dec()
                if not finished:
                    await self._cancel(state.attempt_id, "client gone or failed")

    def _emit(self, state: InFlight, tokens: list[int], finish_reason: str | None, logprobs: list,
              received: float = 0.0) -> None:
        """Tokens (and the finish) to the client's queue, counted by the request's report; the last ends the loop.
        ``received``: when they came off the bus (a token the playout buffer held: when it was released)."""
        now = time.monotonic()
        state.report.tokens(state, len(tokens), now)
        if state.playout is not None:
            state.playout.emitted(now, len(state.flushed), len(tokens))
        state.flushed.extend(tokens)
        event = TokenEvent(tokens, finish_reason, logprobs=logprobs if len(logprobs) == len(tokens) else [],
                           received=received)
        if finish_reason is not None:
            event.info = reporting.request_info(state)
            state.report.finish(state, finish_reason, time.monotonic())
            self.inflight.pop(state.attempt_id, None)  # nothing more of it is taken off the bus
            state.finished = True
            state.control.put_nowait(CHECK)  # wakes the request loop, which sees it finished and ends
        state.out.put_nowait(event)

    async def _submit(self, state: InFlight) -> None:
        req, route = state.request, state.route
        await self.bus.publish(Subjects.instance(route.prefill.instance_id, "submit"), SubmitRequest(
            request_id=state.attempt_id, prompt_ids=req.prompt_ids, sampling=req.sampling,
            pipeline=route.pipeline, events_subject=self.events_subject, deadline_unix=req.deadline_unix,
            rld_instance=route.relay.instance_id if route.relay else None,
            md_instance=route.main_decode.instance_id if route.main_decode else None, md_link=route.md_link,
            handoff_mode=req.forced_handoff or self.config.router.forced_handoff))

    async def _cancel(self, attempt_id: str, reason: str) -> None:
        try:
            await self.bus.publish(Subjects.CANCEL, Cancel(attempt_id, reason=reason))
        except Exception as exc:
            log.warning("cancel_publish_failed", request_id=attempt_id, error=str(exc))

    async def _migrate(self, state: InFlight, failure: Failure) -> None:
        """Move the request to healthy instances under a new attempt id, or fail it with a clear error."""
        rid = state.request.request_id
        state.playout.flush()  # what it holds went to the client: part of the resume point
        if state.migrations >= self.config.router.max_migrations:
            raise GenerationError(503, "failover_exhausted", f"request {rid} failed after {state.migrations} "
                                  f"failover(s): {failure.code}: {failure.message}")
        state.migrations += 1
        if failure.exclude:
            state.excluded.add(failure.exclude)
        owners = failover.depends_on(state)
        left = failure.exclude or (owners[-1].instance_id if owners else None)
        self.inflight.pop(state.attempt_id, None)
        await self._cancel(state.attempt_id, f"migrating: {failure.code}")
        if state.held:  # the client gets the held first token now: it is part of the resume point
            held, held_logprobs, state.held, state.held_logprobs = state.held, state.held_logprobs, [], []
            self._emit(state, held, None, held_logprobs)
        state.attempt_id = f"{rid}-m{state.migrations}"
        self.inflight[state.attempt_id] = state
        state.last_progress = time.monotonic()
        if not state.flushed:
            kind = "retry"
            state.route = await self.route(state.request, exclude=state.excluded)
            state.tracker = OwnershipTracker(state.route.pipeline)
            state.wan_fallback, state.resumed_on = False, None
            reporting.note_route(state.report.span, state.route)
            await self._submit(state)
            target = state.route.prefill
        else:
            kind = "resume"
            target = failover.resume_target(state, self.registry, self.config,
                                            prefer_relay=failure.code in WAN_ERRORS)
            state.tracker = OwnershipTracker(Pipeline.RESUME, next_position=len(state.flushed),
                                             relay_tokens=state.tracker.relay_tokens)
            state.resumed_on = target
            req = state.request
            await self.bus.publish(Subjects.instance(target.instance_id, "resume"), SubmitRequest(
                request_id=state.attempt_id, prompt_ids=req.prompt_ids, sampling=req.sampling, pipeline=Pipeline.RESUME,
                events_subject=self.events_subject, deadline_unix=req.deadline_unix,
                output_ids=list(state.flushed)))
        reporting.note_migration(state, state.report.span, kind, failure.code, left, target)
        log.warning("request_migrated", request_id=rid, kind=kind, reason=failure.code, detail=failure.message,
                    left=left, to=target.instance_id, to_role=target.role, resume_at=len(state.flushed))

    async def _on_event(self, message: Message, envelope: Envelope) -> None:
        rid = getattr(message, "request_id", None)
        if self.probes.owns(rid):
            self.probes.on_event(message)
            return
        state = self.inflight.get(rid) if rid else None
        if state is None:
            return  # unknown, finished, or from an attempt the request migrated away from
        if envelope is not self._envelope:  # a new bus message: its items (a decoder's batch) share its arrival
            self._envelope, self._envelope_at = envelope, time.monotonic()
        state.last_progress = received = self._envelope_at
        if isinstance(message, ErrorReply):
            outcome = failover.on_error(state, message, self.wan, self.registry)
            if outcome is not None:
                state.control.put_nowait(outcome)
            return
        if isinstance(message, PrefillResult):
            state.p_cached = message.cached_tokens
            first_logprobs = [message.first_logprobs] if message.first_logprobs is not None else []
            emission = state.tracker.accept(Role.PREFILL, 0, [message.first_token], message.finish_reason,
                                            logprobs=first_logprobs)
        else:
            assert isinstance(message, TokenChunk)
            if message.meta:
                state.meta.update(message.meta)
            emission = state.tracker.accept(message.role, message.start, message.token_ids, message.finish_reason,
                                            message.owner_until, logprobs=message.logprobs)
        tokens, logprobs = emission.token_ids, emission.logprobs
        if not state.flushed and not state.held and not emission.finish_reason and len(tokens) == 1 \
                and state.tracker.next_position == 1 and self.config.router.first_token_after_kv \
                and spec(state.route.pipeline).crosses_wan:
            state.held, state.held_logprobs = tokens, logprobs  # conventional PD: the first token waits
            return
        if state.held:
            tokens, state.held = state.held + tokens, []
            logprobs, state.held_logprobs = state.held_logprobs + logprobs, []
        if not tokens and not emission.finish_reason:
            return
        playout, start, boundary = state.playout, len(state.flushed) + state.playout.held, state.tracker.relay_until
        if not emission.finish_reason and playout.hold(tokens, logprobs, start, boundary):
            return  # the relay's last tokens before a handover: released paced (router/playout.py)
        playout.flush(took_over=bool(tokens) and boundary is not None and start > boundary)
        self._emit(state, tokens, emission.finish_reason, logprobs, received)
