"""A rejected or cancelled transfer must not wedge the link for the transfers after it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.transports.conftest import PLUGINS, Pair, layout_for


@pytest.mark.parametrize("plugin", [p for p in PLUGINS if p != "inproc"])
async def test_link_keeps_serving_after_rejected_and_cancelled_sends(plugin: str) -> None:
    layout = layout_for("float32")
    async with Pair(plugin, layout, sender_opts={"max_frame_bytes": 256, "window_bytes": 1024}) as pair:
        # 1. frames for a request the receiver no longer expects (e.g. MD dropped it): rejected
        with pytest.raises(Exception):
            await pair.sender.send(pair.peer, "gone", list(range(12)), list(range(12)))
        # 2. a send cancelled half-way (e.g. the request was cancelled while its KV was moving)
        handle = pair.receiver.expect("cut", list(range(12)), timeout_s=5)
        task = asyncio.create_task(pair.sender.send(pair.peer, "cut", list(range(12)), list(range(12))))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pair.receiver.cancel("cut")
        await asyncio.gather(handle.wait(), return_exceptions=True)
        # 3. the next transfer on the same link completes, bit-exact
        handle = pair.receiver.expect("next", [20, 21, 22], timeout_s=10)
        stats = await asyncio.wait_for(pair.sender.send(pair.peer, "next", [3, 4, 5], [20, 21, 22]), 10)
        await asyncio.wait_for(handle.wait(), 10)
        assert stats.bytes > 0
        for layer in range(layout.num_layers):
            assert torch.equal(pair.dst_pool[0][layer][20:23], pair.src_pool[0][layer][3:6])


@pytest.mark.parametrize("plugin", [p for p in PLUGINS if p != "inproc"])
async def test_second_link_to_the_same_receiver_gets_its_acknowledgements(plugin: str) -> None:
    """A sender that reconnects (e.g. after a failure) must not collide with its old link."""
    layout = layout_for("float32")
    async with Pair(plugin, layout) as pair:
        second = await pair.sender.connect(pair.receiver.descriptor())
        for peer, rid, dst in ((second, "via-new", [7, 8]), (pair.peer, "via-old", [9, 10])):
            handle = pair.receiver.expect(rid, dst, timeout_s=10)
            await asyncio.wait_for(pair.sender.send(peer, rid, [1, 2], dst), 10)
            await asyncio.wait_for(handle.wait(), 10)
        await pair.sender.disconnect(second)
