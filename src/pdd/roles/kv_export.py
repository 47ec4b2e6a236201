"""P's streamed export: the prompt's blocks whose KV is final, as the prefill computes them chunk by chunk.

P sends each destination the blocks a prefill chunk finished while later chunks compute (Mooncake and
PrfaaS stream layer by layer; PDD streams by chunk, the unit its engines compute in). ``PromptExport`` is
what the engine runner's block watcher fills after every step and what each destination's sender waits on;
``LinkBusy`` measures how long a destination's link carried the request (the sends of several chunks
overlap, and the waits for the prefill between them are not link time); ``Sent`` adds up what they moved.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdd.transports.base import TransferStats

BLOCKS_FINAL_EVENT = "kv.blocks_final"
"""The prefill span's event at each step that made more prompt blocks final, with ``tokens``: how many of the
prompt's tokens have final KV by then. The KV-ready lag's floor is computed from these (bench/pipelines_emulated.py)."""


class ExportMoved(RuntimeError):
    """The prompt's blocks changed under a streamed export (the request was preempted): what was sent may be
    overwritten, so the transfer fails and the fallback runs."""


class ExportEnded(RuntimeError):
    """The request ended (finished at prefill, failed or cancelled) while a destination still waited for blocks."""


class PromptExport:
    """The prompt blocks whose KV is final so far; ``done`` once the prefill has finished."""

    def __init__(self, total_blocks: int) -> None:
        self.total_blocks = total_blocks
        self.blocks: list[int] = []
        self.done = False
        self.error: Exception | None = None
        self._listeners: list[asyncio.Event] = []

    def listen(self) -> asyncio.Event:
        """An event set at every change (a sender clears it before it reads ``ready``, then waits on it)."""
        event = asyncio.Event()
        self._listeners.append(event)
        return event

    def update(self, blocks: list[int], done: bool = False) -> None:
        """More blocks are final (or, ``done``, all of them). Blocks already announced must keep their ids."""
        if blocks[: len(self.blocks)] != self.blocks:
            self.error = self.error or ExportMoved("the prompt's KV blocks moved while they were being sent")
        elif len(blocks) > len(self.blocks):
            self.blocks = list(blocks)
        if done and self.error is None and len(self.blocks) != self.total_blocks:
            self.error = ExportMoved(f"the prefill ended with {len(self.blocks)} blocks, {self.total_blocks} expected")
        self.done = self.done or done
        self._notify()

    def close(self) -> None:
        """The request ended: every sender still waiting for blocks stops. Cancelling the senders is not enough
        on its own: a task whose cancellation was swallowed below it (Python 3.11's ``wait_for``) would wait here
        for blocks that never come, and P would hold the prompt's KV forever."""
        self.error = self.error or ExportEnded("the request ended before its KV was sent")
        self.done = True
        self._notify()

    def ready(self) -> list[int]:
        """The final blocks so far; raises the export's error."""
        if self.error is not None:
            raise self.error
        return self.blocks

    def _notify(self) -> None:
        for event in self._listeners:
            event.set()


class LinkBusy:
    """Seconds during which at least one of a destination's sends was in flight: the transfer's own time, for
    its rate (MD's estimate of the WAN) and its span, without the waits for the prefill between chunks."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._in_flight = 0
        self._since = 0.0

    def begin(self) -> None:
        if self._in_flight == 0:
            self._since = time.monotonic()
        self._in_flight += 1

    def end(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self.seconds += time.monotonic() - self._since


@dataclass
class Sent:
    """What a destination's sends moved: bytes on the wire, the KV they decode to, the codec of each send."""

    wire: int = 0
    kv: int = 0
    codecs: list[str] = field(default_factory=list)

    def add(self, stats: TransferStats) -> None:
        self.wire += stats.bytes
        self.kv += stats.raw_bytes
        self.codecs.append(stats.codec)
