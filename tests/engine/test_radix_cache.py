"""Radix cache unit tests (match/insert/split/evict/lock/events) and an engine-level leak test."""

from __future__ import annotations

import random

from pdd.engine import SamplingParams
from pdd.engine.core.kv_pool import BlockAllocator
from pdd.engine.core.radix_cache import RadixCache
from pdd.shared.block_hash import prefix_block_hashes

from .conftest import make_engine

BS = 2


def _cache(n=32):
    alloc = BlockAllocator(n)
    return alloc, RadixCache(alloc, BS)


def _store(alloc, cache, tokens):
    """Like a finishing request: allocate, insert, drop own refs. Returns the already-cached length."""
    blocks = alloc.allocate(len(tokens) // BS)
    done = cache.insert(tokens, blocks)
    alloc.decref(blocks)
    return done


def test_match_insert_split():
    alloc, cache = _cache()
    assert _store(alloc, cache, [1, 2, 3, 4, 5, 6]) == 0
    assert cache.match_len([1, 2, 3, 4, 5, 6, 7]) == 6
    assert cache.match_len([1, 2, 3, 9]) == 2  # block aligned: [3, 9] differs
    assert cache.match_len([1]) == 0  # a partial block never matches
    # inserting a diverging sequence splits the edge at the block boundary
    assert _store(alloc, cache, [1, 2, 3, 4, 7, 8]) == 4
    assert set(cache.root.children) == {(1, 2)}
    mid = cache.root.children[(1, 2)]
    assert mid.key == (1, 2, 3, 4) and len(mid.children) == 2
    m = cache.match([1, 2, 3, 4, 7, 8, 0])
    assert m.num_tokens == 6 and len(m.blocks) == 3
    assert cache.cached_blocks == 4 and alloc.num_free == 32 - 4
    assert cache.stats.hit_tokens == 6 and cache.stats.queries == 1


def test_match_splits_inside_an_edge_and_lock_blocks_eviction():
    alloc, cache = _cache()
    _store(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    m = cache.match([1, 2, 3, 4, 0, 0])
    assert m.num_tokens == 4 and m.node.key == (1, 2, 3, 4)
    cache.lock(m.node)
    assert cache.evictable_blocks == 2  # only the unlocked tail [5..8]
    cache.evict(100)
    assert cache.match_len([1, 2, 3, 4, 5, 6, 7, 8]) == 4  # locked prefix survived
    cache.unlock(m.node)
    cache.evict(100)
    assert cache.cached_blocks == 0 and alloc.num_free == 32


def test_lru_eviction_order_and_events():
    alloc, cache = _cache()
    _store(alloc, cache, [1, 1, 1, 1])
    _store(alloc, cache, [2, 2, 2, 2])
    cache.match([1, 1, 1, 1])  # touch: [2,2,..] is now least recently used
    events = cache.drain_events()
    assert [e.kind for e in events] == ["stored"] * 4
    assert events[1].block_hash == prefix_block_hashes([1, 1, 1, 1], BS)[1]
    assert events[1].parent_hash == events[0].block_hash
    freed = cache.evict(1)
    assert freed == 2
    assert cache.match_len([2, 2, 2, 2]) == 0 and cache.match_len([1, 1, 1, 1]) == 4
    removed = cache.drain_events()
    assert {e.kind for e in removed} == {"removed"}
    assert {e.block_hash for e in removed} == set(prefix_block_hashes([2, 2, 2, 2], BS))


def test_duplicate_insert_frees_duplicates():
    alloc, cache = _cache()
    _store(alloc, cache, [1, 2, 3, 4])
    assert _store(alloc, cache, [1, 2, 3, 4]) == 4
    assert alloc.num_free == 30


def test_random_tree_operations_keep_refcounts_consistent():
    rng = random.Random(0)
    alloc, cache = _cache(64)
    locked = []
    for _ in range(400):
        seq = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        op = rng.random()
        if op < 0.5 and len(seq) // BS <= alloc.num_free:
            _store(alloc, cache, seq)
        elif op < 0.7:
            m = cache.match(seq)
            cache.lock(m.node)
            locked.append(m.node)
        elif op < 0.85 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            cache.evict(rng.randrange(1, 6))
        assert alloc.num_free + cache.cached_blocks == 64
    for node in locked:
        cache.unlock(node)
    cache.clear()
    assert alloc.num_free == 64 and cache.cached_blocks == 0 and cache.evictable_blocks == 0


def test_thousand_random_requests_with_aborts_leave_no_leak(llama_path):
    """1,000 requests with shared prefixes, a small pool (evictions, preemption) and random
    aborts (queued, mid-prefill, decoding, held, importing): afterwards every block is free."""
    rng = random.Random(42)
    engine = make_engine(llama_path, num_blocks=48, max_num_seqs=12, max_prefill_tokens=40)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 24))] for _ in range(6)]
    live: list[str] = []
    submitted = 0
    while submitted < 1000 or engine.has_work():
        if submitted < 1000 and rng.random() < 0.7:
            rid = f"q{submitted}"
            prompt = rng.choice(prefixes)[: rng.randrange(1, 25)] + [rng.randrange(50) for _ in range(rng.randrange(0, 8))]
            kind = rng.random()
            if kind < 0.1:
                try:
                    engine.prepare_import(rid, prompt)
                    live.append(rid)
                except Exception:  # noqa: BLE001 - OutOfBlocks is expected sometimes
                    pass
            else:
                params = SamplingParams(temperature=rng.choice([0.0, 0.7]), seed=submitted)
                engine.add_request(rid, prompt, params, max_new_tokens=rng.randrange(1, 6), hold_kv=kind > 0.9)
                live.append(rid)
            submitted += 1
        if live and rng.random() < 0.15:
            engine.abort(live.pop(rng.randrange(len(live))))
        for o in engine.step():
            if o.finished and o.rid in engine.requests:  # held: release or abort later
                (engine.release if rng.random() < 0.5 else engine.abort)(o.rid)
        if not engine.scheduler.running and not engine.scheduler.waiting and submitted >= 1000:
            break
    for rid in list(engine.requests):
        engine.abort(rid)
    assert not engine.requests
    assert engine.num_free_blocks() + engine.cache.cached_blocks == engine.num_total_blocks()
    assert engine.cache.stats.hit_tokens > 0
    engine.cache.clear()
    assert engine.num_free_blocks() == engine.num_total_blocks()
    assert all(rc == 0 for rc in engine.pool.allocator.refcount)
