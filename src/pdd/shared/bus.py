"""NATS helpers: typed publish/subscribe/request with trace context in headers.

How a service authenticates to NATS (credentials, TLS, telling a refusal from a server that is
down) is nats_auth.py's; ``connect_options`` is re-exported here.

Why one module: what is left is one NATS connection seen from its user's side; publishing, the
hold-and-replay across an outage and request/subscribe share its state (open/held/recent) and its
reconnect callbacks, so splitting them would spread one state machine over several files.

Handlers receive decoded messages. A message that fails to decode is rejected here (logged,
counted, and answered with an ``ErrorReply`` when the sender expects a reply), so no service
loop ever sees a ``ProtocolError`` or dies of one.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats import errors as nats_errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry import context as otel_context
from opentelemetry import trace
from prometheus_client import Counter

from pdd.shared import protocol
from pdd.shared.config import NatsConfig, redact_url
from pdd.shared.nats_auth import connect_options, describe_refusal, is_fatal_connect_error
from pdd.shared.protocol import Batch, ErrorReply, Message, ProtocolError
from pdd.shared.telemetry import extract_context, get_logger, inject_headers

log = get_logger("pdd.bus")
_tracer = trace.get_tracer("pdd.bus")

REJECTED = Counter("pdd:bus_rejected_messages_total", "Bus messages rejected by strict decoding", ["subject", "code"])
HANDLER_ERRORS = Counter("pdd:bus_handler_errors_total", "Handler exceptions caught by the bus", ["subject"])
ERROR_LOG_INTERVAL_S = 5.0
HANDSHAKE_DROPS_FATAL = 5
# Subjects whose receivers drop duplicates: the router places every token by its output position and
# ignores one it already has. What was sent to them just before a disconnect is sent again after it.
REPLAYABLE_PREFIXES = ("pdd.router.",)
HELD = Counter("pdd:bus_held_messages_total", "Messages published during a NATS outage, sent after the reconnect")

Handler = Callable[[Message, "Envelope"], Awaitable[Message | None]]


class BusError(RuntimeError):
    """A request over the bus failed: no responder, timeout, or the peer replied with an error."""

    def __init__(self, code: str, message: str, retryable: bool = False):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable


class BusConnectError(BusError):
    """The first connection was refused for good (bad credentials, TLS failure): retrying cannot help."""


@dataclass(frozen=True)
class Envelope:
    subject: str
    reply: str | None
    headers: dict[str, str]


async def flush_barrier(nc: NatsClient, timeout_s: float = 10.0) -> None:
    """Return once the server has processed everything ``nc`` sent before the call (its subscriptions are live).

    nats-py's ``flush()`` alone is not that barrier: it writes its PING straight to the socket, ahead of commands
    still queued for its flusher task (nats-py 2.16), so the PONG can come back before a subscription made just
    before reaches the server, and a message published right after is routed without it (seen in about 1 of 40
    runs). The first flush kicks the flusher, which writes the queue while the PING is out; the second PING then
    follows everything queued before the call."""
    await nc.flush(timeout=timeout_s)
    await nc.flush(timeout=timeout_s)


class Bus:
    """One NATS connection per service, with reconnects handled by nats-py.

    A server restart is survived without losing what was published meanwhile: while disconnected,
    and for ``nats.reconnect_settle_s`` after the reconnect (the time the other services need to get
    back and re-subscribe; core NATS drops a message that finds no subscriber), publishes are held
    here in order and sent together after that, up to ``nats.reconnect_buffer_bytes``. Requests wait
    for the same moment, within their timeout.
    """

    def __init__(self, config: NatsConfig, name: str):
        self.config = config
        self.name = name
        self.nc: NatsClient | None = None
        self._subs: list[Subscription] = []
        self.connected = asyncio.Event()
        self.disconnected_at: float | None = None  # monotonic, while an outage lasts
        self.outages = 0
        self._listeners: list[Callable[[str], None]] = []
        self._open = asyncio.Event()  # set: publishes go straight out; clear: they are held
        self._held: deque[tuple[str, bytes, str, dict[str, str]]] = deque()
        self._held_bytes = 0
        self._release: asyncio.Task | None = None
        self._last_error: tuple[str, float, int] = ("", 0.0, 0)  # text, logged at, repeats not logged since
        self._recent: deque[tuple[float, str, bytes, str, dict[str, str]]] = deque()  # replayable, just sent

    def add_listener(self, callback: Callable[[str], None]) -> None:
        """``callback("disconnected")`` / ``callback("reconnected")`` on the event loop, in order added.

        Subscriptions survive a reconnect (nats-py re-subscribes) and what this process published
        meanwhile is held and sent after the reconnect; what others published while this process was
        away from the server is gone. Owners of request state use this to know an outage happened.
        """
        self._listeners.append(callback)

    def _notify(self, event: str) -> None:
        for callback in list(self._listeners):
            try:
                callback(event)
            except Exception:
                log.exception("bus_listener_failed", bus_event=event)

    async def connect(self) -> None:
        """Connect (retrying while no server answers); BusConnectError at once if our credentials or
        TLS are refused; ConfigError if the auth/TLS config cannot be used at all."""
        loop = asyncio.get_running_loop()
        refused: asyncio.Future = loop.create_future()
        servers = [u.strip() for u in self.config.url.split(",")]
        shown = redact_url(self.config.url)

        async def on_disconnect() -> None:
            if self.nc is None or not self.connected.is_set():
                return
            self.connected.clear()
            self._open.clear()
            if self._release is not None:
                self._release.cancel()
            self._replay_recent()
            self.disconnected_at = time.monotonic()
            self.outages += 1
            log.warning("nats_disconnected", name=self.name)
            self._notify("disconnected")

        async def on_reconnect() -> None:
            down_s = time.monotonic() - self.disconnected_at if self.disconnected_at is not None else 0.0
            self.disconnected_at = None
            self.connected.set()
            if self._release is None or self._release.done():
                self._release = asyncio.get_running_loop().create_task(self._release_held(), name="bus-release")
            url = self.nc.connected_url if self.nc is not None else None
            log.info("nats_reconnected", name=self.name, down_s=round(down_s, 3),
                     server=redact_url(url.geturl()) if url is not None else None)
            self._notify("reconnected")

        dropped = [0]  # first connection: the server accepted TCP, then closed it, this many times in a row

        async def on_error(exc: Exception) -> None:
            if self.nc is None and not refused.done():
                if is_fatal_connect_error(exc):
                    refused.set_result(exc)
                elif isinstance(exc, (ConnectionResetError, nats_errors.UnexpectedEOF, ssl.SSLEOFError)):
                    # e.g. TLS 1.3 with `verify: true` and no client certificate: the server's alert is
                    # often lost in the reset. A server that is merely down refuses instead.
                    dropped[0] += 1
                    if dropped[0] >= HANDSHAKE_DROPS_FATAL:
                        refused.set_result(exc)
                else:
                    dropped[0] = 0
            text = redact_url(str(exc)) or type(exc).__name__
            now = time.monotonic()
            last_text, last_at, quiet = self._last_error
            if text == last_text and now - last_at < ERROR_LOG_INTERVAL_S:  # one line per 5 s while reconnecting
                self._last_error = (last_text, last_at, quiet + 1)
                return
            self._last_error = (text, now, 0)
            log.warning("nats_error", name=self.name, error=text, **({"repeated": quiet} if quiet else {}))

        options = connect_options(self.config)
        nc = NatsClient()
        attempt = asyncio.create_task(nc.connect(
            servers=servers,
            name=self.name,
            connect_timeout=self.config.connect_timeout_s,
            max_reconnect_attempts=self.config.max_reconnect_attempts,
            reconnect_time_wait=self.config.reconnect_time_wait_s,
            pending_size=self.config.reconnect_buffer_bytes,
            allow_reconnect=True,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            error_cb=on_error,
            **options,
        ), name=f"nats-connect-{self.name}")
        try:
            await asyncio.wait({attempt, refused}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            attempt.cancel()
            raise
        if not attempt.done():
            attempt.cancel()
            await asyncio.gather(attempt, return_exceptions=True)
            await _close_quietly(nc)
            exc = refused.result()
            what, fix = describe_refusal(exc, dropped[0] if dropped[0] >= HANDSHAKE_DROPS_FATAL else 0)
            raise BusConnectError("nats_connect_refused", (
                f"NATS at {shown}: {what} ({type(exc).__name__}: {redact_url(str(exc))}); check {fix}"))
        attempt.result()
        websocket = servers[0].startswith(("ws://", "wss://"))  # wss: TLS below the NATS protocol
        if self.config.wants_tls and not websocket and not nc._server_info.get("tls_required"):  # noqa: SLF001
            await _close_quietly(nc)
            raise BusConnectError("nats_tls_unavailable", (
                f"NATS at {shown} does not require TLS, but nats.url/nats.tls ask for it; nats-py would send "
                f"everything in clear text, so the connection was closed (enable tls {{}} on the server)"))
        self.nc = nc
        self.connected.set()
        self._open.set()

    @property
    def is_connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def sync(self) -> None:
        """Wait until the server has processed all this bus sent so far: its subscriptions are live."""
        assert self.nc is not None, "bus not connected"
        await flush_barrier(self.nc)

    async def close(self) -> None:
        if self.nc is None:
            return
        if self._release is not None:
            self._release.cancel()
        if self._held and self.nc.is_connected:  # closing while settling: send what is held now
            await self._send_held()
        if self._held:
            log.warning("bus_held_dropped", name=self.name, messages=len(self._held))
            self._held.clear()
            self._held_bytes = 0
        nc, self.nc = self.nc, None
        self.connected.clear()
        self._open.clear()
        if not nc.is_connected:  # drain would wait for a server that is not there
            await _close_quietly(nc)
            return
        try:
            await nc.drain()
        except Exception:
            await _close_quietly(nc)

    async def publish(self, subject: str, message: Message, reply: str = "") -> None:
        """Send, or hold while NATS is away (see the class doc); BusError ``bus_buffer_full`` when the
        outage outlasts ``nats.reconnect_buffer_bytes``."""
        assert self.nc is not None, "bus not connected"
        await self._publish_raw(subject, message.encode(), reply, inject_headers())

    async def publish_batch(self, subject: str, messages: list[Message]) -> None:
        """``messages`` (all for ``subject``, in order) as one NATS message (a ``Batch``; one alone goes as
        itself): the receiver handles each as if published one by one, for a fraction of the per-message cost."""
        assert self.nc is not None, "bus not connected"
        data = messages[0].encode() if len(messages) == 1 else protocol.encode_batch(messages)
        await self._publish_raw(subject, data, "", inject_headers())

    async def _publish_raw(self, subject: str, data: bytes, reply: str, headers: dict[str, str]) -> None:
        if self._open.is_set() and not self._held:
            try:
                await self.nc.publish(subject, data, reply=reply, headers=headers)  # type: ignore[union-attr]
                self._remember(subject, data, reply, headers)
                return
            except nats_errors.OutboundBufferLimitError:  # went down before we heard of it
                pass
        if self._held_bytes + len(data) > self.config.reconnect_buffer_bytes:
            raise BusError("bus_buffer_full", f"NATS unreachable and {self._held_bytes} bytes already held; "
                                              f"{subject} not sent", retryable=True)
        if not self._held:
            log.info("bus_holding", name=self.name, reason="disconnected" if not self.connected.is_set()
                     else "settling after reconnect")
        self._held.append((subject, data, reply, headers))
        self._held_bytes += len(data)
        HELD.inc()

    def _remember(self, subject: str, data: bytes, reply: str, headers: dict[str, str]) -> None:
        """Keep what went to a duplicate-tolerant subject for ``replay_window_s``: a server that dies
        takes with it what it had not yet delivered, and we cannot know how much that was."""
        window = self.config.replay_window_s
        if window <= 0 or not subject.startswith(REPLAYABLE_PREFIXES):
            return
        now = time.monotonic()
        self._recent.append((now, subject, data, reply, headers))
        while self._recent and self._recent[0][0] < now - window:
            self._recent.popleft()

    def _replay_recent(self) -> None:
        """On disconnect: what was sent within the window goes first into the hold, to be sent again."""
        now = time.monotonic()
        recent = [r[1:] for r in self._recent if r[0] >= now - self.config.replay_window_s]
        self._recent.clear()
        size = sum(len(r[1]) for r in recent)
        if not recent or self._held_bytes + size > self.config.reconnect_buffer_bytes:
            return
        self._held.extendleft(reversed(recent))
        self._held_bytes += size
        log.info("bus_replay_queued", name=self.name, messages=len(recent))

    async def _release_held(self) -> None:
        """After a reconnect: give the others time to re-subscribe, then send what was held, in order."""
        await asyncio.sleep(self.config.reconnect_settle_s)
        if await self._send_held():
            self._open.set()

    async def _send_held(self) -> bool:
        sent = 0
        while self._held:
            if self.nc is None or not self.nc.is_connected:
                return False  # down again: the next reconnect releases the rest
            subject, data, reply, headers = self._held[0]
            try:
                await self.nc.publish(subject, data, reply=reply, headers=headers)
                self._remember(subject, data, reply, headers)
            except nats_errors.OutboundBufferLimitError:
                return False
            except Exception as exc:  # a bad message must not block the rest
                log.warning("bus_held_send_failed", subject=subject, error=str(exc))
            self._held.popleft()
            self._held_bytes -= len(data)
            sent += 1
        if sent:
            log.info("bus_released", name=self.name, messages=sent)
        return True

    async def _sendable(self, timeout: float) -> float:
        """Wait (within ``timeout``) until publishes go straight out; the time left."""
        if self._open.is_set():
            return timeout
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                await self._open.wait()
        except asyncio.TimeoutError:
            return 0.0
        return max(0.0, timeout - (time.monotonic() - t0))

    async def request(self, subject: str, message: Message, timeout: float | None = None,
                      expect: type[Message] | tuple[type[Message], ...] | None = None) -> Message:
        """Request/reply with a timeout; an ErrorReply from the peer raises BusError."""
        assert self.nc is not None, "bus not connected"
        timeout = self.config.request_timeout_s if timeout is None else timeout
        left = await self._sendable(timeout)
        if left <= 0:
            raise BusError("timeout", f"NATS unreachable: {subject} not sent within {timeout:.1f}s", retryable=True)
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        try:
            msg = await self.nc.request(subject, message.encode(), timeout=left, headers=inject_headers())
        except NoRespondersError:
            raise BusError("no_responders", f"nobody serves {subject}", retryable=True) from None
        except (NatsTimeoutError, asyncio.TimeoutError):
            raise BusError("timeout", f"no reply on {subject} within {timeout:.1f}s", retryable=True) from None
        if task is not None and task.cancelling() > cancels:
            # nats-py waits with asyncio.wait_for, which on Python 3.11 returns a reply that lands together with a
            # cancellation and drops the cancellation: the caller (P's prepare, cancelled because the request
            # ended) then went on as if nothing happened, and everything awaiting it with it
            raise asyncio.CancelledError()
        try:
            reply = protocol.decode(msg.data)
        except ProtocolError as exc:
            raise BusError("bad_reply", f"reply on {subject} rejected: {exc}") from None
        if isinstance(reply, ErrorReply):
            raise BusError(reply.code, reply.message, reply.retryable)
        if expect is not None and not isinstance(reply, expect):
            raise BusError("unexpected_reply", f"reply on {subject} was {reply.TYPE!r}")
        return reply

    async def subscribe(self, subject: str, handler: Handler, *, queue: str = "",
                        expect: type[Message] | tuple[type[Message], ...] | None = None,
                        span_name: str | None = None) -> Subscription:
        """Decode strictly, run ``handler`` in the sender's trace context, reply if it returns a message."""
        assert self.nc is not None, "bus not connected"

        def reject(msg: Msg, exc: ProtocolError) -> None:
            REJECTED.labels(subject=_metric_subject(subject), code=exc.code).inc()
            log.warning("bus_message_rejected", subject=msg.subject, code=exc.code, error=exc.message,
                        size=len(msg.data))

        async def handle(message: Message, msg: Msg, envelope: Envelope) -> Message | None:
            try:
                if span_name:
                    with _tracer.start_as_current_span(span_name, attributes={"messaging.destination": msg.subject}):
                        return await handler(message, envelope)
                return await handler(message, envelope)
            except Exception as exc:  # a handler bug must not kill the subscription
                HANDLER_ERRORS.labels(subject=_metric_subject(subject)).inc()
                log.exception("bus_handler_failed", subject=msg.subject, type=message.TYPE)
                return ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}")

        async def callback(msg: Msg) -> None:
            headers = dict(msg.headers or {})
            try:
                message = protocol.decode(msg.data, expect=_or_batch(expect))
                if isinstance(message, Batch) and msg.reply:
                    raise ProtocolError("bad_frame", "a batch cannot be a request")
            except ProtocolError as exc:
                reject(msg, exc)
                if msg.reply:
                    await self._safe_respond(msg, ErrorReply(code="protocol_error", message=str(exc)))
                return
            envelope = Envelope(msg.subject, msg.reply or None, headers)
            # the sender's trace context, once per NATS message: a batch's items share its headers
            token = otel_context.attach(extract_context(headers))
            try:
                if isinstance(message, Batch):  # each item as if it had come alone, in order
                    for item in message.items:
                        try:
                            one = protocol.decode_envelope(item, expect=expect)
                            if isinstance(one, Batch):
                                raise ProtocolError("bad_frame", "a batch cannot hold a batch")
                        except ProtocolError as exc:
                            reject(msg, exc)
                            continue
                        await handle(one, msg, envelope)
                    return
                result = await handle(message, msg, envelope)
            finally:
                otel_context.detach(token)
            if msg.reply and result is not None:
                await self._safe_respond(msg, result)

        sub = await self.nc.subscribe(subject, queue=queue, cb=callback)
        self._subs.append(sub)
        return sub

    async def _safe_respond(self, msg: Msg, reply: Message) -> None:
        try:
            await self._publish_raw(msg.reply, reply.encode(), "", inject_headers())  # type: ignore[arg-type]
        except Exception as exc:
            log.warning("bus_reply_failed", subject=msg.subject, error=str(exc))


async def _close_quietly(nc: NatsClient) -> None:
    try:
        await nc.close()
    except Exception:
        pass


def _or_batch(expect: type[Message] | tuple[type[Message], ...] | None) -> tuple[type[Message], ...] | None:
    """What a subscription accepts on the wire: its message types, or a ``Batch`` of them."""
    if expect is None:
        return None
    return (*(expect if isinstance(expect, tuple) else (expect,)), Batch)


def _metric_subject(subject: str) -> str:
    """Collapse instance ids so label cardinality stays bounded: pdd.inst.X.verb -> pdd.inst.*.verb."""
    parts = subject.split(".")
    if len(parts) >= 4 and parts[1] in ("inst", "router", "cache"):
        parts[2] = "*"
    return ".".join(parts)
