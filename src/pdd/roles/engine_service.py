"""What P, RLD and MD share: an engine on its own thread, KV transports, cancel and cache queries.

Each role adds its own handlers on top; a role's request logic stays in its own module.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.errors import Error as NatsError

from pdd.engine import SamplingParams
from pdd.engine.interface import EngineBackend
from pdd.roles.engine_runner import EngineRunner
from pdd.roles.peer_links import PeerLinks
from pdd.roles.router_watch import RouterWatch
from pdd.shared import metrics
from pdd.shared.bus import Bus, Envelope
from pdd.shared.config import ConfigError, InstanceConfig, PDDConfig, TransportConfig
from pdd.shared.kv_layout import KVLayout
from pdd.shared.protocol import (
    Announce,
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
from pdd.transports import KVTransport, create_link_transport

log = get_logger("pdd.engine_service")


class KVLayoutMismatchError(ConfigError):
    """This instance's KV pages would not mean the same bytes as the running fleet's: refuse to start."""


class FleetLayouts:
    """The KV layouts (dtype included) the running P, RLD and MD instances announce.

    A request's KV moves P -> RLD -> MD as raw pages, so all of them must share one layout. An instance
    listens to the fleet's heartbeats while its model loads and refuses to start on a mismatch, naming
    both dtypes (the router's registry also refuses such an instance, for two that start at once).
    """

    def __init__(self, own_id: str) -> None:
        self.own_id = own_id
        self.seen: dict[str, Announce] = {}
        self.started = time.monotonic()
        self._sub: Any = None

    @classmethod
    async def listen(cls, bus: Bus, own_id: str) -> FleetLayouts:
        fleet = cls(own_id)
        fleet._sub = await bus.subscribe(Subjects.ANNOUNCE, fleet._on_announce, expect=Announce)
        return fleet

    async def _on_announce(self, message: Message, _: Envelope) -> None:
        assert isinstance(message, Announce)
        if message.instance_id == self.own_id:
            return
        if message.state == "stopped" or not message.kv_layout:
            self.seen.pop(message.instance_id, None)
        else:
            self.seen[message.instance_id] = message

    async def check(self, own: KVLayout, heartbeat_s: float) -> None:
        """After at least 1.5 heartbeat periods of listening (every live instance beat once), compare."""
        await asyncio.sleep(max(0.0, 1.5 * heartbeat_s - (time.monotonic() - self.started)))
        for info in sorted(self.seen.values(), key=lambda a: a.instance_id):
            try:
                theirs = KVLayout.from_dict(info.kv_layout)
            except (KeyError, TypeError, ValueError):
                theirs = None
            if theirs is None or not own.compatible_with(theirs):
                their_dtype = info.kv_layout.get("dtype", "?")
                raise KVLayoutMismatchError(
                    f"KV dtype/layout mismatch: this instance's KV is {own.dtype} ({own.to_dict()}), but running "
                    f"{info.role} {info.instance_id} uses {their_dtype} ({info.kv_layout}); every prefill, relay "
                    f"and main decode of a fleet must resolve model.dtype / model.kv_dtype to the same KV dtype and "
                    f"run one model.backend (pages here: {own.backend}, there: {info.kv_layout.get('backend', '?')})")
        log.info("fleet_kv_layout_agrees", kv_dtype=own.dtype, peers=sorted(self.seen))

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except NatsError as exc:  # the connection may already be gone on a failed start
                log.debug("unsubscribe_failed", error=str(exc))
            self._sub = None


def sampling_params(spec: SamplingSpec) -> SamplingParams:
    return SamplingParams(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed,
                          stop_token_ids=list(spec.stop_token_ids), ignore_eos=spec.ignore_eos, min_p=spec.min_p,
                          repetition_penalty=spec.repetition_penalty, presence_penalty=spec.presence_penalty,
                          frequency_penalty=spec.frequency_penalty, min_tokens=spec.min_tokens,
                          logprobs=spec.logprobs)


OUTBOX_BATCH = 256  # most messages one outbox drain publishes at once (~100 bytes per token chunk)


def _runs_by_subject(queued: list[tuple[str, Message]]) -> list[tuple[str, list[Message]]]:
    """Consecutive messages for the same subject, grouped: the order of everything stays as posted."""
    runs: list[tuple[str, list[Message]]] = []
    for subject, message in queued:
        if runs and runs[-1][0] == subject:
            runs[-1][1].append(message)
        else:
            runs.append((subject, [message]))
    return runs


class EngineService(Service):
    """A role that runs the engine. ``cache_finished``: keep finished requests' KV for reuse."""

    cache_finished = True

    def __init__(self, config: PDDConfig, instance: InstanceConfig):
        super().__init__(config, instance)
        self.runner: EngineRunner | None = None
        self.transports: dict[str, KVTransport] = {}
        self.links = PeerLinks(self.transports)  # one shared link per remote pool (roles/peer_links.py)
        self.router_watch = RouterWatch(config.service, self._router_lost)  # requests of a dead router end here
        self._outbox: asyncio.Queue[tuple[str, Message]] = asyncio.Queue()
        self._cache_counted = (0, 0)  # prefix-cache (query, hit) tokens already added to the counters

    @property
    def engine(self) -> EngineBackend:
        """The engine, seen through its stated interface (engine/interface.py) only."""
        assert self.runner is not None
        return self.runner.engine

    async def on_start(self) -> None:
        m = self.config.model
        log.info("model_loading", backend=m.backend, path=m.path, **self.config.engine_settings().model_dump())
        t0 = time.monotonic()
        fleet = await FleetLayouts.listen(self.bus, self.instance_id)  # while the model loads
        try:
            self.runner = await EngineRunner.load(self.config, self.role, self.cache_finished)
            choice = self.engine.dtype_choice
            log.info("model_loaded", backend=m.backend, seconds=round(time.monotonic() - t0, 2), dtype=choice.dtype,
                     kv_dtype=choice.kv_dtype, dtype_reason=choice.reason,
                     linear_kernel=self.engine.linear_kernel, layout=self.engine.layout.to_dict(),
                     kv_blocks=self.engine.num_total_blocks(), max_context=self.engine.max_context,
                     **self.engine.describe())
            await fleet.check(self.engine.layout, self.config.service.heartbeat_ms / 1000)
        finally:
            await fleet.close()
        self.runner.start()
        await self.bus.subscribe(Subjects.CANCEL, self._on_cancel, expect=Cancel)
        await self.bus.subscribe(Subjects.instance(self.instance_id, "cancel"), self._on_cancel, expect=Cancel)
        await self.bus.subscribe(Subjects.instance(self.instance_id, "cache_query"), self._on_cache_query,
                                 expect=CacheQuery)
        self._tasks.append(asyncio.create_task(self._publish_cache_events(), name="cache-events"))
        self._tasks.append(asyncio.create_task(self._drain_outbox(), name="outbox"))
        await self.router_watch.start(self.bus)

    def requests_of(self, events_subject: str) -> list[str]:
        """The requests here whose tokens go to ``events_subject`` (one router's): roles with requests override."""
        return []

    async def _router_lost(self, router_id: str) -> None:
        """The router that owned these requests is gone: nobody reads their tokens or will cancel them."""
        rids = self.requests_of(Subjects.router_events(router_id))
        for rid in rids:
            await self.cancel_request(rid, f"router {router_id} lost")
        if rids:
            log.warning("router_requests_cancelled", router=router_id, requests=len(rids))

    def post(self, subject: str, message: Message) -> None:
        """Publish from synchronous engine callbacks, keeping the order messages were posted in."""
        self._outbox.put_nowait((subject, message))

    async def _drain_outbox(self) -> None:
        """Publish what the engine callbacks posted, in order. What is already queued goes out together: a run
        of messages for one subject (an engine step's token chunks for one router) as one ``Batch``."""
        while True:
            queued = [await self._outbox.get()]
            while len(queued) < OUTBOX_BATCH and not self._outbox.empty():
                queued.append(self._outbox.get_nowait())
            for subject, messages in _runs_by_subject(queued):
                try:
                    await self.bus.publish_batch(subject, messages)
                except Exception as exc:
                    log.warning("publish_failed", subject=subject, messages=len(messages), error=str(exc))
                    for rid in dict.fromkeys(getattr(m, "request_id", None) for m in messages):
                        if rid:  # its stream now has a gap: free it here; the router resumes it elsewhere
                            await self.cancel_request(rid, "publish failed")

    async def on_stop(self) -> None:
        await self.router_watch.stop()
        for transport in self.transports.values():
            await transport.close()
        if self.runner is not None:
            await self.runner.stop()

    async def open_transport(self, kind: str, cfg: TransportConfig) -> KVTransport:
        """Start a transport plugin and register this engine's pool with it."""
        transport = create_link_transport(cfg, {"bind_host": self.instance.host})
        await transport.start()
        transport.register(self.engine.layout, *self.engine.kv_buffers())
        self.transports[kind] = transport
        return transport

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
        """Every 0.1 s, the blocks stored and removed since. The first message says ``cleared``: routers that
        indexed an earlier process under this instance id (a restart) drop what it held."""
        subject = Subjects.cache_events(self.instance_id)
        cleared = True
        while True:
            await asyncio.sleep(0.1)
            try:
                events = await self.runner.call(self.engine.drain_cache_events)
                if events:  # the bus holds publishes across a NATS outage
                    stored = [e.block_hash for e in events if e.kind == "stored"]
                    removed = [e.block_hash for e in events if e.kind == "removed"]
                    await self.bus.publish(subject, CacheEvents(self.instance_id, stored=stored, removed=removed,
                                                                cleared=cleared))
                    cleared = False
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
        self.record_engine_metrics(free, total, stats)
        load = self.current_load()
        endpoints = {name: t.descriptor() for name, t in self.transports.items()}
        return {
            "load": load, "running_requests": self.in_flight(), "free_kv_blocks": free,
            "total_kv_blocks": total, "max_context": engine.max_context,
            "model": self.config.model.name or self.config.model.path,
            "dtype": engine.dtype_choice.dtype, "kv_layout": engine.layout.to_dict(),
            "cache_summary": {"hit_rate": stats["cache_hit_rate"], "cached_blocks": stats["cached_blocks"],
                              "block_size": engine.block_size, "kv_bytes_per_token": engine.layout.bytes_per_token,
                              **self.cache_summary_extra()},
            "endpoints": endpoints,
        }

    def record_engine_metrics(self, free: int, total: int, stats: dict[str, Any]) -> None:
        """vLLM's engine gauges and prefix-cache counters (counters advance by the engine's growth since
        the last heartbeat), and PDD's block counts."""
        labels = (self.config.model.served_name, self.instance_id, self.role)
        metrics.NUM_RUNNING.labels(*labels).set(stats["running"])
        metrics.NUM_WAITING.labels(*labels).set(stats["waiting"])
        metrics.KV_CACHE_USAGE.labels(*labels).set(1.0 - free / max(1, total))
        seen = self._cache_counted
        metrics.PREFIX_CACHE_QUERIES.labels(*labels).inc(max(0, stats["cache_query_tokens"] - seen[0]))
        metrics.PREFIX_CACHE_HITS.labels(*labels).inc(max(0, stats["cache_hit_tokens"] - seen[1]))
        self._cache_counted = (stats["cache_query_tokens"], stats["cache_hit_tokens"])
        metrics.KV_BLOCKS_FREE.labels(self.instance_id, self.role).set(free)
        metrics.KV_BLOCKS_TOTAL.labels(self.instance_id, self.role).set(total)
        metrics.PREFIX_HIT_RATE.labels(self.instance_id, self.role).set(stats["cache_hit_rate"])

    def current_load(self) -> float:
        """0..1: the busier of batch slots and KV blocks (what routing and handoff decisions use)."""
        engine = self.engine
        stats = engine.stats()
        running = stats["running"] + stats["waiting"]
        free_share = stats["free_blocks"] / max(1, stats["total_blocks"])
        return min(1.0, max(running / self.config.model.max_num_seqs, 1 - free_share))

    def cache_summary_extra(self) -> dict[str, Any]:
        return {}

    def health_details(self) -> dict[str, Any]:
        if self.runner is None:
            return {}
        return {"engine": self.engine.stats()}
