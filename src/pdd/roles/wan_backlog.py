"""P's WAN backlog: KV bytes it has started sending over the WAN and not finished, and the egress rate it
measured while sending. Both go out in P's heartbeat, so every router sees the same WAN queue and the policy
(`pdd.shared.policy.wan_queue_seconds`) can finish requests on the relay while the WAN is saturated.

Why the rate is measured here and not per transfer: concurrent transfers share the line, so one transfer's
rate understates how fast the backlog drains; bytes delivered per second of having anything in flight does not.
"""

from __future__ import annotations

import time

from pdd.shared.protocol import WAN_EGRESS_KEY, WAN_QUEUED_KEY

EWMA_WEIGHT = 0.3  # of the newest heartbeat interval's rate


class WanBacklog:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self.queued = 0  # bytes
        self.rate = 0.0  # bytes/s, 0 until measured
        self._delivered = 0  # bytes finished since the last sample
        self._busy_s = 0.0  # seconds with something in flight since the last sample
        self._since = clock()
        self._in_flight = 0

    def _account(self) -> None:
        now = self._clock()
        if self._in_flight:
            self._busy_s += now - self._since
        self._since = now

    def started(self, nbytes: int) -> None:
        self._account()
        self._in_flight += 1
        self.queued += max(0, nbytes)

    def finished(self, planned: int, delivered: int) -> None:
        """A transfer ended (sent, failed or cancelled): ``planned`` leaves the backlog, ``delivered`` counts."""
        self._account()
        self._in_flight = max(0, self._in_flight - 1)
        self.queued = max(0, self.queued - max(0, planned))
        self._delivered += max(0, delivered)

    def summary(self) -> dict[str, float]:
        """The heartbeat's fields; folds the interval's delivered bytes per busy second into the rate."""
        self._account()
        if self._busy_s > 0 and self._delivered > 0:
            sample = self._delivered / self._busy_s
            self.rate = sample if self.rate == 0 else (1 - EWMA_WEIGHT) * self.rate + EWMA_WEIGHT * sample
            self._delivered, self._busy_s = 0, 0.0
        return {WAN_QUEUED_KEY: float(self.queued), WAN_EGRESS_KEY: self.rate}
