"""WAN link state at the router (services/router/wan_health.py): a down link is probed until a probe gets
through, whatever the probes run into, and ``pdd:wan_link_up`` never reports a link down for good.

Both failures below once left a link reported down forever after a chaos run
(tests/e2e/test_failover.py, ``wan_back_after_s`` null):
* a probe that timed out raised CancelledError out of ``WanProbe.probe`` (``asyncio.wait_for`` cancels
  the future it waits on), which ended the prober task: no more probes, the link stayed down;
* a main decoder marked down and then lost (kill -9 with a KV transfer in flight) was forgotten with its
  gauge left at 0, so after it was respawned the link read as down although nothing probed it.
"""

from __future__ import annotations

import asyncio

from pdd.router.registry import Registry
from pdd.router.wan_health import WanHealth, WanProbe
from pdd.shared import metrics
from pdd.shared.config import PDDConfig
from pdd.shared.protocol import Announce, SubmitRequest, TokenChunk
from pdd.shared.roles import Role


def _announce(iid: str, role: Role) -> Announce:
    return Announce(instance_id=iid, role=role, site="site-a", state="ready", load=0.0, running_requests=0,
                    free_kv_blocks=10, total_kv_blocks=10, heartbeat_ms=500)


def _gauge(decode_id: str) -> float | None:
    """The router's pdd:wan_link_up for ``decode_id``; None when it has no such series."""
    for metric in metrics.WAN_UP.collect():
        for sample in metric.samples:
            if sample.labels.get("main_decode") == decode_id:
                return sample.value
    return None


class _Bus:
    """Takes probe submissions; answers each with MD's token only once ``answer`` is set."""

    def __init__(self) -> None:
        self.answer = False
        self.submitted: list[SubmitRequest] = []
        self.probes: WanProbe | None = None

    async def publish(self, subject: str, message) -> None:
        if isinstance(message, SubmitRequest):
            self.submitted.append(message)
            if self.answer:
                loop = asyncio.get_running_loop()
                loop.call_soon(self.probes.on_event, TokenChunk(
                    request_id=message.request_id, instance_id=message.md_instance, role=Role.MAIN_DECODE,
                    start=1, token_ids=[7]))


async def test_a_timed_out_probe_does_not_end_probing():
    registry = Registry(bus=None)
    for a in (_announce("p-0", Role.PREFILL), _announce("md-7", Role.MAIN_DECODE)):
        registry.observe(a)
    bus = _Bus()
    cancelled: list[str] = []

    async def cancel(rid: str, reason: str) -> None:
        cancelled.append(rid)

    config = PDDConfig()
    config.router.stall_timeout_s = 0.1  # the probe waits max(5 s, this) for MD's token
    health: WanHealth | None = None
    probes = WanProbe(config, bus, registry, "events", cancel, forget=lambda d: health.forget(d))
    bus.probes = probes
    health = WanHealth(probes.probe, interval_s=0.05)
    health.mark_down("md-7", "test: transfer lost")
    try:
        while len(bus.submitted) < 1:  # the first probe goes out and is never answered: it times out
            await asyncio.sleep(0.05)
        bus.answer = True  # the link is back: the next probe's token comes through
        for _ in range(200):  # 10 s: the first probe's 5 s timeout, then the next probe
            if health.is_up("md-7"):
                break
            await asyncio.sleep(0.05)
        assert health.is_up("md-7"), "probing stopped after a probe timed out"
        assert len(bus.submitted) >= 2
        assert cancelled and cancelled[0] == bus.submitted[0].request_id  # the timed-out probe was cancelled
        assert _gauge("md-7") == 1
    finally:
        await health.stop()


async def test_a_forgotten_decoder_is_not_reported_down():
    registry = Registry(bus=None)
    registry.observe(_announce("p-0", Role.PREFILL))  # md-8 is not (any more) in the registry
    bus = _Bus()

    async def cancel(rid: str, reason: str) -> None:
        pass

    health: WanHealth | None = None
    probes = WanProbe(PDDConfig(), bus, registry, "events", cancel, forget=lambda d: health.forget(d))
    bus.probes = probes
    health = WanHealth(probes.probe, interval_s=0.02)
    health.mark_down("md-8", "test: transfer lost when it died")
    assert _gauge("md-8") == 0
    for _ in range(100):
        if "md-8" not in health.down_since:
            break
        await asyncio.sleep(0.02)
    assert health.is_up("md-8") and not health._probers
    assert _gauge("md-8") != 0, "a decoder that left the registry stays reported down"
    # an instance of that id comes back and its link is cut again: down, probed, up
    registry.observe(_announce("md-8", Role.MAIN_DECODE))
    bus.answer = True
    health.mark_down("md-8", "test: cut again")
    assert _gauge("md-8") == 0
    for _ in range(100):
        if health.is_up("md-8"):
            break
        await asyncio.sleep(0.02)
    assert health.is_up("md-8") and _gauge("md-8") == 1
    await health.stop()


async def test_stop_ends_probing():
    async def never(decode_id: str) -> bool:
        await asyncio.sleep(3600)
        return False

    health = WanHealth(never, interval_s=0.01)
    health.mark_down("md-9", "test")
    await asyncio.sleep(0.05)  # the prober is inside a probe
    await asyncio.wait_for(health.stop(), 2)
    assert not health._probers
