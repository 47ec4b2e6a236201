"""Which decode instances the router can reach over the WAN for KV, with probing of down links.

A failed WAN transfer marks the link to that decode instance down: the policy stops choosing
pipelines that move KV over it (requests finish on the relay, P-RLD) until a probe — a real
two-token request forced over that link, so it moves one fresh block of KV — gets through.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from pdd.shared import metrics
from pdd.shared.telemetry import get_logger

log = get_logger("pdd.router.wan")


class WanHealth:
    def __init__(self, probe: Callable[[str], Awaitable[bool]], interval_s: float):
        self._probe = probe
        self.interval_s = interval_s
        self.down_since: dict[str, float] = {}
        self._probers: dict[str, asyncio.Task] = {}

    def is_up(self, decode_id: str) -> bool:
        return decode_id not in self.down_since

    def mark_down(self, decode_id: str, reason: str) -> None:
        if decode_id in self.down_since:
            return
        self.down_since[decode_id] = time.monotonic()
        metrics.WAN_UP.labels(decode_id).set(0)
        log.warning("wan_link_down", decode=decode_id, reason=reason)
        self._probers[decode_id] = asyncio.create_task(self._probe_until_up(decode_id), name=f"wan-probe-{decode_id}")

    def forget(self, decode_id: str) -> None:
        """The instance left the registry: nothing to probe."""
        task = self._probers.pop(decode_id, None)
        if task is not None:
            task.cancel()
        self.down_since.pop(decode_id, None)

    async def _probe_until_up(self, decode_id: str) -> None:
        probes = 0
        while True:
            await asyncio.sleep(self.interval_s)
            probes += 1
            try:
                ok = await self._probe(decode_id)
            except Exception as exc:  # a probe never takes the router down
                log.debug("wan_probe_error", decode=decode_id, error=str(exc))
                ok = False
            if ok:
                since = self.down_since.pop(decode_id, time.monotonic())
                self._probers.pop(decode_id, None)
                metrics.WAN_UP.labels(decode_id).set(1)
                log.info("wan_link_up", decode=decode_id, down_s=round(time.monotonic() - since, 2), probes=probes)
                return

    async def stop(self) -> None:
        tasks = list(self._probers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._probers.clear()
