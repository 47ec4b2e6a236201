"""Main decode (MD): the remote site's decoder, with the Decode-side RadixCache (DRC).

The DRC is the engine's radix cache with ``cache_finished``: every finished request leaves its KV
(prompt and output) for later turns, so only the KV MD lacks crosses the WAN. P-MD: decode as soon
as the missing blocks land. P-RLD-MD: when the KV lands, tell the relay "ready"; each handoff batch
of token ids is extended in one forward pass (no KV crosses for them); after the final batch MD owns
the request and streams every later position.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace

from pdd.engine import StepOutput
from pdd.roles.decoder_service import DecoderService, Incoming
from pdd.shared import metrics
from pdd.shared.bus import Envelope
from pdd.shared.links import KVLink, link_between
from pdd.shared.pipelines import spec
from pdd.shared.protocol import (
    WAN_RATE_KEY,
    HandoffAck,
    HandoffReady,
    HandoffTokens,
    Message,
    Subjects,
    TokenChunk,
)
from pdd.shared.roles import Role
from pdd.shared.telemetry import get_logger

log = get_logger("pdd.maindecode")
tracer = trace.get_tracer("pdd.maindecode")


@dataclass
class Decoding:
    inc: Incoming
    ctx: otel_context.Context
    span: trace.Span | None = None
    owner: bool = False  # MD emits only once it owns the request


class MainDecodeService(DecoderService):
    role = Role.MAIN_DECODE
    cache_finished = True  # the Decode-side RadixCache

    def kv_links(self) -> list[KVLink]:
        """Across the WAN, and inside this site as well where the deployment puts a prefill instance in it (one
        site, the colocated setup): the router then routes that prefill's KV over the fast link."""
        sites = {i.site for i in self.config.instances if i.role == Role.PREFILL}
        return sorted({KVLink.WAN} | {link_between(site, self.instance.site) for site in sites})

    def __init__(self, config, instance):
        super().__init__(config, instance)
        self.decoding: dict[str, Decoding] = {}
        self._wan_rate = 0.0  # EWMA bytes/s of KV arriving over the WAN, for the router's cost model

    async def on_start(self) -> None:
        await super().on_start()
        await self.bus.subscribe(Subjects.instance(self.instance_id, "handoff_tokens"), self._on_handoff_tokens,
                                 expect=HandoffTokens)

    def cache_summary_extra(self) -> dict:
        return {WAN_RATE_KEY: self._wan_rate}

    async def on_kv_landed(self, inc: Incoming) -> None:
        rid = inc.req.request_id
        state = Decoding(inc, otel_context.get_current())
        self.decoding[rid] = state
        # small transfers measure latency, not rate; KV bytes, not wire bytes: the router's cost model divides
        # the KV main decode lacks by this rate, and a codec makes more KV cross per second
        if inc.wan_bytes >= 256 * 1024 and inc.wan_seconds > 0:
            rate = inc.wan_kv_bytes / inc.wan_seconds
            self._wan_rate = rate if self._wan_rate == 0 else 0.7 * self._wan_rate + 0.3 * rate
        if spec(inc.req.pipeline).hands_over and inc.req.rld_instance:
            await self.bus.publish(Subjects.instance(inc.req.rld_instance, "handoff_ready"), HandoffReady(
                request_id=rid, md_instance=self.instance_id, next_position=len(inc.outputs)))
            return
        state.owner = True
        self._start_decode_span(state)
        await self.commit(inc, list(inc.outputs), lambda out: self._on_output(state, out))

    def _start_decode_span(self, state: Decoding) -> None:
        state.span = tracer.start_span("main.decode", context=state.ctx, attributes={
            "request_id": state.inc.req.request_id, "pipeline": state.inc.req.pipeline,
            "cached_tokens": state.inc.cached_tokens, "wan_bytes": state.inc.wan_bytes})

    def _on_output(self, state: Decoding, out: StepOutput) -> None:
        inc = state.inc
        if out.start_position != len(inc.outputs):  # extend outputs of tokens we were given
            return
        inc.outputs.extend(out.token_ids)
        if state.owner:
            meta = {}
            if out.finished:
                meta = {"md_cached_tokens": inc.cached_tokens, "wan_bytes": inc.wan_bytes,
                        "prompt_tokens": len(inc.req.prompt_ids), "kv_codec": inc.kv_codec}
            self.post(inc.req.events_subject, TokenChunk(
                request_id=inc.req.request_id, instance_id=self.instance_id, role=self.role,
                start=out.start_position, token_ids=list(out.token_ids), finish_reason=out.finish_reason, meta=meta,
                logprobs=out.logprobs or []))
        if out.finished:
            if state.span is not None:
                state.span.set_attribute("output_tokens", len(inc.outputs))
                state.span.end()
            self.decoding.pop(inc.req.request_id, None)
            self.finish(inc.req.request_id)

    async def _on_handoff_tokens(self, message: Message, _: Envelope) -> None:
        assert isinstance(message, HandoffTokens)
        rid = message.request_id
        state = self.decoding.get(rid)
        if state is None:
            if message.finish_reason is not None and rid in self.incoming:
                # the relay finished before our KV even landed: nothing left to hand over
                await self.drop(rid)
            return
        if state.owner:
            return
        inc = state.inc
        if message.start != len(inc.outputs):
            log.warning("handoff_gap", request_id=rid, expected=len(inc.outputs), got=message.start)
            return
        if message.finish_reason is not None:
            # the relay finished the request itself: keep what we have in the DRC, emit nothing
            self.decoding.pop(rid, None)
            self.finish(rid)
            await self.runner.call(self._cache_and_free, rid, inc.committed)
            return
        inc.outputs.extend(message.token_ids)
        metrics.EXTEND_TOKENS.observe(len(message.token_ids) + (0 if inc.committed else 1))
        with tracer.start_as_current_span("extend", context=state.ctx, attributes={
            "request_id": rid, "start": message.start, "count": len(message.token_ids), "final": message.final,
            "mode": message.mode}):
            if not inc.committed:
                await self.commit(inc, list(inc.outputs), lambda out: self._on_output(state, out),
                                  paused=not message.final)
            elif message.token_ids:
                await self.runner.call(self._if_live, rid, self.engine.extend_known, list(message.token_ids),
                                       message.start)
        if rid not in self.decoding:  # cancelled while the extend was queued
            return
        if message.final:
            state.owner = True
            self._start_decode_span(state)
            await self.runner.call(self._if_live, rid, self.engine.resume)
            self.runner.wake()
        else:
            self.runner.wake()
            await self.bus.publish(Subjects.instance(message.rld_instance, "handoff_ack"), HandoffAck(
                request_id=rid, md_instance=self.instance_id, through_position=len(inc.outputs) - 1))

    def _if_live(self, rid: str, fn, *args) -> None:
        """Engine thread: act on ``rid`` only if the engine still has it. A step may finish it, or a Cancel
        abort it, after this handler's last check and before this call runs (found by tests/fuzz)."""
        if self.engine.has_request(rid):
            fn(rid, *args)

    def _cache_and_free(self, rid: str, committed: bool) -> None:
        if committed and self.engine.has_request(rid):
            self.engine.finish_to_cache(rid)
        else:
            self.engine.abort(rid)

    async def cancel_request(self, request_id: str, reason: str) -> None:
        """A cancelled request whose KV is in place (a client that stopped reading, a deadline) leaves it in the
        DRC, as P keeps its prompt and as vLLM keeps an aborted request's blocks: the next turn still hits."""
        state = self.decoding.pop(request_id, None)
        if state is not None and state.span is not None:
            state.span.end()
        if state is not None and state.inc.committed and self.runner is not None:
            self.runner.unwatch(request_id)
            await self.runner.call(self._cache_and_free, request_id, True)
        await super().cancel_request(request_id, reason)
