"""Service lifecycle shared by every role: start -> announce -> heartbeat -> drain on SIGTERM -> stop.

A role subclasses ``Service`` and fills in ``on_start`` (load the model, subscribe), ``in_flight``
(requests it still owes an answer) and ``announce_fields`` (load and cache statistics). The base
owns the bus connection, the heartbeat, the /health + /metrics HTTP endpoint and signal handling.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest

from pdd.shared.bus import Bus, Envelope
from pdd.shared.config import InstanceConfig, PDDConfig
from pdd.shared.protocol import Announce, Message, Ping, Pong, Subjects
from pdd.shared.roles import Role
from pdd.shared.telemetry import get_logger, setup_logging, setup_tracing, shutdown_tracing

log = get_logger("pdd.service")

UP = Gauge("pdd:instance_up", "1 while the instance is ready, 0 while draining", ["instance", "role"])


class Service:
    role: Role  # each role sets its own

    def __init__(self, config: PDDConfig, instance: InstanceConfig):
        self.config = config
        self.instance = instance
        self.instance_id = instance.id
        self.bus = Bus(config.nats, name=f"{self.role}:{instance.id}")
        self.state = "starting"
        self.started_unix = time.time()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._http: web.AppRunner | None = None
        self.metrics_url: str | None = None

    # -- hooks for roles ------------------------------------------------------------------------
    async def on_start(self) -> None:
        """Load what the role needs and subscribe to its subjects."""

    async def on_stop(self) -> None:
        """Release role resources (transports, engine thread)."""

    def in_flight(self) -> int:
        """Requests this instance still owes an answer (drain waits for zero)."""
        return 0

    def announce_fields(self) -> dict[str, Any]:
        """Load and cache statistics for the heartbeat."""
        return {}

    def health_details(self) -> dict[str, Any]:
        return {}

    def http_routes(self) -> list[web.RouteDef]:
        return []

    # -- lifecycle --------------------------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        return self.state == "ready"

    async def run(self) -> None:
        """Run until SIGTERM/SIGINT (or ``request_stop``), then drain and stop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.request_stop)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        try:
            await self.start()
            await self._stop.wait()
        finally:
            await self.stop()

    def request_stop(self) -> None:
        self._stop.set()

    async def start(self) -> None:
        await self._start_http()
        await self.bus.connect()
        self.bus.add_listener(self._on_bus_event)
        await self.bus.subscribe(Subjects.instance(self.instance_id, "ping"), self._on_ping, expect=Ping,
                                 span_name="ping")
        await self.on_start()
        # Everything alive now (torch, the model, its modules) lives as long as the process: keep it
        # out of the collector, so full collections while serving traverse only per-request objects
        # (no pause in the event loop or the engine thread) and exit skips a ~1 s final collection.
        gc.collect()
        gc.freeze()
        self.state = "ready"
        UP.labels(self.instance_id, self.role).set(1)
        await self._announce()
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
        log.info("service_ready", role=self.role, instance=self.instance_id, site=self.instance.site,
                 metrics=self.metrics_url, pid=os.getpid(), gc_frozen_objects=gc.get_freeze_count())

    async def stop(self) -> None:
        if self.state == "stopped":
            return
        if self.state == "ready":
            await self.drain()
        self.state = "stopped"
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            if self.bus.is_connected:
                await self._announce()
        except Exception:
            pass
        try:
            await self.on_stop()
        finally:
            await self.bus.close()
            if self._http is not None:
                await self._http.cleanup()
            shutdown_tracing()
            log.info("service_stopped", role=self.role, instance=self.instance_id)

    async def drain(self) -> None:
        """Stop taking new work, tell the registry, finish what is in flight (bounded)."""
        self.state = "draining"
        UP.labels(self.instance_id, self.role).set(0)
        log.info("service_draining", in_flight=self.in_flight())
        try:
            await self._announce()
        except Exception:
            pass
        deadline = time.monotonic() + self.config.service.drain_timeout_s
        while self.in_flight() > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight():
            log.warning("drain_timeout", abandoned=self.in_flight())

    # -- heartbeat ------------------------------------------------------------------------------
    def _announcement(self) -> Announce:
        fields = {"load": 0.0, "running_requests": self.in_flight(), "free_kv_blocks": 0, "total_kv_blocks": 0}
        fields.update(self.announce_fields())
        endpoints = dict(fields.pop("endpoints", {}))
        if self.metrics_url:
            endpoints.setdefault("metrics", self.metrics_url)
        return Announce(instance_id=self.instance_id, role=self.role, site=self.instance.site, state=self.state,
                        heartbeat_ms=self.config.service.heartbeat_ms, endpoints=endpoints,
                        sent_unix=time.time(), started_unix=self.started_unix, **fields)

    async def _announce(self) -> None:
        if self.bus.is_connected:
            await self.bus.publish(Subjects.ANNOUNCE, self._announcement())

    def _on_bus_event(self, event: str) -> None:
        """Back on NATS: announce at once, so routers offer work again without waiting a period."""
        if event == "reconnected" and self.state in ("ready", "draining"):
            task = asyncio.get_running_loop().create_task(self._announce_quietly(), name="announce-reconnected")
            self._tasks.append(task)
            task.add_done_callback(lambda t: t in self._tasks and self._tasks.remove(t))

    async def _announce_quietly(self) -> None:
        try:
            await self._announce()
        except Exception as exc:
            log.debug("heartbeat_failed", error=str(exc))

    async def _heartbeat_loop(self) -> None:
        period = self.config.service.heartbeat_ms / 1000
        while True:
            await asyncio.sleep(period)
            try:
                await self._announce()
            except Exception as exc:  # NATS down: keep beating, the bus reconnects
                log.debug("heartbeat_failed", error=str(exc))

    async def _on_ping(self, message: Message, _: Envelope) -> Message:
        assert isinstance(message, Ping)
        return Pong(instance_id=self.instance_id, role=self.role, payload=message.payload)

    # -- HTTP: /health and /metrics -------------------------------------------------------------
    async def _start_http(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.add_routes(self.http_routes())
        self._http = web.AppRunner(app, access_log=None)
        await self._http.setup()
        site = web.TCPSite(self._http, self.instance.host, self.instance.metrics_port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.metrics_url = f"http://{self.instance.host}:{port}/metrics"

    async def _health(self, _: web.Request) -> web.Response:
        body = {"status": self.state, "role": self.role, "instance": self.instance_id, "site": self.instance.site,
                "nats_connected": self.bus.is_connected, "in_flight": self.in_flight(), **self.health_details()}
        ok = self.state == "ready" and self.bus.is_connected
        return web.json_response(body, status=200 if ok else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def prepare_process(config: PDDConfig, instance: InstanceConfig, role: str) -> None:
    """Per-process observability setup, before the event loop starts."""
    setup_logging(config.telemetry, role=role, instance=instance.id, site=instance.site)
    setup_tracing(f"pdd-{role}", config.telemetry, instance_id=instance.id)
