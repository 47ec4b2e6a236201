"""P's WAN backlog: KV bytes it has started sending over the WAN and not finished, and the egress rate it
measured while sending, and how many transfers it has in flight. They go out in P's heartbeat, so every router
sees the same WAN queue (`site_queue_seconds`, through `pdd.shared.policy.wan_queue_seconds`) and can finish
requests on the relay while the WAN is saturated. The simulator runs this same class on its clock
(`pdd.sim.wan_view`).

Why the rate is measured here and not per transfer: concurrent transfers share the line, so one transfer's
rate understates how fast the backlog drains; bytes delivered per second of having anything in flight does not.
Why "left" and not the transfers' whole size: a long transfer nearly done is not a queue. The sender cannot see
its transfers' progress, so since the backlog last was empty it counts the bytes started, less those of finished
transfers or, if more, what the measured egress has carried meanwhile.
"""

from __future__ import annotations

import math
import time
from typing import Iterable, Mapping

from pdd.shared.policy import PolicyConfig, wan_queue_seconds
from pdd.shared.protocol import WAN_EGRESS_KEY, WAN_QUEUED_KEY, WAN_TRANSFERS_KEY

EWMA_WEIGHT = 0.3  # of the newest heartbeat interval's rate


class WanBacklog:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self.rate = 0.0  # bytes/s, 0 until measured
        self._delivered = 0  # bytes finished since the last sample
        self._busy_s = 0.0  # seconds with something in flight since the last sample
        self._since = clock()
        self._in_flight = 0
        self._period_start = self._since  # when the backlog last went from empty to busy
        self._period_started = 0  # bytes started since then
        self._period_finished = 0  # bytes of transfers finished since then (planned sizes)

    def _account(self) -> None:
        now = self._clock()
        if self._in_flight:
            self._busy_s += now - self._since
        self._since = now

    def started(self, nbytes: int) -> None:
        self._account()
        if not self._in_flight:
            self._period_start, self._period_started, self._period_finished = self._since, 0, 0
        self._in_flight += 1
        self._period_started += max(0, nbytes)

    def finished(self, planned: int, delivered: int) -> None:
        """A transfer ended (sent, failed or cancelled): ``planned`` leaves the backlog, ``delivered`` counts."""
        self._account()
        self._in_flight = max(0, self._in_flight - 1)
        self._delivered += max(0, delivered)
        self._period_finished += max(0, planned)

    def left(self) -> float:
        """Bytes still to cross: started since the backlog was last empty, less what has crossed since."""
        if not self._in_flight:
            return 0.0
        carried = self.rate * (self._clock() - self._period_start)
        return float(max(0.0, self._period_started - max(self._period_finished, carried)))

    def summary(self) -> dict[str, float]:
        """The heartbeat's fields; folds the interval's delivered bytes per busy second into the rate."""
        self._account()
        if self._busy_s > 0 and self._delivered > 0:
            sample = self._delivered / self._busy_s
            self.rate = sample if self.rate == 0 else (1 - EWMA_WEIGHT) * self.rate + EWMA_WEIGHT * sample
            self._delivered, self._busy_s = 0, 0.0
        return {WAN_QUEUED_KEY: self.left(), WAN_EGRESS_KEY: self.rate, WAN_TRANSFERS_KEY: self._in_flight}


def reported_figure(value: object) -> float:
    """A heartbeat figure as a finite non-negative float; anything else (absent, corrupt) counts as 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return 0.0
    return float(value)


def site_queue_seconds(reports: Iterable[Mapping[str, object]], cfg: PolicyConfig) -> float:
    """The WAN queue the router routes on, from the last heartbeat summaries of a site's prefill instances (the
    live router's registry, or the simulator's `sim/wan_view.py`): their queued bytes, egress and transfers in
    flight summed, through `policy.wan_queue_seconds`. A P that does not report its transfers (an older version)
    counts as a full line: its backlog is read as a queue, as before the field existed."""
    reports = list(reports)
    return wan_queue_seconds(sum(reported_figure(r.get(WAN_QUEUED_KEY)) for r in reports),
                             sum(reported_figure(r.get(WAN_EGRESS_KEY)) for r in reports),
                             sum(reported_figure(r.get(WAN_TRANSFERS_KEY, cfg.wan_flows)) for r in reports), cfg)
