"""The simulated router's WAN queue is what the live router has: each P's WanBacklog (the class P runs), read as
of its last heartbeat (sim/wan_view.py)."""

from __future__ import annotations

import pytest

from pdd.shared.policy import PolicyConfig, wan_queue_seconds
from pdd.shared.protocol import WAN_EGRESS_KEY
from pdd.sim.wan_view import HeartbeatWanView

CFG = PolicyConfig()
ASSUMED = CFG.default_wan_gbps * 1e9 / 8  # bytes/s until an egress is measured


def test_the_router_sees_the_backlog_as_of_the_last_heartbeat():
    view = HeartbeatWanView(n_prefill=2, heartbeat_s=0.5, policy=CFG)
    view.started(rid=7, prefill=1, nbytes=2e9, now=0.1)
    assert view.queue_s(0.4) == 0.0  # no heartbeat since it started
    assert view.queue_s(0.6) == pytest.approx(2e9 / ASSUMED)  # the 0.5 s beat: 2 GB queued, no egress yet
    view.finished(rid=7, now=1.2)
    assert view.queue_s(1.3) == pytest.approx(2e9 / ASSUMED)  # the 1.0 s beat, still
    view.finished(rid=7, now=1.3)  # a transfer ends once: a second end is nothing
    assert view.queue_s(1.6) == 0.0  # the 1.5 s beat: nothing in flight
    assert view.reported[1][WAN_EGRESS_KEY] == pytest.approx(2e9 / 1.1)  # 2 GB over 1.1 busy seconds


def test_queued_bytes_of_every_prefill_add_up_over_their_summed_egress():
    view = HeartbeatWanView(n_prefill=2, heartbeat_s=0.25, policy=CFG)
    for rid, (p, nbytes) in enumerate([(0, 1e9), (1, 3e9)]):
        view.started(rid, p, nbytes, now=0.0)
    view.finished(0, now=1.0)
    view.finished(1, now=2.0)
    view.started(2, 0, 4e9, now=10.0)
    view.started(3, 1, 1e9, now=10.0)
    queued = 5e9 - (1e9 / 1.0 + 3e9 / 2.0) * 0.25  # each P's measured egress has carried 0.25 s of it
    assert view.queue_s(10.3) == pytest.approx(wan_queue_seconds(queued, 1e9 / 1.0 + 3e9 / 2.0, 2, CFG), rel=0.05)
    two_flows = HeartbeatWanView(n_prefill=2, heartbeat_s=0.25, policy=PolicyConfig(wan_flows=3))
    two_flows.started(0, 0, 4e9, now=0.0)
    two_flows.started(1, 1, 1e9, now=0.0)
    assert two_flows.queue_s(0.3) == 0.0  # 2 transfers on a line of 3 flows: a third starts at once
