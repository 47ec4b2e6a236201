"""Relay decode (RLD): decode at once from the fast-path KV, stream eager tokens, hand over to MD.

Handoff is by token ids only. One-shot: stop, send every generated id. Catch-up: send the ids so
far and keep decoding; MD extends them and acks; repeat until the relay is at most
``handoff_final_gap`` tokens ahead, then stop at a named position. The relay frees the request's
KV right after it stops. Ownership: the relay owns output positions up to the boundary it names
(``owner_until``); MD owns every position after it.

The relay names its boundary ``BOUNDARY_AHEAD`` tokens before it emits the last of them: the step already
running, then one more. The router paces those last tokens (router/playout.py) so that the switch's pause
(MD's hop and step, out of phase with the relay's) is spread over them instead of landing in one gap.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace

from pdd.engine import StepOutput
from pdd.roles.decoder_service import DecoderService, Incoming
from pdd.shared import metrics
from pdd.shared.bus import Envelope
from pdd.shared.links import KVLink
from pdd.shared.pipelines import HandoffMode, spec
from pdd.shared.policy import choose_handoff_mode
from pdd.shared.protocol import HandoffAck, HandoffReady, HandoffTokens, Message, Subjects, TokenChunk
from pdd.shared.roles import Role
from pdd.shared.telemetry import get_logger

BOUNDARY_AHEAD = 1  # steps the relay still runs after the one in flight once it decides to stop (see above)

log = get_logger("pdd.relay")
tracer = trace.get_tracer("pdd.relay")


@dataclass
class Relayed:
    inc: Incoming
    span: trace.Span
    ctx: otel_context.Context
    mode: str | None = None
    md_next: int | None = None  # first position MD does not hold yet
    batches: int = 0
    stop_at: int | None = None  # the last position the relay emits, once named
    done: bool = False


class RelayService(DecoderService):
    role = Role.RELAY
    cache_finished = False  # relay work is transient: nothing to reuse

    def kv_links(self) -> list[KVLink]:
        return [KVLink.FAST]  # the relay sits beside prefill

    def __init__(self, config, instance):
        super().__init__(config, instance)
        self.relayed: dict[str, Relayed] = {}
        self._early_ready: dict[str, HandoffReady] = {}

    async def on_start(self) -> None:
        await super().on_start()
        await self.bus.subscribe(Subjects.instance(self.instance_id, "handoff_ready"), self._on_handoff_ready,
                                 expect=HandoffReady)
        await self.bus.subscribe(Subjects.instance(self.instance_id, "handoff_ack"), self._on_handoff_ack,
                                 expect=HandoffAck)

    async def on_kv_landed(self, inc: Incoming) -> None:
        ctx = otel_context.get_current()
        span = tracer.start_span("relay.decode", context=ctx, attributes={
            "request_id": inc.req.request_id, "pipeline": inc.req.pipeline})
        state = Relayed(inc, span, ctx)
        self.relayed[inc.req.request_id] = state
        await self.commit(inc, [inc.first_token], lambda out: self._on_output(state, out))
        early = self._early_ready.pop(inc.req.request_id, None)
        if early is not None:  # MD's KV landed before ours
            await self._on_handoff_ready(early, None)

    def _on_output(self, state: Relayed, out: StepOutput) -> None:
        if state.done:
            return
        inc = state.inc
        ids, logprobs, finish = list(out.token_ids), out.logprobs or [], out.finish_reason
        if state.stop_at is not None:  # past the named boundary: MD owns those positions
            keep = max(0, state.stop_at + 1 - out.start_position)
            if keep < len(ids):
                ids, logprobs, finish = ids[:keep], logprobs[:keep], None
            if not ids:
                return
        inc.outputs.extend(ids)
        self.post(inc.req.events_subject, TokenChunk(
            request_id=inc.req.request_id, instance_id=self.instance_id, role=self.role, start=out.start_position,
            token_ids=ids, finish_reason=finish, logprobs=logprobs,
            meta={"rld_tokens": len(inc.outputs) - 1, "kv_codec": inc.kv_codec} if finish else {}))
        if finish:
            self._finalize(state, finish_reason=finish)
        elif state.stop_at is not None and len(inc.outputs) > state.stop_at:
            self._stop_relaying(state)

    def _finalize(self, state: Relayed, finish_reason: str | None) -> None:
        """The relay is done with this request: tell MD (if any) what it holds and free the KV."""
        if state.done:
            return
        state.done = True
        inc = state.inc
        rid = inc.req.request_id
        if inc.req.md_instance and spec(inc.req.pipeline).hands_over:
            start = state.md_next if state.md_next is not None else 1
            self.post(Subjects.instance(inc.req.md_instance, "handoff_tokens"), HandoffTokens(
                request_id=rid, rld_instance=self.instance_id, start=start, token_ids=inc.outputs[start:],
                mode=state.mode or HandoffMode.ONE_SHOT, final=True, finish_reason=finish_reason))
            self._batch_span(state, start, len(inc.outputs) - start, final=True)
        if finish_reason is None:  # handed over: name the boundary so the router switches owner
            self.post(inc.req.events_subject, TokenChunk(
                request_id=rid, instance_id=self.instance_id, role=self.role, start=len(inc.outputs), token_ids=[],
                owner_until=len(inc.outputs) - 1,
                meta={"handoff_mode": state.mode, "handoff_batches": state.batches,
                      "rld_tokens": len(inc.outputs) - 1}))
            metrics.HANDOFF.labels(state.mode or HandoffMode.ONE_SHOT).inc()
        state.span.set_attributes({"rld_tokens": len(inc.outputs) - 1, "handoff_mode": state.mode or "",
                                   "finish_reason": finish_reason or "handoff"})
        state.span.end()
        self.relayed.pop(rid, None)
        self.finish(rid)

    def _batch_span(self, state: Relayed, start: int, count: int, final: bool) -> None:
        state.batches += 1
        span = tracer.start_span("handoff.batch", context=state.ctx, attributes={
            "request_id": state.inc.req.request_id, "start": start, "count": count, "mode": state.mode or "",
            "final": final})
        span.end()

    def _stop_after_next(self, state: Relayed) -> None:
        """Stop after the step in flight and ``BOUNDARY_AHEAD`` more, naming that boundary to the router now."""
        inc = state.inc
        state.stop_at = len(inc.outputs) + BOUNDARY_AHEAD  # the step in flight emits position len(outputs)
        state.span.add_event("boundary_named", {"owner_until": state.stop_at})
        self.post(inc.req.events_subject, TokenChunk(
            request_id=inc.req.request_id, instance_id=self.instance_id, role=self.role, start=len(inc.outputs),
            token_ids=[], owner_until=state.stop_at))

    def _stop_relaying(self, state: Relayed) -> None:
        """The boundary's token is out: stop decoding (the abort lands before the next step) and hand over."""
        rid = state.inc.req.request_id
        self.runner.unwatch(rid)
        aborted = self.runner.queue(self.engine.abort, rid)
        aborted.add_done_callback(lambda f: f.cancelled() or f.exception() is None or log.error(
            "relay_abort_failed", request_id=rid, error=str(f.exception())))
        self._finalize(state, finish_reason=None)

    async def _on_handoff_ready(self, message: Message, _: Envelope | None) -> None:
        assert isinstance(message, HandoffReady)
        state = self.relayed.get(message.request_id)
        if state is None:
            if message.request_id in self.incoming:
                self._early_ready[message.request_id] = message
            return
        if state.done or state.md_next is not None:
            return
        state.md_next = message.next_position
        pending = len(state.inc.outputs) - message.next_position
        load = self.current_load()
        mode = state.inc.req.handoff_mode or choose_handoff_mode(pending, load, self.config.policy).value
        state.mode = mode
        state.span.add_event("handoff_ready", {"pending": pending, "mode": mode})
        if mode == HandoffMode.ONE_SHOT.value:
            self._stop_after_next(state)
        else:
            self._send_batch(state)

    def _send_batch(self, state: Relayed) -> None:
        inc = state.inc
        start = state.md_next
        tokens = inc.outputs[start:]
        self.post(Subjects.instance(inc.req.md_instance, "handoff_tokens"), HandoffTokens(
            request_id=inc.req.request_id, rld_instance=self.instance_id, start=start, token_ids=tokens,
            mode=state.mode, final=False))
        self._batch_span(state, start, len(tokens), final=False)
        state.md_next = start + len(tokens)

    async def _on_handoff_ack(self, message: Message, _: Envelope) -> None:
        assert isinstance(message, HandoffAck)
        state = self.relayed.get(message.request_id)
        if state is None or state.done or state.stop_at is not None:
            return
        gap = len(state.inc.outputs) - (message.through_position + 1)
        if gap <= self.config.policy.handoff_final_gap:
            self._stop_after_next(state)
        else:
            self._send_batch(state)

    async def drop(self, rid: str) -> None:
        self._early_ready.pop(rid, None)
        await super().drop(rid)

    async def cancel_request(self, request_id: str, reason: str) -> None:
        state = self.relayed.pop(request_id, None)
        if state is not None and not state.done:
            state.done = True
            state.span.end()
        await super().cancel_request(request_id, reason)
