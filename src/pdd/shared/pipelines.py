"""The pipelines, declared once: what each one is made of and who does what in it.

A pipeline is the path a request takes through the roles. Everything that depends on it reads the
spec here (where prefill sends KV, whether the relay hands over, who owns an output position, which
instances a request depends on, which roles it needs); nothing spells a pipeline as a literal.
Which pipeline a request gets is decided in ``policy.py``.

Adding a pipeline: one ``Pipeline`` member and its ``PipelineSpec`` below, a rule in
``policy.choose_pipeline`` if the router should pick it, and whatever new role behaviour it needs
(docs/ARCHITECTURE.md walks through an example).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdd.shared.roles import DECODERS, Role


class Pipeline(enum.StrEnum):
    P_MD = "P-MD"  # high prefix hit: only the missing KV crosses the WAN, MD decodes everything
    P_RLD_MD = "P-RLD-MD"  # low hit: the relay decodes while the WAN transfer runs, then hands over
    P_RLD = "P-RLD"  # local finish: anomalous traffic, or the WAN is down
    RESUME = "resume"  # after a failover: one decoder recomputes prompt + emitted tokens and owns the rest


class HandoffMode(enum.StrEnum):
    ONE_SHOT = "one-shot"  # every pending token id in one extend: frees the relay at once
    CATCH_UP = "catch-up"  # batches until MD is close behind: spreads a big backlog


@dataclass(frozen=True)
class PipelineSpec:
    """What a pipeline is made of. ``kv_to`` is where prefill sends the prompt's KV: the relay over the
    fast in-site path, main decode over the WAN (only the blocks its decode-side cache lacks)."""

    kv_to: frozenset[Role]
    hands_over: bool = False  # the relay hands the request to main decode by token ids
    prefill_streams_first: bool = True  # P samples output position 0 and streams it
    routable: bool = True  # the router may choose it and a client or operator may force it

    @property
    def roles(self) -> frozenset[Role]:
        """The roles a request needs instances of (the router's own role aside)."""
        if not self.prefill_streams_first:
            return frozenset()  # a resume goes to whichever decoder is left
        return frozenset({Role.PREFILL}) | self.kv_to

    @property
    def crosses_wan(self) -> bool:
        return Role.MAIN_DECODE in self.kv_to

    def owns(self, role: Role, position: int, relay_until: int | None) -> bool | None:
        """Whether ``role`` owns output ``position``; None while that cannot be known yet (main decode's
        tokens before the relay has named the last position it emits)."""
        if position == 0:
            return role == Role.PREFILL and self.prefill_streams_first
        if role not in DECODERS:
            return False
        if not self.prefill_streams_first:
            return True  # resume: the one decoder that resumed the request
        if role not in self.kv_to:
            return False
        if not self.hands_over:
            return True
        if role == Role.RELAY:
            return relay_until is None or position <= relay_until
        return None if relay_until is None else position > relay_until

    def depends_on(self, next_position: int, relay_until: int | None) -> tuple[Role, ...]:
        """The roles whose loss stalls a request now, given the next position the client waits for
        (a later owner is not needed yet; an earlier one is done)."""
        needed = [Role.PREFILL] if self.prefill_streams_first and next_position <= 1 else []
        relay_owns = relay_until is None or next_position <= relay_until
        if Role.RELAY in self.kv_to and (relay_owns or not self.hands_over):
            needed.append(Role.RELAY)
        if Role.MAIN_DECODE in self.kv_to and (not self.hands_over or relay_until is not None):
            needed.append(Role.MAIN_DECODE)
        return tuple(needed)


SPECS: dict[Pipeline, PipelineSpec] = {
    Pipeline.P_MD: PipelineSpec(kv_to=frozenset({Role.MAIN_DECODE})),
    Pipeline.P_RLD_MD: PipelineSpec(kv_to=frozenset({Role.RELAY, Role.MAIN_DECODE}), hands_over=True),
    Pipeline.P_RLD: PipelineSpec(kv_to=frozenset({Role.RELAY})),
    Pipeline.RESUME: PipelineSpec(kv_to=frozenset(), prefill_streams_first=False, routable=False),
}
ROUTABLE = tuple(p for p in Pipeline if SPECS[p].routable)


def spec(pipeline: Pipeline | str) -> PipelineSpec:
    return SPECS[Pipeline(pipeline)]


def routable(value: Pipeline | str | None) -> Pipeline | None:
    """A pipeline a client or operator may force, or a ValueError naming the choices."""
    if value is None:
        return None
    try:
        pipeline = Pipeline(value)
    except ValueError:
        pipeline = None
    if pipeline is None or not SPECS[pipeline].routable:
        raise ValueError(f"unknown pipeline {value!r}; choose one of {', '.join(ROUTABLE)}")
    return pipeline
