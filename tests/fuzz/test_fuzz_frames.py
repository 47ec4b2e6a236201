"""Fuzz the KV frame decoder (transports/frames.py) and a live zmq receiver fed over a real socket.

Inputs (hypothesis, deterministic): headers with plausible and hostile field values; header bodies
replaced by arbitrary msgpack and re-sealed with a valid checksum (so validation past the checksum is
reached); bit flips, truncations, insertions, wrong magic/version, oversize headers; payloads of the
wrong length or checksum; and on the socket, messages with the wrong number of parts or a bad sequence
number. Frames name the live requests' ids and blocks most of the time, so they reach the writes.

Unit level: decoding, layout checks and a ReceiveRegistry's ``accept`` let only ``FrameError``
subclasses escape, and never write outside the expected blocks.
Live level: a real ``zmq`` transport answers every frame (that carries a sequence number) with a typed
code; blocks outside the live expectations never change; every expectation ends (completed, failed by
a bad frame, cancelled, or expired) and none stays reserved; a real transfer afterwards succeeds.
"""

from __future__ import annotations

import asyncio
import random
import struct
import time
from dataclasses import dataclass, field

import msgpack
import pytest
import torch
import xxhash
import zmq
import zmq.asyncio
from hypothesis import given
from hypothesis import strategies as st

from pdd.shared.kv_layout import KVLayout
from pdd.transports import create_transport
from pdd.transports.errors import TransferCancelled, TransferError, TransferTimeout
from pdd.transports.frames import (
    MAGIC,
    MAX_HEADER_BYTES,
    VERSION,
    FrameError,
    check_against_layout,
    checksum,
    decode_header,
    error_class,
    verify_payload,
)
from pdd.transports.receive_side import ReceiveRegistry, TransferStats

from .common import Tally, collect, examples, fuzz_settings

LAYOUT = KVLayout(num_layers=2, block_size=4, kv_heads=2, head_dim=8, dtype="float16")
BLOCK_BYTES = LAYOUT.bytes_per_block_per_tensor  # 128
NUM_BLOCKS = 32
MAX_FRAME_BYTES = 4 * BLOCK_BYTES
# Live requests each round: request id -> destination blocks. Blocks 24.. are never expected.
EXPECTED = {"rq-a": (0, 1, 2, 3), "rq-b": (5, 7, 9), "rq-c": (12, 13), "rq-d": (20,)}
NEVER = tuple(range(24, NUM_BLOCKS))


def make_pool(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)

    def one() -> torch.Tensor:
        return torch.randn((NUM_BLOCKS, *LAYOUT.block_shape), generator=g).to(LAYOUT.torch_dtype)

    return [one() for _ in range(LAYOUT.num_layers)], [one() for _ in range(LAYOUT.num_layers)]


def blocks_snapshot(pool, ids) -> list[torch.Tensor]:
    return [t[list(ids)].clone() for t in pool[0] + pool[1]]


# ---- inputs -------------------------------------------------------------------------------------------

INTS = st.one_of(st.integers(0, 40), st.integers(-(2**63), 2**64 - 1), st.sampled_from([-1, 2**31, 2**64 - 1]))
MSGPACK_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                            st.text(max_size=10), st.binary(max_size=10))
MSGPACK = st.recursive(MSGPACK_SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.one_of(st.text(max_size=5), st.integers(0, 9)), c, max_size=3), max_leaves=6)


@dataclass
class FrameInput:
    kind: str
    header: bytes
    payload: bytes
    parts: str = "ok"  # how the live message is framed: ok | short | long | noseq | badseq
    note: str = field(default="", compare=False)


def seal(body: bytes) -> bytes:
    data = MAGIC + bytes([VERSION]) + body
    return data + xxhash.xxh3_64_digest(data)


def payload_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


@st.composite
def frame_input(draw) -> FrameInput:
    """A frame for a live request (plausible fields) with at most one field made hostile, then maybe
    broken as bytes."""
    bad = draw(st.sampled_from(["none"] * 6 + ["rid", "rid", "blocks", "blocks", "blocks", "layer", "tensor",
                                                "dtype", "shape", "nbytes", "size", "csum", "tctx"]))
    rid = draw(st.sampled_from(sorted(EXPECTED)))
    if bad == "rid":
        rid = draw(st.one_of(st.sampled_from(["rq-x", "", "r" * 257, "é", "rq-a\x00"]), st.text(max_size=8)))
    expected = EXPECTED.get(rid, (0, 1))
    blocks = draw(st.lists(st.sampled_from(expected), min_size=1, max_size=len(expected), unique=True))
    if bad == "blocks":
        blocks = draw(st.one_of(st.lists(st.integers(0, NUM_BLOCKS + 4), min_size=1, max_size=4, unique=True),
                                st.lists(st.sampled_from(NEVER), min_size=1, max_size=3, unique=True),
                                st.lists(INTS, min_size=0, max_size=4), st.just(blocks + blocks[:1])))
    layer = draw(INTS if bad == "layer" else st.integers(0, LAYOUT.num_layers - 1))
    tensor = draw(INTS if bad == "tensor" else st.integers(0, 1))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "int8", ""])) if bad == "dtype" else LAYOUT.dtype
    dsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 2)
    shape = (len(blocks), *LAYOUT.block_shape)
    if bad == "shape":
        shape = draw(st.one_of(st.tuples(INTS, INTS, INTS, INTS), st.lists(st.integers(1, 8), max_size=5).map(tuple)))
    right_size = 1
    for s in shape:
        right_size *= s
    right_size = max(-(2**63), min(right_size * dsize, 2**64 - 1))
    nbytes = draw(INTS) if bad == "nbytes" else right_size
    size = nbytes if 0 <= nbytes <= 4 * MAX_FRAME_BYTES else draw(st.integers(0, 600))
    if bad == "size":
        size = draw(st.integers(0, 700))
    payload = payload_bytes(size, draw(st.integers(0, 2**32)))
    csum = draw(INTS) if bad == "csum" else checksum(payload)
    tctx = None
    if bad == "tctx":
        tctx = draw(st.one_of(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=10), MSGPACK))
    body = [rid, layer, tensor, blocks, dtype, list(shape), nbytes, csum, tctx]
    kind = draw(st.sampled_from(["plain"] * 6 + ["body-junk"] * 2 + ["body-shape"] * 2 + ["flip"] * 2 +
                                ["truncate", "extend", "magic", "version", "oversize", "garbage"]))
    if kind == "body-junk":  # any field replaced by any msgpack value, re-sealed: past the checksum gate
        body[draw(st.integers(0, 8))] = draw(MSGPACK)
        header = seal(msgpack.packb(body, use_bin_type=True))
    elif kind == "body-shape":
        header = seal(msgpack.packb(draw(st.one_of(MSGPACK, st.lists(MSGPACK, min_size=8, max_size=10),
                                                   st.just(body[:8]), st.just(body + [1]))), use_bin_type=True))
    else:
        header = seal(msgpack.packb(body, use_bin_type=True))
        at = draw(st.integers(0, len(header) - 1))
        if kind == "flip":
            header = header[:at] + bytes([header[at] ^ (1 << draw(st.integers(0, 7)))]) + header[at + 1:]
        elif kind == "truncate":
            header = header[:at]
        elif kind == "extend":
            header = header + draw(st.binary(min_size=1, max_size=16))
        elif kind == "magic":
            header = draw(st.sampled_from([b"PDKW", b"XXXX", b"", b"PD"])) + header[4:]
        elif kind == "version":
            header = header[:4] + bytes([draw(st.integers(0, 255))]) + header[5:]
        elif kind == "oversize":
            header = seal(msgpack.packb([rid, layer, tensor, blocks, dtype, list(shape), nbytes, csum,
                                         {"x": "y" * MAX_HEADER_BYTES}]))
        elif kind == "garbage":
            header = draw(st.binary(max_size=64))
    parts = draw(st.sampled_from(["ok"] * 12 + ["short", "long", "noseq", "badseq"]))
    return FrameInput(kind, header, payload, parts, note=f"{kind}/{parts} rid={rid!r}"[:80])


# ---- unit: decoding and the receive registry ----------------------------------------------------------

def check_frame_unit(inp: FrameInput, registry: ReceiveRegistry, tally: Tally) -> None:
    tally.add("inputs")
    try:
        h = decode_header(inp.header)
        check_against_layout(h, LAYOUT.num_layers, LAYOUT.block_shape, LAYOUT.dtype, MAX_FRAME_BYTES)
        verify_payload(h, inp.payload)
        registry.accept(h, inp.payload)
        tally.add("accepted")
    except FrameError as exc:
        tally.add(f"rejected_{type(exc).__name__}")


def frames_unit(n: int) -> None:
    tally = Tally("frames-decode")
    t0 = time.monotonic()
    pool = make_pool(3)
    never = blocks_snapshot(pool, NEVER)
    registry = ReceiveRegistry("fuzz", LAYOUT, pool[0], pool[1], MAX_FRAME_BYTES)
    handles = {}

    @fuzz_settings(n)
    @given(frame_input())
    def run(inp: FrameInput) -> None:
        for rid, blocks in EXPECTED.items():  # a bad frame fails its request: make it live again
            if rid not in handles or handles[rid].done():
                handles[rid] = registry.expect(rid, blocks, timeout_s=600)
        check_frame_unit(inp, registry, tally)
        assert all(torch.equal(a, b) for a, b in zip(blocks_snapshot(pool, NEVER), never)), \
            "a frame wrote outside the expected blocks"

    run()
    for rid in EXPECTED:
        registry.cancel(rid)
    assert registry.pending() == 0
    tally.report(seconds=round(time.monotonic() - t0, 1))
    assert tally.counts["inputs"] >= n


def test_fuzz_frame_decoder() -> None:
    frames_unit(examples(slow=False, fast_default=300))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzz_frame_decoder_10k() -> None:
    frames_unit(examples(slow=True))


def test_non_string_dtype_is_a_malformed_header() -> None:
    """Regression (found by this fuzzer): a re-sealed header whose dtype was a list or a map made
    ``decode_header`` raise TypeError (unhashable) instead of MalformedHeader."""
    from pdd.transports.frames import MalformedHeader

    for dtype in ([1], {"a": 1}, None, 5):
        body = ["rq-a", 0, 0, [0], dtype, [1, 4, 2, 8], 128, 0, None]
        with pytest.raises(MalformedHeader):
            decode_header(seal(msgpack.packb(body)))


# ---- live: a zmq receiver on a real socket ---------------------------------------------------------------

_SEQ = struct.Struct(">Q")


async def send_one(sock: zmq.asyncio.Socket, seq: int, inp: FrameInput, tally: Tally) -> None:
    seq_bytes = _SEQ.pack(seq)
    parts = {"ok": [seq_bytes, inp.header, inp.payload], "short": [seq_bytes, inp.header],
             "long": [seq_bytes, inp.header, inp.payload, b"extra"], "noseq": [inp.header, inp.payload],
             "badseq": [b"\x01\x02\x03", inp.header, inp.payload]}[inp.parts]
    await sock.send_multipart(parts)
    if len(parts[0]) != _SEQ.size:  # no part where the sequence number goes (a header of 8 bytes would read as one)
        tally.add("sent_without_seq")  # dropped by the receiver, which cannot address an answer
        return
    seq_bytes = parts[0]  # the receiver answers to whatever sits there
    try:
        reply = await asyncio.wait_for(sock.recv_multipart(), 10)
    except asyncio.TimeoutError:
        tally.bad(f"no acknowledgement within 10s for {inp.note}")
        return
    if len(reply) != 3 or reply[0] != seq_bytes or len(reply[1]) != 4:
        tally.bad(f"malformed acknowledgement {reply!r} for {inp.note}")
        return
    code = struct.unpack(">I", reply[1])[0]
    tally.add("ack_ok" if code == 0 else f"ack_{error_class(code).__name__}")
    if code == 11 and reply[2].startswith(b"receiver error"):  # the receive loop caught a non-frame exception
        tally.bad(f"receiver bug on {inp.note}: {reply[2][:200]!r}")


async def live_rounds(inputs: list[FrameInput], tally: Tally, round_size: int = 200) -> None:
    receiver = create_transport("zmq", {"ack_timeout_s": 10.0, "connect_timeout_s": 10.0,
                                        "max_frame_bytes": MAX_FRAME_BYTES})
    sender = create_transport("zmq", {"streams": 2, "ack_timeout_s": 10.0, "connect_timeout_s": 10.0})
    await receiver.start()
    await sender.start()
    dst_pool, src_pool = make_pool(2), make_pool(1)
    receiver.register(LAYOUT, *dst_pool)
    sender.register(LAYOUT, *src_pool)
    never = blocks_snapshot(dst_pool, NEVER)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(receiver.descriptor()["address"])
    try:
        seq = 0
        rounds = [inputs[i:i + round_size] for i in range(0, len(inputs), round_size)]
        for r, batch in enumerate(rounds):
            last = r == len(rounds) - 1
            # the last round's requests are left to expire by themselves; the others are cancelled,
            # as a service drops a request
            timeout = 3.0 if last else 60.0
            handles = {rid: receiver.expect(rid, blocks, timeout_s=timeout) for rid, blocks in EXPECTED.items()}
            ended = []
            for inp in batch:
                seq += 1
                tally.add("inputs")
                await send_one(sock, seq, inp, tally)
                for rid, handle in list(handles.items()):
                    if handle.done() and not last:  # completed or failed by a bad frame: a new request
                        ended.append(handle)
                        handles[rid] = receiver.expect(rid, EXPECTED[rid], timeout_s=timeout)
            if not last:
                for rid in EXPECTED:
                    receiver.cancel(rid)
            for handle in ended + list(handles.values()):
                try:
                    stats = await asyncio.wait_for(handle.wait(), 30)
                    assert isinstance(stats, TransferStats)
                    tally.add("requests_completed")
                except TransferCancelled:
                    tally.add("requests_cancelled")
                except TransferTimeout:
                    tally.add("requests_expired")
                except TransferError as exc:
                    tally.add(f"requests_failed_{type(exc).__name__}")
                except asyncio.TimeoutError:
                    tally.bad(f"round {r}: request {handle.request_id} neither completed nor failed")
            if receiver._registry.pending():
                tally.bad(f"round {r}: {receiver._registry.pending()} expectations still reserved")
            if not all(torch.equal(a, b) for a, b in zip(blocks_snapshot(dst_pool, NEVER), never)):
                tally.bad(f"round {r}: blocks that no request expected were written")
        # still serving: a real transfer of every layer lands intact
        peer = await sender.connect(receiver.descriptor())
        handle = receiver.expect("after-fuzz", [16, 17, 18], timeout_s=30)
        await sender.send(peer, "after-fuzz", [3, 4, 5], [16, 17, 18])
        stats = await handle
        assert stats.bytes == 3 * 2 * LAYOUT.num_layers * BLOCK_BYTES
        for got, want in zip(dst_pool[0] + dst_pool[1], src_pool[0] + src_pool[1]):
            assert torch.equal(got[16:19], want[3:6])
        tally.add("good_transfer_after", 1)
        assert receiver._registry.pending() == 0
    finally:
        sock.close(0)
        ctx.term()
        await sender.close()
        await receiver.close()


def frames_live(n: int) -> None:
    t0 = time.monotonic()
    inputs = collect(frame_input(), n)
    t_gen = time.monotonic() - t0
    assert len(inputs) >= n, f"hypothesis drew only {len(inputs)} of {n} inputs"
    tally = Tally("frames-live")
    try:
        asyncio.run(live_rounds(inputs, tally))
    finally:
        tally.report(gen_s=round(t_gen, 1), send_s=round(time.monotonic() - t0 - t_gen, 1))
    assert tally.counts["inputs"] >= n
    assert not tally.anomalies, f"{len(tally.anomalies)} anomalies, first: {tally.anomalies[:5]}"


def test_fuzz_live_zmq_receiver() -> None:
    frames_live(examples(slow=False, fast_default=300))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzz_live_zmq_receiver_10k() -> None:
    frames_live(examples(slow=True))
