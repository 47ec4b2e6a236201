"""Which instance holds how much of a prompt: fed by the engines' cache events over NATS.

Keys are the engines' chained block hashes (``prefix_block_hashes``), so equal hashes mean equal
whole prefixes and an instance's overlap is the number of leading hashes it holds. An instance
whose events the router has not seen yet is "cold": the caller asks it directly (CacheQuery).
"""

from __future__ import annotations

from pdd.shared.block_hash import prefix_block_hashes
from pdd.shared.bus import Bus, Envelope
from pdd.shared.protocol import CacheEvents, Message


class PrefixIndex:
    def __init__(self) -> None:
        self._blocks: dict[str, set[int]] = {}

    async def start(self, bus: Bus) -> None:
        await bus.subscribe("pdd.cache.*", self._on_events, expect=CacheEvents)

    async def _on_events(self, message: Message, _: Envelope) -> None:
        assert isinstance(message, CacheEvents)
        self.apply(message)

    def apply(self, events: CacheEvents) -> None:
        blocks = self._blocks.setdefault(events.instance_id, set())
        if events.cleared:
            blocks.clear()
        blocks.update(events.stored)
        blocks.difference_update(events.removed)

    def knows(self, instance_id: str) -> bool:
        return instance_id in self._blocks

    def overlap_tokens(self, instance_id: str, hashes: list[int], block_size: int) -> int:
        held = self._blocks.get(instance_id)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n * block_size

    @staticmethod
    def hashes(prompt_ids: list[int], block_size: int) -> list[int]:
        return prefix_block_hashes(prompt_ids, block_size)
