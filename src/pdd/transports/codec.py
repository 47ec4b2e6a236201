"""KV wire codecs: what a link may do to a frame's payload between the sender's pool and the receiver's.

A link's codec (``transports.<link>.codec``; the transport option ``codec``) is one of

* ``none``: the pool's bytes, zero-copy (the default);
* ``lossless``: byte shuffle (byte *i* of every element together: exponent bytes compress, mantissa bytes
  mostly do not, and mixing them hides the first from the compressor) then one zstd frame. Bit-exact.
  Adaptive: the sender skips it on a frame when compressing would not make that frame cross sooner at
  the link's measured rate (``AdaptiveLossless``);
* ``fp8``: float8 e4m3 with one fp32 scale per (block, KV head), absmax / 448. Lossy: changes tokens, so
  only config turns it on, never link speed;
* ``fp8+lossless``: fp8 first, then the lossless stage over the fp8 bytes (adaptive as above).

Each frame says in its header which stages it carries (``fp8+lossless`` link: ``fp8+lossless`` or ``fp8``;
``lossless`` link: ``lossless`` or ``none``). The receiver decodes with a hard cap: a zstd frame must
declare exactly the size its blocks imply and may not decompress past it (a decompression bomb or a
truncated frame is a ``CodecError``, and nothing is written); see frames.py and receive_side.py.

Wire forms. fp8: ``scales (n_blocks x kv_heads fp32, little-endian) | e4m3 bytes [n, block_size, heads,
head_dim]``. lossless: one zstd frame, content size written, no trailing bytes, over the shuffled bytes
(element size: the pool dtype's; 1 after fp8).
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zstandard

from .frames import FRAME_CODECS, CodecError

CODEC_NAMES: tuple[str, ...] = FRAME_CODECS  # none, lossless, fp8, fp8+lossless
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# zstd level 1 maximizes C (1 - 1/r), the link rate under which the stage pays (AdaptiveLossless). On SmolLM2's
# real bf16 KV, one core (bench/codec.py, 2026-12-05, docs/TRANSPORTS.md): level 1 ratio 1.42 at 369 MB/s (109);
# 3: 1.41 at 273 (79); 6: 1.42 at 124 (37); -1: 1.31 at 388 (92); -5: 1.23 at 460 (85)
DEFAULT_LEVEL = 1
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class CodecSpec:
    """The stages of a codec, in order (fp8, then lossless); ``name`` is what headers, spans and stats carry."""

    fp8: bool = False
    lossless: bool = False

    @property
    def name(self) -> str:
        return "+".join(s for s, on in (("fp8", self.fp8), ("lossless", self.lossless)) if on) or "none"

    @property
    def active(self) -> bool:
        return self.fp8 or self.lossless

    @classmethod
    def parse(cls, value: str | CodecSpec | None) -> CodecSpec:
        """``none`` | ``lossless`` | ``fp8`` | ``fp8+lossless`` (None: none); anything else is a ValueError."""
        if isinstance(value, CodecSpec):
            return value
        name = "none" if value is None else str(value).strip().lower()
        if name not in CODEC_NAMES:
            raise ValueError(f"unknown KV codec {value!r}; use one of {', '.join(CODEC_NAMES)}")
        stages = set(name.split("+"))
        return cls(fp8="fp8" in stages, lossless="lossless" in stages)

    def without_lossless(self) -> CodecSpec:
        return CodecSpec(fp8=self.fp8)

    def frame_codecs(self) -> frozenset[str]:
        """The codecs a frame on a link of this codec may carry: the adaptive sender may drop the lossless stage."""
        return frozenset({self.name, self.without_lossless().name})


NONE = CodecSpec()


def summarize(names: Iterable[str]) -> str:
    """One name for the frames of a transfer: the codec when all frames used it; ``<codec>(partial)`` when the
    adaptive lossless stage ran on some frames only (the codec named is the one with the most stages)."""
    seen, partial = set(), False
    for name in names:
        partial |= name.endswith("(partial)")
        seen.add(name.removesuffix("(partial)"))
    if not seen:
        return "none"
    top = max(seen, key=lambda n: (CodecSpec.parse(n).fp8, CodecSpec.parse(n).lossless))
    return f"{top}(partial)" if partial or len(seen) > 1 else top


# ---- fp8 -------------------------------------------------------------------------------------------------
def fp8_size(shape: tuple[int, ...]) -> int:
    """Bytes of the fp8 form of a [n_blocks, block_size, kv_heads, head_dim] payload: scales, then one byte each."""
    n, _, heads, _ = shape
    return 4 * n * heads + math.prod(shape)


def fp8_encode(t: torch.Tensor) -> bytes:
    """Quantize a [n, block_size, heads, head_dim] tensor to e4m3 with one scale per (block, head)."""
    x = t.to(torch.float32)
    amax = x.abs().amax(dim=(1, 3))  # [n, heads]
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("fp8 codec: the KV holds inf or NaN, which e4m3 scales cannot carry")
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return scale.numpy().astype("<f4").tobytes() + q.view(torch.uint8).numpy().tobytes()


def fp8_decode(data: Any, dtype: str, shape: tuple[int, ...]) -> memoryview:
    """The raw payload bytes (``dtype``) of an fp8 frame; CodecError on a wrong size or a bad scale."""
    n, _, heads, _ = shape
    buf = np.frombuffer(data, dtype=np.uint8)
    if buf.size != fp8_size(shape):
        raise CodecError(f"fp8 payload has {buf.size} bytes, its blocks imply {fp8_size(shape)}")
    scales = buf[:4 * n * heads].view("<f4").astype(np.float32)
    if not (np.isfinite(scales).all() and (scales > 0).all()):
        raise CodecError("fp8 payload has a non-finite or non-positive scale")
    with warnings.catch_warnings():  # torch warns about read-only buffers; we only read them
        warnings.simplefilter("ignore", UserWarning)
        q = torch.from_numpy(buf[4 * n * heads:]).view(torch.float8_e4m3fn).view(shape)
    x = q.to(torch.float32).mul_(torch.from_numpy(scales).view(n, 1, heads, 1))
    return memoryview(x.to(_DTYPES[dtype]).reshape(-1).view(torch.uint8).numpy())


# ---- lossless --------------------------------------------------------------------------------------------
_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("cctx", {})  # a zstd context is not thread-safe: one per thread
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    return cache[level]


def shuffle(data: Any, itemsize: int) -> np.ndarray:
    """Byte planes: byte i of every element together (a strided copy, no Python loop over elements)."""
    a = np.frombuffer(data, dtype=np.uint8)
    if itemsize == 1:
        return a
    out = np.empty((itemsize, a.size // itemsize), dtype=np.uint8)
    np.copyto(out, a.reshape(-1, itemsize).T)
    return out.reshape(-1)


def unshuffle(data: Any, itemsize: int) -> np.ndarray:
    """Inverse of ``shuffle``."""
    a = np.frombuffer(data, dtype=np.uint8)
    if itemsize == 1:
        return a
    planes = a.reshape(itemsize, -1)
    out = np.empty((planes.shape[1], itemsize), dtype=np.uint8)
    for i in range(itemsize):  # one strided copy per byte plane (2 or 4)
        out[:, i] = planes[i]
    return out.reshape(-1)


def compress(data: Any, itemsize: int, level: int = DEFAULT_LEVEL) -> bytes:
    """Shuffle then one zstd frame that declares its content size."""
    return _compressor(level).compress(shuffle(data, itemsize))


def decompress(data: Any, itemsize: int, size: int) -> np.ndarray:
    """Inverse of ``compress``, refusing anything but one zstd frame of exactly ``size`` bytes: a frame that
    declares another size (or none), expands past it, is truncated or has trailing bytes is a CodecError, and
    no more than ``size`` bytes (and a window of at most the next power of two) are ever allocated."""
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as exc:
        raise CodecError(f"not a zstd frame: {exc}") from None
    if params.content_size != size:
        declared = "no size" if params.content_size >= 2**63 else f"{params.content_size} bytes"
        raise CodecError(f"zstd frame declares {declared}, its blocks hold {size}")
    window = 1 << max(10, (size - 1).bit_length())
    try:
        out = zstandard.ZstdDecompressor(max_window_size=window).decompress(
            data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd frame does not decode to its declared {size} bytes: {exc}") from None
    if len(out) != size:
        raise CodecError(f"zstd frame decoded to {len(out)} bytes, expected {size}")
    return unshuffle(out, itemsize)


# ---- whole frames ----------------------------------------------------------------------------------------
def _as_tensor(payload: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if isinstance(payload, torch.Tensor):
        return payload.reshape(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(memoryview(payload).cast("B"), dtype=torch.uint8).view(_DTYPES[dtype]).view(shape)


def _raw_bytes(payload: Any) -> Any:
    if isinstance(payload, torch.Tensor):
        return payload.contiguous().reshape(-1).view(torch.uint8).numpy()
    return payload


def encode(payload: Any, spec: CodecSpec | str, dtype: str, shape: tuple[int, ...],
           level: int = DEFAULT_LEVEL) -> bytes:
    """Every stage of ``spec`` over one frame's payload (a tensor of ``shape`` or its raw bytes)."""
    spec = CodecSpec.parse(spec)
    data: Any = fp8_encode(_as_tensor(payload, dtype, shape)) if spec.fp8 else _raw_bytes(payload)
    if spec.lossless:
        data = compress(data, 1 if spec.fp8 else _ITEMSIZE[dtype], level)
    return bytes(data) if not isinstance(data, bytes) else data


def decode(data: Any, spec: CodecSpec | str, dtype: str, shape: tuple[int, ...], max_bytes: int) -> Any:
    """The raw payload bytes of a coded frame; ``max_bytes`` caps them (the size the frame's blocks imply, checked
    against the pool by the caller). CodecError on anything malformed; nothing larger is ever allocated."""
    spec = CodecSpec.parse(spec)
    if dtype not in _ITEMSIZE or len(shape) != 4:
        raise CodecError(f"cannot decode a {dtype} frame of shape {shape}")
    raw = math.prod(shape) * _ITEMSIZE[dtype]
    if raw > max_bytes:
        raise CodecError(f"frame's blocks hold {raw} bytes, more than the cap of {max_bytes}")
    inner = fp8_size(shape) if spec.fp8 else raw
    n = memoryview(data).nbytes
    if n > inner:  # the sender sends a stage only where it makes the frame smaller
        raise CodecError(f"coded payload of {n} bytes is larger than its decoded form ({inner})")
    if spec.lossless:
        data = decompress(data, 1 if spec.fp8 else _ITEMSIZE[dtype], inner)
    if spec.fp8:
        return fp8_decode(data, dtype, shape)
    if memoryview(data).nbytes != raw:
        raise CodecError(f"payload has {memoryview(data).nbytes} bytes, its blocks hold {raw}")
    return data


# ---- the sender's side of a link -------------------------------------------------------------------------
class AdaptiveLossless:
    """Whether the lossless stage pays on this link, judged per frame from what this transport measured.

    Sending B bytes raw takes B / L at the link's rate L; compressed it takes B / C + B / (r L), with C the
    compressor's throughput (input bytes/s on the one core the sender's loop runs on) and r its ratio. So a frame
    is compressed iff C (1 - 1/r) > L: on a fast link (in-site, loopback) it never is; on a slow WAN it is.
    This counts compressing and sending as serial, which is conservative (zmq overlaps them a little), and
    leaves out the receiver's decompression, which ran 3-5x faster than compression here (bench/codec.py).

    C and r are EWMAs over the frames compressed; L comes from the transport's sends: wire bytes over the
    time at least one send was in flight, less the time spent encoding (decayed sums, so large sends weigh
    most). A frame in every ``PROBE_EVERY`` is compressed regardless, so C and r stay current while the stage
    is off; until C, r and L are known every frame is compressed (``lossless`` was configured for a slow link).
    ``link_hint_bps`` (set by the in-process shaper: its emulated line) replaces the measured L.
    """

    PROBE_EVERY = 16
    ALPHA = 0.25  # EWMA weight of the newest frame
    DECAY = 0.5  # weight of the link history at each finished send

    def __init__(self) -> None:
        self.compress_bps: float | None = None
        self.ratio: float | None = None
        self.link_hint_bps: float | None = None
        self.encode_seconds = 0.0  # all stages, every frame: taken out of the link's busy time
        self._bytes = self._busy = 0.0
        self._active, self._mark, self._enc_mark = 0, 0.0, 0.0
        self._since_probe = self.PROBE_EVERY - 1  # the first frame probes
        self._lock = threading.Lock()

    @property
    def link_bps(self) -> float | None:
        if self.link_hint_bps:
            return self.link_hint_bps
        return self._bytes / self._busy if self._busy > 0 and self._bytes > 0 else None

    def pays(self) -> bool:
        """Compressing makes a frame cross sooner (True while anything is unmeasured)."""
        c, r, link = self.compress_bps, self.ratio, self.link_bps
        if c is None or r is None or link is None:
            return True
        return r > 1.0 and c * (1.0 - 1.0 / r) > link

    def want(self) -> bool:
        """Compress the next frame: it pays, or it is this period's probe."""
        with self._lock:
            self._since_probe += 1
            if self._since_probe >= self.PROBE_EVERY:
                self._since_probe = 0
                return True
        return self.pays()

    def observe_compress(self, n_in: int, n_out: int, seconds: float) -> None:
        with self._lock:
            if seconds > 0 and n_in > 0:
                c = n_in / seconds
                old = self.compress_bps
                self.compress_bps = c if old is None else (1 - self.ALPHA) * old + self.ALPHA * c
            if n_out > 0:
                r = n_in / n_out
                self.ratio = r if self.ratio is None else (1 - self.ALPHA) * self.ratio + self.ALPHA * r

    def add_encode_time(self, seconds: float) -> None:
        with self._lock:
            self.encode_seconds += seconds

    def send_began(self) -> None:
        with self._lock:
            if self._active == 0:
                self._mark, self._enc_mark = time.monotonic(), self.encode_seconds
            self._active += 1

    def send_ended(self, wire_bytes: int, ok: bool) -> None:
        """A send finished: its wire bytes over the link's busy time since the last mark (a failed send's time is
        dropped, not counted against the link)."""
        with self._lock:
            now = time.monotonic()
            busy = max(0.0, (now - self._mark) - (self.encode_seconds - self._enc_mark))
            self._mark, self._enc_mark = now, self.encode_seconds
            self._active = max(0, self._active - 1)
            if ok and wire_bytes > 0 and busy > 0:
                self._bytes = self.DECAY * self._bytes + wire_bytes
                self._busy = self.DECAY * self._busy + busy


class LinkEncoder:
    """One transport's encoder: applies its codec to each outgoing frame, the lossless stage when it pays."""

    def __init__(self, spec: CodecSpec | str, dtype: str, level: int = DEFAULT_LEVEL) -> None:
        self.spec = CodecSpec.parse(spec)
        self.dtype = dtype
        self.level = level
        self.adaptive = AdaptiveLossless()

    def encode(self, block: torch.Tensor, raw: Any) -> tuple[str, Any]:
        """(the codec the frame carries, its wire payload) for one frame's blocks (``raw``: their bytes)."""
        t0 = time.perf_counter()
        spec = self.spec
        data: Any = fp8_encode(block) if spec.fp8 else raw
        applied = spec.without_lossless()
        if spec.lossless and self.adaptive.want():
            n_in = memoryview(data).nbytes
            c0 = time.perf_counter()
            packed = compress(data, 1 if spec.fp8 else _ITEMSIZE[self.dtype], self.level)
            self.adaptive.observe_compress(n_in, len(packed), time.perf_counter() - c0)
            if len(packed) < n_in:  # never send a stage that makes the frame larger
                data, applied = packed, spec
        self.adaptive.add_encode_time(time.perf_counter() - t0)
        return applied.name, (memoryview(data) if isinstance(data, bytes) else data)

    def expected_ratio(self, shape: tuple[int, ...]) -> float:
        """Wire bytes per raw byte the next frames of this shape should take (what the shaper charges its line)."""
        raw = math.prod(shape) * _ITEMSIZE[self.dtype]
        ratio = fp8_size(shape) / raw if self.spec.fp8 else 1.0
        a = self.adaptive
        if self.spec.lossless and a.ratio and a.ratio > 1.0 and a.pays():
            ratio /= a.ratio
        return ratio
