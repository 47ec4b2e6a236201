"""An engine's view of the routers it serves (roles/router_watch.py): a router is lost when it stops beating
for missed_heartbeats periods plus the suspicion time, or when it comes back as a new process under its id; a
graceful stop is no loss, and nothing is judged while this instance's own bus link is down."""

from __future__ import annotations

from pdd.roles.router_watch import RouterWatch
from pdd.shared.config import ServiceConfig
from pdd.shared.protocol import Announce
from pdd.shared.roles import Role


def _announce(iid: str, started: float = 1.0, state: str = "ready", role: Role = Role.ROUTER) -> Announce:
    return Announce(instance_id=iid, role=role, site="site-a", state=state, load=0.0, running_requests=0,
                    free_kv_blocks=0, total_kv_blocks=0, heartbeat_ms=500, started_unix=started)


class _Bus:
    is_connected = True


def _watch(now: list[float]) -> RouterWatch:
    watch = RouterWatch(ServiceConfig(heartbeat_ms=500, missed_heartbeats=3, suspect_timeout_s=5.0),
                        on_lost=None, clock=lambda: now[0])  # type: ignore[arg-type]
    watch._bus = _Bus()  # type: ignore[assignment]
    return watch


def test_silence_past_beats_and_suspicion_loses_a_router() -> None:
    now = [0.0]
    watch = _watch(now)
    assert watch.observe(_announce("router-0")) is False
    assert watch.observe(_announce("router-1")) is False
    now[0] = 6.0  # 6 s < 3 x 0.5 + 5
    watch.observe(_announce("router-1"))
    assert watch.silent() == []
    now[0] = 6.6
    assert watch.silent() == ["router-0"] and list(watch.routers) == ["router-1"]


def test_a_new_process_under_the_same_id_is_a_loss_and_a_stop_is_not() -> None:
    now = [0.0]
    watch = _watch(now)
    watch.observe(_announce("router-0", started=1.0))
    assert watch.observe(_announce("router-0", started=1.0)) is False
    assert watch.observe(_announce("router-0", started=2.0)) is True
    assert watch.observe(_announce("router-0", state="stopped")) is False and not watch.routers
    now[0] = 100.0
    assert watch.silent() == []


def test_our_own_outage_proves_nothing() -> None:
    now = [0.0]
    watch = _watch(now)
    watch.observe(_announce("router-0"))
    watch._bus.is_connected = False  # type: ignore[union-attr]
    now[0] = 60.0
    assert watch.silent() == []
    watch._bus.is_connected = True  # type: ignore[union-attr]
    watch._on_bus_event("reconnected")  # the silence clock restarts now
    now[0] = 63.0
    assert watch.silent() == []
    now[0] = 67.0
    assert watch.silent() == ["router-0"]

