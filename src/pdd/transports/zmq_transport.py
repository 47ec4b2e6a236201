"""ZeroMQ transport for the WAN: TCP, N striped streams per peer, zero-copy frames, optional CURVE.

Receiver: one ROUTER socket bound on ``bind_host``. Sender: per peer, ``streams`` DEALER sockets
(one TCP connection each, so a high-latency link is filled by several congestion windows). Each
message is ``[seq, header, payload]``; the payload is a view of the pool sent with copy=False. The
receiver answers every frame with ``[seq, code, message]`` (code 0 = written), which gives the
sender (a) flow control: at most ``window_bytes`` unacknowledged per stream, and (b) a clear failure
when the peer dies, rejects a frame, or stops answering for ``ack_timeout_s``. A monitor on the
ROUTER fails requests whose sender connection dropped mid-transfer.

Liveness is judged by progress of the whole link (all its streams), never by how long one message
takes: on a slow link one frame can take minutes, and a heartbeat queued behind it says nothing about
the peer. zmq's own heartbeat timeouts do exactly that (libzmq resets them only when a *complete*
message part arrives, per connection), so they are off (HEARTBEAT_TIMEOUT and TTL 0): zmq heartbeats
only keep bytes flowing on idle connections, and the transport judges from Linux TCP_INFO instead,
every ``heartbeat_s``, with a dead time of 3 x ``heartbeat_s``:
* receiver: a sending link is dead when none of its connections received a byte (KV data, or the
  sender's PINGs and PONGs) for the dead time; its unfinished requests fail with PeerLostError;
* sender: a link is dead when on none of its streams the receiver sent a byte (acks, PINGs, PONGs)
  or its TCP acknowledged our bytes beyond our own heartbeats for the dead time; its frames in flight
  fail with PeerLostError (the caller drops the link);
* an acknowledgement wait (``ack_timeout_s``) extends while the receiver's TCP keeps acknowledging
  our bytes, so it bounds a receiver that stopped taking data, not a frame still crossing.

All socket work, checksums and copies run in the transport's own thread and event loop.

Why one module: the sender and the receiver are two halves of one wire protocol (the three-part frame,
its acknowledgement codes, the stream identities that tie a connection to a link) and of one liveness
rule (each side judges the other by the bytes the other side's half sends); split, each half would
restate the other's format.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .base import KVTransport, Peer, SendProgress
from .blocks import FramePlan
from .errors import IncompatiblePeerError, PeerLostError, RemoteRejected, TransferCancelled, TransferError
from .frames import error_class
from .loop_thread import LoopThread
from .window import AckWindow

log = logging.getLogger(__name__)

_SEQ = struct.Struct(">Q")
_CODE = struct.Struct(">I")
_HEARTBEAT_WIRE_BYTES = 64  # upper bound of one ZMTP PING or PONG on the wire (CURVE-boxed ~40)


def _tcp_info(fd: int) -> tuple[int, int] | None:
    """(ms since the peer last sent us data, bytes of ours the peer acknowledged) from Linux TCP_INFO,
    read through a duplicate of zmq's descriptor (closing it leaves the connection alone); None when
    unavailable (not Linux, fd already closed)."""
    if not hasattr(socket, "TCP_INFO"):
        return None
    try:
        dup = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return None
    try:
        raw = dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136)
    except OSError:
        return None
    finally:
        dup.close()
    if len(raw) < 136:
        return None
    # struct tcp_info: tcpi_last_data_recv (u32) at 52, tcpi_bytes_acked (u64) at 120
    return struct.unpack_from("=I", raw, 52)[0], struct.unpack_from("=Q", raw, 120)[0]


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
    fd: int | None = None  # the TCP connection's descriptor while connected (progress via TCP_INFO)
    alive_at: float = field(default_factory=time.monotonic)  # last sign of the receiver on this stream
    sampled: tuple[int | None, int, float] = (None, 0, 0.0)  # (fd, bytes_acked, when) at the last look
    closed: bool = False  # the link was closed (disconnect, or the transport): its sockets are gone


def _wake_senders(streams: list[_Stream]) -> None:
    for stream in streams:
        stream.released.set()


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
        self._fd_link: dict[int, bytes] = {}  # receiver: connection fd -> sending link (identity prefix)

    # ---- lifecycle (public methods hop onto the private loop) -------------------------------
    async def _start(self) -> None:
        self._lt = LoopThread(f"pdd-zmq-{self.instance_id}")
        await self._lt.run(self._start_here())

    async def _start_here(self) -> None:
        self._ctx = zmq.asyncio.Context(io_threads=int(self.options.get("io_threads", 1)))
        self._router = self._ctx.socket(zmq.ROUTER)
        self._tune(self._router)
        self._router.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_frame_bytes + (1 << 20))
        # a sender stream that reconnects (same identity) takes over at once; its old connection may be
        # silently dead, and this receiver no longer drops connections on a heartbeat timeout
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
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
        if self.heartbeat_s > 0:
            self._tasks += [asyncio.create_task(self._watch_senders()), asyncio.create_task(self._watch_links())]
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
        # PINGs (and the peer's PONGs) keep idle connections carrying bytes; no zmq timeout or TTL,
        # which would drop a live connection while one slow message part crosses (module docstring)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 0)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 0)

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
            self._fd_link[parts[1].get(zmq.SRCFD)] = ident.rpartition(b"/")[0]
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
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._fd_link.pop(event["value"], None)
                if self._registry is not None:
                    self._registry.peer_lost(event["value"])

    async def _watch_senders(self) -> None:
        """Receive-side liveness by progress: a sending link is dead when none of its connections has
        received a byte for 3 heartbeat intervals. A live sender always sends something: KV bytes
        while a transfer moves (however slowly), its PINGs and PONGs when idle. Judged per link, not
        per connection: on a congested link one TCP stream can starve for seconds while others move."""
        dead_ms = 3 * self.heartbeat_s * 1000
        while True:
            await asyncio.sleep(self.heartbeat_s)
            quiet: dict[bytes, list[int]] = {}
            alive: set[bytes] = set()
            for fd, link in list(self._fd_link.items()):
                info = _tcp_info(fd)
                if info is None or info[0] < dead_ms:
                    alive.add(link)
                else:
                    quiet.setdefault(link, []).append(fd)
            for link, fds in quiet.items():
                if link not in alive and self._registry is not None:
                    for fd in fds:
                        self._registry.peer_lost(fd, f"sender sent nothing for {3 * self.heartbeat_s:g}s "
                                                     f"(link down or sender dead)")

    async def _watch_links(self) -> None:
        """Send-side liveness by progress (module docstring): fail the frames in flight on a link where
        the receiver showed no sign for 3 heartbeat intervals on any stream."""
        dead_s = 3 * self.heartbeat_s
        while True:
            await asyncio.sleep(self.heartbeat_s)
            now = time.monotonic()
            for streams in list(self._links):
                for s in streams:
                    self._sample(s, now)
                if all(now - s.alive_at >= dead_s for s in streams):
                    err = PeerLostError(f"receiver silent for {dead_s:g}s: it sent nothing and acknowledged none "
                                        f"of our bytes (link down or receiver dead)")
                    for s in streams:
                        s.fail_all(err)

    def _sample(self, s: _Stream, now: float) -> None:
        info = _tcp_info(s.fd) if s.fd is not None else None
        if info is None:  # (re)connecting, or no TCP_INFO here: connect_timeout_s and ack_timeout_s rule
            s.alive_at = now
            return
        heard_ms, acked = info
        fd, acked_before, then = s.sampled
        chatter = 2 * _HEARTBEAT_WIRE_BYTES * ((now - then) / self.heartbeat_s + 1)  # our PINGs and PONGs
        if fd != s.fd or acked - acked_before > chatter:
            s.alive_at = now
        s.alive_at = max(s.alive_at, now - heard_ms / 1000)
        s.sampled = (s.fd, acked, now)

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
            mon = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                                          | zmq.EVENT_DISCONNECTED)
            stream = _Stream(sock, mon)
            stream.tasks = [asyncio.create_task(self._read_acks(stream)),
                            asyncio.create_task(self._watch_stream(stream))]
            for t in stream.tasks:
                t.add_done_callback(_log_death)
            sock.connect(address)
            streams.append(stream)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await asyncio.gather(*(s.connected.wait() for s in streams))
        except asyncio.TimeoutError:
            self._close_streams(streams)
            raise PeerLostError(f"no handshake with {address} within {self.connect_timeout_s}s "
                                f"(peer down, or CURVE keys rejected)") from None
        self._links.append(streams)
        return streams

    async def _watch_stream(self, stream: _Stream) -> None:
        while True:
            event = parse_monitor_message(await stream.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_CONNECTED:
                stream.fd = event["value"]
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                stream.connected.set()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                stream.fd = None
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
            if s.closed:
                continue
            s.closed = True  # first: a send that wakes up below must see a closed link, not a socket error
            s.fd = None  # the descriptor number may be reused at once: never read TCP_INFO through it again
            s.fail_all(PeerLostError("link closed"))
            for t in s.tasks:
                t.cancel()
            s.sock.disable_monitor()
            s.monitor.close(0)
            s.sock.close(0)  # cancels the socket's pending sends (see _send_here)

    async def disconnect(self, peer: Peer) -> None:
        if self._lt is not None and peer.state in self._links:
            self._links.remove(peer.state)
            await self._lt.run(self._async(self._close_streams, peer.state))

    @staticmethod
    async def _async(fn: Any, *args: Any) -> Any:
        return fn(*args)

    async def _send_frames(self, peer: Peer, request_id: str, plans: list[FramePlan],
                           trace_context: dict | None, progress: SendProgress) -> int:
        if self._lt is None:
            raise PeerLostError("transport is closed", request_id)
        # shielded: a caller's cancellation must not cut a frame in half on the wire (the link would
        # stall for every later transfer); it stops the send at the next frame boundary instead, so the frames
        # not yet handed to the socket never cross (a relay finished the request first: its KV is not needed)
        stop = threading.Event()
        sending = self._lt.run(self._send_here(peer.state, request_id, plans, trace_context, progress, stop))
        try:
            return await asyncio.shield(sending)
        except asyncio.CancelledError:
            # the send ends on its own (TransferCancelled at the next frame, or the receiver's refusal): nobody
            # reads that outcome any more, and asyncio must not log it as an error never retrieved
            sending.add_done_callback(lambda f: f.cancelled() or f.exception())
            stop.set()
            if self._lt is not None:  # one waiting for window room sees the stop at once
                self._lt.call(_wake_senders, peer.state)
            raise

    async def _send_here(self, streams: list[_Stream], rid: str, plans: list[FramePlan], tc: dict | None,
                         progress: SendProgress, stop: threading.Event) -> int:
        """A link closed under a send (``disconnect`` while the send runs) fails it with PeerLostError,
        never with the socket's own error (ENOTSOCK) or with the CancelledError that closing a socket sets
        on its pending sends: to the caller both mean "this link is gone", like any lost peer."""
        try:
            return await self._send_on_link(streams, rid, plans, tc, progress, stop)
        except (zmq.ZMQError, asyncio.CancelledError) as exc:
            if not any(s.closed for s in streams):
                raise  # a real cancellation (the transport's loop stopping), or a zmq fault of its own
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise PeerLostError(f"link closed while sending ({detail})", rid) from None

    async def _send_on_link(self, streams: list[_Stream], rid: str, plans: list[FramePlan], tc: dict | None,
                            progress: SendProgress, stop: threading.Event) -> int:
        pending: list[asyncio.Future] = []
        registered: list[tuple[_Stream, int]] = []
        errors: list[BaseException] = []  # first failure of any frame stops the send at once

        def on_done(f: asyncio.Future) -> None:
            if f.cancelled():
                return
            if f.exception() is not None:
                errors.append(f.exception())
            else:
                progress.crossed += f.result()

        try:
            for plan in plans:
                if any(s.closed for s in streams):
                    raise PeerLostError("link closed", rid)
                header, payload = self._build_frame(rid, plan, tc)
                stream = min(streams, key=lambda s: s.inflight_bytes)
                await self._acquire(stream, payload.nbytes, rid, streams, stop)
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
                                    stage="socket send", link=streams)
            total = 0
            for fut in pending:
                total += await self._bounded(asyncio.shield(fut), rid, stage="acknowledgement", link=streams)
            return total
        except TransferError as exc:
            exc.request_id = exc.request_id or rid
            raise
        finally:  # frames left unacknowledged by a failed or cancelled send must not hold the window
            for stream, seq in registered:
                stream.forget([seq])

    async def _acquire(self, stream: _Stream, nbytes: int, rid: str, link: list[_Stream],
                       stop: threading.Event) -> None:
        """Backpressure: wait until this frame fits in the stream's unacknowledged window. The caller gave up on
        the send (``stop``): TransferCancelled before the next frame."""
        while True:
            if stop.is_set():
                raise TransferCancelled("the sender cancelled the transfer", rid)
            if not (stream.inflight and stream.inflight_bytes + nbytes > self.window_bytes):
                return
            stream.released.clear()
            await self._bounded(stream.released.wait(), rid, stage="in-flight window", link=link)

    async def _bounded(self, aw: Any, rid: str, timeout_s: float | None = None, stage: str = "",
                       link: list[_Stream] | None = None) -> Any:
        """Await ``aw``; fail after ``timeout_s`` without progress. With ``link``, progress is also the
        receiver's TCP acknowledging our bytes, so a frame that takes long to cross a slow link never
        times out while it moves; heartbeat bytes alone do not count."""
        timeout_s = timeout_s or self.ack_timeout_s
        task = asyncio.ensure_future(aw)
        mark = self._acked(link)
        chatter = 2 * _HEARTBEAT_WIRE_BYTES * (timeout_s / self.heartbeat_s + 1) if self.heartbeat_s > 0 else 0
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=timeout_s)
                if done:
                    return task.result()
                now = self._acked(link)
                moved = sum(max(0, b - mark[fd]) for fd, b in now.items() if fd in mark)
                if moved <= chatter:
                    raise PeerLostError(f"receiver made no progress (or is unreachable) for {timeout_s}s"
                                        f"{' waiting for ' + stage if stage else ''}", rid)
                mark = now
        finally:
            if not task.done():
                task.cancel()

    @staticmethod
    def _acked(link: list[_Stream] | None) -> dict[int, int]:
        """Per connected stream of the link: bytes the receiver's TCP has acknowledged (TCP_INFO)."""
        out = {}
        for s in link or ():
            info = _tcp_info(s.fd) if s.fd is not None else None
            if info is not None:
                out[s.fd] = info[1]
        return out


def _log_death(task: asyncio.Task) -> None:
    """A transport loop task must never end while the transport is open: say loudly if one does."""
    if not task.cancelled() and task.exception() is not None:
        log.error("zmq transport: %s died: %r", task.get_coro().__qualname__, task.exception())
