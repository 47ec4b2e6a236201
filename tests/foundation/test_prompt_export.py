"""``PromptExport`` (roles/kv_export.py), the blocks P's streamed export hands its senders: unit tests."""

from __future__ import annotations

import asyncio

import pytest

from pdd.roles.kv_export import ExportEnded, ExportMoved, PromptExport


def test_blocks_grow_and_must_keep_their_ids() -> None:
    export = PromptExport(3)
    export.update([4, 5])
    assert export.ready() == [4, 5] and not export.done
    export.update([4, 5, 9], done=True)
    assert export.ready() == [4, 5, 9] and export.done
    moved = PromptExport(2)
    moved.update([1])
    moved.update([2, 3])  # preempted: the first block changed under the send
    with pytest.raises(ExportMoved):
        moved.ready()


async def test_close_stops_a_sender_that_waits_for_blocks() -> None:
    """The request ended before the prefill finished its blocks: a sender waiting for more (one that missed
    its own cancellation) wakes and stops, so P's release is never stuck behind it."""
    export = PromptExport(4)
    export.update([1])
    wake = export.listen()

    async def sender() -> None:
        while True:
            wake.clear()
            if len(export.ready()) == export.total_blocks:
                return
            await wake.wait()

    task = asyncio.create_task(sender())
    await asyncio.sleep(0.01)
    assert not task.done()
    export.close()
    with pytest.raises(ExportEnded):
        await asyncio.wait_for(task, 1)
