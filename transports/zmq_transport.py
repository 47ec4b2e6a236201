"""ZeroMQ transport for the WAN: TCP, N striped streams per peer, zero-copy frames, optional CURVE.

Receiver: one ROUTER socket bound on ``bind_host``. Sender: per peer, ``streams`` DEALER sockets
(one TCP connection each, so a high-latency link is filled by several congestion windows). Each
message is ``[seq, header, payload]``; the payload is a view of the pool sent with copy=False. The
receiver answers every frame with ``[seq, code, message]`` (code 0 = written), which gives the
sender (a) flow control: at most ``window_bytes`` unacknowledged per stream, and (b) a clear failure
when the peer dies, rejects a frame, or stops answering for ``ack_timeout_s``. A monitor on the
ROUTER fails requests whose sender connection dropped mid-transfer.

All socket work, checksums and copies run in the transport's own thread and event loop.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .base import KVTransport, Peer
from .blocks import FramePlan
from .errors import IncompatiblePeerError, PeerLostError, RemoteRejected, TransferError
from .frames import error_class
from .loop_thread import LoopThread
from .window import AckWindow

log = logging.getLogger(__name__)

_SEQ = struct.Struct(">Q")
_CODE = struct.Struct(">I")


def load_curve_keys(cfg: dict) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from {"public_key", "secret_key"} or {"secret_key_file"}."""
    if cfg.get("secret_key_file"):
        import zmq.auth

        public, secret = zmq.auth.load_certificate(cfg["secret_key_file"])
        if secret is None:
            raise ValueError(f"{cfg['secret_key_file']} holds no secret key")
        return public, secret
    if cfg.get("secret_key"):
        secret = cfg["secret_key"].encode() if isinstance(cfg["secret_key"], str) else cfg["secret_key"]
        return zmq.curve_public(secret), secret
    raise ValueError("curve options need secret_key or secret_key_file")


def load_public_keys(paths: list[str]) -> list[str]:
    """z85 public keys from `pdd keys` NAME.key files (what MD's ``authorized_clients_files`` lists)."""
    import zmq.auth

    keys = []
    for path in paths:
        try:
            public, _ = zmq.auth.load_certificate(str(path))
        except (OSError, ValueError) as exc:
            raise ValueError(f"curve.authorized_clients_files: cannot read a public key from {path}: {exc}") from None
        keys.append(public.decode())
    return keys


@dataclass
class _Stream(AckWindow):
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task] = field(default_factory=list)


class ZmqTransport(KVTransport):
    name = "zmq"

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        o = self.options
        self.streams = int(o.get("streams", 4))
        self.bind_host = str(o.get("bind_host", "127.0.0.1"))
        self.advertise_host = str(o.get("advertise_host", self.bind_host))
        self.port = int(o.get("port", 0))
        self.window_bytes = int(o.get("window_bytes", 32 << 20))
        self.ack_timeout_s = float(o.get("ack_timeout_s", 15.0))
        self.connect_timeout_s = float(o.get("connect_timeout_s", 10.0))
        self.heartbeat_s = float(o.get("heartbeat_s", 2.0))
        self.curve = dict(o["curve"]) if o.get("curve") else None
        self._curve_keys = load_curve_keys(self.curve) if self.curve else None
        if self.curve and self.curve.get("authorized_clients_files"):
            self.curve["authorized_clients"] = [*(self.curve.get("authorized_clients") or []),
                                                *load_public_keys(self.curve["authorized_clients_files"])]
        self._lt: LoopThread | None = None
        self._tasks: list[asyncio.Task] = []
        self._links: list[list[_Stream]] = []
        self._link_count = 0

    # ---- lifecycle (public methods hop onto the private loop) -------------------------------
    async def _start(self) -> None:
        self._lt = LoopThread(f"pdd-zmq-{self.instance_id}")
        await self._lt.run(self._start_here())

    async def _start_here(self) -> None:
        self._ctx = zmq.asyncio.Context(io_threads=int(self.options.get("io_threads", 1)))
        self._router = self._ctx.socket(zmq.ROUTER)
        self._tune(self._router)
        self._router.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_frame_bytes + (1 << 20))
        if self._curve_keys:
            public, secret = self._curve_keys
            self._router.curve_server = True
            self._router.curve_publickey, self._router.curve_secretkey = public, secret
            allowed = self.curve.get("authorized_clients")
            if allowed is not None:
                self._start_auth({k.encode() if isinstance(k, str) else k for k in allowed})
        url = f"tcp://{self.bind_host}"
        if self.port:
            self._router.bind(f"{url}:{self.port}")
        else:
            self.port = self._router.bind_to_random_port(url)
        mon = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._tasks = [asyncio.create_task(self._serve()), asyncio.create_task(self._watch_router(mon))]
        for t in self._tasks:
            t.add_done_callback(_log_death)

    def _start_auth(self, allowed: set[bytes]) -> None:
        from zmq.auth.asyncio import AsyncioAuthenticator

        class _Allow:
            def callback(self, domain: str, key: bytes) -> bool:
                return key in allowed or zmq.utils.z85.encode(key) in allowed

        self._auth = AsyncioAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=_Allow())

    def _tune(self, sock: zmq.Socket) -> None:
        sock.linger = 0
        ivl = int(self.heartbeat_s * 1000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * ivl)

    async def _close(self) -> None:
        if self._lt is not None:
            await self._lt.run(self._close_here())
            self._lt.stop()
            self._lt = None

    async def _close_here(self) -> None:
        for streams in self._links:
            self._close_streams(streams)
        for t in self._tasks:
            t.cancel()
        if getattr(self, "_auth", None) is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)

    def _address(self) -> dict:
        desc: dict[str, Any] = {"address": f"tcp://{self.advertise_host}:{self.port}", "streams": self.streams}
        if self._curve_keys:
            desc["curve_public_key"] = self._curve_keys[0].decode()
        return desc

    # ---- receiver ----------------------------------------------------------------------------
    async def _serve(self) -> None:
        while True:
            parts = await self._router.recv_multipart(copy=False)
            ident = parts[0].bytes
            seq = parts[1].bytes if len(parts) > 1 and len(parts[1]) == _SEQ.size else None
            if seq is None:
                log.warning("zmq transport: dropped a message without a sequence number")
                continue
            code, text = 0, b""
            if len(parts) != 4:
                code, text = 11, b"message must have 3 parts: seq, header, payload"
            else:
                try:
                    self._receive_frame(parts[2].buffer, parts[3].buffer, parts[1].get(zmq.SRCFD))
                except TransferError as exc:
                    code, text = exc.code, str(exc).encode()[:500]
                    log.warning("zmq transport: rejected frame: %s: %s", type(exc).__name__, exc)
                except Exception as exc:  # a bug must cost one frame, never the receive loop
                    code, text = 11, f"receiver error: {type(exc).__name__}".encode()
                    log.exception("zmq transport: frame handling failed")
            await self._router.send_multipart([ident, seq, _CODE.pack(code), text])

    async def _watch_router(self, mon: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await mon.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED and self._registry is not None:
                self._registry.peer_lost(event["value"])

    # ---- sender ------------------------------------------------------------------------------
    async def _connect(self, peer: Peer) -> list[_Stream]:
        desc = peer.descriptor
        server_key = desc.get("curve_public_key")
        if self._curve_keys and not server_key:
            raise IncompatiblePeerError("CURVE is configured here but the peer does not offer it")
        return await self._lt.run(self._connect_here(str(desc["address"]), server_key))

    async def _connect_here(self, address: str, server_key: str | None) -> list[_Stream]:
        public, secret = self._curve_keys or (zmq.curve_keypair() if server_key else (None, None))
        self._link_count += 1
        link_no = self._link_count
        streams = []
        for i in range(self.streams):
            sock = self._ctx.socket(zmq.DEALER)
            self._tune(sock)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            # unique per link: a second link to the same receiver (after a failure) must never reuse an
            # identity, or the receiver's ROUTER routes its acknowledgements to the old link
            sock.setsockopt(zmq.IDENTITY, f"{self.instance_id}/{link_no}/{i}".encode())
            if server_key:
                sock.curve_serverkey = server_key.encode()
                sock.curve_publickey, sock.curve_secretkey = public, secret
            mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            stream = _Stream(sock, mon)
            stream.tasks = [asyncio.create_task(self._read_acks(stream)),
                            asyncio.create_task(self._watch_stream(stream))]
            for t in stream.tasks:
                t.add_done_callback(_log_death)
            sock.connect(address)
            streams.append(stream)
        try:
            await asyncio.wait_for(asyncio.gather(*(s.connected.wait() for s in streams)), self.connect_timeout_s)
        except asyncio.TimeoutError:
            self._close_streams(streams)
            raise PeerLostError(f"no handshake with {address} within {self.connect_timeout_s}s "
                                f"(peer down, or CURVE keys rejected)") from None
        self._links.append(streams)
        return streams

    async def _watch_stream(self, stream: _Stream) -> None:
        while True:
            event = parse_monitor_message(await stream.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                stream.connected.set()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                stream.connected.clear()
                stream.fail_all(PeerLostError("connection to the receiver dropped mid-transfer"))

    async def _read_acks(self, stream: _Stream) -> None:
        while True:
            parts = await stream.sock.recv_multipart()
            if len(parts) != 3 or len(parts[0]) != _SEQ.size or len(parts[1]) != _CODE.size:
                continue
            entry = stream.inflight.pop(_SEQ.unpack(parts[0])[0], None)
            if entry is None:
                continue
            fut, nbytes = entry
            stream.inflight_bytes -= nbytes
            stream.released.set()
            code = _CODE.unpack(parts[1])[0]
            if fut.done():
                continue
            if code == 0:
                fut.set_result(nbytes)
            else:
                kind = error_class(code).__name__
                fut.set_exception(RemoteRejected(f"receiver rejected frame ({kind}): {parts[2].decode(errors='replace')}",
                                                 remote_kind=kind))

    def _close_streams(self, streams: list[_Stream]) -> None:
        for s in streams:
            s.fail_all(PeerLostError("link closed"))
            for t in s.tasks:
                t.cancel()
            s.sock.disable_monitor()
            s.monitor.close(0)
            s.sock.close(0)

    async def disconnect(self, peer: Peer) -> None:
        if self._lt is not None and peer.state in self._links:
            self._links.remove(peer.state)
            await self._lt.run(self._async(self._close_streams, peer.state))

    @staticmethod
    async def _async(fn: Any, *args: Any) -> Any:
        return fn(*args)

    async def _send_frames(self, peer: Peer, request_id: str, plans: list[FramePlan],
                           trace_context: dict | None) -> int:
        if self._lt is None:
            raise PeerLostError("transport is closed", request_id)
        # shielded: a caller's cancellation must not cut a frame in half on the wire (the link would
        # stall for every later transfer); the send finishes or fails on its own, bounded by ack timeouts
        return await asyncio.shield(self._lt.run(self._send_here(peer.state, request_id, plans, trace_context)))

    async def _send_here(self, streams: list[_Stream], rid: str, plans: list[FramePlan], tc: dict | None) -> int:
        pending: list[asyncio.Future] = []
        registered: list[tuple[_Stream, int]] = []
        errors: list[BaseException] = []  # first failure of any frame stops the send at once

        def on_done(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is not None:
                errors.append(f.exception())

        try:
            for plan in plans:
                header, payload = self._build_frame(rid, plan, tc)
                stream = min(streams, key=lambda s: s.inflight_bytes)
                await self._acquire(stream, payload.nbytes, rid)
                if errors:
                    raise errors[0]
                if not stream.connected.is_set():
                    await self._bounded(stream.connected.wait(), rid, self.connect_timeout_s, "reconnect")
                seq = stream.next_seq
                stream.next_seq += 1
                fut = asyncio.get_running_loop().create_future()
                fut.add_done_callback(on_done)
                stream.inflight[seq] = (fut, payload.nbytes)
                stream.inflight_bytes += payload.nbytes
                registered.append((stream, seq))
                pending.append(fut)
                await self._bounded(stream.sock.send_multipart([_SEQ.pack(seq), header, payload], copy=False), rid,
                                    stage="socket send")
            total = 0
            for fut in pending:
                total += await self._bounded(asyncio.shield(fut), rid, stage="acknowledgement")
            return total
        except TransferError as exc:
            exc.request_id = exc.request_id or rid
            raise
        finally:  # frames left unacknowledged by a failed or cancelled send must not hold the window
            for stream, seq in registered:
                stream.forget([seq])

    async def _acquire(self, stream: _Stream, nbytes: int, rid: str) -> None:
        """Backpressure: wait until this frame fits in the stream's unacknowledged window."""
        while stream.inflight and stream.inflight_bytes + nbytes > self.window_bytes:
            stream.released.clear()
            await self._bounded(stream.released.wait(), rid, stage="in-flight window")

    async def _bounded(self, aw: Any, rid: str, timeout_s: float | None = None, stage: str = "") -> Any:
        timeout_s = timeout_s or self.ack_timeout_s
        try:
            return await asyncio.wait_for(aw, timeout_s)
        except asyncio.TimeoutError:
            raise PeerLostError(f"receiver made no progress (or is unreachable) for {timeout_s}s"
                                f"{' waiting for ' + stage if stage else ''}", rid) from None


def _log_death(task: asyncio.Task) -> None:
    """A transport loop task must never end while the transport is open: say loudly if one does."""
    if not task.cancelled() and task.exception() is not None:
        log.error("zmq transport: %s died: %r", task.get_coro().__qualname__, task.exception())
