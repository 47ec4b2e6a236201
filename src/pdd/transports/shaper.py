"""Portable in-process WAN shaper: wraps any transport and adds rate, delay, jitter, and a down switch.

For non-root machines and unit tests. Each send is cut per layer; a layer's bytes occupy the
emulated link for ``bytes / rate`` (a token bucket shared by all sends of this transport, so
concurrent transfers share bandwidth), then arrive ``delay ± jitter`` later (in order, like a FIFO
link). ``flow_rate`` adds what one TCP flow gets on a long fat pipe: a send is striped over the
transport's ``streams`` flows, so it also takes at least ``bytes / (streams x flow_rate)`` on its own
(a bucket per send), however idle the line; several sends share ``rate``, the line. ``set_down(True)`` blackholes the link: sends stall and fail with PeerLostError after
``down_timeout_s`` while receivers see nothing — a WAN cut. ``down_file``: the link is also down
while that file exists, so a test or an operator can cut a running service's WAN from outside.
With a codec (codec.py) the line is charged the bytes that would cross it: the KV bytes times the wrapped
transport's expected wire ratio (fp8's size, the lossless stage's measured ratio while it pays).
The wrapped transport's adaptive lossless stage judges against the emulated line's rate, not loopback's.
``wire_ratio`` emulates a codec instead (emulated KV is not real KV: it compresses absurdly well and fp8 would
garble it, so the wrapped link runs without a codec and the shaper is given the ratio pdd.bench.codec measured
on real KV): the line is charged ``wire_ratio`` x the KV bytes, and the send's stats and ``SendProgress`` count
those wire bytes (``raw_bytes`` the KV), so the WAN byte counters read what the coded link would have carried.
The wrapped link must then have no codec of its own (a ValueError otherwise).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any, Sequence

from .base import KVTransport, Peer, SendProgress
from .codec import summarize
from .errors import PeerLostError
from .receive_side import TransferHandle, TransferStats
from .units import rate_bits, seconds


class ShapedTransport(KVTransport):
    def __init__(self, inner: KVTransport, rate: str | float | None = None, delay: str | float = 0.0,
                 jitter: str | float = 0.0, seed: int = 0, down_timeout_s: float = 10.0,
                 down_file: str | None = None, flow_rate: str | float | None = None,
                 wire_ratio: float | None = None) -> None:
        super().__init__(inner.options)
        self.inner = inner
        self.name = inner.name  # peers see the real transport
        self.rate_bps = rate_bits(rate) if rate else None
        streams = max(1, int(inner.options.get("streams", 1) or 1))
        self.transfer_bps = rate_bits(flow_rate) * streams if flow_rate else None  # one send's own ceiling
        self.delay_s, self.jitter_s = seconds(delay), seconds(jitter)
        self.wire_ratio = float(wire_ratio) if wire_ratio is not None else None
        if self.wire_ratio is not None and not 0 < self.wire_ratio <= 1:
            raise ValueError(f"shaper: wire_ratio is wire bytes per KV byte, in (0, 1] (got {wire_ratio!r})")
        if self.wire_ratio and inner.codec.active:
            raise ValueError(f"shaper: wire_ratio emulates a codec, but the wrapped link has one ({inner.codec.name}): "
                             "charge its own wire bytes (no wire_ratio) or give it codec none")
        line = min(r for r in (self.rate_bps, self.transfer_bps) if r) if (self.rate_bps or self.transfer_bps) else None
        inner.set_link_rate_hint(line / 8 if line else None)
        self.down_timeout_s = down_timeout_s
        self.down_file = down_file
        self._rng = random.Random(seed)
        self._link_free_at = 0.0  # token bucket as a virtual clock
        self._last_arrival = 0.0
        self._up = asyncio.Event()
        self._up.set()

    def set_down(self, down: bool = True) -> None:
        """Cut (True) or restore (False) the emulated link."""
        (self._up.clear if down else self._up.set)()

    # ---- delegation --------------------------------------------------------------------------
    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    def register(self, layout: Any, k_cache: Sequence[Any], v_cache: Sequence[Any]) -> None:
        self.inner.register(layout, k_cache, v_cache)
        self.layout = layout

    def descriptor(self) -> dict:
        return self.inner.descriptor()

    async def connect(self, desc: dict) -> Peer:
        return await self.inner.connect(desc)

    async def disconnect(self, peer: Peer) -> None:
        await self.inner.disconnect(peer)

    def expect(self, request_id: str, dst_blocks: Sequence[int], timeout_s: float = 30.0) -> TransferHandle:
        return self.inner.expect(request_id, dst_blocks, timeout_s)

    def cancel(self, request_id: str) -> None:
        self.inner.cancel(request_id)

    # ---- shaping -----------------------------------------------------------------------------
    async def send(self, peer: Peer, request_id: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                   layers: range | Sequence[int] | None = None, trace_context: dict | None = None,
                   progress: SendProgress | None = None) -> TransferStats:
        layers = list(range(self.inner.layout.num_layers) if layers is None else layers)
        ratio = self.wire_ratio or self.inner.expected_wire_ratio()
        per_layer = round(2 * len(src_blocks) * self.inner.layout.bytes_per_block_per_tensor * ratio)
        # the wrapped link's acknowledged bytes reach ``progress`` as wire bytes
        acked = _WireProgress(progress, self.wire_ratio) if self.wire_ratio and progress is not None else progress
        t0 = time.monotonic()
        deliveries = []
        crossed_at: list[float] = []  # per layer, when its bytes are through the line (then the delay)
        begun: set[int] = set()  # layers handed to the inner transport (their acknowledgements count themselves)
        own_free_at = [t0]  # this send's flows, as a virtual clock
        try:
            for i, layer in enumerate(layers):
                await self._wait_up(request_id)
                crossed, arrival = self._schedule(per_layer, own_free_at)
                crossed_at.append(crossed)
                deliveries.append(asyncio.create_task(self._deliver(
                    arrival, peer, request_id, src_blocks, dst_blocks, [layer], trace_context, acked, begun, i)))
            # every layer's delivery runs to its end (success or a typed failure): cancelling one mid-send
            # could cut a frame in half on the wire
            outcomes = await asyncio.gather(*deliveries, return_exceptions=True)
        except asyncio.CancelledError:
            if progress is not None:  # layers through the line but still in its delay were on the wire: they crossed
                now = time.monotonic()
                progress.crossed += per_layer * sum(
                    1 for i, t in enumerate(crossed_at) if t <= now and i not in begun)
            raise
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            raise failures[0]
        results = outcomes
        raw = sum(r.raw_bytes for r in results)
        wire = per_layer * len(layers) if self.wire_ratio else sum(r.bytes for r in results)
        return TransferStats(wire, time.monotonic() - t0, sum(r.frames for r in results),
                             summarize(r.codec for r in results), raw)

    def _schedule(self, nbytes: int, own_free_at: list[float]) -> tuple[float, float]:
        """Monotonic times at which these bytes are through the emulated line, and at which they arrive (the delay
        later): through the line (shared) and through this send's own flows (``own_free_at``, its virtual
        clock), whichever ends later."""
        now = time.monotonic()
        start = max(now, self._link_free_at)
        self._link_free_at = start + (nbytes * 8 / self.rate_bps if self.rate_bps else 0.0)
        crossed = self._link_free_at
        if self.transfer_bps:
            own_free_at[0] = max(now, own_free_at[0]) + nbytes * 8 / self.transfer_bps
            crossed = max(crossed, own_free_at[0])
        jitter = self._rng.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s else 0.0
        arrival = max(crossed + max(0.0, self.delay_s + jitter), self._last_arrival)
        self._last_arrival = arrival
        return crossed, arrival

    async def _deliver(self, at: float, peer: Peer, rid: str, src: Sequence[int], dst: Sequence[int],
                       layers: list[int], tc: dict | None, progress: SendProgress | None, begun: set[int],
                       index: int) -> TransferStats:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        await self._wait_up(rid)
        begun.add(index)
        return await self.inner.send(peer, rid, src, dst, layers, tc, progress)

    def is_up(self) -> bool:
        return self._up.is_set() and not (self.down_file and os.path.exists(self.down_file))

    async def _wait_up(self, rid: str) -> None:
        deadline = time.monotonic() + self.down_timeout_s
        while not self.is_up():
            if time.monotonic() >= deadline:
                raise PeerLostError(f"emulated WAN link down for {self.down_timeout_s}s", rid)
            try:
                async with asyncio.timeout(0.05):  # wakes at once on set_down(False)
                    await self._up.wait()
                if self.down_file:
                    await asyncio.sleep(0.05)  # the file is polled
            except asyncio.TimeoutError:
                pass

    # KVTransport hooks are unused: every public method delegates to the wrapped transport.
    async def _start(self) -> None: ...
    def _address(self) -> dict: return {}
    async def _connect(self, peer: Peer) -> Any: ...
    async def _send_frames(self, *a: Any) -> int: return 0
    async def _close(self) -> None: ...


class _WireProgress(SendProgress):
    """A send's progress as the wrapped transport adds to it (KV bytes acknowledged), passed on to ``outer`` as
    wire bytes (x ``ratio``): what an emulated codec's line carried."""

    def __init__(self, outer: SendProgress, ratio: float) -> None:
        self._outer, self._ratio, self._kv = outer, ratio, 0

    @property  # type: ignore[override]
    def crossed(self) -> int:
        return self._kv

    @crossed.setter
    def crossed(self, value: int) -> None:
        self._outer.crossed += round(value * self._ratio) - round(self._kv * self._ratio)
        self._kv = value
