"""Round trips of random block maps over every plugin: bit-exact, untouched blocks stay untouched."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from pdd.transports import IncompatiblePeerError, RemoteRejected, TransferCancelled, TransferTimeout, create_transport

from .conftest import PLUGINS, Pair, layout_for, make_pool, snapshot, unchanged


def assert_moved(pair: Pair, src: list[int], dst: list[int], before: list[torch.Tensor]) -> None:
    L = pair.layout.num_layers
    dst_set = set(dst)
    for i, (s_t, d_t) in enumerate(zip(pair.src_pool[0] + pair.src_pool[1], pair.dst_pool[0] + pair.dst_pool[1])):
        for s, d in zip(src, dst):
            assert torch.equal(d_t[d].view(torch.uint8), s_t[s].view(torch.uint8)), (i % L, s, d)
        for b in range(d_t.shape[0]):
            if b not in dst_set:
                assert torch.equal(d_t[b], before[i][b]), f"block {b} outside the map was modified"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("plugin", PLUGINS)
async def test_random_block_maps_round_trip(plugin: str, dtype: str) -> None:
    rng = random.Random(hash((plugin, dtype)) & 0xFFFF)
    async with Pair(plugin, layout_for(dtype), sender_opts={"max_frame_bytes": 512}) as pair:
        for r in range(3):
            n = rng.randint(1, 12)
            src = rng.sample(range(24), n)
            dst = rng.sample(range(32), n)
            before = snapshot(pair.dst_pool)
            handle = pair.receiver.expect(f"req-{r}", dst, timeout_s=30)
            stats = await pair.sender.send(pair.peer, f"req-{r}", src, dst)
            got = await handle
            expected = 2 * pair.layout.num_layers * n * pair.layout.bytes_per_block_per_tensor
            assert stats.bytes == got.bytes == expected
            assert stats.gbps >= 0
            assert_moved(pair, src, dst, before)


@pytest.mark.parametrize("plugin", PLUGINS)
async def test_layer_by_layer_sends_complete_one_handle(plugin: str) -> None:
    async with Pair(plugin, layout_for("float16", layers=4)) as pair:
        src, dst = [3, 4, 5, 20], [0, 9, 1, 31]
        before = snapshot(pair.dst_pool)
        handle = pair.receiver.expect("r", dst)
        for layer in range(4):  # as a prefill would, overlapping with compute
            await pair.sender.send(pair.peer, "r", src, dst, layers=range(layer, layer + 1))
            assert (layer == 3) == handle.done()
        await handle
        assert_moved(pair, src, dst, before)


@pytest.mark.parametrize("plugin", PLUGINS)
async def test_streamed_chunks_out_of_order_complete_one_import(plugin: str) -> None:
    """A streamed export's chunks (a send per prefill chunk, overlapping) may land in any order: the import
    completes once the last block is in, with every byte where it belongs."""
    async with Pair(plugin, layout_for("bfloat16")) as pair:
        src, dst = list(range(2, 14)), [30, 1, 7, 8, 9, 22, 23, 0, 5, 6, 17, 11]
        chunks = [(src[i:i + 4], dst[i:i + 4]) for i in range(0, 12, 4)]
        before = snapshot(pair.dst_pool)
        handle = pair.receiver.expect("streamed", dst)
        await pair.sender.send(pair.peer, "streamed", *chunks[2])  # the last chunk first
        assert not handle.done()
        await asyncio.gather(*(pair.sender.send(pair.peer, "streamed", s, d) for s, d in chunks[:2]))
        got = await handle
        assert got.bytes == 2 * pair.layout.num_layers * 12 * pair.layout.bytes_per_block_per_tensor
        assert_moved(pair, src, dst, before)


@pytest.mark.parametrize("plugin", PLUGINS)
async def test_a_lost_chunk_fails_the_import_and_a_late_one_writes_nothing(plugin: str) -> None:
    """A chunk that never comes fails the import at its deadline (the receiver frees its reservation then); the
    chunk arriving after that is refused, and the pool keeps the bytes it had."""
    async with Pair(plugin, layout_for("float16")) as pair:
        src, dst = list(range(8)), list(range(10, 18))
        handle = pair.receiver.expect("lossy", dst, timeout_s=0.5)
        await pair.sender.send(pair.peer, "lossy", src[:4], dst[:4])
        with pytest.raises(TransferTimeout):
            await handle
        before = snapshot(pair.dst_pool)
        with pytest.raises(RemoteRejected):
            await pair.sender.send(pair.peer, "lossy", src[4:], dst[4:])
        assert unchanged(pair.dst_pool, before)


@pytest.mark.parametrize("plugin", PLUGINS)
async def test_concurrent_requests(plugin: str) -> None:
    async with Pair(plugin, layout_for("float32")) as pair:
        maps = [([0, 1, 2], [10, 11, 12]), ([5, 7], [20, 3]), ([9], [0])]
        before = snapshot(pair.dst_pool)
        handles = [pair.receiver.expect(f"c{i}", d) for i, (_, d) in enumerate(maps)]
        await asyncio.gather(*(pair.sender.send(pair.peer, f"c{i}", s, d) for i, (s, d) in enumerate(maps)))
        await asyncio.gather(*handles)
        assert_moved(pair, [b for s, _ in maps for b in s], [b for _, d in maps for b in d], before)


@pytest.mark.parametrize("plugin", PLUGINS)
async def test_layout_mismatch_is_refused_at_connect(plugin: str) -> None:
    a, b = create_transport(plugin), create_transport(plugin)
    await a.start()
    await b.start()
    try:
        a.register(layout_for("float16"), *make_pool(layout_for("float16"), 4, 0))
        b.register(layout_for("bfloat16"), *make_pool(layout_for("bfloat16"), 4, 0))
        with pytest.raises(IncompatiblePeerError, match="layout mismatch"):
            await a.connect(b.descriptor())
        with pytest.raises(IncompatiblePeerError):
            await a.connect({**a.descriptor(), "transport": "other"})
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("plugin", PLUGINS)
async def test_timeout_and_cancel_are_typed(plugin: str) -> None:
    async with Pair(plugin, layout_for()) as pair:
        with pytest.raises(TransferTimeout):
            await pair.receiver.expect("never", [1, 2], timeout_s=0.2)
        h = pair.receiver.expect("gone", [1, 2])
        pair.receiver.cancel("gone")
        with pytest.raises(TransferCancelled):
            await h
        # A late sender for a cancelled request is rejected and writes nothing.
        before = snapshot(pair.dst_pool)
        with pytest.raises(RemoteRejected) as info:
            await pair.sender.send(pair.peer, "gone", [0, 1], [1, 2])
        assert info.value.remote_kind == "UnexpectedFrame"
        assert all(torch.equal(a, b) for a, b in zip(pair.dst_pool[0] + pair.dst_pool[1], before))


async def test_registry_discovers_builtins_and_third_parties() -> None:
    from pdd.transports import KVTransport, available_transports, register_transport
    from pdd.transports.inproc import InprocTransport

    assert {"inproc", "zmq", "ucx"} <= set(available_transports())
    with pytest.raises(KeyError, match="unknown KV transport"):
        create_transport("nope")

    class Mine(InprocTransport):
        name = "mine"

    register_transport("mine", Mine)
    t = create_transport("mine", {"max_frame_bytes": 1024})
    assert isinstance(t, KVTransport) and t.max_frame_bytes == 1024
