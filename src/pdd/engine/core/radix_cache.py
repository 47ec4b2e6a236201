"""Radix prefix cache over block-aligned token keys (serves P and MD's Decode-side RadixCache).

Edges hold whole blocks of tokens and the matching KV block ids; nodes split only on block
boundaries. The cache holds one allocator reference per block it stores; requests lock the
node path they use so LRU eviction (unlocked leaves first) never takes KV that is being read.
Each stored/removed block is reported as an event keyed by a chained block hash, so a router
can mirror which prefixes an instance holds without asking it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from pdd.engine.core.kv_pool import BlockAllocator
from pdd.shared.block_hash import ROOT_HASH, block_hash


@dataclass
class CacheEvent:
    kind: str  # "stored" | "removed"
    block_hash: int
    parent_hash: int = ROOT_HASH
    token_ids: tuple[int, ...] = ()


_clock = itertools.count()


class RadixNode:
    __slots__ = ("key", "blocks", "hashes", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...], blocks: list[int], hashes: list[int], parent: "RadixNode | None") -> None:
        self.key = key
        self.blocks = blocks
        self.hashes = hashes
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = next(_clock)

    @property
    def parent_hash(self) -> int:
        p = self.parent
        return p.hashes[-1] if p is not None and p.hashes else ROOT_HASH


@dataclass
class CacheStats:
    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass
class MatchResult:
    num_tokens: int
    blocks: list[int]
    node: RadixNode
    hashes: list[int] = field(default_factory=list)


class RadixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_events: int = 100_000) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.root = RadixNode((), [], [], None)
        self.root.lock_ref = 1  # never evicted
        self.stats = CacheStats()
        self._events: deque[CacheEvent] = deque(maxlen=max_events)
        self.cached_blocks = 0
        self.evictable_blocks = 0

    # ---- lookup -------------------------------------------------------------------------
    def _walk(self, token_ids: list[int], split: bool) -> tuple[int, list[int], RadixNode]:
        bs = self.block_size
        n_blocks = len(token_ids) // bs
        node, pos, blocks = self.root, 0, []
        while pos < n_blocks * bs:
            child = node.children.get(tuple(token_ids[pos : pos + bs]))
            if child is None:
                break
            k = 1  # first block matched by the dict key
            max_k = min(len(child.blocks), n_blocks - pos // bs)
            while k < max_k and tuple(token_ids[pos + k * bs : pos + (k + 1) * bs]) == child.key[k * bs : (k + 1) * bs]:
                k += 1
            if k < len(child.blocks):
                if not split:
                    blocks.extend(child.blocks[:k])
                    pos += k * bs
                    return pos, blocks, node
                child = self._split(child, k)
            blocks.extend(child.blocks)
            pos += len(child.key)
            node = child
        return pos, blocks, node

    def match(self, token_ids: list[int], record: bool = True) -> MatchResult:
        """Longest cached block-aligned prefix; splits an edge so the result ends on a node."""
        pos, blocks, node = self._walk(token_ids, split=True)
        touch = next(_clock)
        n = node
        while n is not None:
            n.last_access = touch
            n = n.parent
        if record:
            self.stats.queries += 1
            self.stats.query_tokens += len(token_ids)
            self.stats.hit_tokens += pos
        return MatchResult(pos, blocks, node)

    def match_len(self, token_ids: list[int]) -> int:
        """Cached prefix length without side effects (routing queries)."""
        return self._walk(token_ids, split=False)[0]

    # ---- mutation -----------------------------------------------------------------------
    def _split(self, child: RadixNode, k: int) -> RadixNode:
        bs = self.block_size
        parent = child.parent
        mid = RadixNode(child.key[: k * bs], child.blocks[:k], child.hashes[:k], parent)
        mid.lock_ref = child.lock_ref
        mid.last_access = child.last_access
        parent.children[child.key[:bs]] = mid
        child.key = child.key[k * bs :]
        child.blocks = child.blocks[k:]
        child.hashes = child.hashes[k:]
        child.parent = mid
        mid.children[child.key[:bs]] = child
        return mid

    def insert(self, token_ids: list[int], blocks: list[int]) -> int:
        """Store the full blocks of token_ids (KV in ``blocks``); returns the length already cached.

        The cache takes its own reference on newly stored blocks; the caller keeps (and later
        drops) its references, so duplicates of an already cached prefix are freed by the caller.
        """
        bs = self.block_size
        n_blocks = min(len(token_ids) // bs, len(blocks))
        token_ids = token_ids[: n_blocks * bs]
        pos, _, node = self._walk(token_ids, split=True)
        if pos < n_blocks * bs:
            first = pos // bs
            new_blocks = list(blocks[first:n_blocks])
            key = tuple(token_ids[pos:])
            hashes, parent_hash = [], node.hashes[-1] if node.hashes else ROOT_HASH
            for i in range(len(new_blocks)):
                parent_hash = block_hash(parent_hash, key[i * bs : (i + 1) * bs])
                hashes.append(parent_hash)
            leaf = RadixNode(key, new_blocks, hashes, node)
            node.children[key[:bs]] = leaf
            self.allocator.incref(new_blocks)
            self.cached_blocks += len(new_blocks)
            self.evictable_blocks += len(new_blocks)
            prev = leaf.parent_hash
            for i, h in enumerate(hashes):
                self._events.append(CacheEvent("stored", h, prev, key[i * bs : (i + 1) * bs]))
                prev = h
            node = leaf
        touch = next(_clock)
        while node is not None:
            node.last_access = touch
            node = node.parent
        return pos

    def lock(self, node: RadixNode) -> None:
        while node is not None:
            if node.lock_ref == 0:
                self.evictable_blocks -= len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_blocks += len(node.blocks)
            if node.lock_ref < 0:
                raise RuntimeError("radix cache unlock without lock")
            node = node.parent

    def evict(self, num_blocks: int) -> int:
        """Free at least num_blocks blocks from unlocked leaves, least recently used first."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, node = heapq.heappop(heap)
            freed += self._remove_leaf(node)
            parent = node.parent
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _remove_leaf(self, node: RadixNode) -> int:
        del node.parent.children[node.key[: self.block_size]]
        prev = node.parent_hash
        for h in node.hashes:
            self._events.append(CacheEvent("removed", h, prev))
            prev = h
        self.cached_blocks -= len(node.blocks)
        self.evictable_blocks -= len(node.blocks)
        before = self.allocator.num_free
        self.allocator.decref(node.blocks)
        return self.allocator.num_free - before

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                out.append(n)
        return out

    def clear(self) -> None:
        """Evict everything unlocked."""
        self.evict(self.cached_blocks + 1)

    def drain_events(self) -> list[CacheEvent]:
        out = list(self._events)
        self._events.clear()
        return out
