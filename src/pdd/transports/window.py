"""The sender's acknowledgement window, shared by the socket plugins (zmq streams, ucx links)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from .errors import TransferError


@dataclass(kw_only=True)
class AckWindow:
    """Frames sent but not yet acknowledged: bounded in bytes, so a slow receiver pushes back."""

    inflight: dict[int, tuple[asyncio.Future, int]] = field(default_factory=dict)
    inflight_bytes: int = 0
    next_seq: int = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def fail_all(self, exc: TransferError) -> None:
        for fut, _ in self.inflight.values():
            if not fut.done():
                fut.set_exception(exc)
        self.inflight.clear()
        self.inflight_bytes = 0
        self.released.set()

    def forget(self, seqs: list[int]) -> None:
        """Give the window back for frames a failed or cancelled send leaves unacknowledged."""
        for seq in seqs:
            entry = self.inflight.pop(seq, None)
            if entry is not None:
                self.inflight_bytes -= entry[1]
                self.released.set()
                if not entry[0].done():
                    entry[0].cancel()
