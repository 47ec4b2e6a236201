"""The router's playout buffer: the relay's last tokens before a handover, paced so the switch shows no pause.

Main decode's first token follows the relay's last by the hop, the rest of main decode's running step (none when
main decode is idle) and one more step: (1 + U + h) of the stream's gaps, U in [0, 1) because the two step clocks
are independent, h the hop over a step (~0.15; docs/BENCHMARKS.md, "The handoff stall"). Released as they come,
the relay's tokens leave that whole pause in one gap. The relay names its boundary two tokens ahead
(roles/relay.py, ``BOUNDARY_AHEAD``), so the router can spread the two relay gaps and the pause evenly over three:
each (2 + G) / 3 gaps, G the handover's cost in gaps. G is known only once main decode's token is there, so the
router releases the held tokens ``stretch`` = (2 + G90) / 3 gaps apart, G90 the 90th percentile of the last
handovers' costs (``HandoverCosts``: an adaptive playout delay, as a VoIP jitter buffer adapts to its jitter).
Before any handover was seen, and at most: the busy case's (2 + 1 + 1 + h) / 3; at least 1 (no slower than the
relay itself).

Nothing waits for a held token longer than it must: main decode's first token (or any finish, error, migration)
releases what is held at once, ahead of itself, so main decode's tokens and the request's end are never delayed.
Positions 0 and 1 (TTFT, TT2) are never held.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from pdd.loadgen.stats import pct
from pdd.shared.protocol import TokenLogprobs

HOP_OVER_STEP = 0.15  # h above: the handover's hop over a decode step (spans of the emulated runs)
MAX_STRETCH = (4 + HOP_OVER_STEP) / 3  # main decode busy (U -> 1): a longer pause is not the step clocks' phase
COST_WINDOW = 32  # handovers whose cost sets the stretch
GAP_WEIGHT = 0.25  # the gap estimate's exponential weight per emission
FIRST_HELD_POSITION = 2  # TTFT (0) and TT2 (1) are never held

Release = Callable[[list[int], list[TokenLogprobs]], None]


class HandoverCosts:
    """The router's last handovers: main decode's first token after the relay's last, in the stream's gaps."""

    def __init__(self) -> None:
        self._costs: deque[float] = deque(maxlen=COST_WINDOW)

    def record(self, cost: float) -> None:
        self._costs.append(cost)

    def stretch(self) -> float:
        """Gaps between the held tokens' releases: the two relay gaps and the 90th-percentile cost in three."""
        p90 = pct(list(self._costs), 90)
        return MAX_STRETCH if p90 is None else min(MAX_STRETCH, max(1.0, (2 + p90) / 3))


class Playout:
    """One request's playout buffer. ``release`` emits tokens to the client (the orchestrator's ``_emit``)."""

    def __init__(self, release: Release, costs: HandoverCosts) -> None:
        self._release = release
        self._costs = costs
        self.gap = 0.0  # the stream's per-token gap while the relay owns it (0: not known yet)
        self._last = 0.0  # when the last token went to the client (time.monotonic())
        self._held: list[tuple[list[int], list[TokenLogprobs]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._stretch = MAX_STRETCH
        self._boundary_arrival = 0.0  # when the relay's last held token came (0: none held yet)

    @property
    def held(self) -> int:
        """Tokens held now (their positions follow the ones already emitted)."""
        return sum(len(tokens) for tokens, _ in self._held)

    def emitted(self, now: float, start: int, count: int) -> None:
        """``count`` tokens from position ``start`` went to the client at ``now``: the gap estimate learns."""
        if not self._boundary_arrival and start >= FIRST_HELD_POSITION and self._last > 0 and count:
            gap = (now - self._last) / count
            self.gap = gap if self.gap == 0 else self.gap + GAP_WEIGHT * (gap - self.gap)
        self._last = now

    def hold(self, tokens: list[int], logprobs: list[TokenLogprobs], start: int, boundary: int | None) -> bool:
        """Whether these tokens (the relay's, from position ``start``) wait for their paced release: the relay has
        named its boundary, they end at or before it, and the stream's gap is known."""
        if boundary is None or not tokens or start < FIRST_HELD_POSITION or start + len(tokens) - 1 > boundary:
            return False
        if self.gap <= 0:
            return False
        if not self._boundary_arrival:
            self._stretch = self._costs.stretch()
        self._boundary_arrival = time.monotonic()
        self._held.append((tokens, logprobs))
        if self._timer is None:
            self._schedule()
        return True

    def flush(self, took_over: bool = False) -> None:
        """Release everything held now: main decode's first token is here (``took_over``: its cost is recorded),
        or a finish, a migration."""
        if took_over and self._boundary_arrival > 0 and self.gap > 0:
            self._costs.record((time.monotonic() - self._boundary_arrival) / self.gap)
            self._boundary_arrival = -1.0  # recorded once; still nonzero, so the gap estimate stays frozen
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held, self._held = self._held, []
        for tokens, logprobs in held:
            self._release(tokens, logprobs)

    def close(self) -> None:
        """The request ended: drop what is held (it reached the client or never will)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._held = []

    def _schedule(self) -> None:
        count = len(self._held[0][0])
        delay = self._last + self._stretch * self.gap * count - time.monotonic()
        self._timer = asyncio.get_running_loop().call_later(max(0.0, delay), self._release_next)

    def _release_next(self) -> None:
        self._timer = None
        if not self._held:
            return
        tokens, logprobs = self._held.pop(0)
        self._release(tokens, logprobs)
        self._last = time.monotonic()
        if self._held:
            self._schedule()
