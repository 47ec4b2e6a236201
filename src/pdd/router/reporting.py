"""What a request leaves behind: metrics, span attributes and events, and the final event's info.

Kept out of the request loop so the loop reads as the protocol it is; everything here observes a
request (its route, its stream's timing, how it finished) and changes nothing about it.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from pdd.router.inflight import InFlight
from pdd.router.routing import Route
from pdd.router.types import GenerationError
from pdd.shared import metrics
from pdd.shared.pipelines import Pipeline, spec
from pdd.shared.protocol import Announce
from pdd.shared.roles import Role

SPAN_TOKEN_EVENTS_UNTIL = 64  # token events on the span for the stream's start: where eager tokens show


def note_route(span: trace.Span, route: Route) -> None:
    span.set_attributes({"pipeline": route.pipeline, "prefill": route.prefill.instance_id,
                         "relay": route.relay.instance_id if route.relay else "",
                         "main_decode": route.main_decode.instance_id if route.main_decode else ""})
    metrics.PIPELINE.labels(route.pipeline, route.reason).inc()


def note_migration(state: InFlight, span: trace.Span, kind: str, reason: str, left: str | None,
                   target: Announce) -> None:
    """A failover (``kind`` retry or resume): the counter, the span event, and in the `pdd` block the count,
    each move (``failovers``: why, the instance left, the one taken, the role, the resume position) and, after
    a resume, the decoder that finished it (``resumed_on``, ``resumed_on_role``)."""
    at, role = len(state.flushed), str(target.role)
    metrics.MIGRATIONS.labels(kind, reason, role).inc()
    state.meta["migrations"] = state.migrations
    state.meta.setdefault("failovers", []).append(
        {"kind": kind, "reason": reason, "left": left, "to": target.instance_id, "role": role, "at": at})
    if kind == "resume":
        state.meta["resumed_on"], state.meta["resumed_on_role"] = target.instance_id, role
    span.add_event("migrated", {"kind": kind, "reason": reason, "left": left or "", "to": target.instance_id,
                                "role": role, "resume_at": at})


def request_info(state: InFlight) -> dict[str, Any]:
    """The final event's ``info``: pipeline, instances, hit rates, what the decoders reported."""
    r = state.route
    kv_to = spec(r.pipeline).kv_to
    info = {"pipeline": r.pipeline, "reason": r.reason, "prefill": r.prefill.instance_id,
            "relay": r.relay.instance_id if r.relay and Role.RELAY in kv_to else None,
            "main_decode": r.main_decode.instance_id if r.main_decode and Role.MAIN_DECODE in kv_to else None,
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


def record_finish(state: InFlight, reason: str, model: str) -> None:
    """PDD's per-request figures and the vLLM-named counters of a finished request."""
    prompt = max(1, len(state.request.prompt_ids))
    metrics.REQUEST_HIT_RATIO.labels("P").observe(state.p_cached / prompt)
    if "md_cached_tokens" in state.meta:
        metrics.REQUEST_HIT_RATIO.labels("MD").observe(state.meta["md_cached_tokens"] / prompt)
    if "wan_bytes" in state.meta:
        metrics.REQUEST_WAN_BYTES.observe(state.meta["wan_bytes"])
    metrics.REQUESTS.labels(model, reason).inc()
    metrics.GENERATION_TOKENS.labels(model).inc(len(state.flushed))
    metrics.REQUEST_PROMPT_TOKENS.labels(model).observe(len(state.request.prompt_ids))
    metrics.REQUEST_GENERATION_TOKENS.labels(model).observe(len(state.flushed))
    metrics.REQUEST_MAX_GENERATION_TOKENS.labels(model).observe(state.request.sampling.max_tokens)
    metrics.REQUEST_PARAMS_MAX_TOKENS.labels(model).observe(state.request.sampling.max_tokens)
    metrics.RLD_TOKENS.inc(state.tracker.relay_tokens)


class StreamReport:
    """The timing of one request's stream as the client gets it: TTFT, ITL per token, the phases
    (queue, prefill, decode) and the handoff stall, and the span's events along the way. TTFT, ITL and
    E2E are labelled by the pipeline first chosen; every vLLM-named series by the served model name."""

    def __init__(self, span: trace.Span, pipeline: Pipeline, arrival: float, model: str):
        self.span = span
        self.pipeline = pipeline
        self.arrival = arrival
        self.model = model
        self.submitted: float | None = None  # first handed to a prefill instance
        self.first: float | None = None  # the client got the first token
        self.last: float | None = None  # when the client last got tokens
        self._itl = metrics.ITL.labels(model, pipeline)  # observed per token: the labelled child looked up once

    def submit(self, now: float) -> None:
        """The request was handed to its prefill instance: the router's queue time ends here."""
        if self.submitted is None:
            self.submitted = now
            metrics.QUEUE_TIME.labels(self.model).observe(now - self.arrival)

    def tokens(self, state: InFlight, count: int, now: float) -> None:
        """``count`` tokens go to the client at ``now``; ``state.flushed`` does not hold them yet."""
        sent = len(state.flushed)
        if not count:
            return
        boundary = state.tracker.relay_until
        if boundary is not None and self.last is not None and sent <= boundary + 1 < sent + count:
            stall = now - self.last  # the gap in which ownership moved from the relay to MD
            metrics.HANDOFF_STALL.observe(stall)
            self.span.set_attribute("handoff_stall_ms", round(stall * 1000, 2))
        if not sent:
            metrics.TTFT.labels(self.model, self.pipeline).observe(now - self.arrival)
            self.first = now
            if self.submitted is not None:
                metrics.PREFILL_TIME.labels(self.model).observe(now - self.submitted)
            gaps = metrics.itl_observations(0.0, count)[1:]  # positions arriving with the first token
            self.span.add_event("first_token")
        elif count == 1:  # nearly every call: one token, one observation
            gaps = ()
            self._itl.observe(now - (self.last if self.last is not None else now))
        else:
            gaps = metrics.itl_observations(now - (self.last if self.last is not None else now), count)
        for gap in gaps:
            self._itl.observe(gap)
        self.last = now
        emitted = sent + count
        if emitted <= SPAN_TOKEN_EVENTS_UNTIL:  # spans cap their events
            self.span.add_event("tokens", {"count": count, "emitted": emitted,
                                           "relay_tokens": state.tracker.relay_tokens})

    def finish(self, state: InFlight, reason: str, now: float) -> None:
        record_finish(state, reason, self.model)
        metrics.E2E.labels(self.model, state.route.pipeline).observe(now - self.arrival)
        if self.first is not None:
            decode = (self.last or now) - self.first
            metrics.DECODE_TIME.labels(self.model).observe(decode)
            if len(state.flushed) > 1:
                metrics.TPOT.labels(self.model).observe(decode / (len(state.flushed) - 1))
        if self.submitted is not None:
            metrics.INFERENCE_TIME.labels(self.model).observe(now - self.submitted)
        self.span.set_attributes({"output_tokens": len(state.flushed), "rld_tokens": state.tracker.relay_tokens})

    def error(self, exc: GenerationError) -> None:
        metrics.REQUEST_ERRORS.labels(exc.code).inc()
        self.span.set_attribute("error", exc.code)
