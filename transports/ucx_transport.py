"""UCX transport (ucxx) for the in-site fast path: RDMA where the hardware and UCX build have it,
otherwise tcp/shm/cma — same code.

Per frame the sender posts three tagged messages on one endpoint: a 16-byte prefix
``(seq, header_len, payload_len)``, the header, the payload (a view of the pool). The receiver checks
the prefix bounds before allocating, receives the payload into a staging buffer, validates it and
only then copies it into the pool, and answers ``(seq, code)``. Acknowledgements give the same
backpressure and peer-loss detection as the zmq plugin. ucxx keeps one context per process, so all
UcxTransport instances of a process share one private event-loop thread.

Endpoint creation is retried with a hello exchange: a first connect occasionally fails with
"Endpoint is not connected".
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# ucxx's default progress mode busy-polls requests: 25-45% of a core per process even when idle,
# and erratic transfer times on small CPU hosts. Python futures wake on completion instead.
os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")

from .base import KVTransport, Peer  # noqa: E402
from .blocks import FramePlan  # noqa: E402
from .errors import PeerLostError, RemoteRejected, TransferError  # noqa: E402
from .frames import MAX_HEADER_BYTES, OversizeFrame, error_class  # noqa: E402
from .loop_thread import LoopThread  # noqa: E402
from .window import AckWindow  # noqa: E402

log = logging.getLogger(__name__)

_PREFIX = struct.Struct(">QII")  # seq, header_len, payload_len
_ACK = struct.Struct(">QI")  # seq, code
_HELLO = 2**64 - 1

_shared_loop: LoopThread | None = None
_shared_lock = threading.Lock()


def _loop() -> LoopThread:
    global _shared_loop
    with _shared_lock:
        if _shared_loop is None:
            _shared_loop = LoopThread("pdd-ucx")
        return _shared_loop


@dataclass
class _Link(AckWindow):
    ep: Any
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    reader: asyncio.Task | None = None


class UcxTransport(KVTransport):
    name = "ucx"

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        o = self.options
        self.host = str(o.get("advertise_host", o.get("bind_host", "127.0.0.1")))
        self.port = int(o.get("port", 0))
        self.window_bytes = int(o.get("window_bytes", 64 << 20))
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

    def _address(self) -> dict:
        return {"address": f"{self.host}:{self.port}"}

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
        prefix = bytearray(_PREFIX.size)
        staging = bytearray(0)
        while True:
            await ep.recv(prefix)
            seq, hlen, plen = _PREFIX.unpack(prefix)
            if seq == _HELLO:
                await ep.send(_ACK.pack(seq, 0))
                continue
            if hlen > MAX_HEADER_BYTES or plen > self.max_frame_bytes or hlen == 0:
                # Cannot receive it without trusting its size: reject and drop this endpoint.
                await ep.send(_ACK.pack(seq, OversizeFrame.code))
                raise OversizeFrame(f"frame prefix announces {hlen}+{plen} bytes; limit {self.max_frame_bytes}")
            header = bytearray(hlen)
            await ep.recv(header)
            if len(staging) < plen:
                staging = bytearray(plen)
            payload = memoryview(staging)[:plen]
            if plen:
                await ep.recv(payload)
            code = 0
            try:
                self._receive_frame(header, payload, source)
            except TransferError as exc:
                code = exc.code
                log.warning("ucx transport: rejected frame: %s: %s", type(exc).__name__, exc)
            except Exception:  # a bug must cost one frame, never the receive loop
                code = 11
                log.exception("ucx transport: frame handling failed")
            await ep.send(_ACK.pack(seq, code))

    # ---- sender ------------------------------------------------------------------------------
    async def _connect(self, peer: Peer) -> _Link:
        host, _, port = str(peer.descriptor["address"]).rpartition(":")
        return await self._lt.run(self._connect_here(host, int(port)))

    async def _connect_here(self, host: str, port: int) -> _Link:
        import ucxx

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout_s
        delay, last = 0.05, None
        while loop.time() < deadline:
            ep = None
            try:
                ep = await ucxx.create_endpoint(host, port)
                await ep.send(_PREFIX.pack(_HELLO, 0, 0))
                reply = bytearray(_ACK.size)
                await asyncio.wait_for(ep.recv(reply), max(0.1, deadline - loop.time()))
                link = _Link(ep)
                link.reader = asyncio.create_task(self._read_acks(link))
                self._links.append(link)
                return link
            except Exception as exc:  # noqa: BLE001  e.g. "Endpoint is not connected"
                last = exc
                if ep is not None:
                    await _quiet_close(ep)
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

    async def disconnect(self, peer: Peer) -> None:
        if self._lt is not None and peer.state in self._links:
            self._links.remove(peer.state)
            await self._lt.run(self._close_link(peer.state))

    async def _send_frames(self, peer: Peer, request_id: str, plans: list[FramePlan],
                           trace_context: dict | None) -> int:
        if self._lt is None:
            raise PeerLostError("transport is closed", request_id)
        # shielded: a caller's cancellation must not cut a frame in half on the wire (the link would
        # stall for every later transfer); the send finishes or fails on its own, bounded by ack timeouts
        return await asyncio.shield(self._lt.run(self._send_here(peer.state, request_id, plans, trace_context)))

    async def _send_here(self, link: _Link, rid: str, plans: list[FramePlan], tc: dict | None) -> int:
        pending = []
        registered: list[int] = []
        try:
            for plan in plans:
                header, payload = self._build_frame(rid, plan, tc)
                while link.inflight and link.inflight_bytes + payload.nbytes > self.window_bytes:
                    link.released.clear()
                    await self._bounded(link.released.wait(), rid)
                if link.reader is None or link.reader.done():
                    raise PeerLostError("ucx connection to the receiver is gone", rid)
                fut = asyncio.get_running_loop().create_future()
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())
                async with link.lock:  # the three messages of a frame must stay together
                    seq = link.next_seq
                    link.next_seq += 1
                    link.inflight[seq] = (fut, payload.nbytes)
                    link.inflight_bytes += payload.nbytes
                    registered.append(seq)
                    pending.append(fut)
                    await self._bounded(self._post(link.ep, seq, header, payload), rid)
            total = 0
            for fut in pending:
                total += await self._bounded(asyncio.shield(fut), rid)
            return total
        except TransferError as exc:
            exc.request_id = exc.request_id or rid
            raise
        finally:  # frames left unacknowledged by a failed or cancelled send must not hold the window
            link.forget(registered)

    @staticmethod
    async def _post(ep: Any, seq: int, header: bytes, payload: memoryview) -> None:
        try:
            await ep.send(_PREFIX.pack(seq, len(header), payload.nbytes))
            await ep.send(header)
            await ep.send(payload)
        except Exception as exc:  # noqa: BLE001
            raise PeerLostError(f"ucx send failed: {exc}") from None

    async def _bounded(self, aw: Any, rid: str) -> Any:
        try:
            return await asyncio.wait_for(aw, self.ack_timeout_s)
        except asyncio.TimeoutError:
            raise PeerLostError(f"receiver made no progress for {self.ack_timeout_s}s", rid) from None


async def _quiet_close(ep: Any) -> None:
    try:
        if not ep.closed:
            await asyncio.wait_for(ep.close(), 2.0)
    except Exception:  # noqa: BLE001
        pass
