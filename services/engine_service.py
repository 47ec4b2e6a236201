"""What P, RLD and MD share: an engine on its own thread, KV transports, cancel and cache queries.

Each role adds its own handlers on top; a role's request logic stays in its own module.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pdd.engine import SamplingParams
from pdd.services.engine_runner import EngineRunner
from pdd.shared import metrics
from pdd.shared.bus import Envelope
from pdd.shared.config import InstanceConfig, PDDConfig, TransportConfig
from pdd.shared.protocol import (
    CacheEvents,
    CacheQuery,
    CacheQueryReply,
    Cancel,
    ErrorReply,
    Message,
    SamplingSpec,
    Subjects,
)
from pdd.shared.service import Service
from pdd.shared.telemetry import get_logger
from pdd.transports import KVTransport, Peer, create_transport

log = get_logger("pdd.engine_service")


def sampling_params(spec: SamplingSpec) -> SamplingParams:
    return SamplingParams(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed,
                          stop_token_ids=list(spec.stop_token_ids), ignore_eos=spec.ignore_eos)


class EngineService(Service):
    """A role that runs the engine. ``cache_finished``: keep finished requests' KV for reuse."""

    cache_finished = True

    def __init__(self, config: PDDConfig, instance: InstanceConfig):
        super().__init__(config, instance)
        self.runner: EngineRunner | None = None
        self.transports: dict[str, KVTransport] = {}
        self._peers: dict[tuple[str, str], Peer] = {}
        self._peer_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._outbox: asyncio.Queue[tuple[str, Message]] = asyncio.Queue()

    @property
    def engine(self):
        assert self.runner is not None
        return self.runner.engine

    async def on_start(self) -> None:
        m = self.config.model
        log.info("model_loading", path=m.path, dtype=m.dtype)
        t0 = time.monotonic()
        self.runner = await EngineRunner.load(
            path=m.path, dtype=m.dtype, num_threads=m.threads, kv_memory_bytes=m.kv_memory_mb * 1024 * 1024,
            block_size=m.block_size, max_num_seqs=m.max_num_seqs, max_prefill_tokens=m.max_prefill_tokens,
            cache_finished=self.cache_finished, enable_prefix_cache=m.enable_prefix_cache,
        )
        self.runner.start()
        log.info("model_loaded", seconds=round(time.monotonic() - t0, 2), layout=self.engine.layout.to_dict(),
                 kv_blocks=self.engine.num_total_blocks(), max_context=self.engine.max_context)
        await self.bus.subscribe(Subjects.CANCEL, self._on_cancel, expect=Cancel)
        await self.bus.subscribe(Subjects.instance(self.instance_id, "cancel"), self._on_cancel, expect=Cancel)
        await self.bus.subscribe(Subjects.instance(self.instance_id, "cache_query"), self._on_cache_query,
                                 expect=CacheQuery)
        self._tasks.append(asyncio.create_task(self._publish_cache_events(), name="cache-events"))
        self._tasks.append(asyncio.create_task(self._drain_outbox(), name="outbox"))

    def post(self, subject: str, message: Message) -> None:
        """Publish from synchronous engine callbacks, keeping the order messages were posted in."""
        self._outbox.put_nowait((subject, message))

    async def _drain_outbox(self) -> None:
        while True:
            subject, message = await self._outbox.get()
            try:
                await self.bus.publish(subject, message)
            except Exception as exc:
                log.warning("publish_failed", subject=subject, error=str(exc))
                rid = getattr(message, "request_id", None)
                if rid:  # its stream now has a gap: free it here; the router resumes it elsewhere
                    await self.cancel_request(rid, "publish failed")

    async def on_stop(self) -> None:
        for transport in self.transports.values():
            await transport.close()
        if self.runner is not None:
            await self.runner.stop()

    async def open_transport(self, kind: str, cfg: TransportConfig) -> KVTransport:
        """Start a transport plugin and register this engine's pool with it."""
        options = {"bind_host": self.instance.host, **cfg.options}
        transport = create_transport(cfg.name, options)
        await transport.start()
        transport.register(self.engine.layout, self.engine.k_cache, self.engine.v_cache)
        self.transports[kind] = transport
        return transport

    async def peer(self, kind: str, descriptor: dict) -> Peer:
        """Connected peers are reused: one link per (transport, remote pool)."""
        key = (kind, str(descriptor.get("instance_id")))
        lock = self._peer_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in self._peers:
                self._peers[key] = await self.transports[kind].connect(descriptor)
            return self._peers[key]

    async def forget_peer(self, kind: str, descriptor: dict) -> None:
        """Close a broken link so the next transfer to that pool opens a fresh one."""
        peer = self._peers.pop((kind, str(descriptor.get("instance_id"))), None)
        if peer is not None:
            try:
                await self.transports[kind].disconnect(peer)
            except Exception as exc:
                log.debug("disconnect_failed", error=str(exc))

    # -- bus handlers -----------------------------------------------------------------------------
    async def _on_cancel(self, message: Message, _: Envelope) -> None:
        assert isinstance(message, Cancel)
        await self.cancel_request(message.request_id, message.reason)

    async def cancel_request(self, request_id: str, reason: str) -> None:
        """Roles override to drop their own state; the base frees the engine side."""
        for transport in self.transports.values():
            transport.cancel(request_id)
        if self.runner is not None:
            self.runner.unwatch(request_id)
            await self.runner.call(self.engine.abort, request_id)

    async def _on_cache_query(self, message: Message, _: Envelope) -> Message:
        assert isinstance(message, CacheQuery)
        cached = await self.runner.call(self.engine.cached_prefix_len, message.prompt_ids)
        return CacheQueryReply(instance_id=self.instance_id, cached_tokens=cached)

    async def _publish_cache_events(self) -> None:
        subject = Subjects.cache_events(self.instance_id)
        while True:
            await asyncio.sleep(0.1)
            try:
                events = await self.runner.call(self.engine.cache.drain_events)
                if events:  # the bus holds publishes across a NATS outage
                    stored = [e.block_hash for e in events if e.kind == "stored"]
                    removed = [e.block_hash for e in events if e.kind == "removed"]
                    await self.bus.publish(subject, CacheEvents(self.instance_id, stored=stored, removed=removed))
            except Exception as exc:
                log.debug("cache_events_failed", error=str(exc))

    async def send_error(self, subject: str, request_id: str, code: str, message: str,
                         retryable: bool = False) -> None:
        log.warning("request_failed", request_id=request_id, code=code, error=message)
        try:
            await self.bus.publish(subject, ErrorReply(code=str(code), message=message, request_id=request_id,
                                                       instance_id=self.instance_id, retryable=retryable))
        except Exception as exc:
            log.warning("error_publish_failed", request_id=request_id, error=str(exc))

    # -- heartbeat ------------------------------------------------------------------------------
    def announce_fields(self) -> dict[str, Any]:
        if self.runner is None:
            return {}
        engine = self.engine
        free, total = engine.num_free_blocks(), engine.num_total_blocks()
        stats = engine.stats()
        metrics.KV_BLOCKS_FREE.labels(self.instance_id, self.role).set(free)
        metrics.KV_BLOCKS_TOTAL.labels(self.instance_id, self.role).set(total)
        metrics.PREFIX_HIT_RATE.labels(self.instance_id, self.role).set(stats["cache_hit_rate"])
        load = self.current_load()
        endpoints = {name: t.descriptor() for name, t in self.transports.items()}
        return {
            "load": load, "running_requests": self.in_flight(), "free_kv_blocks": free,
            "total_kv_blocks": total, "max_context": engine.max_context,
            "model": self.config.model.name or self.config.model.path,
            "cache_summary": {"hit_rate": stats["cache_hit_rate"], "cached_blocks": stats["cached_blocks"],
                              "block_size": engine.block_size, "kv_bytes_per_token": engine.layout.bytes_per_token,
                              **self.cache_summary_extra()},
            "endpoints": endpoints,
        }

    def current_load(self) -> float:
        """0..1: the busier of batch slots and KV blocks (what routing and handoff decisions use)."""
        engine = self.engine
        running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        free_share = engine.num_free_blocks() / max(1, engine.num_total_blocks())
        return min(1.0, max(running / self.config.model.max_num_seqs, 1 - free_share))

    def cache_summary_extra(self) -> dict[str, Any]:
        return {}

    def health_details(self) -> dict[str, Any]:
        if self.runner is None:
            return {}
        return {"engine": self.engine.stats()}
