"""One instance's prefix cache in the simulator: LRU over block-hash chains, bounded by the instance's KV.

Why this model: the engines' radix caches key whole-prefix block hashes (an id stands for its whole prefix,
as a trace's ``hash_ids`` do), keep what finished requests computed, and evict least recently used leaves
first when memory runs short. Touching a chain from its last block to its first keeps every parent more
recent than its children, so plain LRU evicts leaves first and never strands a child without its parent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockCache:
    """Blocks held by one instance; ``capacity`` (in blocks) may shrink while requests hold memory."""

    __slots__ = ("blocks", "capacity", "evicted")

    def __init__(self, capacity: int) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.capacity = max(0, int(capacity))
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, chain: Sequence[int]) -> int:
        """Leading blocks of ``chain`` held here."""
        held = self.blocks
        k = 0
        for h in chain:
            if h not in held:
                break
            k += 1
        return k

    def insert(self, chain: Sequence[int]) -> None:
        """The chain is now held, most recently used; the least recently used leaves go if over capacity."""
        if self.capacity <= 0:
            return
        held = self.blocks
        for h in reversed(chain[: self.capacity]):
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
        self.shrink(self.capacity)

    def shrink(self, capacity: int) -> None:
        """Set the capacity (memory running requests now hold is not cache) and evict down to it."""
        self.capacity = max(0, int(capacity))
        held = self.blocks
        while len(held) > self.capacity:
            held.popitem(last=False)
            self.evicted += 1
