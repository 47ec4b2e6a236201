"""Per-request latency by output position, the one timing rule of every benchmark comparison.

A streamed chunk may carry several tokens (the router flushes what it has; a baseline that holds its
first token sends positions 0 and 1 together). Timing by chunk would then put a setup's "second
token" one position off. So every figure here is read from the arrival time of each output position
(``Stream.token_times()``): TTFT = position 0, TT2 = position 1, gaps between consecutive positions.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

STALL_AROUND = 2  # positions either side of the handover whose gaps count (catch-up spreads the switch)


@dataclass(frozen=True)
class PositionTimes:
    t_send: float
    times: list[float]  # arrival of output position i (perf_counter seconds)

    @property
    def ttft(self) -> float | None:
        return self.times[0] - self.t_send if self.times else None

    @property
    def tt2(self) -> float | None:
        return self.times[1] - self.t_send if len(self.times) > 1 else None

    @property
    def e2e(self) -> float | None:
        return self.times[-1] - self.t_send if self.times else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:])]

    @property
    def mean_itl(self) -> float | None:
        """Decode pace after the first token: (last - first) / (positions - 1)."""
        if len(self.times) < 2:
            return None
        return (self.times[-1] - self.times[0]) / (len(self.times) - 1)

    def stall(self, handover: int, around: int = STALL_AROUND) -> float | None:
        """The handoff stall: the largest gap into positions ``handover`` +- ``around`` (``handover``: main
        decode's first position, after the relay's last) over the request's median gap. 1 for an even stream,
        large where ownership moved with a visible pause. Position 1 (TT2: prefill to relay) never counts: it
        is no handoff. A median of 0 (most positions arrive several per chunk) falls back to the mean gap, so
        the ratio stays defined; None when the stream is too short or never reached the handover."""
        gaps = self.gaps
        first, last = max(2, handover - around), min(len(self.times) - 1, handover + around)
        if len(gaps) < 3 or first > last:
            return None
        typical = statistics.median(gaps) or statistics.fmean(gaps)
        return max(gaps[first - 1:last]) / typical if typical > 0 else None
