"""Router-side view of the fleet, built only from announce/heartbeat messages.

An instance is dropped after ``missed_heartbeats`` of its own periods without a beat (e.g. after a
``kill -9``), or at once when it announces ``stopped``. Draining instances stay visible but are not
offered new work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Gauge

from pdd.shared.bus import Bus, Envelope
from pdd.shared.protocol import Announce, Message, Subjects
from pdd.shared.telemetry import get_logger

log = get_logger("pdd.registry")
INSTANCES = Gauge("pdd:registry_instances", "Live instances known to this router", ["role"])


@dataclass
class InstanceState:
    info: Announce
    last_seen: float  # monotonic

    @property
    def ready(self) -> bool:
        return self.info.state == "ready"


class Registry:
    def __init__(self, bus: Bus, missed_heartbeats: int = 3, clock: Callable[[], float] = time.monotonic):
        self.bus = bus
        self.missed_heartbeats = missed_heartbeats
        self.clock = clock
        self._instances: dict[str, InstanceState] = {}
        self._task: asyncio.Task | None = None
        self.changed = asyncio.Event()

    async def start(self) -> None:
        await self.bus.subscribe(Subjects.ANNOUNCE, self._on_announce, expect=Announce)
        self._task = asyncio.create_task(self._prune_loop(), name="registry-prune")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _on_announce(self, message: Message, _: Envelope) -> None:
        assert isinstance(message, Announce)
        self.observe(message)

    def observe(self, info: Announce) -> None:
        known = info.instance_id in self._instances
        if info.state == "stopped":
            if self._instances.pop(info.instance_id, None) is not None:
                log.info("instance_left", instance=info.instance_id, role=info.role)
                self._changed()
            return
        self._instances[info.instance_id] = InstanceState(info, self.clock())
        if not known:
            log.info("instance_joined", instance=info.instance_id, role=info.role, site=info.site)
            self._changed()

    def prune(self) -> list[str]:
        now = self.clock()
        dead = [
            iid for iid, st in self._instances.items()
            if now - st.last_seen > self.missed_heartbeats * st.info.heartbeat_ms / 1000
        ]
        for iid in dead:
            st = self._instances.pop(iid)
            log.warning("instance_lost", instance=iid, role=st.info.role,
                        silent_s=round(now - st.last_seen, 3))
        if dead:
            self._changed()
        return dead

    async def _prune_loop(self) -> None:
        while True:
            periods = [st.info.heartbeat_ms for st in self._instances.values()] or [500]
            await asyncio.sleep(min(periods) / 1000 / 4)
            self.prune()

    def _changed(self) -> None:
        for role in ("router", "prefill", "relay", "decode"):
            INSTANCES.labels(role).set(len(self.instances(role, ready_only=False)))
        self.changed.set()
        self.changed = asyncio.Event()

    def instances(self, role: str | None = None, ready_only: bool = True, site: str | None = None) -> list[Announce]:
        return [
            st.info for st in self._instances.values()
            if (role is None or st.info.role == role) and (not ready_only or st.ready)
            and (site is None or st.info.site == site)
        ]

    def get(self, instance_id: str) -> Announce | None:
        st = self._instances.get(instance_id)
        return st.info if st else None

    def snapshot(self) -> list[dict]:
        now = self.clock()
        return [
            {"instance": st.info.instance_id, "role": st.info.role, "site": st.info.site, "state": st.info.state,
             "load": st.info.load, "free_kv_blocks": st.info.free_kv_blocks,
             "age_s": round(now - st.last_seen, 3)}
            for st in sorted(self._instances.values(), key=lambda s: s.info.instance_id)
        ]
