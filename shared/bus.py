"""NATS helpers: typed publish/subscribe/request with trace context in headers.

Handlers receive decoded messages. A message that fails to decode is rejected here (logged,
counted, and answered with an ``ErrorReply`` when the sender expects a reply), so no service
loop ever sees a ``ProtocolError`` or dies of one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry import context as otel_context
from opentelemetry import trace
from prometheus_client import Counter

from pdd.shared import protocol
from pdd.shared.config import NatsConfig
from pdd.shared.protocol import ErrorReply, Message, ProtocolError
from pdd.shared.telemetry import extract_context, get_logger, inject_headers

log = get_logger("pdd.bus")
_tracer = trace.get_tracer("pdd.bus")

REJECTED = Counter("pdd:bus_rejected_messages_total", "Bus messages rejected by strict decoding", ["subject", "code"])
HANDLER_ERRORS = Counter("pdd:bus_handler_errors_total", "Handler exceptions caught by the bus", ["subject"])

Handler = Callable[[Message, "Envelope"], Awaitable[Message | None]]


class BusError(RuntimeError):
    """A request over the bus failed: no responder, timeout, or the peer replied with an error."""

    def __init__(self, code: str, message: str, retryable: bool = False):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable


@dataclass
class Envelope:
    subject: str
    reply: str | None
    headers: dict[str, str]


class Bus:
    """One NATS connection per service, with reconnects handled by nats-py."""

    def __init__(self, config: NatsConfig, name: str):
        self.config = config
        self.name = name
        self.nc: NatsClient | None = None
        self._subs: list[Subscription] = []
        self.connected = asyncio.Event()

    async def connect(self) -> None:
        async def on_disconnect() -> None:
            self.connected.clear()
            log.warning("nats_disconnected", name=self.name)

        async def on_reconnect() -> None:
            self.connected.set()
            log.info("nats_reconnected", name=self.name)

        async def on_error(exc: Exception) -> None:
            log.warning("nats_error", name=self.name, error=str(exc))

        self.nc = await nats.connect(
            servers=[u.strip() for u in self.config.url.split(",")],
            name=self.name,
            token=self.config.token,
            user=self.config.user,
            password=self.config.password,
            connect_timeout=self.config.connect_timeout_s,
            max_reconnect_attempts=self.config.max_reconnect_attempts,
            reconnect_time_wait=0.5,
            allow_reconnect=True,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            error_cb=on_error,
        )
        self.connected.set()

    @property
    def is_connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def close(self) -> None:
        if self.nc is None:
            return
        try:
            await self.nc.drain()
        except Exception:
            await self.nc.close()
        self.nc = None

    async def publish(self, subject: str, message: Message, reply: str = "") -> None:
        assert self.nc is not None, "bus not connected"
        await self.nc.publish(subject, message.encode(), reply=reply, headers=inject_headers())

    async def request(self, subject: str, message: Message, timeout: float | None = None,
                      expect: type[Message] | tuple[type[Message], ...] | None = None) -> Message:
        """Request/reply with a timeout; an ErrorReply from the peer raises BusError."""
        assert self.nc is not None, "bus not connected"
        timeout = self.config.request_timeout_s if timeout is None else timeout
        try:
            msg = await self.nc.request(subject, message.encode(), timeout=timeout, headers=inject_headers())
        except NoRespondersError:
            raise BusError("no_responders", f"nobody serves {subject}", retryable=True) from None
        except (NatsTimeoutError, asyncio.TimeoutError):
            raise BusError("timeout", f"no reply on {subject} within {timeout:.1f}s", retryable=True) from None
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

        async def callback(msg: Msg) -> None:
            headers = dict(msg.headers or {})
            try:
                message = protocol.decode(msg.data, expect=expect)
            except ProtocolError as exc:
                REJECTED.labels(subject=_metric_subject(subject), code=exc.code).inc()
                log.warning("bus_message_rejected", subject=msg.subject, code=exc.code, error=exc.message,
                            size=len(msg.data))
                if msg.reply:
                    await self._safe_respond(msg, ErrorReply(code="protocol_error", message=str(exc)))
                return
            token = otel_context.attach(extract_context(headers))
            try:
                if span_name:
                    with _tracer.start_as_current_span(span_name, attributes={"messaging.destination": msg.subject}):
                        result = await handler(message, Envelope(msg.subject, msg.reply or None, headers))
                else:
                    result = await handler(message, Envelope(msg.subject, msg.reply or None, headers))
            except Exception as exc:  # a handler bug must not kill the subscription
                HANDLER_ERRORS.labels(subject=_metric_subject(subject)).inc()
                log.exception("bus_handler_failed", subject=msg.subject, type=message.TYPE)
                result = ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}")
            finally:
                otel_context.detach(token)
            if msg.reply and result is not None:
                await self._safe_respond(msg, result)

        sub = await self.nc.subscribe(subject, queue=queue, cb=callback)
        self._subs.append(sub)
        return sub

    async def _safe_respond(self, msg: Msg, reply: Message) -> None:
        try:
            await self.nc.publish(msg.reply, reply.encode(), headers=inject_headers())  # type: ignore[union-attr]
        except Exception as exc:
            log.warning("bus_reply_failed", subject=msg.subject, error=str(exc))


def _metric_subject(subject: str) -> str:
    """Collapse instance ids so label cardinality stays bounded: pdd.inst.X.verb -> pdd.inst.*.verb."""
    parts = subject.split(".")
    if len(parts) >= 4 and parts[1] in ("inst", "router", "cache"):
        parts[2] = "*"
    return ".".join(parts)
