"""The KV transport interface (the plugin registry is plugins.py).

A transport moves KV *blocks* between two paged pools and knows nothing about models:

    t = create_transport("zmq", {"streams": 4})  # plugins.py
    await t.start(); t.register(layout, k_cache, v_cache)
    desc = t.descriptor()                      # -> peers, over NATS
    peer = await t.connect(remote_desc)        # sender side
    handle = t.expect(rid, dst_blocks)         # receiver side, before the sender starts
    stats = await t.send(peer, rid, src, dst, layers=range(0, 8))   # repeatable per layer range
    await handle                               # TransferStats, or a TransferError subclass

Plugins subclass KVTransport and fill in five hooks (_start, _address, _connect, _send_frames,
_close); validation, framing, the wire codec (codec.py), completion tracking and telemetry live here and in
receive_side.py, so every plugin behaves the same. Third parties add plugins through the ``pdd.transports`` entry-point
group.
"""

from __future__ import annotations

import abc
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

import torch

from pdd.shared.kv_layout import KVLayout

from . import telemetry
from .blocks import FramePlan, byte_view, gather, plan_frames
from .codec import CodecSpec, LinkEncoder, summarize
from .errors import IncompatiblePeerError
from .frames import FrameHeader, UnexpectedFrame, checksum, decode_header
from .receive_side import ReceiveRegistry, SendProgress, TransferHandle, TransferStats

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 16 << 20  # bulk KV: fewer, larger frames (per-frame cost ~1-3 ms CPU)

__all__ = ["KVTransport", "Peer", "SendProgress", "TransferHandle", "TransferStats"]


@dataclass
class Peer:
    """A connected remote pool; ``state`` belongs to the plugin."""

    peer_id: str
    descriptor: dict
    layout: KVLayout
    num_blocks: int
    state: Any = field(default=None, repr=False)


class KVTransport(abc.ABC):
    name: ClassVar[str] = "abstract"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.options = dict(options or {})
        self.instance_id = uuid.uuid4().hex[:12]
        self.max_frame_bytes = int(self.options.get("max_frame_bytes", DEFAULT_MAX_FRAME_BYTES))
        self.codec = CodecSpec.parse(self.options.get("codec"))  # ValueError names the allowed codecs
        self._encoder: LinkEncoder | None = None
        self._link_hint_bps: float | None = None
        self.layout: KVLayout | None = None
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._registry: ReceiveRegistry | None = None
        self._started = False

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Open listeners and worker threads."""
        if not self._started:
            await self._start()
            self._started = True

    async def close(self) -> None:
        """Fail pending receives with TransferCancelled, close sockets, stop threads."""
        if self._registry is not None:
            self._registry.close()
        if self._started:
            self._started = False
            await self._close()

    # ---- memory ------------------------------------------------------------------------------
    def register(self, layout: KVLayout, k_cache: Sequence[torch.Tensor], v_cache: Sequence[torch.Tensor]) -> None:
        """Register the pool: per layer, K and V tensors of [num_blocks, *layout.block_shape]."""
        if len(k_cache) != layout.num_layers or len(v_cache) != layout.num_layers:
            raise ValueError(f"expected {layout.num_layers} K and V tensors, got {len(k_cache)}/{len(v_cache)}")
        n = k_cache[0].shape[0]
        for t in [*k_cache, *v_cache]:
            if tuple(t.shape) != (n, *layout.block_shape) or t.dtype != layout.torch_dtype or not t.is_contiguous():
                raise ValueError(f"pool tensor {tuple(t.shape)} {t.dtype} does not match layout "
                                 f"[{n}, {layout.block_shape}] {layout.dtype} (contiguous)")
        self.layout, self._k, self._v = layout, list(k_cache), list(v_cache)
        self._registry = ReceiveRegistry(self.name, layout, self._k, self._v, self.max_frame_bytes, self.codec)
        self._encoder = LinkEncoder(self.codec, layout.dtype) if self.codec.active else None
        self.set_link_rate_hint(self._link_hint_bps)

    @property
    def num_blocks(self) -> int:
        return self._k[0].shape[0] if self._k else 0

    def descriptor(self) -> dict:
        """Everything a peer needs to connect to us; msgpack-able, travels over NATS."""
        self._require_registered()
        return {"transport": self.name, "protocol": PROTOCOL_VERSION, "instance_id": self.instance_id,
                "layout": self.layout.to_dict(), "num_blocks": self.num_blocks, "codec": self.codec.name,
                **self._address()}

    def check_codec(self, desc: Mapping[str, Any]) -> None:
        """Refuse a peer whose link codec differs from ours (IncompatiblePeerError naming both): a sender must
        never put lossy (fp8) KV into a pool that did not ask for it, nor a receiver wait for frames it refuses.
        A descriptor without ``codec`` (before codecs) means ``none``."""
        theirs = desc.get("codec", "none")
        try:
            remote = CodecSpec.parse(theirs)
        except ValueError:
            raise IncompatiblePeerError(f"KV codec mismatch: ours {self.codec.name!r}, the peer's {theirs!r} "
                                        f"(unknown here)") from None
        if remote != self.codec:
            raise IncompatiblePeerError(f"KV codec mismatch: ours {self.codec.name!r}, the peer's {remote.name!r}")

    # ---- sender side -------------------------------------------------------------------------
    async def connect(self, desc: Mapping[str, Any]) -> Peer:
        """Check that the peer speaks our transport and page layout, then open the link."""
        self._require_registered()
        if desc.get("transport") != self.name or desc.get("protocol") != PROTOCOL_VERSION:
            raise IncompatiblePeerError(f"peer speaks {desc.get('transport')!r} v{desc.get('protocol')}, "
                                        f"we speak {self.name!r} v{PROTOCOL_VERSION}")
        try:
            layout = KVLayout.from_dict(desc["layout"])
        except (KeyError, TypeError, ValueError) as exc:
            raise IncompatiblePeerError(f"peer descriptor has no valid layout: {exc}") from None
        if not layout.compatible_with(self.layout):
            raise IncompatiblePeerError(f"KV layout mismatch: ours {self.layout}, peer's {layout}")
        self.check_codec(desc)
        peer = Peer(str(desc.get("instance_id", "")), dict(desc), layout, int(desc.get("num_blocks", 0)))
        peer.state = await self._connect(peer)
        return peer

    async def send(self, peer: Peer, request_id: str, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                   layers: range | Sequence[int] | None = None, trace_context: dict | None = None,
                   progress: SendProgress | None = None) -> TransferStats:
        """Send blocks src->dst for the given layers (all by default); returns when all are acknowledged.
        ``progress`` counts the bytes that crossed as they do, for a caller whose send may fail or be cancelled."""
        self._require_registered()
        src, dst = [int(b) for b in src_blocks], [int(b) for b in dst_blocks]
        layers = list(range(self.layout.num_layers) if layers is None else layers)
        if len(src) != len(dst) or not src:
            raise ValueError("src_blocks and dst_blocks must be non-empty and of equal length")
        if not all(0 <= b < self.num_blocks for b in src):
            raise ValueError(f"src block ids must lie in [0, {self.num_blocks})")
        if peer.num_blocks and not all(0 <= b < peer.num_blocks for b in dst):
            raise ValueError(f"dst block ids must lie in [0, {peer.num_blocks}) on the peer")
        if not all(0 <= layer < self.layout.num_layers for layer in layers):
            raise ValueError(f"layers must lie in [0, {self.layout.num_layers})")
        tally: dict[str, int] = {}
        per_block = self.layout.bytes_per_block_per_tensor
        plans = plan_frames(src, dst, layers, per_block, self.max_frame_bytes, tally)
        t0 = time.monotonic()
        adaptive = self._encoder.adaptive if self._encoder is not None else None
        if adaptive is not None:
            adaptive.send_began()
        nbytes = 0
        try:
            nbytes = await self._send_frames(peer, request_id, plans, trace_context,
                                             progress if progress is not None else SendProgress())
        finally:
            if adaptive is not None:
                adaptive.send_ended(nbytes, nbytes > 0)
        stats = TransferStats(nbytes, time.monotonic() - t0, len(plans), summarize(tally),
                              2 * len(src) * len(layers) * per_block)
        telemetry.record(self.name, "send", nbytes, stats.seconds, trace_context, request_id)
        return stats

    def expected_wire_ratio(self) -> float:
        """Wire bytes per KV byte the next frames should take: 1 without a codec; the fp8 size and the lossless
        stage's measured ratio (while it pays) with one. The in-process shaper charges its line with it."""
        if self._encoder is None or self.layout is None:
            return 1.0
        return self._encoder.expected_ratio((1, *self.layout.block_shape))

    def set_link_rate_hint(self, bytes_per_s: float | None) -> None:
        """The link's rate when it is known better than this transport can measure it (the in-process shaper's
        emulated line: its own sends run at loopback speed); the adaptive lossless stage judges against it."""
        self._link_hint_bps = bytes_per_s
        if self._encoder is not None:
            self._encoder.adaptive.link_hint_bps = bytes_per_s

    async def disconnect(self, peer: Peer) -> None:
        """Close the link to one peer (default: nothing to do)."""

    # ---- receiver side -----------------------------------------------------------------------
    def expect(self, request_id: str, dst_blocks: Sequence[int], timeout_s: float = 30.0) -> TransferHandle:
        """Pre-register where request_id's frames may land (all layers, K and V, these blocks)."""
        self._require_registered()
        return self._registry.expect(request_id, dst_blocks, timeout_s)

    def cancel(self, request_id: str) -> None:
        """Stop accepting frames for request_id; its handle raises TransferCancelled."""
        if self._registry is not None:
            self._registry.cancel(request_id)

    # ---- plugin hooks ------------------------------------------------------------------------
    @abc.abstractmethod
    async def _start(self) -> None: ...

    @abc.abstractmethod
    def _address(self) -> dict:
        """Plugin-specific descriptor fields (address, keys)."""

    @abc.abstractmethod
    async def _connect(self, peer: Peer) -> Any:
        """Open the link; return the plugin's per-peer state."""

    @abc.abstractmethod
    async def _send_frames(self, peer: Peer, request_id: str, plans: list[FramePlan],
                           trace_context: dict | None, progress: SendProgress) -> int:
        """Send every planned frame, wait for acknowledgements, return payload bytes sent; add each frame's
        bytes to ``progress`` as it is acknowledged."""

    @abc.abstractmethod
    async def _close(self) -> None: ...

    # ---- helpers for plugins -----------------------------------------------------------------
    def _require_registered(self) -> None:
        if self.layout is None:
            raise RuntimeError(f"{self.name} transport: call register(layout, k_cache, v_cache) first")

    def _build_frame(self, request_id: str, plan: FramePlan, trace_context: dict | None) -> tuple[bytes, memoryview]:
        """Header bytes and a payload view for one planned frame: zero-copy when the blocks are consecutive and
        the link has no codec; else the frame's coded bytes (codec.py)."""
        pool = (self._k if plan.tensor == 0 else self._v)[plan.layer]
        blocks = gather(pool, plan.src)
        raw = byte_view(blocks)
        codec, payload = "none", raw
        if self._encoder is not None:
            codec, payload = self._encoder.encode(blocks, raw)
        if plan.tally is not None:
            plan.tally[codec] = plan.tally.get(codec, 0) + 1
        header = FrameHeader(request_id, plan.layer, plan.tensor, plan.dst, self.layout.dtype,
                             (len(plan.dst), *self.layout.block_shape), raw.nbytes,
                             checksum(payload), trace_context, codec, payload.nbytes)
        return header.encode(), payload

    def _receive_frame(self, header: bytes | memoryview, payload: Any, source: Any = None) -> int:
        """Decode, validate and write one incoming frame; raises a FrameError subclass if bad."""
        if self._registry is None:
            raise UnexpectedFrame("no pool registered on this receiver")
        return self._registry.accept(decode_header(header), payload, source)
