"""Prefill (P): prefix match, prefill, first token at once, then dual-path KV transfer.

For each request the receivers (relay over the fast in-site transport, main decode over the WAN, or
over the fast one where it shares P's site) are asked to prepare while the prompt is being prefilled:
each answers with the prefix it already holds and where the rest must land, so only missing blocks
move. Both transfers run in parallel.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from opentelemetry import trace

from pdd.engine import EngineInputError, StepOutput
from pdd.roles.engine_runner import BlocksCallback
from pdd.roles.engine_service import EngineService, sampling_params
from pdd.roles.kv_export import BLOCKS_FINAL_EVENT, LinkBusy, PromptExport, Sent
from pdd.shared import metrics
from pdd.shared.bus import BusError, Envelope
from pdd.shared.links import KVLink
from pdd.shared.pipelines import spec
from pdd.shared.protocol import (
    Cancel,
    ImportPlan,
    KVReady,
    Message,
    PrefillResult,
    PrepareImport,
    Subjects,
    SubmitRequest,
    TokenLogprobs,
    TransferCheck,
    TransferCheckReply,
    TransferState,
)
from pdd.shared.roles import Role
from pdd.shared.telemetry import get_logger, inject_headers
from pdd.shared.wan_backlog import WanBacklog
from pdd.transports.base import SendProgress
from pdd.transports.codec import summarize
from pdd.transports.errors import PeerLostError, TransferTimeout

SENT_MEMORY_S = 60.0  # how long a finished transfer is remembered for its receiver's transfer check

log = get_logger("pdd.prefill")
tracer = trace.get_tracer("pdd.prefill")


@dataclass
class Destination:
    instance_id: str
    link: KVLink
    use_cache: bool


class PrefillService(EngineService):
    role = Role.PREFILL

    def __init__(self, config, instance):
        super().__init__(config, instance)
        self._active: dict[str, asyncio.Task] = {}
        self._subjects: dict[str, str] = {}  # request -> the events subject of the router that owns it
        # (request, receiver) -> when its KV was sent and kv_ready published: a receiver asking just before the
        # kv_ready reaches it must hear "sent", not "unknown" (which frees its reservation)
        self._sent: dict[tuple[str, str], float] = {}
        self.wan_backlog = WanBacklog()

    async def on_start(self) -> None:
        await super().on_start()
        for link in KVLink:
            await self.open_transport(link, self.config.transports.of(link))
        await self.bus.subscribe(Subjects.instance(self.instance_id, "submit"), self._on_submit, expect=SubmitRequest)
        await self.bus.subscribe(Subjects.instance(self.instance_id, "transfer_check"), self._on_transfer_check,
                                 expect=TransferCheck)

    def in_flight(self) -> int:
        return len(self._active)

    def requests_of(self, events_subject: str) -> list[str]:
        return [rid for rid, subject in self._subjects.items() if subject == events_subject]

    def cache_summary_extra(self) -> dict:
        return self.wan_backlog.summary()

    async def on_stop(self) -> None:
        for task in list(self._active.values()):  # past the drain timeout: give up on them cleanly
            task.cancel()
        await asyncio.gather(*self._active.values(), return_exceptions=True)
        await super().on_stop()

    async def _on_submit(self, message: Message, _: Envelope) -> None:
        assert isinstance(message, SubmitRequest)
        if not self.accepting:
            await self.send_error(message.events_subject, message.request_id, "draining",
                                  f"prefill {self.instance_id} is draining", retryable=True)
            return
        if message.request_id in self._active:
            return
        task = asyncio.create_task(self._run(message), name=f"prefill-{message.request_id}")
        self._active[message.request_id] = task
        self._subjects[message.request_id] = message.events_subject

        def done(_: asyncio.Task) -> None:
            self._active.pop(message.request_id, None)
            self._subjects.pop(message.request_id, None)
        task.add_done_callback(done)

    async def _on_transfer_check(self, message: Message, _: Envelope) -> Message:
        """A receiver whose KV has not landed asks whether it is still coming (decoder_service's lease)."""
        assert isinstance(message, TransferCheck)
        now = time.monotonic()
        while self._sent and now - next(iter(self._sent.values())) > SENT_MEMORY_S:
            del self._sent[next(iter(self._sent))]
        if (message.request_id, message.instance_id) in self._sent:
            state = TransferState.SENT
        elif message.request_id in self._active:
            state = TransferState.SENDING
        else:
            state = TransferState.UNKNOWN
        return TransferCheckReply(request_id=message.request_id, state=state)

    async def cancel_request(self, request_id: str, reason: str) -> None:
        task = self._active.get(request_id)
        if task is not None:
            task.cancel()  # its finally frees the KV once no transfer reads it any more
        else:
            await super().cancel_request(request_id, reason)

    def _destinations(self, req: SubmitRequest) -> list[Destination]:
        dests = []
        kv_to = spec(req.pipeline).kv_to
        if Role.RELAY in kv_to and req.rld_instance:
            dests.append(Destination(req.rld_instance, KVLink.FAST, use_cache=False))
        if Role.MAIN_DECODE in kv_to and req.md_instance:
            dests.append(Destination(req.md_instance, req.md_link, use_cache=True))
        return dests

    async def _run(self, req: SubmitRequest) -> None:
        rid = req.request_id
        held = False
        export = PromptExport(-(-len(req.prompt_ids) // self.engine.block_size))
        first: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        plans: dict[str, asyncio.Task[ImportPlan]] = {}
        sends: list[asyncio.Task] = []
        try:
            with tracer.start_as_current_span("prefill", attributes={"request_id": rid, "pipeline": req.pipeline,
                                                                     "prompt_tokens": len(req.prompt_ids)}) as span:
                dests = self._destinations(req)
                plans = {d.instance_id: asyncio.create_task(self._prepare(req, d)) for d in dests}
                # each destination's KV streams from the first finished chunk on, while later chunks compute
                sends = [asyncio.create_task(self._transfer(req, d, plans[d.instance_id], export, first))
                         for d in dests]
                self.runner.watch_blocks(rid, self._blocks_watcher(len(req.prompt_ids), export, span))
                cached = await self.runner.call(self.engine.cached_prefix_len, req.prompt_ids)
                token, first_logprobs, finish_reason = await self._prefill(req)
                held = True
                span.set_attribute("cached_tokens", cached)
            await self.bus.publish(req.events_subject, PrefillResult(
                request_id=rid, instance_id=self.instance_id, first_token=token, prompt_tokens=len(req.prompt_ids),
                cached_tokens=cached, finish_reason=finish_reason, first_logprobs=first_logprobs))
            if finish_reason is not None or not dests:
                if dests:
                    await self.bus.publish(Subjects.CANCEL, Cancel(rid, reason="finished at prefill"))
                return
            export.update(await self.runner.call(self.engine.request_blocks, rid), done=True)
            first.set_result(token)
            for plan in plans.values():
                await plan  # a decoder that could not be reached fails the request as a bus error
            results = await asyncio.gather(*sends, return_exceptions=True)
            failed = [(d, r) for d, r in zip(dests, results) if isinstance(r, BaseException)]
            if failed:
                await self._transfer_failed(req, dests, failed)
        except asyncio.CancelledError:
            raise
        except EngineInputError as exc:
            await self.send_error(req.events_subject, rid, "invalid_request", str(exc))
        except BusError as exc:
            await self.send_error(req.events_subject, rid, exc.code, f"prefill could not reach a decoder: {exc}",
                                  retryable=True)
            await self.bus.publish(Subjects.CANCEL, Cancel(rid, reason="prepare failed"))
        except Exception as exc:
            log.exception("prefill_failed", request_id=rid)
            await self.send_error(req.events_subject, rid, "internal", f"prefill failed: {exc}")
        finally:
            self.runner.unwatch(rid)
            # shielded: a Cancel arriving while this runs (the router's, once the request ended) must not skip
            # the release, or the prompt's blocks stay held forever
            await asyncio.shield(self._end_export(rid, export, first, [*sends, *plans.values()], held))

    def _blocks_watcher(self, prompt_tokens: int, export: PromptExport, span: trace.Span) -> BlocksCallback:
        """After each step: the export learns the blocks now final; the span marks when more became final."""
        block_size = self.engine.block_size

        def update(blocks: list[int]) -> None:
            if len(blocks) > len(export.blocks):
                span.add_event(BLOCKS_FINAL_EVENT, {"tokens": min(len(blocks) * block_size, prompt_tokens)})
            export.update(blocks)
        return update

    async def _end_export(self, rid: str, export: PromptExport, first: asyncio.Future[int],
                          tasks: list[asyncio.Task], held: bool) -> None:
        """Stop the request's sends, then free its KV: into P's radix cache once prefilled, else dropped.

        What a sender may wait on ends too (the export, the first token), so a sender that missed its
        cancellation still stops and the release below is never stuck behind it."""
        export.close()
        first.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # no send may read the blocks once they are freed
        await self.runner.call(self._release if held else self.engine.abort, rid)

    async def _transfer_failed(self, req: SubmitRequest, dests: list[Destination],
                               failed: list[tuple[Destination, BaseException]]) -> None:
        """WAN fallback: in P-RLD-MD a lost WAN transfer leaves the relay to finish the request locally.

        Any other failure ends this attempt everywhere; the router migrates or retries it.
        """
        rid = req.request_id
        wan_only = all(d.link == KVLink.WAN for d, _ in failed) and len(failed) < len(dests)
        dest, exc = failed[0]
        # only a link that lost its peer or timed out says the WAN is down; a receiver that refused the
        # frames (e.g. MD dropped the request because the relay already finished it) says nothing about it
        link_down = isinstance(exc, (PeerLostError, TransferTimeout, TimeoutError))
        code = ("wan_transfer_failed" if link_down else "wan_transfer_refused") if dest.link == KVLink.WAN \
            else "kv_transfer_failed"
        if wan_only:
            await self.bus.publish(Subjects.instance(dest.instance_id, "cancel"),
                                   Cancel(rid, reason="wan transfer failed"))
            await self.send_error(req.events_subject, rid, code, f"KV transfer to {dest.instance_id} failed "
                                  f"({exc}); the relay finishes the request locally", retryable=True)
            return
        await self.send_error(req.events_subject, rid, code, f"KV transfer to {dest.instance_id} failed: {exc}",
                              retryable=True)
        await self.bus.publish(Subjects.CANCEL, Cancel(rid, reason="kv transfer failed"))

    def _release(self, rid: str) -> None:
        if self.engine.has_request(rid):
            self.engine.release(rid)

    async def _prefill(self, req: SubmitRequest) -> tuple[int, TokenLogprobs | None, str | None]:
        """Run the prompt; the first token (output position 0) and its logprobs (if asked) are sampled here."""
        done: asyncio.Future[StepOutput] = asyncio.get_running_loop().create_future()

        def on_output(out: StepOutput) -> None:
            if out.finished and not done.done():
                done.set_result(out)

        self.runner.watch(req.request_id, on_output)
        await self.runner.call(self.engine.add_request, req.request_id, req.prompt_ids,
                               sampling_params(req.sampling), max_new_tokens=1, hold_kv=True)
        self.runner.wake()
        out = await done
        first = out.token_ids[0]
        # max_new_tokens=1 always ends in "length" here; only a real stop or the client's limit ends the request
        eos = first in self.engine.eos_token_ids and not req.sampling.ignore_eos
        stop = eos or first in req.sampling.stop_token_ids
        finish = "stop" if stop else ("length" if req.sampling.max_tokens <= 1 else None)
        return first, (out.logprobs or [None])[0], finish

    async def _prepare(self, req: SubmitRequest, dest: Destination) -> ImportPlan:
        message = PrepareImport(
            request_id=req.request_id, prompt_ids=req.prompt_ids, sampling=req.sampling,
            events_subject=req.events_subject, deadline_unix=req.deadline_unix, pipeline=req.pipeline,
            use_cache=dest.use_cache, link=dest.link, source_descriptor=self.transports[dest.link].descriptor(),
            handoff_mode=req.handoff_mode, md_instance=req.md_instance, rld_instance=req.rld_instance,
            source_instance=self.instance_id,
        )
        plan = await self.bus.request(Subjects.instance(dest.instance_id, "prepare_import"), message,
                                      expect=ImportPlan)
        assert isinstance(plan, ImportPlan)
        return plan

    def _count_sent(self, link: KVLink, nbytes: int, seconds: float, span: trace.Span) -> None:
        """A transfer's bytes, whether it completed or not, in the link's counter and the span."""
        gbps = nbytes * 8 / seconds / 1e9 if seconds > 0 else 0.0
        span.set_attributes({"bytes": nbytes, "seconds": seconds, "gbps": gbps})
        if link == KVLink.WAN:
            metrics.WAN_BYTES.labels(self.instance_id).inc(nbytes)
        else:
            metrics.FAST_BYTES.labels(self.instance_id).inc(nbytes)

    async def _transfer(self, req: SubmitRequest, dest: Destination, plan_task: asyncio.Task[ImportPlan],
                        export: PromptExport, first: asyncio.Future[int]) -> None:
        """Stream one destination's missing blocks as the prefill finishes them, then announce them (KVReady).

        Each chunk's blocks go out as their own send, at once: the sends overlap on the link (one setup and one
        delay for the whole transfer, not one per chunk), and the receiver commits when the last block lands."""
        plan = await plan_task
        skip = plan.cached_tokens // self.engine.block_size
        if export.total_blocks - skip != len(plan.dst_blocks):
            raise RuntimeError(f"{dest.instance_id} planned {len(plan.dst_blocks)} blocks, "
                               f"P has {export.total_blocks - skip} to send")
        with tracer.start_as_current_span(f"kv.transfer.{dest.link}", attributes={
            "request_id": req.request_id, "peer": dest.instance_id, "blocks": len(plan.dst_blocks),
            "cached_tokens_at_peer": plan.cached_tokens,
        }) as span:
            busy, progress, sent = LinkBusy(), SendProgress(), Sent()
            if plan.dst_blocks:
                await self._stream_blocks(req, dest, plan, skip, export, busy, progress, sent, span)
        if dest.link == KVLink.WAN:
            metrics.WAN_TRANSFER.observe(busy.seconds)
        token = await first
        self._sent[(req.request_id, dest.instance_id)] = time.monotonic()
        await self.bus.publish(Subjects.instance(dest.instance_id, "kv_ready"), KVReady(
            request_id=req.request_id, instance_id=self.instance_id, first_token=token, bytes_sent=sent.wire,
            seconds=busy.seconds, codec=summarize(sent.codecs), kv_bytes=sent.kv))

    async def _stream_blocks(self, req: SubmitRequest, dest: Destination, plan: ImportPlan, skip: int,
                             export: PromptExport, busy: LinkBusy, progress: SendProgress, sent: Sent,
                             span: trace.Span) -> None:
        """Send blocks [skip:] to the planned destination blocks, a send per batch of newly final blocks, adding what
        they moved to ``sent``. A failed send fails the transfer (the others are cancelled at a frame boundary)."""
        transport, wake = self.transports[dest.link], export.listen()
        # held for this transfer: other transfers share the link, and none may close it under this one
        peer = await self.links.hold(dest.link, plan.descriptor)
        planned = len(plan.dst_blocks) * self.engine.block_size * self.engine.layout.bytes_per_token
        sends: list[asyncio.Task] = []
        launched, backlogged = skip, False

        async def send(src: list[int], dst: list[int]) -> None:
            busy.begin()
            try:
                stats = await transport.send(peer, req.request_id, src, dst, trace_context=inject_headers(),
                                             progress=progress)
                sent.add(stats)
            finally:
                busy.end()
                wake.set()
        try:
            while launched < export.total_blocks or not export.done:
                wake.clear()
                for task in sends:
                    if task.done() and not task.cancelled() and task.exception() is not None:
                        raise task.exception()
                blocks = export.ready()
                if export.done and not backlogged and dest.link == KVLink.WAN:
                    # P's WAN backlog counts a transfer from its prefill's end, when it is all there to send, as
                    # the simulator's view of it does (sim/wan_view.py)
                    self.wan_backlog.started(planned)
                    backlogged = True
                if len(blocks) > launched:
                    dst = plan.dst_blocks[launched - skip:len(blocks) - skip]
                    sends.append(asyncio.create_task(send(blocks[launched:], dst)))
                    launched = len(blocks)
                else:
                    await wake.wait()
            await asyncio.gather(*sends)
        except PeerLostError:  # this link is gone: the next transfer opens a new one
            await self.links.forget(dest.link, plan.descriptor, peer)
            raise
        finally:
            for task in sends:
                task.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
            await self.links.release(dest.link, peer)
            # failed or cancelled (the relay finished first): what crossed until then still crossed
            sent.wire = max(sent.wire, progress.crossed)
            span.set_attributes({"sends": len(sends), "codec": summarize(sent.codecs), "kv_bytes": sent.kv})
            if backlogged:  # in KV bytes, as planned: the router divides queued KV by the egress it measures
                self.wan_backlog.finished(planned, sent.kv or sent.wire)
            self._count_sent(dest.link, sent.wire, busy.seconds, span)
