"""Frame header: encode, strict decode, validation against a pool, checksum.

A frame carries the K or V bytes of a run of blocks of one layer. Its header says exactly what the
payload is (request id, layer, tensor, destination block ids, dtype, shape, byte count, xxh3-64
checksum, optional W3C trace context). The receiver checks every field against what it expects
*before* touching its pool, so a corrupt, truncated, misaddressed or oversized frame is rejected
with a typed error and never corrupts KV of any request.

Wire form: ``MAGIC(4) | VERSION(1) | msgpack array | xxh3-64 of the preceding bytes (8)``, so a
flipped bit in the header (say, in a block id) is caught as surely as one in the payload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import xxhash

from .errors import TransferError

MAGIC = b"PDKV"
VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
MAX_BLOCKS_PER_FRAME = 65536
TENSORS = ("k", "v")
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


class FrameError(TransferError):
    """A frame failed validation; the pool was not modified."""

    code = 10


class MalformedHeader(FrameError):
    code = 11


class ChecksumMismatch(FrameError):
    code = 12


class FrameTruncated(FrameError):
    code = 13


class UnexpectedFrame(FrameError):
    """Unknown/expired request id, block ids outside the expected set, or a duplicate."""

    code = 14


class LayoutMismatch(FrameError):
    """Wrong dtype, shape or layer for the registered page layout."""

    code = 15


class OversizeFrame(FrameError):
    code = 16


def error_class(code: int) -> type[TransferError]:
    """Wire code -> error class (used to turn a negative acknowledgement into a typed error)."""
    from . import errors

    classes: list[type[TransferError]] = [
        FrameError, MalformedHeader, ChecksumMismatch, FrameTruncated, UnexpectedFrame,
        LayoutMismatch, OversizeFrame, errors.TransferError, errors.TransferTimeout,
        errors.PeerLostError, errors.TransferCancelled, errors.IncompatiblePeerError,
    ]
    return next((c for c in classes if c.code == code), TransferError)


@dataclass(frozen=True)
class FrameHeader:
    request_id: str
    layer: int
    tensor: int  # 0 = K, 1 = V
    block_ids: tuple[int, ...]  # destination block ids, in payload order
    dtype: str
    shape: tuple[int, ...]  # (len(block_ids), block_size, kv_heads, head_dim)
    nbytes: int
    checksum: int  # xxh3-64 of the payload
    trace_context: dict[str, str] | None = field(default=None, compare=False)

    def encode(self) -> bytes:
        body = [self.request_id, self.layer, self.tensor, list(self.block_ids), self.dtype,
                list(self.shape), self.nbytes, self.checksum, self.trace_context]
        data = MAGIC + bytes([VERSION]) + msgpack.packb(body, use_bin_type=True)
        return data + xxhash.xxh3_64_digest(data)


def checksum(payload: Any) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def decode_header(data: bytes | memoryview) -> FrameHeader:
    """Parse and type-check a header; raise MalformedHeader on anything unexpected."""
    data = bytes(data)
    if len(data) > MAX_HEADER_BYTES:
        raise OversizeFrame(f"frame header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    if len(data) < 14 or data[:4] != MAGIC:
        raise MalformedHeader("not a PDD KV frame (bad magic or too short)")
    if data[4] != VERSION:
        raise MalformedHeader(f"unsupported frame version {data[4]} (expected {VERSION})")
    if xxhash.xxh3_64_digest(data[:-8]) != data[-8:]:
        raise ChecksumMismatch("frame header checksum mismatch")
    try:
        body = msgpack.unpackb(data[5:-8], raw=False, strict_map_key=True,
                               max_array_len=MAX_BLOCKS_PER_FRAME, max_map_len=16)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MalformedHeader(f"frame header is not valid msgpack: {exc}") from None
    if not isinstance(body, list) or len(body) != 9:
        raise MalformedHeader("frame header must be a 9-field array")
    rid, layer, tensor, blocks, dtype, shape, nbytes, csum, tctx = body
    rid_str = rid if isinstance(rid, str) else None
    if rid_str is None or not 0 < len(rid_str) <= 256:
        raise MalformedHeader("request id must be a non-empty string of at most 256 chars")
    if not (_is_int(layer) and layer >= 0 and tensor in (0, 1) and _is_int(tensor)):
        raise MalformedHeader("bad layer or tensor field", rid_str)
    if not (isinstance(blocks, list) and blocks and all(_is_int(b) and b >= 0 for b in blocks)):
        raise MalformedHeader("block ids must be a non-empty list of non-negative ints", rid_str)
    if len(set(blocks)) != len(blocks):
        raise MalformedHeader("duplicate block ids in one frame", rid_str)
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise MalformedHeader(f"unsupported dtype {dtype!r}", rid_str)
    if not (isinstance(shape, list) and len(shape) == 4 and all(_is_int(s) and s > 0 for s in shape)):
        raise MalformedHeader("shape must be 4 positive ints", rid_str)
    if not (_is_int(nbytes) and nbytes == math.prod(shape) * DTYPE_SIZES[dtype]):
        raise MalformedHeader("byte count does not match shape and dtype", rid_str)
    if shape[0] != len(blocks):
        raise MalformedHeader("shape[0] must equal the number of block ids", rid_str)
    if not (_is_int(csum) and 0 <= csum < 2**64):
        raise MalformedHeader("checksum must be an unsigned 64-bit int", rid_str)
    if tctx is not None and not (isinstance(tctx, dict) and len(tctx) <= 8 and all(
            isinstance(k, str) and isinstance(v, str) for k, v in tctx.items())):
        raise MalformedHeader("trace context must be a small str->str map", rid_str)
    return FrameHeader(rid_str, layer, tensor, tuple(blocks), dtype, tuple(shape), nbytes, csum, tctx)


def check_against_layout(h: FrameHeader, num_layers: int, block_shape: tuple[int, int, int],
                         dtype: str, max_frame_bytes: int) -> None:
    """Reject frames that cannot belong to a pool of this layout."""
    if h.nbytes > max_frame_bytes:
        raise OversizeFrame(f"frame of {h.nbytes} bytes exceeds limit {max_frame_bytes}", h.request_id)
    if h.layer >= num_layers:
        raise LayoutMismatch(f"layer {h.layer} out of range (pool has {num_layers})", h.request_id)
    if h.dtype != dtype:
        raise LayoutMismatch(f"frame dtype {h.dtype} != pool dtype {dtype}", h.request_id)
    if tuple(h.shape[1:]) != tuple(block_shape):
        raise LayoutMismatch(f"frame block shape {h.shape[1:]} != pool block shape {block_shape}",
                             h.request_id)


def verify_payload(h: FrameHeader, payload: Any) -> None:
    """Length then checksum; raise before anything is written."""
    n = memoryview(payload).nbytes
    if n != h.nbytes:
        raise FrameTruncated(f"payload has {n} bytes, header says {h.nbytes}", h.request_id)
    if checksum(payload) != h.checksum:
        raise ChecksumMismatch("payload checksum mismatch", h.request_id)
