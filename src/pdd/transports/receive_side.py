"""Receive side shared by every plugin: expectations, validation, writes, completion.

A request's destination blocks are registered with ``expect`` before its frames can arrive. A frame
is written only if its header is valid for the pool, its request is live, its blocks are expected
and not yet received, and its payload checksum matches. Writes and cancel/expiry share one lock, so
once ``cancel`` returns (or a deadline passes) no byte of that request reaches the pool. A coded frame
(codec.py) must carry a codec the link agreed on; it is checksummed as it crossed, then decoded into a
buffer capped at the size its blocks imply, and only a payload that decoded exactly is written.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import numpy as np
import torch

from . import telemetry
from .blocks import scatter
from .codec import NONE, CodecSpec, decode, summarize
from .errors import PeerLostError, TransferCancelled, TransferError, TransferTimeout
from .frames import CodecError, FrameHeader, UnexpectedFrame, check_against_layout, verify_payload


@dataclass
class SendProgress:
    """Bytes of one send that have crossed the link so far: acknowledged by the receiver (the in-process shaper
    also counts layers through its emulated line and still in its delay, on the wire). A send that fails, or
    whose caller cancels it (a relay finished the request first), has still moved these: the sender counts them."""

    crossed: int = 0


@dataclass
class TransferStats:
    """What one send (or one completed receive) moved. ``bytes`` crossed the link (payload bytes on the wire:
    what the WAN carried); ``raw_bytes`` is the KV they decode to (equal without a codec). ``codec`` is what the
    frames carried: the link's codec, ``none`` when the adaptive lossless stage skipped every frame, or
    ``<codec>(partial)`` when it ran on some frames only (codec.summarize)."""

    bytes: int
    seconds: float
    frames: int = 0
    codec: str = "none"
    raw_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.raw_bytes is None:
            self.raw_bytes = self.bytes

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0


class TransferHandle:
    """Awaitable completion of one expected request; raises a TransferError subclass on failure."""

    def __init__(self, request_id: str, future: concurrent.futures.Future, deadline: float,
                 on_timeout: Callable[[str, concurrent.futures.Future], None]) -> None:
        self.request_id = request_id
        self._future = future
        self._deadline = deadline
        self._on_timeout = on_timeout

    def done(self) -> bool:
        return self._future.done()

    async def wait(self) -> TransferStats:
        fut = asyncio.wrap_future(self._future)
        try:
            async with asyncio.timeout(max(0.0, self._deadline - time.monotonic())):
                return await asyncio.shield(fut)
        except asyncio.TimeoutError:
            self._on_timeout(self.request_id, self._future)
            return await fut  # now failed with TransferTimeout (or completed in the race)

    def __await__(self):
        return self.wait().__await__()


@dataclass
class _Expectation:
    request_id: str
    slot: dict[int, int]  # dst block id -> position
    received: np.ndarray  # bool [layers, 2, n]
    remaining: int  # (layer, tensor, block) slots not yet written; 0 = complete
    future: concurrent.futures.Future
    deadline: float
    trace_context: dict | None = None
    sources: set = field(default_factory=set)
    bytes: int = 0  # on the wire
    raw_bytes: int = 0
    codecs: set = field(default_factory=set)
    frames: int = 0
    started: float = field(default_factory=time.monotonic)


class ReceiveRegistry:
    def __init__(self, transport_name: str, layout: Any, k_cache: Sequence[torch.Tensor],
                 v_cache: Sequence[torch.Tensor], max_frame_bytes: int, codec: CodecSpec = NONE) -> None:
        self._name = transport_name
        self._codecs = codec.frame_codecs()  # what a frame on this link may carry
        self._layout = layout
        self._pools = (list(k_cache), list(v_cache))
        self._max_frame_bytes = max_frame_bytes
        self._lock = threading.Lock()
        self._live: dict[str, _Expectation] = {}

    # ---- caller side -------------------------------------------------------------------------
    def expect(self, request_id: str, dst_blocks: Sequence[int], timeout_s: float) -> TransferHandle:
        num_blocks = self._pools[0][0].shape[0]
        blocks = [int(b) for b in dst_blocks]
        if not blocks or len(set(blocks)) != len(blocks) or not all(0 <= b < num_blocks for b in blocks):
            raise ValueError(f"dst_blocks must be distinct ids in [0, {num_blocks}); got {len(blocks)} ids")
        now = time.monotonic()
        received = np.zeros((self._layout.num_layers, 2, len(blocks)), dtype=bool)
        exp = _Expectation(request_id, {b: i for i, b in enumerate(blocks)}, received, received.size,
                           concurrent.futures.Future(), now + timeout_s)
        with self._lock:
            self._purge_expired(now)
            if request_id in self._live:
                raise ValueError(f"request {request_id!r} is already expected")
            self._live[request_id] = exp
        return TransferHandle(request_id, exp.future, exp.deadline, self._expire)

    def cancel(self, request_id: str) -> None:
        self._fail(request_id, TransferCancelled(f"request {request_id} cancelled", request_id))

    def peer_lost(self, source: Hashable, reason: str = "sender disconnected") -> None:
        """A connection closed (or went silent): fail the unfinished requests that were receiving from it."""
        with self._lock:
            hit = [rid for rid, e in self._live.items() if source in e.sources]
        for rid in hit:
            self._fail(rid, PeerLostError(f"{reason} in the middle of request {rid}", rid))

    def close(self) -> None:
        with self._lock:
            rids = list(self._live)
        for rid in rids:
            self._fail(rid, TransferCancelled("transport closed", rid))

    def pending(self) -> int:
        with self._lock:
            return len(self._live)

    # ---- transport side ----------------------------------------------------------------------
    def accept(self, header: FrameHeader, payload: Any, source: Hashable = None) -> int:
        """Validate and write one frame; return its byte count on the wire or raise a FrameError.

        A frame with a known request id that fails validation also fails that request (its data
        cannot arrive intact any more); frames for unknown requests are only rejected.
        """
        lay = self._layout
        try:
            check_against_layout(header, lay.num_layers, lay.block_shape, lay.dtype, self._max_frame_bytes)
            if header.codec not in self._codecs:
                raise CodecError(f"frame carries codec {header.codec!r}; this link's codec allows only "
                                 f"{sorted(self._codecs)}", header.request_id)
            verify_payload(header, payload)
            if header.codec != "none":
                if header.request_id not in self._live:  # re-checked under the lock; spares decoding junk
                    raise UnexpectedFrame(f"no live expectation for request {header.request_id!r}",
                                          header.request_id)
                try:
                    payload = decode(payload, header.codec, header.dtype, header.shape, header.nbytes)
                except CodecError as exc:
                    exc.request_id = header.request_id
                    raise
        except TransferError as exc:
            self._fail(header.request_id, exc, only_if_live=True)
            raise
        done: _Expectation | None = None
        with self._lock:
            exp = self._live.get(header.request_id)
            if exp is None or exp.deadline < time.monotonic():
                raise UnexpectedFrame(f"no live expectation for request {header.request_id!r}",
                                      header.request_id)
            try:
                pos = [exp.slot[b] for b in header.block_ids]
            except KeyError as missing:
                err = UnexpectedFrame(f"block {missing} is not expected for this request", header.request_id)
                self._fail_locked(exp, err)
                raise err from None
            seen = exp.received[header.layer, header.tensor]
            first, n = pos[0], len(pos)
            # a run of consecutive slots (the usual case) is checked and marked as a slice
            idx = slice(first, first + n) if pos[-1] - first == n - 1 and pos == list(range(first, first + n)) \
                else np.asarray(pos)
            if seen[idx].any():
                err = UnexpectedFrame("duplicate frame for already received blocks", header.request_id)
                self._fail_locked(exp, err)
                raise err
            scatter(self._pools[header.tensor][header.layer], header.block_ids, payload)
            seen[idx] = True
            exp.remaining -= n  # header block ids are distinct (decode_header) and were all unseen
            exp.bytes += header.wire_nbytes
            exp.raw_bytes += header.nbytes
            exp.codecs.add(header.codec)
            exp.frames += 1
            exp.trace_context = exp.trace_context or header.trace_context
            if source is not None:
                exp.sources.add(source)
            if exp.remaining == 0:
                del self._live[header.request_id]
                done = exp
        if done is not None:
            stats = TransferStats(done.bytes, time.monotonic() - done.started, done.frames, summarize(done.codecs),
                                  done.raw_bytes)
            telemetry.record(self._name, "recv", stats.bytes, stats.seconds, done.trace_context,
                             request_id=done.request_id)
            if not done.future.done():  # it may have been failed (timeout, cancel) in a race
                done.future.set_result(stats)
        return header.wire_nbytes

    # ---- internals ---------------------------------------------------------------------------
    def _expire(self, request_id: str, future: concurrent.futures.Future) -> None:
        with self._lock:
            exp = self._live.get(request_id)
            if exp is not None and exp.future is future:
                self._fail_locked(exp, TransferTimeout(
                    f"request {request_id}: not all KV blocks arrived before the deadline", request_id))

    def _purge_expired(self, now: float) -> None:
        for exp in [e for e in self._live.values() if e.deadline < now]:
            self._fail_locked(exp, TransferTimeout(f"request {exp.request_id} timed out", exp.request_id))

    def _fail(self, request_id: str, exc: TransferError, only_if_live: bool = False) -> None:
        with self._lock:
            exp = self._live.get(request_id)
            if exp is not None:
                self._fail_locked(exp, exc)

    def _fail_locked(self, exp: _Expectation, exc: TransferError) -> None:
        self._live.pop(exp.request_id, None)
        if not exp.future.done():
            exp.future.set_exception(exc)
