"""UCX transport (ucxx) for the in-site fast path: RDMA where the hardware and UCX build have it,
otherwise tcp/shm/cma — same code.

Frames travel in **batches** (wire 2): per batch the sender posts, without waiting between them, a
16-byte prefix ``(seq, nframes, index_len)``, an index (per frame ``(header_len, payload_len)``,
then the headers), and one message per frame payload (a view of the pool). The receiver checks the
prefix and index bounds before allocating, receives the payloads into a staging buffer, validates
every frame and only then copies it into the pool, and answers ``(seq, code)`` once per batch.
Batching matters: every awaited ucxx message costs a hand-off between the UCX progress thread, the
notifier thread and this loop (~1-2 ms on a loaded 2-core host), which with one frame per layer and
tensor (60 for SmolLM2) made per-message latency, not bytes, the cost of a transfer.
Acknowledgements give the same backpressure and peer-loss detection as the zmq plugin. ucxx keeps
one context per process, so all UcxTransport instances of a process share one private event-loop
thread.

Two endpoints per link. The **control** endpoint (listener, UCX peer error handling) carries the
batch prefixes, indexes and acknowledgements, and detects a lost peer. The **data** endpoint, made from
the receiver's worker address (advertised in its descriptor) with error handling off, carries the
payloads, tagged per link and batch. Why two: UCX turns its shared-memory transports (posix/sysv/cma)
off on endpoints with peer error handling, so one endpoint ran intra-node transfers over tcp/lo
(raw ucxx: 0.1-0.5 GB/s here, 2.3-3.1 GB/s over the data endpoint, load ~10). Without error handling a
dead receiver leaves data sends pending instead of failing them; the control endpoint and the
acknowledgement timeout turn that into ``PeerLostError``, and the pool memory they read stays valid.
Between hosts the same data endpoint uses RDMA or tcp, whichever UCX picks.

Why one module: the sender and the receiver are two halves of one wire format (prefix, index, tagged
payloads, acknowledgements, the hello); split, every change to the wire would touch both files.

Endpoint creation is retried with a hello exchange (a first connect occasionally fails with
"Endpoint is not connected"); the hello also names the link's data tag and wires the data endpoint up
with one small message, so the first transfer does not pay for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import struct
import threading
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# ucxx's default progress mode busy-polls requests: 25-45% of a core per process even when idle,
# and erratic transfer times on small CPU hosts. Python futures wake on completion instead.
os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")

from .base import KVTransport, Peer, SendProgress  # noqa: E402
from .blocks import FramePlan  # noqa: E402
from .errors import IncompatiblePeerError, PeerLostError, RemoteRejected, TransferCancelled, TransferError  # noqa: E402
from .frames import MAX_HEADER_BYTES, OversizeFrame, error_class  # noqa: E402
from .loop_thread import LoopThread  # noqa: E402
from .window import AckWindow  # noqa: E402

log = logging.getLogger(__name__)

_PREFIX = struct.Struct(">QII")  # seq, nframes, index_len
_ENTRY = struct.Struct(">II")  # per frame in the index: header_len, payload_len
_ACK = struct.Struct(">QI")  # seq, code
_HELLO = 2**64 - 1
WIRE_VERSION = 3  # 1: one frame per prefix/header/payload triple; 2: batches; 3: payloads on a data endpoint
MAX_BATCH_FRAMES = 4096
DEFAULT_BATCH_BYTES = 4 << 20  # payload per batch: large enough to amortise, small enough to pipeline
MAX_BATCH_BYTES = 64 << 20  # what a receiver stages for one batch (or one frame, if max_frame_bytes is larger)


def pack_batch(seq: int, frames: list[tuple[bytes, Any]]) -> tuple[bytes, bytes]:
    """The prefix and index messages of one batch of (header, payload) frames."""
    index = b"".join(_ENTRY.pack(len(h), memoryview(p).nbytes) for h, p in frames) + b"".join(h for h, _ in frames)
    return _PREFIX.pack(seq, len(frames), len(index)), index

_shared_loop: LoopThread | None = None
_shared_lock = threading.Lock()


def _loop() -> LoopThread:
    global _shared_loop
    with _shared_lock:
        if _shared_loop is None:
            _shared_loop = LoopThread("pdd-ucx")
        return _shared_loop


_WIREUP = 0xFFFFFFFF  # the data tag's batch field of the hello's wire-up message


def data_tag(link_id: int, seq: int) -> int:
    """The tag of a batch's payloads on the data endpoint: unique per link (random id) and batch."""
    return ((link_id & 0xFFFFFFFF) << 32) | (seq & 0xFFFFFFFF)


@dataclass
class _Link(AckWindow):
    ep: Any
    data_ep: Any = None
    link_id: int = 0
    reader: asyncio.Task | None = None


class UcxTransport(KVTransport):
    name = "ucx"

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        o = self.options
        self.host = str(o.get("advertise_host", o.get("bind_host", "127.0.0.1")))
        self.port = int(o.get("port", 0))
        self.window_bytes = int(o.get("window_bytes", 64 << 20))
        self.batch_bytes = max(1, min(int(o.get("batch_bytes", DEFAULT_BATCH_BYTES)), MAX_BATCH_BYTES))
        self.ack_timeout_s = float(o.get("ack_timeout_s", 15.0))
        self.connect_timeout_s = float(o.get("connect_timeout_s", 10.0))
        self._lt: LoopThread | None = None
        self._links: list[_Link] = []
        self._handlers: set[asyncio.Task] = set()
        self._server_eps: set[Any] = set()

    async def _start(self) -> None:
        import ucxx  # noqa: F401  (fail here, clearly, if ucxx is missing)

        self._lt = _loop()
        await self._lt.run(self._start_here())

    async def _start_here(self) -> None:
        import ucxx

        self._listener = ucxx.create_listener(self._on_connect, self.port or None)
        self.port = self._listener.port
        self._worker_address = bytes(ucxx.get_worker_address())

    def _address(self) -> dict:
        return {"address": f"{self.host}:{self.port}", "wire": WIRE_VERSION, "worker": self._worker_address.hex()}

    async def _close(self) -> None:
        if self._lt is not None:
            await self._lt.run(self._close_here())
            self._lt = None

    async def _close_here(self) -> None:
        for link in self._links:
            await self._close_link(link)
        for ep in list(self._server_eps):
            await _quiet_close(ep)
        for t in list(self._handlers):
            t.cancel()
        self._listener.close()

    # ---- receiver ----------------------------------------------------------------------------
    async def _on_connect(self, ep: Any) -> None:
        task = asyncio.current_task()
        self._handlers.add(task)
        self._server_eps.add(ep)
        source = ("ucx", id(ep))
        try:
            await self._serve(ep, source)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001  ucxx raises its own hierarchy on peer loss
            log.info("ucx transport: endpoint closed: %s", exc)
        finally:
            if self._registry is not None:
                self._registry.peer_lost(source)
            self._handlers.discard(task)
            self._server_eps.discard(ep)
            await _quiet_close(ep)

    async def _serve(self, ep: Any, source: Any) -> None:
        import ucxx

        link_id = None
        lost = _loss_signal(ep)
        prefix = bytearray(_PREFIX.size)
        staging = bytearray(0)
        max_index = MAX_BATCH_FRAMES * (_ENTRY.size + MAX_HEADER_BYTES)
        max_total = max(MAX_BATCH_BYTES, self.max_frame_bytes)
        while True:
            await ep.recv(prefix)
            seq, nframes, ilen = _PREFIX.unpack(prefix)
            if seq == _HELLO:
                if ilen != 8:
                    raise IncompatiblePeerError(f"ucx hello of {ilen} bytes: the sender speaks an older wire")
                hello = bytearray(8)
                await ep.recv(hello)
                link_id = int.from_bytes(hello, "big")
                await _unless_lost(ucxx.recv(bytearray(8), data_tag(link_id, _WIREUP)), lost)  # data wire-up
                await ep.send(_ACK.pack(seq, 0))
                continue
            if link_id is None:
                raise IncompatiblePeerError("ucx batch before the hello")
            if not 0 < nframes <= MAX_BATCH_FRAMES or not nframes * (_ENTRY.size + 14) <= ilen <= max_index:
                # Cannot receive it without trusting its size: reject and drop this endpoint.
                await ep.send(_ACK.pack(seq, OversizeFrame.code))
                raise OversizeFrame(f"batch prefix announces {nframes} frames in {ilen} index bytes")
            index = bytearray(ilen)
            await ep.recv(index)
            sizes = [_ENTRY.unpack_from(index, i * _ENTRY.size) for i in range(nframes)]
            total = sum(p for _, p in sizes)
            if (any(not 0 < h <= MAX_HEADER_BYTES or p > self.max_frame_bytes for h, p in sizes)
                    or total > max_total or nframes * _ENTRY.size + sum(h for h, _ in sizes) != ilen):
                await ep.send(_ACK.pack(seq, OversizeFrame.code))
                raise OversizeFrame(f"batch index announces {total} payload bytes, a frame over {self.max_frame_bytes}, "
                                    f"or inconsistent lengths")
            if len(staging) < total:
                staging = bytearray(total)
            view = memoryview(staging)
            frames, recvs, hoff, poff = [], [], nframes * _ENTRY.size, 0
            for hlen, plen in sizes:
                payload = view[poff:poff + plen]
                frames.append((memoryview(index)[hoff:hoff + hlen], payload))
                if plen:
                    recvs.append(ucxx.recv(payload, data_tag(link_id, seq)))
                hoff, poff = hoff + hlen, poff + plen
            if recvs:  # posted together, in order: one tag per batch, and UCX keeps a sender's order per tag
                await _unless_lost(asyncio.gather(*recvs), lost)
            code = 0
            for header, payload in frames:
                try:
                    self._receive_frame(header, payload, source)
                except TransferError as exc:
                    code = code or exc.code
                    log.warning("ucx transport: rejected frame: %s: %s", type(exc).__name__, exc)
                except Exception:  # a bug must cost one frame, never the receive loop
                    code = code or 11
                    log.exception("ucx transport: frame handling failed")
            await ep.send(_ACK.pack(seq, code))

    # ---- sender ------------------------------------------------------------------------------
    async def _connect(self, peer: Peer) -> _Link:
        if peer.descriptor.get("wire", 1) != WIRE_VERSION:
            raise IncompatiblePeerError(f"ucx peer speaks wire {peer.descriptor.get('wire', 1)}, we speak {WIRE_VERSION}")
        try:
            worker = bytes.fromhex(peer.descriptor["worker"])
        except (KeyError, TypeError, ValueError):
            raise IncompatiblePeerError("ucx peer descriptor has no valid worker address") from None
        host, _, port = str(peer.descriptor["address"]).rpartition(":")
        return await self._lt.run(self._connect_here(host, int(port), worker))

    async def _connect_here(self, host: str, port: int, worker: bytes) -> _Link:
        import ucxx

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout_s
        delay, last = 0.05, None
        while loop.time() < deadline:
            ep = data_ep = None
            try:
                ep = await ucxx.create_endpoint(host, port)
                data_ep = await ucxx.create_endpoint_from_worker_address(
                    ucxx.get_ucx_address_from_buffer(worker), endpoint_error_handling=False)
                link_id = secrets.randbits(32)
                await ep.send(_PREFIX.pack(_HELLO, 0, 8))
                await ep.send(link_id.to_bytes(8, "big"))
                wired = data_ep.send(bytearray(8), tag=data_tag(link_id, _WIREUP), force_tag=True)
                reply = bytearray(_ACK.size)
                async with asyncio.timeout(max(0.1, deadline - loop.time())):
                    await asyncio.gather(wired, ep.recv(reply))
                link = _Link(ep, data_ep, link_id)
                link.reader = asyncio.create_task(self._read_acks(link))
                self._links.append(link)
                return link
            except Exception as exc:  # noqa: BLE001  e.g. "Endpoint is not connected"
                last = exc
                for e in (ep, data_ep):
                    if e is not None:
                        await _quiet_close(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        raise PeerLostError(f"could not connect to ucx peer {host}:{port}: {last}")

    async def _read_acks(self, link: _Link) -> None:
        buf = bytearray(_ACK.size)
        try:
            while True:
                await link.ep.recv(buf)
                seq, code = _ACK.unpack(buf)
                entry = link.inflight.pop(seq, None)
                if entry is None:
                    continue
                fut, nbytes = entry
                link.inflight_bytes -= nbytes
                link.released.set()
                if fut.done():
                    continue
                if code == 0:
                    fut.set_result(nbytes)
                else:
                    kind = error_class(code).__name__
                    fut.set_exception(RemoteRejected(f"receiver rejected frame ({kind})", remote_kind=kind))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            link.fail_all(PeerLostError(f"ucx connection to the receiver lost: {exc}"))

    async def _close_link(self, link: _Link) -> None:
        link.fail_all(PeerLostError("link closed"))
        if link.reader:
            link.reader.cancel()
        await _quiet_close(link.ep)
        await _quiet_close(link.data_ep)

    async def disconnect(self, peer: Peer) -> None:
        if self._lt is not None and peer.state in self._links:
            self._links.remove(peer.state)
            await self._lt.run(self._close_link(peer.state))

    async def _send_frames(self, peer: Peer, request_id: str, plans: list[FramePlan],
                           trace_context: dict | None, progress: SendProgress) -> int:
        if self._lt is None:
            raise PeerLostError("transport is closed", request_id)
        # shielded: a caller's cancellation must not cut a batch in half on the wire (the link would
        # stall for every later transfer); it stops the send at the next batch boundary instead, so the batches
        # not yet posted never cross (a relay finished the request first: its KV is not needed)
        stop = threading.Event()
        link: _Link = peer.state
        sending = self._lt.run(self._send_here(link, request_id, plans, trace_context, progress, stop))
        try:
            return await asyncio.shield(sending)
        except asyncio.CancelledError:
            sending.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody reads it any more
            stop.set()
            if self._lt is not None:  # one waiting for window room sees the stop at once
                self._lt.call(link.released.set)
            raise

    async def _send_here(self, link: _Link, rid: str, plans: list[FramePlan], tc: dict | None,
                         progress: SendProgress, stop: threading.Event) -> int:
        def acknowledged(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is None:
                progress.crossed += f.result()

        pending: list[asyncio.Future] = []
        posts: list[asyncio.Future] = []
        registered: list[int] = []
        try:
            for batch in self._batches(plans):
                frames = [self._build_frame(rid, plan, tc) for plan in batch]
                nbytes = sum(p.nbytes for _, p in frames)
                while True:
                    if stop.is_set():
                        raise TransferCancelled("the sender cancelled the transfer", rid)
                    if not (link.inflight and link.inflight_bytes + nbytes > self.window_bytes):
                        break
                    link.released.clear()
                    await self._bounded(link.released.wait(), rid)
                if link.reader is None or link.reader.done():
                    raise PeerLostError("ucx connection to the receiver is gone", rid)
                for post in posts:  # a send that failed already: stop now
                    if post.done() and post.exception() is not None:
                        raise post.exception()
                fut = asyncio.get_running_loop().create_future()
                fut.add_done_callback(acknowledged)
                seq = link.next_seq
                link.next_seq += 1
                link.inflight[seq] = (fut, nbytes)
                link.inflight_bytes += nbytes
                registered.append(seq)
                pending.append(fut)
                # Posted, not awaited: every message of the batch is handed to UCX in this synchronous
                # block (ep.send posts before its first await, tasks start in creation order), so
                # batches of concurrent sends on one link never interleave and nothing waits per message.
                posts.append(self._post(link, seq, frames))
            total = 0
            for post in posts:
                await self._bounded(post, rid)
            for fut in pending:
                total += await self._bounded(asyncio.shield(fut), rid)
            return total
        except TransferError as exc:
            exc.request_id = exc.request_id or rid
            raise
        finally:  # frames left unacknowledged by a failed or cancelled send must not hold the window
            link.forget(registered)
            for post in posts:
                if not post.done():
                    post.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _batches(self, plans: list[FramePlan]) -> list[list[FramePlan]]:
        """Consecutive frames in groups of at most ``batch_bytes`` of payload (at least one frame each)."""
        per_block = self.layout.bytes_per_block_per_tensor
        batches: list[list[FramePlan]] = []
        size = 0
        for plan in plans:
            n = len(plan.src) * per_block
            if batches and size + n <= self.batch_bytes and len(batches[-1]) < MAX_BATCH_FRAMES:
                batches[-1].append(plan)
                size += n
            else:
                batches.append([plan])
                size = n
        return batches

    @staticmethod
    def _post(link: _Link, seq: int, frames: list[tuple[bytes, memoryview]]) -> asyncio.Future:
        prefix, index = pack_batch(seq, frames)
        tag = data_tag(link.link_id, seq)
        sends = [link.ep.send(prefix), link.ep.send(index)]
        sends += [link.data_ep.send(p, tag=tag, force_tag=True) for _, p in frames if p.nbytes]
        posted = asyncio.gather(*sends)

        async def wait() -> None:
            try:
                await posted
            except Exception as exc:  # noqa: BLE001
                raise PeerLostError(f"ucx send failed: {exc}") from None

        return asyncio.ensure_future(wait())

    async def _bounded(self, aw: Any, rid: str) -> Any:
        try:
            async with asyncio.timeout(self.ack_timeout_s):
                return await aw
        except asyncio.TimeoutError:
            raise PeerLostError(f"receiver made no progress for {self.ack_timeout_s}s", rid) from None


def _loss_signal(ep: Any) -> asyncio.Event:
    """An event set when the control endpoint closes (peer gone): the data endpoint never reports it."""
    lost = asyncio.Event()
    loop = asyncio.get_running_loop()
    ep.set_close_callback(lambda: loop.call_soon_threadsafe(lost.set))
    return lost


async def _unless_lost(receives: Any, lost: asyncio.Event) -> None:
    """Wait for data receives, or raise when the sender's control endpoint is gone.

    A receive whose sender died stays posted in UCX (ucxx cannot cancel it); its tag is never sent
    again, so it only holds its staging buffer (one batch) until the process exits.
    """
    receives = asyncio.ensure_future(receives)
    loss = asyncio.ensure_future(lost.wait())
    try:
        await asyncio.wait({receives, loss}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        loss.cancel()
    if not receives.done():
        receives.add_done_callback(lambda f: f.cancelled() or f.exception())
        raise PeerLostError("ucx sender's control endpoint closed mid-batch")
    receives.result()


async def _quiet_close(ep: Any) -> None:
    try:
        if ep is not None and not ep.closed:
            async with asyncio.timeout(2.0):
                await ep.close()
    except Exception:  # noqa: BLE001
        pass
