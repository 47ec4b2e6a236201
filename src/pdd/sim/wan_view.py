"""The WAN queue as the live router sees it, for the simulated router's WAN-saturated rule.

Live, each prefill instance counts its WAN backlog and measures its egress (`pdd.shared.wan_backlog`), and sends
them, with its transfers in flight, in its heartbeat; the router sums the last heartbeats of the site's instances
and routes on that (`policy.wan_queue_seconds`). So it decides on a figure up to one heartbeat old, whose drain
rate is a measurement (bytes delivered per second of having a transfer in flight, setup included), not the link's
rate. Here the same class runs per simulated P on the simulated clock, fed the same events (a WAN transfer starts
when its prefill ends; it ends when its KV lands, or when the relay finished first and the transfer was cancelled),
and its summary is taken at every heartbeat tick; the router reads the last one, through the same
`policy.wan_queue_seconds` (no queue while the transfers in flight leave one of the line's `wan_flows` free).
The exact wait for a free transfer slot, which the simulator read before, is a better figure than the live router
has: it sent 5 requests relay-only where the live system sent 11 on the same 60 (docs/BENCHMARKS.md, "Real
traffic"; with this view 8).
"""

from __future__ import annotations

from pdd.shared.policy import PolicyConfig
from pdd.shared.wan_backlog import WanBacklog, site_queue_seconds


class HeartbeatWanView:
    """Every P's WanBacklog on the simulated clock, read as the router reads it: at heartbeat ticks."""

    def __init__(self, n_prefill: int, heartbeat_s: float, policy: PolicyConfig) -> None:
        self.now = 0.0
        self.heartbeat_s = heartbeat_s
        self.policy = policy
        self.backlogs = [WanBacklog(clock=self._clock) for _ in range(max(1, n_prefill))]
        self.reported = [b.summary() for b in self.backlogs]  # before the first beat: nothing queued
        self.next_tick = heartbeat_s
        self.open: dict[int, tuple[int, float]] = {}  # request -> (its P, planned bytes) of a transfer under way

    def _clock(self) -> float:
        return self.now

    def advance(self, now: float) -> None:
        """Every heartbeat up to ``now``, in order, each taken on the state it found (events come in time order:
        nothing changed between the last event and ``now``)."""
        hb = self.heartbeat_s
        while self.next_tick <= now:
            self.now = self.next_tick
            self.reported = [b.summary() for b in self.backlogs]
            self.next_tick += hb
            if not self.open and self.next_tick <= now:  # idle: every later tick until now reports the same
                self.next_tick += (int((now - self.next_tick) / hb) + 1) * hb
        self.now = now

    def started(self, rid: int, prefill: int, nbytes: float, now: float) -> None:
        self.advance(now)
        self.backlogs[prefill].started(int(nbytes))
        self.open[rid] = (prefill, nbytes)

    def finished(self, rid: int, now: float, delivered: float | None = None) -> None:
        """The request's transfer ended (no-op if it has none under way); ``delivered``: bytes it carried
        (all of them unless cut short)."""
        entry = self.open.pop(rid, None)
        if entry is None:
            return
        self.advance(now)
        prefill, planned = entry
        self.backlogs[prefill].finished(int(planned), int(planned if delivered is None else delivered))

    def queue_s(self, now: float) -> float:
        """What the router routes on at ``now``: the site's queued KV over its measured egress, as last reported."""
        self.advance(now)
        return site_queue_seconds(self.reported, self.policy)
