"""The WAN queue the policy routes on: P's heartbeat reports its backlog and measured egress (shared/wan_backlog.py);
every router sums them per site (router/routing.py); past `wan_saturated_s` the relay finishes requests locally
(shared/policy.py), the same rule the simulator runs."""

from __future__ import annotations

import math

import pytest

from pdd.shared.wan_backlog import WanBacklog
from pdd.router.prefix_index import PrefixIndex
from pdd.router.registry import Registry
from pdd.router.routing import Routing
from pdd.router.wan_health import WanHealth
from pdd.shared.config import PDDConfig
from pdd.shared.pipelines import Pipeline
from pdd.shared.policy import PolicyConfig, RouteInputs, choose_pipeline, wan_queue_seconds
from pdd.shared.protocol import WAN_EGRESS_KEY, WAN_QUEUED_KEY, WAN_TRANSFERS_KEY, Announce
from pdd.shared.roles import Role

CFG = PolicyConfig()
BIG = RouteInputs(prompt_tokens=60_000, max_tokens=2000, p_cached_tokens=0, md_cached_tokens=0,
                  kv_bytes_per_token=50_000, wan_bandwidth_bps=1.25e9)


def test_a_saturated_wan_sends_requests_to_the_relay_to_finish():
    assert choose_pipeline(BIG, CFG).pipeline == Pipeline.P_RLD_MD
    saturated = RouteInputs(**{**vars(BIG), "wan_queue_s": CFG.wan_saturated_s + 0.1})
    decision = choose_pipeline(saturated, CFG)
    assert decision.pipeline == Pipeline.P_RLD and decision.wan_bytes == 0 and "saturated" in decision.reason
    busy_relay = RouteInputs(**{**vars(saturated), "rld_load": CFG.rld_max_load})
    assert choose_pipeline(busy_relay, CFG).pipeline != Pipeline.P_RLD
    no_relay = RouteInputs(**{**vars(saturated), "rld_available": False})
    assert choose_pipeline(no_relay, CFG).pipeline == Pipeline.P_MD
    all_cached = RouteInputs(**{**vars(saturated), "md_cached_tokens": 60_000})  # nothing would cross
    assert choose_pipeline(all_cached, CFG).pipeline == Pipeline.P_MD


def test_queue_seconds_use_the_measured_egress_else_the_assumed_rate():
    assert wan_queue_seconds(2e9, 1e9, 1, CFG) == pytest.approx(2.0)
    assert wan_queue_seconds(CFG.default_wan_gbps * 1e9 / 8, 0.0, 1, CFG) == pytest.approx(1.0)
    assert wan_queue_seconds(-5, 1e9, 1, CFG) == 0.0


def test_a_line_with_a_free_flow_has_no_queue():
    """On a line of 10 flows (100 Gbit/s, 10 per transfer) one long transfer is slow on its own, not queued:
    a new transfer starts at once beside it. Only with every flow taken does the backlog become a wait."""
    line = PolicyConfig(wan_flows=10)
    assert wan_queue_seconds(3.2e9, 1.25e9, 1, line) == 0.0
    assert wan_queue_seconds(3.2e9, 1.25e9, 9, line) == 0.0
    assert wan_queue_seconds(32e9, 12.5e9, 10, line) == pytest.approx(2.56)


def test_backlog_counts_bytes_in_flight_and_egress_per_busy_second():
    now = [0.0]
    backlog = WanBacklog(clock=lambda: now[0])
    backlog.started(1000)
    backlog.started(3000)
    assert backlog.summary() == {WAN_QUEUED_KEY: 4000.0, WAN_EGRESS_KEY: 0.0, WAN_TRANSFERS_KEY: 2}
    now[0] = 2.0
    backlog.finished(1000, 1000)
    now[0] = 4.0
    backlog.finished(3000, 3000)
    now[0] = 10.0  # idle: does not dilute the rate
    assert backlog.summary() == {WAN_QUEUED_KEY: 0.0, WAN_EGRESS_KEY: 1000.0, WAN_TRANSFERS_KEY: 0}
    backlog.started(500)
    backlog.finished(500, 0)  # failed: leaves the backlog, delivers nothing
    assert backlog.summary()[WAN_QUEUED_KEY] == 0.0
    # with the egress known (1000 B/s), a transfer in flight counts only what it has left to send
    now[0] = 20.0
    backlog.started(5000)
    now[0] = 23.0
    assert backlog.summary()[WAN_QUEUED_KEY] == pytest.approx(2000.0)
    now[0] = 30.0  # past its expected end, still unfinished: nothing is counted as queued
    assert backlog.summary()[WAN_QUEUED_KEY] == 0.0


def _announce(iid: str, site: str, summary: dict) -> Announce:
    return Announce(instance_id=iid, role=Role.PREFILL, site=site, state="ready", load=0.0, running_requests=0,
                    free_kv_blocks=10, total_kv_blocks=10, heartbeat_ms=500, cache_summary=summary)


def test_router_sums_the_sites_prefill_backlogs_and_ignores_corrupt_figures():
    registry = Registry(bus=None)
    for a in (_announce("p-0", "a", {WAN_QUEUED_KEY: 3e9, WAN_EGRESS_KEY: 1e9}),
              _announce("p-1", "a", {WAN_QUEUED_KEY: 1e9, WAN_EGRESS_KEY: 1e9}),
              _announce("p-2", "b", {WAN_QUEUED_KEY: 9e9, WAN_EGRESS_KEY: 1e9}),
              _announce("p-3", "a", {WAN_QUEUED_KEY: math.nan, WAN_EGRESS_KEY: "x"})):
        registry.observe(a)
    routing = Routing(PDDConfig(), None, registry, PrefixIndex(), WanHealth(probe=None, interval_s=1.0))
    assert routing.wan_queue_s("a") == pytest.approx(2.0)
    assert routing.wan_queue_s("b") == pytest.approx(9.0)
    assert routing.wan_queue_s("nowhere") == 0.0
    # a line of 3 flows, 2 transfers in flight: a new one would wait for none
    two = Registry(bus=None)
    for a in (_announce("p-0", "a", {WAN_QUEUED_KEY: 3e9, WAN_EGRESS_KEY: 1e9, WAN_TRANSFERS_KEY: 1}),
              _announce("p-1", "a", {WAN_QUEUED_KEY: 1e9, WAN_EGRESS_KEY: 1e9, WAN_TRANSFERS_KEY: 1})):
        two.observe(a)
    line = PDDConfig(policy={"wan_flows": 3})
    assert Routing(line, None, two, PrefixIndex(), WanHealth(probe=None, interval_s=1.0)).wan_queue_s("a") == 0.0
    two.observe(_announce("p-1", "a", {WAN_QUEUED_KEY: 1e9, WAN_EGRESS_KEY: 1e9, WAN_TRANSFERS_KEY: 2}))
    assert Routing(line, None, two, PrefixIndex(), WanHealth(probe=None, interval_s=1.0)).wan_queue_s("a") == \
        pytest.approx(2.0)
