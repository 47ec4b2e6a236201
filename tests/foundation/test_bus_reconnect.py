"""The bus across a nats-server restart (same port): what is published during the outage arrives, in
order, once everyone is back; requests wait for the reconnect within their timeout; listeners hear
both edges; the router's registry neither drops the fleet for our own outage nor offers work to an
instance it has not heard from since."""

from __future__ import annotations

import asyncio

import pytest

from pdd.launch.natsserver import free_port, start_nats_server
from pdd.router.registry import Registry
from pdd.shared.bus import Bus, BusError
from pdd.shared.config import NatsConfig
from pdd.shared.protocol import Announce, Ping, Pong, Subjects

GUARD_S = 30  # hang guard only


async def _until(predicate, what: str, state=None) -> None:
    """Poll until ``predicate()``; on the hang guard, fail with ``what`` and what ``state()`` shows then."""
    async def poll():
        while not predicate():
            await asyncio.sleep(0.02)
    try:
        await asyncio.wait_for(poll(), GUARD_S)
    except asyncio.TimeoutError:
        raise AssertionError(f"never: {what}" + (f" ({state()})" if state else "")) from None


@pytest.fixture
def restartable(tmp_path):
    port = free_port()
    state = {"server": start_nats_server(port=port, log_file=str(tmp_path / "nats.log"))}

    def restart(stop_only: bool = False):
        state["server"].stop()
        if not stop_only:
            state["server"] = start_nats_server(port=port, log_file=str(tmp_path / "nats.log"))

    yield state["server"].url, restart, state
    state["server"].stop()


async def test_published_during_outage_arrives_in_order_after_restart(restartable) -> None:
    url, restart, state = restartable
    # the publisher is back first (as P was in the restart test): without the hold, what it buffered
    # would be flushed before the subscriber re-subscribed, and dropped by the server
    publisher = Bus(NatsConfig(url=url, reconnect_time_wait_s=0.05, reconnect_settle_s=1.0), "pub")
    subscriber = Bus(NatsConfig(url=url, reconnect_time_wait_s=0.3), "sub")
    events: list[str] = []
    await publisher.connect()
    await subscriber.connect()
    publisher.add_listener(events.append)
    got: list[str] = []

    async def on_ping(message, _env):
        got.append(message.payload)

    await subscriber.subscribe("t.outage", on_ping, expect=Ping)
    await subscriber.sync()
    try:
        await publisher.publish("t.outage", Ping(payload="before"))
        await _until(lambda: got == ["before"], "the message before the outage")
        state["server"].stop()
        await _until(lambda: not publisher.connected.is_set() and not subscriber.connected.is_set(), "disconnect")
        for i in range(50):
            await publisher.publish("t.outage", Ping(payload=f"during-{i}"))
        await asyncio.to_thread(restart)  # the same port, after the outage
        await _until(lambda: len(got) == 51, f"every held message delivered (got {len(got)})")
        assert got == ["before"] + [f"during-{i}" for i in range(50)]
        assert events == ["disconnected", "reconnected"]
        await publisher.publish("t.outage", Ping(payload="after"))
        await _until(lambda: got[-1] == "after", "the message after the outage")
    finally:
        await publisher.close()
        await subscriber.close()


async def test_router_bound_messages_just_before_the_outage_are_sent_again(restartable) -> None:
    """A dying server loses what it had not delivered; messages to the router (which drops duplicates
    by output position) sent within ``replay_window_s`` before the disconnect go out again after it.
    Other subjects are never duplicated."""
    url, restart, state = restartable
    publisher = Bus(NatsConfig(url=url, reconnect_time_wait_s=0.05, reconnect_settle_s=0.5,
                               replay_window_s=60), "pub")
    subscriber = Bus(NatsConfig(url=url, reconnect_time_wait_s=0.05), "sub")
    await publisher.connect()
    await subscriber.connect()
    got: dict[str, list[str]] = {"router": [], "other": []}

    def collect(key):
        async def handler(message, _env):
            got[key].append(message.payload)
        return handler

    await subscriber.subscribe(Subjects.router_events("r0"), collect("router"), expect=Ping)
    await subscriber.subscribe(Subjects.instance("md-0", "handoff"), collect("other"), expect=Ping)
    await subscriber.sync()
    try:
        await publisher.publish(Subjects.router_events("r0"), Ping(payload="tok-1"))
        await publisher.publish(Subjects.instance("md-0", "handoff"), Ping(payload="ctl-1"))
        # say what arrived and whether either side saw an outage, so a failure tells a lost message from a
        # duplicate (the one seen, nothing delivered and no outage, was nats-py's flush: Bus.sync above)
        await _until(lambda: got == {"router": ["tok-1"], "other": ["ctl-1"]}, "delivery before the outage",
                     lambda: f"got {got}, outages pub {publisher.outages} sub {subscriber.outages}")
        state["server"].stop()
        await _until(lambda: not publisher.connected.is_set(), "disconnect")
        await publisher.publish(Subjects.router_events("r0"), Ping(payload="tok-2"))
        await asyncio.to_thread(restart)
        await _until(lambda: got["router"][-1:] == ["tok-2"], "the held message")
        assert got["router"] == ["tok-1", "tok-1", "tok-2"]  # replayed first, then what was held
        assert got["other"] == ["ctl-1"]
    finally:
        await publisher.close()
        await subscriber.close()


async def test_request_waits_for_reconnect_within_its_timeout(restartable) -> None:
    url, restart, state = restartable
    server = Bus(NatsConfig(url=url, reconnect_time_wait_s=0.05), "srv")
    client = Bus(NatsConfig(url=url, reconnect_time_wait_s=0.05, reconnect_settle_s=1.0), "cli")
    await server.connect()
    await client.connect()

    async def on_ping(message, _env):
        return Pong(instance_id="srv", role="prefill", payload=message.payload)

    await server.subscribe(Subjects.instance("srv", "ping"), on_ping, expect=Ping)
    await server.sync()
    try:
        state["server"].stop()
        await _until(lambda: not client.connected.is_set(), "disconnect")
        with pytest.raises(BusError) as info:  # nobody to ask, and the timeout runs out
            await client.request(Subjects.instance("srv", "ping"), Ping(payload="x"), timeout=0.3)
        assert info.value.code == "timeout" and info.value.retryable
        pending = asyncio.create_task(client.request(Subjects.instance("srv", "ping"), Ping(payload="y"),
                                                     timeout=GUARD_S, expect=Pong))
        await asyncio.sleep(0.3)
        assert not pending.done()
        await asyncio.to_thread(restart)
        reply = await pending
        assert reply.payload == "y"
    finally:
        await client.close()
        await server.close()


async def test_hold_buffer_is_bounded(restartable) -> None:
    url, restart, state = restartable
    bus = Bus(NatsConfig(url=url, reconnect_buffer_bytes=2000), "bounded")
    await bus.connect()
    try:
        state["server"].stop()
        await _until(lambda: not bus.connected.is_set(), "disconnect")
        with pytest.raises(BusError) as info:
            for _ in range(1000):
                await bus.publish("t.bounded", Ping(payload="x" * 100))
        assert info.value.code == "bus_buffer_full" and info.value.retryable
    finally:
        await bus.close()  # closing while disconnected returns at once


class _FakeBus:
    def __init__(self):
        self.is_connected = True
        self.listeners = []

    def add_listener(self, cb):
        self.listeners.append(cb)


def _announce(iid: str, role: str = "prefill") -> Announce:
    return Announce(instance_id=iid, role=role, site="site-a", state="ready", heartbeat_ms=500, endpoints={},
                    sent_unix=0.0, load=0.0, running_requests=0, free_kv_blocks=0, total_kv_blocks=0)


def test_registry_keeps_the_fleet_through_our_own_outage() -> None:
    now = [100.0]
    bus = _FakeBus()
    reg = Registry(bus, missed_heartbeats=3, clock=lambda: now[0], suspect_timeout_s=0.0)  # type: ignore[arg-type]
    reg.observe(_announce("p-0"))
    reg.observe(_announce("p-1"))
    # our link drops: silence proves nothing, nothing is pruned, but nothing is offered work either
    bus.is_connected = False
    reg.on_bus_event("disconnected")
    now[0] += 60
    assert reg.prune() == []
    assert reg.instances("prefill") == [] and len(reg.instances("prefill", ready_only=False)) == 2
    assert {s["confirmed"] for s in reg.snapshot()} == {False}
    # back: the silence clock restarts now; p-0 beats and is offered work again, p-1 died meanwhile
    bus.is_connected = True
    reg.on_bus_event("reconnected")
    now[0] += 1.0
    reg.observe(_announce("p-0"))
    assert [a.instance_id for a in reg.instances("prefill")] == ["p-0"]
    assert reg.prune() == []
    now[0] += 1.0  # 2.0 s since the reconnect > 3 x 0.5 s
    assert reg.prune() == ["p-1"]
    assert [a.instance_id for a in reg.instances("prefill", ready_only=False)] == ["p-0"]


def test_a_silent_instance_is_suspected_before_it_is_lost() -> None:
    """Slow is not dead: past missed_heartbeats an instance gets no new work but keeps its requests (get() still
    finds it, so nothing migrates); a beat clears that; only suspect_timeout_s more of silence drops it."""
    now = [100.0]
    reg = Registry(_FakeBus(), missed_heartbeats=3, clock=lambda: now[0], suspect_timeout_s=5.0)  # type: ignore[arg-type]
    reg.observe(_announce("p-0"))
    reg.observe(_announce("md-0", "main-decode"))
    now[0] += 2.0  # > 3 x 0.5 s
    assert reg.prune() == []
    assert reg.instances("prefill") == [] and reg.get("p-0") is not None
    assert {s["instance"]: s["suspected"] for s in reg.snapshot()} == {"md-0": True, "p-0": True}
    reg.observe(_announce("p-0"))  # it was only slow
    assert [a.instance_id for a in reg.instances("prefill")] == ["p-0"]
    now[0] += 4.0  # md-0: 6 s of silence, inside 1.5 + 5
    assert reg.prune() == [] and reg.get("md-0") is not None
    now[0] += 1.0  # 7 s > 6.5 s
    assert reg.prune() == ["md-0"] and reg.get("md-0") is None
