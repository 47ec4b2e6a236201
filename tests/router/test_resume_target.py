"""Which decoder a stranded request resumes on (failover.resume_target) over a real Registry fed the
announces a fleet sends: another main decode first, else a relay, a relay first after a WAN failure,
never an excluded or draining one, and with none left a 503 that names what is gone. The end-to-end
behaviour (a real kill -9 mid-stream) is tests/e2e/test_decoder_loss.py; this pins the order, which
there is only one of each role to show."""

from __future__ import annotations

import time

import pytest

from pdd.router.failover import resume_target
from pdd.router.inflight import InFlight
from pdd.router.ownership import OwnershipTracker
from pdd.router.registry import Registry
from pdd.router.routing import Route
from pdd.router.types import GenerationError, GenerationRequest
from pdd.shared.config import PDDConfig
from pdd.shared.pipelines import Pipeline
from pdd.shared.protocol import Announce, SamplingSpec
from pdd.shared.roles import Role


def _announce(iid: str, role: Role, state: str = "ready", load: float = 0.0) -> Announce:
    return Announce(instance_id=iid, role=role, site="site-a", state=state, load=load, running_requests=0,
                    free_kv_blocks=10, total_kv_blocks=10, heartbeat_ms=500)


def _fleet(*announces: Announce) -> Registry:
    registry = Registry(bus=None)  # fed directly: no bus needed to observe announces
    for a in announces:
        registry.observe(a)
    return registry


def _state(excluded: set[str]) -> InFlight:
    req = GenerationRequest("r", [1, 2, 3], SamplingSpec(max_tokens=8), time.time() + 60)
    route = Route(Pipeline.P_MD, "forced", _announce("p-0", Role.PREFILL), _announce("rld-0", Role.RELAY),
                  _announce("md-0", Role.MAIN_DECODE), 0, 0, 0)
    return InFlight(req, route, OwnershipTracker(Pipeline.P_MD), attempt_id="r", report=None,  # type: ignore[arg-type]
                    excluded=set(excluded))


def test_another_main_decode_before_the_relay():
    fleet = _fleet(_announce("md-0", Role.MAIN_DECODE), _announce("md-1", Role.MAIN_DECODE, load=0.9),
                   _announce("rld-0", Role.RELAY))
    chosen = resume_target(_state({"md-0"}), fleet, PDDConfig(), prefer_relay=False)
    assert (chosen.instance_id, chosen.role) == ("md-1", Role.MAIN_DECODE)


def test_the_relay_when_no_main_decode_is_left():
    fleet = _fleet(_announce("md-1", Role.MAIN_DECODE, state="draining"), _announce("rld-0", Role.RELAY))
    chosen = resume_target(_state({"md-0"}), fleet, PDDConfig(), prefer_relay=False)
    assert (chosen.instance_id, chosen.role) == ("rld-0", Role.RELAY)


def test_the_relay_first_after_a_wan_failure():
    fleet = _fleet(_announce("md-1", Role.MAIN_DECODE), _announce("rld-0", Role.RELAY))
    assert resume_target(_state(set()), fleet, PDDConfig(), prefer_relay=True).instance_id == "rld-0"


def test_no_decoder_left_names_what_is_gone():
    fleet = _fleet(_announce("p-0", Role.PREFILL), _announce("rld-0", Role.RELAY, state="draining"))
    with pytest.raises(GenerationError) as err:
        resume_target(_state({"md-0"}), fleet, PDDConfig(), prefer_relay=False)
    assert (err.value.http_status, err.value.code) == (503, "no_decode")
    assert "given up on md-0" in err.value.message and "rld-0 draining" in err.value.message
