"""What the router keeps about one request while it runs, across every attempt it takes.

Its own module because the request loop, failover and reporting all read and change it: the
prompt and every token id queued for the client (the resume point), the current route and attempt
id, the first token held back for the handoff, and what failover has learned (instances to avoid,
where the request was resumed, whether the relay finishes it after a failed WAN transfer).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdd.router.ownership import OwnershipTracker
from pdd.router.playout import Playout
from pdd.router.routing import Route
from pdd.router.types import GenerationRequest
from pdd.shared.protocol import Announce

if TYPE_CHECKING:
    from pdd.router.reporting import StreamReport

CHECK = object()  # a request that has heard nothing for a while (or reached its deadline): look around


@dataclass
class InFlight:
    request: GenerationRequest
    route: Route
    tracker: OwnershipTracker
    attempt_id: str  # the request's id on the bus for the current attempt
    report: StreamReport
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # what the client gets: TokenEvents, an exception
    control: asyncio.Queue = field(default_factory=asyncio.Queue)  # what the request loop acts on (CHECK, ...)
    flushed: list[int] = field(default_factory=list)  # every token id queued for the client (resume point)
    meta: dict[str, Any] = field(default_factory=dict)
    p_cached: int = 0
    held: list[int] = field(default_factory=list)  # first token held back (first_token_after_kv)
    held_logprobs: list = field(default_factory=list)  # its logprobs (protocol.TokenLogprobs), when asked
    migrations: int = 0
    excluded: set[str] = field(default_factory=set)
    resumed_on: Announce | None = None  # the decoder the request was last resumed on (it owns the rest)
    wan_fallback: bool = False  # P-RLD-MD whose WAN transfer failed: the relay finishes it
    last_progress: float = field(default_factory=time.monotonic)
    check_queued: bool = False  # a CHECK waits in ``control`` (the watchdog queues one at a time)
    finished: bool = False  # the last token went to the client
    playout: Playout | None = None  # the relay's last tokens before a handover, paced (router/playout.py)
