"""A peer killed (SIGKILL) mid-transfer: both sides fail clearly, nothing hangs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdd.transports import PeerLostError, TransferError, create_transport

from .conftest import PLUGINS
from .peer_proc import BLOCKS, LAYOUT, pool

HELPER = str(Path(__file__).with_name("peer_proc.py"))
GUARD_S = 30  # hang guard only; failures are expected within the transports' own timeouts
SOCKET_PLUGINS = [p for p in PLUGINS if getattr(p, "values", [p])[0] != "inproc"]


@pytest.mark.parametrize("plugin", SOCKET_PLUGINS)
async def test_sender_killed_mid_transfer(plugin: str) -> None:
    rx = create_transport(plugin)
    await rx.start()
    rx.register(LAYOUT, *pool())
    handle = rx.expect("victim", list(range(BLOCKS)), timeout_s=120)
    proc = await asyncio.create_subprocess_exec(sys.executable, HELPER, "sender", plugin, json.dumps(rx.descriptor()),
                                                stdout=subprocess.PIPE)
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), GUARD_S)
        assert line.strip() == b"HALF"
        with pytest.raises(PeerLostError, match="disconnected"):
            await asyncio.wait_for(handle.wait(), GUARD_S)
        assert await proc.wait() == -9
    finally:
        if proc.returncode is None:
            proc.kill()
        await rx.close()


@pytest.mark.parametrize("plugin", SOCKET_PLUGINS)
async def test_receiver_killed_mid_transfer(plugin: str) -> None:
    proc = await asyncio.create_subprocess_exec(sys.executable, HELPER, "receiver", plugin, stdout=subprocess.PIPE)
    tx = create_transport(plugin, {"ack_timeout_s": 10.0, "max_frame_bytes": 256, "window_bytes": 512})
    await tx.start()
    try:
        desc = json.loads(await asyncio.wait_for(proc.stdout.readline(), GUARD_S))
        tx.register(LAYOUT, *pool())
        peer = await tx.connect(desc)
        with pytest.raises(TransferError) as info:
            await asyncio.wait_for(tx.send(peer, "victim", list(range(BLOCKS)), list(range(BLOCKS))), GUARD_S)
        assert isinstance(info.value, PeerLostError)
        assert await proc.wait() == -9
    finally:
        if proc.returncode is None:
            proc.kill()
        await tx.close()
