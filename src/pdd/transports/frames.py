"""Frame header: encode, strict decode, validation against a pool, checksum.

A frame carries the K or V bytes of a run of blocks of one layer. Its header says exactly what the
payload is (request id, layer, tensor, destination block ids, dtype, shape, byte count, xxh3-64
checksum, optional W3C trace context). The receiver checks every field against what it expects
*before* touching its pool, so a corrupt, truncated, misaddressed or oversized frame is rejected
with a typed error and never corrupts KV of any request.

Wire form: ``MAGIC(4) | VERSION(1) | msgpack array | xxh3-64 of the preceding bytes (8)``, so a
flipped bit in the header (say, in a block id) is caught as surely as one in the payload.

Versions: 1 is a frame as the pool holds it (9 fields; what every frame was before codecs). 2 is a coded
frame (codec.py): the same 9 fields plus the codec it carries and its byte count on the wire; ``nbytes``
stays the decoded size (what its blocks hold) and the checksum covers the bytes on the wire. A frame with
codec ``none`` is always written as version 1, so a link without a codec is byte-identical to before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import xxhash

from .errors import TransferError

MAGIC = b"PDKV"
VERSION = 1  # an uncoded frame
VERSION_CODED = 2  # a frame with a codec: two more fields (codec, wire byte count)
MAX_HEADER_BYTES = 64 * 1024
MAX_BLOCKS_PER_FRAME = 65536
TENSORS = ("k", "v")
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
FRAME_CODECS = ("none", "lossless", "fp8", "fp8+lossless")  # codec.py's names (fp8 first when stacked)


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


class CodecError(FrameError):
    """A coded payload does not decode to exactly what its header and blocks imply (truncated, corrupt, a
    decompression bomb, a codec the link did not agree on)."""

    code = 17


def error_class(code: int) -> type[TransferError]:
    """Wire code -> error class (used to turn a negative acknowledgement into a typed error)."""
    from . import errors

    classes: list[type[TransferError]] = [
        FrameError, MalformedHeader, ChecksumMismatch, FrameTruncated, UnexpectedFrame,
        LayoutMismatch, OversizeFrame, CodecError, errors.TransferError, errors.TransferTimeout,
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
    nbytes: int  # decoded payload bytes: what the blocks hold
    checksum: int  # xxh3-64 of the payload on the wire
    trace_context: dict[str, str] | None = field(default=None, compare=False)
    codec: str = "none"  # codec.py: the stages this frame's payload carries
    wire_nbytes: int | None = None  # payload bytes on the wire; an uncoded frame's are always nbytes

    def __post_init__(self) -> None:
        if self.wire_nbytes is None or self.codec == "none":
            object.__setattr__(self, "wire_nbytes", self.nbytes)

    def encode(self) -> bytes:
        body = [self.request_id, self.layer, self.tensor, list(self.block_ids), self.dtype,
                list(self.shape), self.nbytes, self.checksum, self.trace_context]
        version = VERSION
        if self.codec != "none":
            body += [self.codec, self.wire_nbytes]
            version = VERSION_CODED
        data = MAGIC + bytes([version]) + msgpack.packb(body, use_bin_type=True)
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
    version = data[4]
    if version not in (VERSION, VERSION_CODED):
        raise MalformedHeader(f"unsupported frame version {version} (expected {VERSION} or {VERSION_CODED})")
    if xxhash.xxh3_64_digest(data[:-8]) != data[-8:]:
        raise ChecksumMismatch("frame header checksum mismatch")
    try:
        body = msgpack.unpackb(data[5:-8], raw=False, strict_map_key=True,
                               max_array_len=MAX_BLOCKS_PER_FRAME, max_map_len=16)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MalformedHeader(f"frame header is not valid msgpack: {exc}") from None
    fields = 9 if version == VERSION else 11
    if not isinstance(body, list) or len(body) != fields:
        raise MalformedHeader(f"frame header v{version} must be a {fields}-field array")
    rid, layer, tensor, blocks, dtype, shape, nbytes, csum, tctx = body[:9]
    codec, wire = body[9:] if version == VERSION_CODED else ("none", nbytes)
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
    if version == VERSION_CODED and not (isinstance(codec, str) and codec in FRAME_CODECS and codec != "none"):
        raise MalformedHeader(f"a v{VERSION_CODED} frame must name a codec of {FRAME_CODECS[1:]}", rid_str)
    if not (_is_int(wire) and 0 < wire <= nbytes):  # a codec never makes a frame larger (codec.py)
        raise MalformedHeader("wire byte count must be a positive int no larger than the decoded size", rid_str)
    return FrameHeader(rid_str, layer, tensor, tuple(blocks), dtype, tuple(shape), nbytes, csum, tctx, codec, wire)


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
    """Length then checksum of the bytes on the wire; raise before anything is decoded or written."""
    n = memoryview(payload).nbytes
    if n != h.wire_nbytes:
        raise FrameTruncated(f"payload has {n} bytes, header says {h.wire_nbytes}", h.request_id)
    if checksum(payload) != h.checksum:
        raise ChecksumMismatch("payload checksum mismatch", h.request_id)
