"""When a request must leave the instances it is on, and where it goes to finish.

Failover: an instance the request depends on leaves the registry (missed heartbeats, e.g. after a
``kill -9``: ``decoder_lost`` / ``prefill_lost``), its decoder goes silent past ``stall_timeout_s``,
or a retryable error arrives -> the request migrates under a fresh attempt id (the request loop in
orchestrator.py does the move). With no token out yet it starts over on another prefill
(routing.py); otherwise another decoder resumes it from prompt + emitted tokens (recompute, no KV),
so the client's stream goes on with no position lost or repeated: a main decode if one is left,
else a relay (local finish). Only with no ready decoder left does the request fail (503
``no_decode``, naming the decoders given up on and those that are draining).
A failed WAN transfer in P-RLD-MD leaves the relay to finish.

These are decisions over one request's state and the fleet's, kept out of the request loop so each
rule reads on its own: who the request depends on now, whether something is wrong, what an error
reply means, which decoder resumes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdd.router.inflight import InFlight
from pdd.router.registry import Registry
from pdd.router.routing import NO_DECODE
from pdd.router.types import GenerationError
from pdd.router.wan_health import WanHealth
from pdd.shared import metrics
from pdd.shared.bus import Bus
from pdd.shared.config import PDDConfig
from pdd.shared.pipelines import spec
from pdd.shared.protocol import Announce, ErrorReply
from pdd.shared.roles import DECODERS, Role

WATCH_INTERVAL_S = 0.25  # how often a waiting request checks its instances' health
EXCLUDE_ON_ERROR = ("draining",)  # the sender itself cannot take this request now
WAN_ERRORS = ("wan_transfer_failed", "wan_transfer_refused")  # P's WAN transfer to MD did not complete


@dataclass
class Failure:
    """Something went wrong with the current attempt; the request may migrate."""

    code: str
    message: str
    exclude: str | None = None  # an instance that should not get this request again


def depends_on(state: InFlight) -> list[Announce]:
    """Instances whose loss stalls this request now (a later owner is not yet needed), the owner last."""
    if state.resumed_on is not None:
        return [state.resumed_on]
    route, tracker = state.route, state.tracker
    instances = {Role.PREFILL: route.prefill, Role.RELAY: route.relay,
                 Role.MAIN_DECODE: None if state.wan_fallback else route.main_decode}
    roles = spec(route.pipeline).depends_on(tracker.next_position, tracker.relay_until)
    return [instances[r] for r in roles if instances[r] is not None]


def lost_code(role: Role | str) -> str:
    """The failure code of an instance that left the registry: ``decoder_lost`` or ``prefill_lost``."""
    return "decoder_lost" if role in DECODERS else f"{role}_lost"


class HealthWatch:
    """Checks a waiting request's instances; blind while NATS is away and until heartbeats are back."""

    def __init__(self, config: PDDConfig, bus: Bus, registry: Registry):
        self.config = config
        self.bus = bus
        self.registry = registry
        self._bus_down_at = float("-inf")

    def problem(self, state: InFlight) -> Failure | None:
        now = time.monotonic()
        if not self.bus.is_connected:
            self._bus_down_at = now
        service = self.config.service
        grace = service.missed_heartbeats * service.heartbeat_ms / 1000 + self.config.nats.reconnect_settle_s
        if now - self._bus_down_at < grace:  # blind while NATS is away, and until heartbeats are back
            return None
        for instance in depends_on(state):
            if self.registry.get(instance.instance_id) is None:
                return Failure(lost_code(instance.role), f"{instance.role} {instance.instance_id} stopped answering",
                               exclude=instance.instance_id)
        # a stream silent since before a NATS outage lost its chunks with the old server: do not wait the
        # whole stall timeout for it once the fleet is visible again
        lost_in_outage = state.last_progress < self._bus_down_at
        silent = now - max(state.last_progress, self._bus_down_at + grace)
        limit = grace if lost_in_outage else self.config.router.stall_timeout_s
        if state.flushed and silent > limit:
            owners = depends_on(state)
            return Failure("stalled", f"no output for {silent:.1f}s",
                           exclude=owners[-1].instance_id if owners else None)
        return None


def on_error(state: InFlight, error: ErrorReply, wan: WanHealth,
             registry: Registry) -> GenerationError | Failure | None:
    """What an error reply means for the request: fail it, migrate it, or (None) let the relay finish it."""
    route = state.route
    if error.code in WAN_ERRORS and route.main_decode is not None and state.resumed_on is None:
        if error.code == "wan_transfer_failed":
            wan.mark_down(route.main_decode.instance_id, error.message)
        relay_owns = spec(route.pipeline).hands_over and state.tracker.relay_until is None
        if relay_owns and route.relay is not None and registry.get(route.relay.instance_id) is not None:
            state.wan_fallback = True  # the relay keeps decoding to the end (P-RLD); MD got a cancel
            state.meta["wan_fallback"] = "relay_finishes"
            metrics.WAN_FALLBACKS.labels("relay_finishes").inc()
            return None
        metrics.WAN_FALLBACKS.labels("resume").inc()
    if not error.retryable:
        status = 400 if error.code == "invalid_request" else 500
        return GenerationError(status, error.code, error.message)
    exclude = error.instance_id if error.code in EXCLUDE_ON_ERROR else None
    return Failure(error.code, error.message, exclude=exclude)


def resume_target(state: InFlight, registry: Registry, config: PDDConfig, prefer_relay: bool) -> Announce:
    """Another decoder for the rest: MD (its DRC likely holds the prefix), else a relay (local finish); a relay
    first after a WAN failure. 503 ``no_decode`` when none is ready, naming what was given up on and why the
    decoders still known are not usable (draining: stopping, refusing new work)."""
    def pick(role: Role) -> Announce | None:
        options = [i for i in registry.instances(role) if i.instance_id not in state.excluded]
        if role == Role.RELAY:
            options = [i for i in options if i.load < config.policy.rld_max_load] or options
        return min(options, key=lambda i: (i.load, i.instance_id)) if options else None

    order = (Role.RELAY, Role.MAIN_DECODE) if prefer_relay else (Role.MAIN_DECODE, Role.RELAY)
    for role in order:
        chosen = pick(role)
        if chosen is not None:
            return chosen
    others = [f"{i.instance_id} {i.state if i.state != 'ready' else 'unconfirmed'}" for role in DECODERS
              for i in registry.instances(role, ready_only=False) if i.instance_id not in state.excluded]
    given_up = sorted(state.excluded)
    raise GenerationError(503, NO_DECODE, "no decode instance is left to resume the request on ("
                          + (f"given up on {', '.join(given_up)}; " if given_up else "")
                          + (f"not usable: {', '.join(others)}" if others
                             else f"no other {Role.RELAY} or {Role.MAIN_DECODE} instance is alive") + ")")
