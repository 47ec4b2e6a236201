"""The import side shared by relay (RLD) and main decode (MD): reserve blocks, receive KV, continue.

Flow per request: ``prepare_import`` (reserve blocks, reply with the cached prefix and the
destination blocks) -> KV frames land through the transport -> ``kv_ready`` from P carries the
first token -> ``on_kv_landed`` (role-specific). Reserved blocks are leased: if the KV does not
arrive before the request's deadline (or the lease), everything is freed.

Migration: ``resume`` continues a request another decoder lost, from its prompt and every token the
client already has (recomputed here; no KV crosses). The router sends it under a fresh attempt id.
Any decoder takes it, a relay as well as MD (local finish), even one that never held the request.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from opentelemetry import trace

from pdd.engine import EngineInputError, OutOfBlocks, StepOutput
from pdd.roles.engine_service import EngineService, sampling_params
from pdd.shared.bus import BusError, Envelope
from pdd.shared.links import KVLink
from pdd.shared.protocol import (
    ErrorReply,
    ImportPlan,
    KVReady,
    Message,
    PrepareImport,
    Subjects,
    SubmitRequest,
    TokenChunk,
    TransferCheck,
    TransferCheckReply,
    TransferState,
)
from pdd.shared.telemetry import get_logger
from pdd.transports import TransferHandle

log = get_logger("pdd.receiver")
tracer = trace.get_tracer("pdd.receiver")

IMPORT_LEASE_S = 120.0  # reserved blocks whose KV never arrives are freed after this
TRANSFER_CHECK_S = 5.0  # while KV has not landed, the sending prefill is asked this often whether it still sends
TRANSFER_CHECK_TIMEOUT_S = 2.0  # no answer (a cut WAN, a busy bus): keep the reservation and ask again
CANCEL_MEMORY_S = 30.0  # a Cancel can overtake its request's prepare_import (separate subscriptions)


@dataclass
class Incoming:
    req: PrepareImport
    cached_tokens: int
    handle: TransferHandle | None
    lease_task: asyncio.Task | None = None
    first_token: int | None = None
    wan_bytes: int = 0  # on the wire
    wan_kv_bytes: int = 0  # the KV they decode to (more, with a lossless or fp8 codec)
    wan_seconds: float = 0.0
    kv_codec: str = "none"  # what the KV crossed with (the response says it)
    outputs: list[int] = field(default_factory=list)  # output positions 0.. known here
    committed: bool = False
    kv_landed_unix: float = 0.0


class DecoderService(EngineService):
    def kv_links(self) -> list[KVLink]:
        """The links this decoder takes KV over; a transport is opened for each."""
        raise NotImplementedError

    def __init__(self, config, instance):
        super().__init__(config, instance)
        self.incoming: dict[str, Incoming] = {}
        self._cancelled: dict[str, float] = {}  # recently cancelled request ids -> monotonic time

    async def on_start(self) -> None:
        await super().on_start()
        for link in self.kv_links():
            await self.open_transport(link, self.config.transports.of(link))
        await self.bus.subscribe(Subjects.instance(self.instance_id, "prepare_import"), self._on_prepare,
                                 expect=PrepareImport)
        await self.bus.subscribe(Subjects.instance(self.instance_id, "kv_ready"), self._on_kv_ready, expect=KVReady)
        await self.bus.subscribe(Subjects.instance(self.instance_id, "resume"), self._on_resume, expect=SubmitRequest)

    def in_flight(self) -> int:
        return len(self.incoming)

    def requests_of(self, events_subject: str) -> list[str]:
        return [rid for rid, inc in self.incoming.items() if inc.req.events_subject == events_subject]

    async def _on_prepare(self, message: Message, _: Envelope) -> Message:
        assert isinstance(message, PrepareImport)
        rid = message.request_id
        if not self.accepting:
            return ErrorReply(code="draining", message=f"{self.instance_id} is draining", request_id=rid,
                              retryable=True)
        if rid in self.incoming:
            return ErrorReply(code="duplicate", message=f"request {rid} already imported here", request_id=rid)
        transport = self.transports.get(message.link)
        if transport is None:  # checked before any block is reserved: a refusal holds nothing
            return ErrorReply(code="invalid_request", message=f"{self.instance_id} takes KV over "
                              f"{sorted(self.transports)}, not {message.link}", request_id=rid)
        cancelled = ErrorReply(code="cancelled", message=f"request {rid} was cancelled", request_id=rid)
        if rid in self._cancelled:
            return cancelled
        try:
            plan = await self.runner.call(self.engine.prepare_import, rid, message.prompt_ids, message.use_cache)
        except OutOfBlocks as exc:
            return ErrorReply(code="out_of_kv_blocks", message=str(exc), request_id=rid, retryable=True)
        except EngineInputError as exc:
            return ErrorReply(code="invalid_request", message=str(exc), request_id=rid)
        if rid in self._cancelled:  # the Cancel ran while the blocks were being reserved: nobody sends KV
            await self.runner.call(self.engine.abort, rid)
            return cancelled
        remaining = max(1.0, message.deadline_unix - time.time())
        timeout = min(IMPORT_LEASE_S, remaining)
        handle = transport.expect(rid, plan.dst_blocks, timeout_s=timeout) if plan.dst_blocks else None
        inc = Incoming(req=message, cached_tokens=plan.cached_tokens, handle=handle)
        inc.lease_task = asyncio.create_task(self._lease(rid, timeout, remaining + 5))
        self.incoming[rid] = inc
        return ImportPlan(request_id=rid, instance_id=self.instance_id, cached_tokens=plan.cached_tokens,
                          dst_blocks=plan.dst_blocks, descriptor=transport.descriptor())

    async def _on_resume(self, message: Message, _: Envelope) -> None:
        assert isinstance(message, SubmitRequest)
        rid = message.request_id
        if not self.accepting:
            await self.send_error(message.events_subject, rid, "draining", f"{self.instance_id} is draining",
                                  retryable=True)
            return
        if rid in self.incoming:
            return
        req = PrepareImport(request_id=rid, prompt_ids=message.prompt_ids, sampling=message.sampling,
                            events_subject=message.events_subject, deadline_unix=message.deadline_unix,
                            pipeline=message.pipeline, use_cache=True)
        inc = Incoming(req=req, cached_tokens=0, handle=None, first_token=(message.output_ids or [None])[0],
                       outputs=list(message.output_ids), committed=True)
        remaining = max(1.0, message.deadline_unix - time.time())
        inc.lease_task = asyncio.create_task(self._lease(rid, remaining + 5, remaining + 5))
        self.incoming[rid] = inc

        def on_output(out: StepOutput) -> None:
            inc.outputs.extend(out.token_ids)
            self.post(message.events_subject, TokenChunk(
                request_id=rid, instance_id=self.instance_id, role=self.role, start=out.start_position,
                token_ids=list(out.token_ids), finish_reason=out.finish_reason, logprobs=out.logprobs or [],
                meta={"resumed_at": len(message.output_ids)} if out.finished else {}))
            if out.finished:
                self.finish(rid)

        self.runner.watch(rid, on_output)
        try:
            await self.runner.call(self.engine.add_request, rid, message.prompt_ids,
                                   sampling_params(message.sampling), max_new_tokens=message.sampling.max_tokens,
                                   known_outputs=list(message.output_ids))
        except EngineInputError as exc:
            await self.send_error(message.events_subject, rid, "invalid_request", str(exc))
            await self.drop(rid)
            return
        log.info("request_resumed", request_id=rid, known_outputs=len(message.output_ids))
        self.runner.wake()

    async def _lease(self, rid: str, kv_seconds: float, request_seconds: float) -> None:
        """Free what a request holds here if its KV never lands, or if it outlives its deadline. While the KV has
        not landed the sending prefill is asked whether it still sends: a Cancel lost while the WAN was cut
        would otherwise hold the blocks for the whole lease."""
        start = time.monotonic()
        until = start + kv_seconds
        while (left := until - time.monotonic()) > 0:
            await asyncio.sleep(min(TRANSFER_CHECK_S, left))
            inc = self.incoming.get(rid)
            if inc is None or inc.first_token is not None:
                break
            if await self._source_forgot(inc):
                log.warning("import_orphaned", request_id=rid, source=inc.req.source_instance)
                await self.drop(rid)
                return
        inc = self.incoming.get(rid)
        if inc is not None and inc.first_token is None:
            log.warning("import_lease_expired", request_id=rid)
            await self.drop(rid)
            return
        await asyncio.sleep(max(0.0, start + request_seconds - time.monotonic()))  # the KV may have landed early
        if rid in self.incoming:
            log.warning("request_deadline_expired", request_id=rid)
            await self.drop(rid)

    async def _source_forgot(self, inc: Incoming) -> bool:
        """True only when the sending prefill answers that it knows nothing of this transfer any more."""
        source = inc.req.source_instance
        if not source:
            return False
        try:
            reply = await self.bus.request(
                Subjects.instance(source, "transfer_check"),
                TransferCheck(request_id=inc.req.request_id, instance_id=self.instance_id),
                timeout=TRANSFER_CHECK_TIMEOUT_S, expect=TransferCheckReply)
        except BusError:
            return False
        return isinstance(reply, TransferCheckReply) and reply.state == TransferState.UNKNOWN

    def finish(self, rid: str) -> None:
        """The request is done here (its KV was freed or cached by the engine)."""
        inc = self.incoming.pop(rid, None)
        if inc is not None and inc.lease_task:
            inc.lease_task.cancel()

    async def _on_kv_ready(self, message: Message, _: Envelope) -> None:
        assert isinstance(message, KVReady)
        inc = self.incoming.get(message.request_id)
        if inc is None or inc.first_token is not None:
            return
        inc.first_token = message.first_token
        inc.kv_codec = message.codec
        if inc.req.link == KVLink.WAN:
            inc.wan_bytes = message.bytes_sent
            inc.wan_kv_bytes = message.kv_bytes or message.bytes_sent
            inc.wan_seconds = message.seconds
        inc.outputs = [message.first_token]
        with tracer.start_as_current_span("kv.receive", attributes={
            "request_id": message.request_id, "bytes": message.bytes_sent, "cached_tokens": inc.cached_tokens,
            "codec": message.codec,
        }):
            try:
                if inc.handle is not None:
                    await inc.handle
            except Exception as exc:
                if message.request_id not in self.incoming:  # cancelled or finished elsewhere meanwhile
                    return
                await self.send_error(inc.req.events_subject, message.request_id, "kv_transfer_failed",
                                      f"KV for {message.request_id} did not arrive at {self.instance_id}: {exc}",
                                      retryable=True)
                await self.drop(message.request_id)
                return
        if message.request_id not in self.incoming:  # cancelled meanwhile
            return
        inc.kv_landed_unix = time.time()
        try:
            await self.on_kv_landed(inc)
        except EngineInputError as exc:
            await self.send_error(inc.req.events_subject, message.request_id, "invalid_request", str(exc))
            await self.drop(message.request_id)

    async def on_kv_landed(self, inc: Incoming) -> None:
        raise NotImplementedError

    async def commit(self, inc: Incoming, known: list[int], on_output, paused: bool = False) -> None:
        """Attach the imported KV; ``known`` output tokens are extended in one pass, then decoding goes on.

        ``paused``: extend only, sample nothing until ``engine.resume`` (MD during catch-up).
        """
        rid = inc.req.request_id
        params = sampling_params(inc.req.sampling)

        def attach() -> None:
            self.engine.commit_import(rid, inc.req.prompt_ids, known, params, inc.req.sampling.max_tokens)
            if paused:
                self.engine.pause(rid)

        self.runner.watch(rid, on_output)
        await self.runner.call(attach)
        inc.committed = True
        self.runner.wake()

    async def emit(self, inc: Incoming, out: StepOutput, **extra) -> None:
        await self.bus.publish(inc.req.events_subject, TokenChunk(
            request_id=inc.req.request_id, instance_id=self.instance_id, role=self.role, start=out.start_position,
            token_ids=list(out.token_ids), finish_reason=out.finish_reason, logprobs=out.logprobs or [], **extra))

    async def drop(self, rid: str) -> None:
        """Forget a request here and free its blocks (idempotent)."""
        inc = self.incoming.pop(rid, None)
        if inc is not None and inc.lease_task:
            inc.lease_task.cancel()
        await EngineService.cancel_request(self, rid, "dropped")

    async def cancel_request(self, request_id: str, reason: str) -> None:
        """Also remembered for a while: a prepare_import still queued here must not reserve blocks for
        a request that no longer exists (they would stay reserved until the lease ran out)."""
        now = time.monotonic()
        self._cancelled.pop(request_id, None)
        self._cancelled[request_id] = now
        while self._cancelled:
            oldest = next(iter(self._cancelled))
            if now - self._cancelled[oldest] <= CANCEL_MEMORY_S and len(self._cancelled) <= 100_000:
                break
            del self._cancelled[oldest]
        await self.drop(request_id)
