"""A slow WAN link must never kill a zmq transfer that is making progress; a dead one still fails fast.

The link is a real TCP bottleneck: a relay between the sender's DEALER sockets and the receiver's
ROUTER that forwards the sender's bytes at 1 Mbit/s (shared by all connections, 4 KiB at a time)
and the receiver's bytes (acks, heartbeats) at full speed. It buffers little (~16 KiB per
connection), so the backlog queues in the sender's TCP and zmq as behind a slow WAN hop, and the
sender's TCP sees its bytes acknowledged only as they cross. Everything else is the transport's real
zmq sockets.

Why not 20 MB at 1 Mbit/s to the end: that takes ~170 s, over the suite's budget. What broke
transfers is the ratio between how long one message takes to cross and the liveness timeouts (zmq
heartbeat timeout, ``ack_timeout_s``), not the size. So the timeouts are shrunk instead of the link
being slowed further: heartbeat 0.5 s (timeout 1.5 s), ``ack_timeout_s`` 2 s, frames of 256 KiB that
take ~4 s each to cross (two streams share the link). ``test_20mb_at_1mbit_keeps_moving`` runs the
20 MB transfer at 1 Mbit/s for 20 s (13 heartbeat timeouts, 10 ack timeouts) and checks it is alive
and progressing the whole time, then opens the link so that the same transfer finishes and is
compared bit for bit. ``test_transfer_completes_at_1mbit`` moves 1 MiB entirely at 1 Mbit/s (~8.5 s,
each frame longer than both timeouts). Before the fix both failed within ~2 s: the receiver's zmq
heartbeat timeout, which libzmq only resets when a *whole* message part arrives, dropped the live
connection; with only that fixed, the ack wait would still give up on frames still crossing.
``test_dead_link_still_fails_fast``
blackholes the link mid-transfer (no byte in either direction, no FIN): both sides must still fail
with PeerLostError within a few heartbeat timeouts; the one-stream-cut test silences only one of the two
streams. ``test_stuck_receiver_still_times_out``: a
receiver that takes our bytes but never acknowledges (heartbeats still flowing) is still bounded by
``ack_timeout_s``.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Self

import pytest
import torch

from pdd.shared.kv_layout import KVLayout
from pdd.transports import PeerLostError, TransferError, create_transport

from .conftest import make_pool

RATE = 1e6  # bit/s
HEARTBEAT_S = 0.5  # zmq heartbeat timeout 3 x 0.5 s; small enough that a frame outlasts it several times
ACK_TIMEOUT_S = 2.0
FRAME = 256 << 10
OPTS = {"streams": 2, "heartbeat_s": HEARTBEAT_S, "ack_timeout_s": ACK_TIMEOUT_S, "max_frame_bytes": FRAME,
        "connect_timeout_s": 5.0}


def layout(layers: int) -> KVLayout:
    return KVLayout(num_layers=layers, block_size=16, kv_heads=8, head_dim=128, dtype="float16")  # 32 KiB blocks


class SlowLink:
    """Throttling TCP relay: sender -> receiver at ``rate_bps`` (None = unlimited), receiver -> sender
    at full speed; ``cut()`` silently stops both directions (no byte, no FIN), like a dead WAN."""

    def __init__(self, target: str, rate_bps: float | None) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.rate_bps = rate_bps
        self.forwarded = 0  # sender bytes that crossed
        self._free_at = 0.0  # token bucket as a virtual clock, shared by every connection
        self._up = asyncio.Event()
        self._up.set()
        self._tasks: list[asyncio.Task] = []
        self._writers: list[asyncio.StreamWriter] = []
        self.connections: list[asyncio.Event] = []  # per accepted connection (a zmq stream): set while it passes bytes

    async def start(self) -> str:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # inherited by accepted sockets
        listener.bind(("127.0.0.1", 0))
        self._server = await asyncio.start_server(self._accept, sock=listener, limit=4096)
        return f"tcp://127.0.0.1:{listener.getsockname()[1]}"

    def cut(self, connection: int | None = None) -> None:
        """Stop the whole link, or only one of its connections (one stream of the transport)."""
        (self._up if connection is None else self.connections[connection]).clear()

    async def _accept(self, r_cli: asyncio.StreamReader, w_cli: asyncio.StreamWriter) -> None:
        r_srv, w_srv = await asyncio.open_connection(*self.target)
        up = asyncio.Event()
        up.set()
        self.connections.append(up)
        self._writers += [w_cli, w_srv]
        self._tasks += [asyncio.create_task(self._pump(r_cli, w_srv, up, slow=True)),
                        asyncio.create_task(self._pump(r_srv, w_cli, up, slow=False))]

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: asyncio.Event,
                    slow: bool) -> None:
        try:
            while True:
                await self._up.wait()
                await up.wait()
                data = await reader.read(4096 if slow and self.rate_bps else 1 << 16)
                if not data:
                    break
                if slow and self.rate_bps:
                    now = time.monotonic()
                    self._free_at = max(now, self._free_at) + len(data) * 8 / self.rate_bps
                    await asyncio.sleep(self._free_at - now)
                await self._up.wait()
                await up.wait()
                writer.write(data)
                await writer.drain()
                if slow:
                    self.forwarded += len(data)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            if self._up.is_set() and up.is_set():  # a cut link passes on nothing, not even a close
                writer.close()

    async def close(self) -> None:
        self._server.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self._writers:
            w.close()


class SlowPair:
    """zmq sender and receiver whose link runs through a SlowLink."""

    def __init__(self, layers: int, blocks: int, rate_bps: float | None = RATE, **opts) -> None:
        self.layout, self.blocks = layout(layers), blocks
        self.sender = create_transport("zmq", {**OPTS, **opts})
        self.receiver = create_transport("zmq", {**OPTS, **opts})
        self.src, self.dst = make_pool(self.layout, blocks, seed=1), make_pool(self.layout, blocks, seed=2)
        self.rate_bps = rate_bps
        self.nbytes = 2 * layers * blocks * self.layout.bytes_per_block_per_tensor
        self._tasks: list[asyncio.Future] = []

    async def __aenter__(self) -> Self:
        await self.sender.start()
        await self.receiver.start()
        self.sender.register(self.layout, *self.src)
        self.receiver.register(self.layout, *self.dst)
        desc = self.receiver.descriptor()
        self.link = SlowLink(desc["address"], self.rate_bps)
        self.peer = await self.sender.connect({**desc, "address": await self.link.start()})
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sender.close()  # ends a send still running (PeerLostError) and a handle still waiting
        await self.receiver.close()
        await self.link.close()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=10)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def start_transfer(self, rid: str) -> tuple[asyncio.Task, asyncio.Task]:
        blocks = list(range(self.blocks))
        handle = self.receiver.expect(rid, blocks, timeout_s=600)  # the deadline is never what ends a test
        send = asyncio.create_task(self.sender.send(self.peer, rid, blocks, blocks))
        recv = asyncio.ensure_future(handle.wait())
        self._tasks += [send, recv]
        return send, recv

    def landed(self) -> int:
        """Blocks (per layer and K/V) already written bit-exact on the receiver."""
        return sum(int((d == s).flatten(1).all(1).sum()) for d, s in zip(self.dst[0] + self.dst[1],
                                                                         self.src[0] + self.src[1]))

    def intact(self) -> bool:
        return all(torch.equal(d, s) for d, s in zip(self.dst[0] + self.dst[1], self.src[0] + self.src[1]))


async def _alive(send: asyncio.Task, recv: asyncio.Task, what: str) -> None:
    """Fail with the transfer's own error if either side has ended."""
    for task in (send, recv):
        if task.done():
            await task  # raises the transport's error
            pytest.fail(f"{what}: transfer ended early")


async def test_20mb_at_1mbit_keeps_moving() -> None:
    async with SlowPair(layers=4, blocks=80) as pair:  # 2 x 4 x 80 x 32 KiB = 20 MiB, 80 frames
        assert pair.nbytes == 20 << 20
        send, recv = pair.start_transfer("big")
        window_s, samples = 20.0, []
        t0 = time.monotonic()
        while (elapsed := time.monotonic() - t0) < window_s:
            await asyncio.sleep(1.0)
            await _alive(send, recv, f"after {elapsed:.1f}s at 1 Mbit/s")
            samples.append((time.monotonic() - t0, pair.link.forwarded, pair.landed()))
        # moving the whole time, at about the link rate; frames keep landing
        for (_, b0, _), (_, b1, _) in zip(samples, samples[4:]):
            assert b1 > b0, f"no byte crossed in a 4 s window: {samples}"
        t_end, crossed, landed = samples[-1]
        assert 0.6 * RATE * t_end / 8 < crossed < 1.3 * RATE * t_end / 8, samples
        assert samples[len(samples) // 2][2] > 0 and landed > samples[len(samples) // 2][2], samples
        assert landed < 2 * 4 * 80  # still far from done: the link really is slow
        # open the link: the same transfer completes, every byte intact
        pair.link.rate_bps = None
        stats = await asyncio.wait_for(send, 60)
        await asyncio.wait_for(recv, 30)
        assert stats.bytes == 20 << 20
        assert pair.intact()


async def test_transfer_completes_at_1mbit() -> None:
    async with SlowPair(layers=2, blocks=8) as pair:  # 1 MiB in 4 frames of 256 KiB, ~4 s each to cross
        send, recv = pair.start_transfer("small")
        t0 = time.monotonic()
        stats = await asyncio.wait_for(send, 60)
        await asyncio.wait_for(recv, 30)
        elapsed = time.monotonic() - t0
        assert stats.bytes == 1 << 20
        assert pair.intact()
        assert elapsed > 0.8 * (1 << 20) * 8 / RATE, "the link was not slow"
        assert elapsed > 5 * 3 * HEARTBEAT_S and elapsed > 3 * ACK_TIMEOUT_S


async def test_dead_link_still_fails_fast() -> None:
    async with SlowPair(layers=4, blocks=80) as pair:
        send, recv = pair.start_transfer("cut")
        await asyncio.sleep(4 * 3 * HEARTBEAT_S)
        await _alive(send, recv, "before the cut")
        assert pair.link.forwarded > 0
        pair.link.cut()
        t0 = time.monotonic()
        bound = 3 * HEARTBEAT_S + 3.0  # detection (3 heartbeats) plus slack for a loaded 2-core box
        done, _ = await asyncio.wait({send, recv}, timeout=2 * bound, return_when=asyncio.ALL_COMPLETED)
        elapsed = time.monotonic() - t0
        assert done == {send, recv}, f"a side still waits {elapsed:.1f}s after the link died"
        for task in (send, recv):
            assert isinstance(task.exception(), PeerLostError), repr(task.exception())
        assert "sent nothing" in str(recv.exception()) or "disconnected" in str(recv.exception())
        assert elapsed < bound, f"detected after {elapsed:.1f}s"


async def test_one_stream_cut_fails_the_transfer_and_the_caller_can_fall_back() -> None:
    """Two streams, one of them cut mid-transfer (silent both ways, no FIN) while the other stays up: the live
    stream carries its frames to the end, then the link makes no progress and the send fails with PeerLostError
    within ``ack_timeout_s`` (a link is judged by all its streams, so a stream that still moves keeps it alive
    until then). The receiver's import keeps waiting (its link still answers heartbeats) until the caller cancels
    it, as P's failed transfer makes main decode do before the fallback runs; the cut stream's frames never land."""
    async with SlowPair(layers=2, blocks=16, rate_bps=4e6) as pair:  # 8 frames of 256 KiB, 0.5 s each at 4 Mbit/s
        send, recv = pair.start_transfer("one-cut")
        while pair.link.forwarded == 0 or len(pair.link.connections) < 2:
            await asyncio.sleep(0.05)
        await _alive(send, recv, "before the cut")
        pair.link.cut(connection=0)
        t0 = time.monotonic()
        done, _ = await asyncio.wait({send}, timeout=60)
        assert done == {send}, f"the send still waits {time.monotonic() - t0:.1f}s after one stream died"
        assert isinstance(send.exception(), PeerLostError) and "no progress" in str(send.exception())
        assert not recv.done() and 0 < pair.landed() < 2 * 2 * pair.blocks  # the live stream's frames landed
        pair.receiver.cancel("one-cut")
        with pytest.raises(TransferError):
            await asyncio.wait_for(recv, 10)


async def test_stuck_receiver_still_times_out() -> None:
    """Heartbeats alone are not progress: a receiver that stops acknowledging fails the send."""
    async with SlowPair(layers=2, blocks=8, rate_bps=None, ack_timeout_s=1.0) as pair:
        accept, stalled = pair.receiver._registry.accept, []

        def stall_then_accept(*args, **kwargs):
            if not stalled:
                stalled.append(True)
                time.sleep(4.0)  # the receiver's loop hangs; its zmq I/O thread still heartbeats
            return accept(*args, **kwargs)

        pair.receiver._registry.accept = stall_then_accept
        send, _ = pair.start_transfer("stuck")
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            await asyncio.wait_for(send, 10)
        assert isinstance(info.value, PeerLostError) and "no progress" in str(info.value)
        assert time.monotonic() - t0 < 3.5
