"""Corrupt frames injected on the real wire: typed rejection, pool untouched, receiver keeps serving."""

from __future__ import annotations

import asyncio
import struct

import pytest
import zmq
import zmq.asyncio

from pdd.transports.blocks import FramePlan
from pdd.transports.errors import TransferError
from pdd.transports.frames import FrameHeader, decode_header, error_class

from .conftest import PLUGINS, Pair, layout_for, snapshot, unchanged

LAYOUT = layout_for("bfloat16", layers=2)


async def inject(pair: Pair, header: bytes, payload: bytes) -> str:
    """Deliver one raw frame to the receiver; return the class name of its verdict ('ok' if accepted)."""
    if pair.name == "inproc":
        try:
            pair.receiver._receive_frame(header, payload)
            return "ok"
        except TransferError as exc:
            return type(exc).__name__
    if pair.name == "zmq":
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(pair.receiver.descriptor()["address"])
        try:
            await sock.send_multipart([struct.pack(">Q", 7), header, payload])
            seq, code, _ = await sock.recv_multipart()
        finally:
            sock.close()
        assert struct.unpack(">Q", seq)[0] == 7
        code = struct.unpack(">I", code)[0]
        return "ok" if code == 0 else error_class(code).__name__
    if pair.name == "ucx":
        return await pair.sender._lt.run(_inject_ucx(pair, header, payload))
    raise AssertionError(pair.name)


async def _inject_ucx(pair: Pair, header: bytes, payload: bytes) -> str:
    """One raw batch over a fresh link of the real sender (hello, data endpoint, then the batch)."""
    from pdd.transports.errors import RemoteRejected
    from pdd.transports.ucx_transport import UcxTransport

    descriptor = pair.receiver.descriptor()
    host, _, port = descriptor["address"].rpartition(":")
    link = await pair.sender._connect_here(host, int(port), bytes.fromhex(descriptor["worker"]))
    try:
        ack = asyncio.get_running_loop().create_future()
        seq = link.next_seq
        link.next_seq += 1
        link.inflight[seq] = (ack, len(payload))
        await UcxTransport._post(link, seq, [(header, memoryview(payload))])
        try:
            await ack
        except RemoteRejected as exc:
            return exc.remote_kind
        return "ok"
    finally:
        pair.sender._links.remove(link)
        await pair.sender._close_link(link)


def frame(pair: Pair, rid: str, dst=(4, 5), **over) -> tuple[bytes, bytes]:
    header, payload = pair.sender._build_frame(rid, FramePlan(1, 0, (0, 1), tuple(dst)), None)
    h = decode_header(header)
    fields = {**h.__dict__, **over}
    return FrameHeader(**fields).encode(), bytes(payload)


def flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x10]) + data[index + 1:]


CASES = {
    "payload bit flip": (lambda p, rid: (lambda h, d: (h, flip(d, 17)))(*frame(p, rid)), "ChecksumMismatch"),
    "header bit flip": (lambda p, rid: (lambda h, d: (flip(h, 9), d))(*frame(p, rid)), "ChecksumMismatch"),
    "truncated payload": (lambda p, rid: (lambda h, d: (h, d[:-8]))(*frame(p, rid)), "FrameTruncated"),
    "wrong request id": (lambda p, rid: frame(p, "someone-else"), "UnexpectedFrame"),
    "block not expected": (lambda p, rid: frame(p, rid, dst=(4, 9)), "UnexpectedFrame"),
    "wrong dtype": (lambda p, rid: frame(p, rid, dtype="float16"), "LayoutMismatch"),
    "wrong shape": (lambda p, rid: frame(p, rid, shape=(2, 4, 1, 16)), "LayoutMismatch"),
    "oversize": (lambda p, rid: frame(p, rid, dtype="float32", shape=(2, 4, 2, 16), nbytes=1024), "OversizeFrame"),
    "garbage header": (lambda p, rid: (b"PDKV\x01garbage-garbage", b"x"), "ChecksumMismatch"),
}


@pytest.mark.parametrize("plugin", PLUGINS)
async def test_bad_frames_rejected_pool_untouched_receiver_serving(plugin: str) -> None:
    async with Pair(plugin, LAYOUT, receiver_opts={"max_frame_bytes": 512}) as pair:
        snap = snapshot(pair.dst_pool)
        for i, (name, (make, verdict)) in enumerate(CASES.items()):
            rid = f"r{i}"
            handle = pair.receiver.expect(rid, [4, 5, 6], timeout_s=30)
            header, payload = make(pair, rid)
            assert await inject(pair, header, payload) == verdict, name
            assert unchanged(pair.dst_pool, snap), f"{name} modified the pool"
            if verdict != "UnexpectedFrame" or name == "block not expected":
                if name not in ("header bit flip", "garbage header"):  # these cannot name a request
                    with pytest.raises(TransferError):
                        await handle
            pair.receiver.cancel(rid)
        # still serving: a valid frame over a raw connection, then a full transfer
        pair.receiver.expect("good", [4, 5], timeout_s=30)
        assert await inject(pair, *frame(pair, "good")) == "ok"
        handle = pair.receiver.expect("full", [10, 11], timeout_s=30)
        await pair.sender.send(pair.peer, "full", [0, 1], [10, 11])
        assert (await handle).bytes == 2 * 2 * 2 * LAYOUT.bytes_per_block_per_tensor
