"""Router-side view of the fleet, built only from announce/heartbeat messages.

An instance silent for ``missed_heartbeats`` of its own periods is *suspected*: offered no new work, but its
requests stay where they are (a box under overload delays beats by seconds; a dead process never beats
again). Silent ``suspect_timeout_s`` longer (e.g. after a ``kill -9``) it is dropped, and its requests
migrate; a beat in between clears the suspicion. An instance announcing ``stopped`` is dropped at once.
Draining instances stay visible but are not offered new work.

While this router's own NATS connection is down, silence proves nothing about the fleet: nothing is
dropped, but every instance is marked unconfirmed and offered no new work (work submitted to it could
be lost), until its next beat after the reconnect. The silence clock restarts at the reconnect, so an
instance that died during the outage is dropped ``missed_heartbeats`` periods later.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Gauge

from pdd.shared.bus import Bus, Envelope
from pdd.shared.protocol import Announce, Message, Subjects
from pdd.shared.roles import Role
from pdd.shared.telemetry import get_logger

log = get_logger("pdd.registry")
INSTANCES = Gauge("pdd:registry_instances", "Live instances known to this router", ["role"])


MAX_HEARTBEAT_MS = 60_000  # the config's ceiling: an announce claiming more is not trusted beyond it


@dataclass
class InstanceState:
    info: Announce
    last_seen: float  # monotonic
    confirmed: bool = True  # False from a bus outage of ours until its next beat
    suspected: bool = False  # silent past missed_heartbeats: no new work until it beats again

    @property
    def ready(self) -> bool:
        return self.info.state == "ready" and self.confirmed and not self.suspected


class Registry:
    def __init__(self, bus: Bus, missed_heartbeats: int = 3, clock: Callable[[], float] = time.monotonic,
                 suspect_timeout_s: float = 5.0):
        self.bus = bus
        self.missed_heartbeats = missed_heartbeats
        self.suspect_timeout_s = suspect_timeout_s
        self.clock = clock
        self._instances: dict[str, InstanceState] = {}
        self.refused: dict[str, str] = {}  # instance -> why it gets no work (a KV layout unlike the fleet's)
        self._task: asyncio.Task | None = None
        self._announce_sub: Any = None
        self.changed = asyncio.Event()

    async def start(self) -> None:
        self._announce_sub = await self.bus.subscribe(Subjects.ANNOUNCE, self._on_announce, expect=Announce)
        self.bus.add_listener(self.on_bus_event)
        self._task = asyncio.create_task(self._prune_loop(), name="registry-prune")

    def on_bus_event(self, event: str) -> None:
        """Our own NATS link went down / came back (see the module doc)."""
        now = self.clock()
        for st in self._instances.values():
            st.confirmed = False
            st.last_seen = now
        if event == "disconnected":
            log.warning("registry_unconfirmed", reason="nats disconnected", instances=len(self._instances))
        if self._instances:
            self._changed()

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
            self.refused.pop(info.instance_id, None)
            if self._instances.pop(info.instance_id, None) is not None:
                log.info("instance_left", instance=info.instance_id, role=info.role)
                self._changed()
            return
        if not known and self._refuse_kv_layout(info):
            return
        before = self._instances.get(info.instance_id)
        self._instances[info.instance_id] = InstanceState(info, self.clock())
        if before is not None and before.suspected:
            log.info("instance_recovered", instance=info.instance_id, role=info.role)
        if before is not None and (before.suspected or not before.confirmed):
            self._changed()  # offered work again
        if not known:
            log.info("instance_joined", instance=info.instance_id, role=info.role, site=info.site)
            self._changed()

    def _refuse_kv_layout(self, info: Announce) -> bool:
        """KV pages move between P, RLD and MD as raw bytes, so a fleet has one KV layout (dtype included).

        An engine instance refuses to start into a fleet of another layout (roles/engine_service.py);
        this catches two that start at once: the one whose layout differs from those already known gets
        no work, logged once with both dtypes.
        """
        if not info.kv_layout:
            return False
        other = next((st.info for st in self._instances.values()
                      if st.info.kv_layout and st.info.kv_layout != info.kv_layout), None)
        if other is None:
            return False
        if info.instance_id not in self.refused:
            reason = (f"KV dtype/layout {info.kv_layout.get('dtype')} {info.kv_layout} differs from "
                      f"{other.kv_layout.get('dtype')} {other.kv_layout} of {other.role} {other.instance_id}")
            self.refused[info.instance_id] = reason
            log.error("instance_refused", instance=info.instance_id, role=info.role, reason=reason)
        return True

    def serving_dtypes(self) -> dict[str, str | None]:
        """The weights and KV dtypes the ready engine instances announce (several: comma-separated)."""
        engines = [i for i in self.instances() if i.kv_layout]
        dtypes = sorted({i.dtype for i in engines if i.dtype})
        kv_dtypes = sorted({str(i.kv_layout.get("dtype")) for i in engines})
        return {"dtype": ",".join(dtypes) or None, "kv_dtype": ",".join(kv_dtypes) or None}

    def prune(self) -> list[str]:
        if not self.bus.is_connected:  # our outage, not theirs: keep the view, re-time it on reconnect
            return []
        if getattr(self._announce_sub, "pending_msgs", 0):  # beats received but not read yet: we are behind
            return []
        now = self.clock()
        dead, suspected = [], []
        for iid, st in self._instances.items():
            silent = now - st.last_seen
            allowed = self.missed_heartbeats * min(st.info.heartbeat_ms, MAX_HEARTBEAT_MS) / 1000
            if silent > allowed + self.suspect_timeout_s:
                dead.append(iid)
            elif silent > allowed and not st.suspected:
                st.suspected = True
                suspected.append(iid)
                log.warning("instance_suspected", instance=iid, role=st.info.role, silent_s=round(silent, 3))
        for iid in dead:
            st = self._instances.pop(iid)
            log.warning("instance_lost", instance=iid, role=st.info.role,
                        silent_s=round(now - st.last_seen, 3))
        if dead or suspected:
            self._changed()
        return dead

    async def _prune_loop(self) -> None:
        while True:
            periods = [st.info.heartbeat_ms for st in self._instances.values()] or [500]
            interval = min(periods) / 1000 / 4
            t0 = self.clock()
            await asyncio.sleep(interval)
            if self.clock() - t0 > 4 * interval:
                # this event loop was starved (a busy router): beats may sit unread in the socket, and
                # silence measured now would drop live instances; judge after the next sleep has let them in
                continue
            self.prune()

    def _changed(self) -> None:
        for role in Role:
            INSTANCES.labels(role).set(len(self.instances(role, ready_only=False)))
        self.changed.set()
        self.changed = asyncio.Event()

    def instances(self, role: Role | None = None, ready_only: bool = True, site: str | None = None) -> list[Announce]:
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
            {"instance": st.info.instance_id, "role": st.info.role, "site": st.info.site,
             "state": st.info.state, "confirmed": st.confirmed, "suspected": st.suspected, "load": st.info.load, "free_kv_blocks": st.info.free_kv_blocks,
             "age_s": round(now - st.last_seen, 3)}
            for st in sorted(self._instances.values(), key=lambda s: s.info.instance_id)
        ]
