"""Frame header codec and the receive registry, without sockets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdd.transports.blocks import FramePlan, byte_view, gather
from pdd.transports.frames import (
    ChecksumMismatch,
    FrameError,
    FrameHeader,
    FrameTruncated,
    LayoutMismatch,
    MalformedHeader,
    OversizeFrame,
    UnexpectedFrame,
    checksum,
    decode_header,
)
from pdd.transports.receive_side import ReceiveRegistry

from .conftest import layout_for, make_pool, snapshot, unchanged

LAYOUT = layout_for("float16", layers=2)


def valid_frame(pool, rid="r", layer=1, tensor=0, src=(0, 1), dst=(4, 5), **over):
    payload = byte_view(gather(pool[tensor][min(layer, LAYOUT.num_layers - 1)], list(src)))
    fields = dict(request_id=rid, layer=layer, tensor=tensor, block_ids=tuple(dst), dtype=LAYOUT.dtype,
                  shape=(len(dst), *LAYOUT.block_shape), nbytes=payload.nbytes, checksum=checksum(payload))
    fields.update(over)
    return FrameHeader(**fields).encode(), bytes(payload)


def registry(max_frame_bytes=1 << 20):
    pool = make_pool(LAYOUT, 8, seed=3)
    return pool, ReceiveRegistry("test", LAYOUT, pool[0], pool[1], max_frame_bytes)


def test_header_round_trip() -> None:
    h = FrameHeader("req", 3, 1, (7, 2), "bfloat16", (2, 4, 2, 8), 256, 12345, {"traceparent": "00-ab-cd-01"})
    assert decode_header(h.encode()) == h
    assert decode_header(h.encode()).trace_context == {"traceparent": "00-ab-cd-01"}


@pytest.mark.parametrize("mutate, error", [
    (lambda b: b"XXXX" + b[4:], MalformedHeader),
    (lambda b: b[:4] + b"\x09" + b[5:], MalformedHeader),
    (lambda b: b[:-1], ChecksumMismatch),
    (lambda b: b"", MalformedHeader),
    (lambda b: b + b"\0" * (70 * 1024), OversizeFrame),
])
def test_malformed_headers(mutate, error) -> None:
    header, _ = valid_frame(make_pool(LAYOUT, 8, 0))
    with pytest.raises(error):
        decode_header(mutate(header))


@pytest.mark.parametrize("fields", [
    dict(nbytes=999),                                   # byte count inconsistent with shape
    dict(block_ids=(1, 1)),                             # duplicate block ids
    dict(dtype="int8"),
    dict(shape=(3, 4, 2, 8)),                           # shape[0] != number of blocks
    dict(request_id=""),
    dict(trace_context={"a": 1}),
])
def test_inconsistent_fields_are_malformed(fields) -> None:
    header, _ = valid_frame(make_pool(LAYOUT, 8, 0), **fields)
    with pytest.raises(MalformedHeader):
        decode_header(header)


def test_registry_rejections_leave_pool_untouched_and_keep_serving() -> None:
    src = make_pool(LAYOUT, 8, seed=9)
    pool, reg = registry(max_frame_bytes=256)
    snap = snapshot(pool)
    cases = [
        (valid_frame(src, rid="x"), UnexpectedFrame),                                  # unknown request id
        (valid_frame(src, dst=(4, 7)), UnexpectedFrame),                               # block not expected
        (valid_frame(src, layer=5), LayoutMismatch),
        (valid_frame(src, dtype="float32", nbytes=512), OversizeFrame),
        (valid_frame(src, dtype="bfloat16"), LayoutMismatch),
        (valid_frame(src, shape=(2, 4, 1, 16)), LayoutMismatch),
    ]
    for (header, payload), error in cases:
        reg.expect("r", [4, 5, 6], timeout_s=30)
        with pytest.raises(error):
            reg.accept(decode_header(header), payload)
        assert unchanged(pool, snap)
        reg.cancel("r")
    # truncated and flipped payloads
    for mutate, error in [(lambda p: p[:-2], FrameTruncated), (lambda p: bytes([p[0] ^ 1]) + p[1:], ChecksumMismatch)]:
        reg.expect("r", [4, 5], timeout_s=30)
        header, payload = valid_frame(src)
        with pytest.raises(error):
            reg.accept(decode_header(header), mutate(payload))
        assert unchanged(pool, snap)
        reg.cancel("r")
    # duplicate frame fails the request after the first (valid) copy was written
    handle = reg.expect("d", [4, 5], timeout_s=30)
    header, payload = valid_frame(src, rid="d")
    reg.accept(decode_header(header), payload)
    with pytest.raises(UnexpectedFrame, match="duplicate"):
        reg.accept(decode_header(header), payload)
    assert handle.done()
    # still serving: a full, valid request completes
    handle = reg.expect("ok", [6, 7], timeout_s=30)
    for layer in range(LAYOUT.num_layers):
        for tensor in (0, 1):
            h, p = valid_frame(src, rid="ok", layer=layer, tensor=tensor, dst=(6, 7))
            reg.accept(decode_header(h), p)
    assert handle.done() and handle._future.result().bytes == 4 * 2 * LAYOUT.bytes_per_block_per_tensor
    assert torch.equal(pool[1][1][6], src[1][1][0])
    assert reg.pending() == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_single_bit_flip_is_rejected(data) -> None:
    src = make_pool(LAYOUT, 8, seed=5)
    pool, reg = registry()
    snap = snapshot(pool)
    reg.expect("r", [4, 5], timeout_s=30)
    header, payload = valid_frame(src)
    blob = bytearray(header + payload)
    bit = data.draw(st.integers(0, len(blob) * 8 - 1))
    blob[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(FrameError):
        reg.accept(decode_header(bytes(blob[:len(header)])), bytes(blob[len(header):]))
    assert unchanged(pool, snap)


def test_plan_frames_splits_by_layer_tensor_and_size() -> None:
    from pdd.transports.blocks import plan_frames

    plans = plan_frames([5, 1, 2, 3], [0, 1, 2, 3], [0, 1], bytes_per_block=100, max_frame_bytes=250)
    assert len(plans) == 2 * 2 * 2
    assert plans[0] == FramePlan(0, 0, (1, 2), (1, 2))
    assert plans[1] == FramePlan(0, 0, (3, 5), (3, 0))
