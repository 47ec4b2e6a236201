"""Which routers an engine instance still serves, from their heartbeats.

A request belongs to the router that accepted it (its events subject). When that router dies (``kill -9``: its
beats stop) or comes back as a new process under the same id (a supervisor restart: another ``started_unix``),
nobody reads the request's tokens any more and nobody will cancel it, so P, RLD and MD cancel it themselves and
free its KV. Silence is judged as the router's registry judges instances: ``missed_heartbeats`` periods, then
``suspect_timeout_s`` more (slow is not dead), and never while this instance's own bus link is down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdd.shared.bus import Bus, Envelope
from pdd.shared.config import ServiceConfig
from pdd.shared.protocol import Announce, Message, Subjects
from pdd.shared.roles import Role
from pdd.shared.telemetry import get_logger

log = get_logger("pdd.router_watch")


@dataclass
class _Seen:
    last_seen: float
    started_unix: float
    heartbeat_s: float


class RouterWatch:
    def __init__(self, service: ServiceConfig, on_lost: Callable[[str], Awaitable[None]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self.on_lost = on_lost
        self.clock = clock
        self.routers: dict[str, _Seen] = {}
        self._bus: Bus | None = None
        self._task: asyncio.Task | None = None

    async def start(self, bus: Bus) -> None:
        self._bus = bus
        await bus.subscribe(Subjects.ANNOUNCE, self._on_announce, expect=Announce)
        bus.add_listener(self._on_bus_event)
        self._task = asyncio.create_task(self._loop(), name="router-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _on_bus_event(self, _event: str) -> None:
        """Our own link went down or came back: their silence meanwhile proves nothing, restart its clock."""
        now = self.clock()
        for seen in self.routers.values():
            seen.last_seen = now

    async def _on_announce(self, message: Message, _: Envelope) -> None:
        assert isinstance(message, Announce)
        if message.role != Role.ROUTER:
            return
        lost = self.observe(message)
        if lost:
            await self._lost(message.instance_id, "restarted")

    def observe(self, info: Announce) -> bool:
        """Record a router's beat; True when it is a new process under a known id (the old one is gone)."""
        rid = info.instance_id
        before = self.routers.get(rid)
        if info.state == "stopped":  # a graceful stop drains its requests first
            self.routers.pop(rid, None)
            return False
        self.routers[rid] = _Seen(self.clock(), info.started_unix, max(0.01, info.heartbeat_ms / 1000))
        return before is not None and before.started_unix != info.started_unix

    def silent(self) -> list[str]:
        """Routers silent past missed beats plus the suspicion time (dropped from the watch)."""
        if self._bus is not None and not self._bus.is_connected:
            return []
        now, limit = self.clock(), self.service.missed_heartbeats
        gone = [rid for rid, seen in self.routers.items()
                if now - seen.last_seen > limit * seen.heartbeat_s + self.service.suspect_timeout_s]
        for rid in gone:
            del self.routers[rid]
        return gone

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.service.heartbeat_ms / 1000)
            for rid in self.silent():
                await self._lost(rid, "silent")

    async def _lost(self, router_id: str, why: str) -> None:
        log.warning("router_lost", router=router_id, why=why)
        try:
            await self.on_lost(router_id)
        except Exception:  # one failed cancel must not stop the watch
            log.exception("router_lost_cancel_failed", router=router_id)
