"""Driving one backend generation for the HTTP layer: its event queue, disconnect watch, text deltas.

The router's orchestrator fills the event queue from its bus callback in a task of its own (a
``Generation``); any other backend's async generator runs in its own asyncio task (the pump). Either
way the producer is not the HTTP handler's task. Why: when a client goes away, the handler may be
cancelled by the server with anyio's level-triggered cancellation, and then every ``await`` in the
backend's cleanup (telling prefill/relay/decode over NATS to drop the request and free KV) would be
cancelled again. In its own task, the backend is closed exactly once — one ``CancelledError`` at an
``await`` (or ``aclose()``: GeneratorExit at a ``yield``) — and its ``finally`` can await freely.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from pdd.router.detokenize import IncrementalDetokenizer
from pdd.router.types import EventQueue, Generation, GenerationError, TokenEvent
from pdd.shared.protocol import TokenLogprobs
from pdd.shared.telemetry import get_logger

log = get_logger("pdd.router.api")

CLOSE_TIMEOUT_S = 10.0  # how long closing may take before the HTTP layer stops waiting
DEADLINE_GRACE_S = 5.0  # the backend enforces the deadline; this is the HTTP layer's backstop


class ClientDisconnected(Exception):
    """The HTTP client went away; the generation was (or is being) cancelled."""


class _End:
    pass


class _Disconnected:
    pass


class _Expired:
    pass


_END = _End()
_DISCONNECTED = _Disconnected()
_EXPIRED = _Expired()


class BackendStream:
    """Owns one generation: its events in one queue, its producer closed exactly once. A ``Generation`` fills the
    queue itself; an async generator is iterated into it by a pump task. ``attach`` hands the queue's items to a
    consumer from then on (the SSE writer), instead of ``next``."""

    def __init__(self, source: AsyncIterator[TokenEvent] | Generation, request_id: str, deadline_unix: float):
        """``deadline_unix``: the request's; ``DEADLINE_GRACE_S`` after it the consumer gets a 504 whatever the
        backend does (one timer per stream, none per event)."""
        self._request_id = request_id
        self._stash: list[Any] = []  # at most one item next_ready took and gave back
        if isinstance(source, Generation):
            self._queue, self._task = source.events, source.task
        else:
            self._agen = source
            self._queue = EventQueue()  # unbounded: put never blocks the pump
            self._task = asyncio.create_task(self._pump(), name=f"pdd-gen-{request_id}")
        self._expiry = asyncio.get_running_loop().call_later(
            max(0.0, deadline_unix + DEADLINE_GRACE_S - time.time()), self._queue.put_nowait, _EXPIRED)

    @property
    def request_id(self) -> str:
        return self._request_id

    async def _pump(self) -> None:
        try:
            async for event in self._agen:
                self._queue.put_nowait(event)
                if event.finish_reason is not None:
                    break  # never resume the generator after its final event
                await asyncio.sleep(0)  # a backend that never awaits must not starve the loop
            else:
                self._queue.put_nowait(_END)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which maps it to an HTTP error
            self._queue.put_nowait(exc)
        finally:
            aclose = getattr(self._agen, "aclose", None)
            if aclose is not None:
                await aclose()

    def mark_disconnected(self) -> None:
        self._queue.put_nowait(_DISCONNECTED)

    async def next(self) -> TokenEvent | None:
        """The next event; None when the generator ended without a final event."""
        return as_event(self._stash.pop() if self._stash else await self._queue.get())

    def next_ready(self) -> TokenEvent | None:
        """The next event if it is already queued and carries no logprobs, else None (without waiting); an end,
        an error or an event with logprobs stays for ``next``. Lets the HTTP layer send tokens that arrived
        together as one SSE event."""
        if self._stash or self._queue.empty():
            return None
        item = self._queue.get_nowait()
        if isinstance(item, (_End, _Disconnected, _Expired, BaseException)) or item.logprobs:
            self._stash.append(item)
            return None
        return item

    def attach(self, consumer: Callable[[Any], None]) -> None:
        """From now on every item (events, errors, the end, a disconnect, the deadline) goes to ``consumer`` in the
        producer's call, the ones already queued first; read them with ``as_event``. ``next`` is not used after."""
        stash, self._stash = self._stash, []
        for item in stash:
            consumer(item)
        self._queue.attach(consumer)

    async def close(self) -> None:
        """Stop the generation (no-op when it ended); waits for the backend's cleanup, shielded."""
        self._expiry.cancel()
        with anyio.CancelScope(shield=True):
            if not self._task.done():
                self._task.cancel()
            with anyio.move_on_after(CLOSE_TIMEOUT_S) as scope:
                await asyncio.wait({self._task})
            if scope.cancelled_caught:
                log.warning("backend_close_timeout", request_id=self._request_id)
            elif not self._task.cancelled() and self._task.exception() is not None:
                log.warning("backend_close_error", request_id=self._request_id,
                            error_type=type(self._task.exception()).__name__)


def as_event(item: Any) -> TokenEvent | None:
    """A queued item as the event it is: None for the end of a generator without a final event; the deadline,
    a disconnect or the backend's error raise (GenerationError 504, ClientDisconnected, the error)."""
    if isinstance(item, TokenEvent):
        return item
    if item is _EXPIRED:
        raise GenerationError(504, "timeout", "the request exceeded its deadline")
    if item is _DISCONNECTED:
        raise ClientDisconnected()
    if item is _END:
        return None
    if isinstance(item, BaseException):
        raise item
    return item


def is_disconnect(item: Any) -> bool:
    """Whether a queued item says the client went away (acted on at once, ahead of queued tokens)."""
    return item is _DISCONNECTED


async def watch_disconnect(receive: Any, stream: BackendStream) -> None:
    """Wait for ``http.disconnect`` (the request body is already read) and tell the stream."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            stream.mark_disconnected()
            return


@dataclass
class Delta:
    """Text that may be sent now; on the last delta ``finish_reason`` is set and ``info`` is final."""

    text: str
    finish_reason: str | None = None
    completion_tokens: int = 0
    info: dict = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)  # the tokens this delta counts (with logprobs: theirs)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    received: float = 0.0  # when its oldest token came off the bus (time.monotonic(); 0: unknown)


class DeltaBuilder:
    """Backend events -> text deltas, the one rule of both response paths: a delta gathers consecutive events
    until the output ends (the backend's finish, a stop string, ``max_tokens``) or an event carries logprobs
    (an event with logprobs starts a delta of its own, ``must_start``); its token count tells the client how
    many output positions it carries."""

    def __init__(self, detok: IncrementalDetokenizer, max_tokens: int):
        self._detok = detok
        self._max_tokens = max_tokens
        self.count = 0  # output tokens taken so far
        self._info: dict = {}
        self._open = False
        self._parts: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprobs] = []
        self._finish: str | None = None
        self._received = 0.0

    @property
    def open(self) -> bool:
        """Whether a delta holds events not taken yet."""
        return self._open

    def must_start(self, event: TokenEvent) -> bool:
        """Whether ``event`` cannot join the open delta (it carries logprobs): take that one first."""
        return self._open and bool(event.logprobs)

    def add(self, event: TokenEvent) -> bool:
        """Add the event's tokens to the open delta; True when the delta is complete (take it now)."""
        if not self._open:
            self._open, self._received = True, event.received
        if event.info:
            self._info = {**self._info, **event.info}
        ids = event.token_ids
        if len(ids) == 1 and event.finish_reason is None and self.count + 1 < self._max_tokens:
            # nearly every event of a stream: one token that cannot end the output by its count
            self.count += 1
            step = self._detok.add(int(ids[0]))
            self._parts.append(step.text)
            self._token_ids.append(ids[0])
            if len(event.logprobs) == 1:
                self._logprobs.append(event.logprobs[0])
            if step.stopped:
                self._finish = "stop"
                return True
            return bool(event.logprobs)
        return self._add_many(event)

    def _add_many(self, event: TokenEvent) -> bool:
        detok, max_tokens, parts = self._detok, self._max_tokens, self._parts
        finish: str | None = None
        taken = 0  # tokens of this event that count (a stop string or max_tokens may cut it short)
        ids = event.token_ids
        last = len(ids) - 1
        for n, token_id in enumerate(ids):
            self.count += 1
            taken += 1
            ends = n == last and event.finish_reason == "stop"  # the event's last token may be a stop token
            step = detok.add_last(int(token_id)) if ends else detok.add(int(token_id))
            parts.append(step.text)
            if step.stopped:
                finish = "stop"
                break
            if self.count >= max_tokens:
                break
        if finish is None and event.finish_reason is not None:
            finish = event.finish_reason
        elif finish is None and self.count >= max_tokens:
            finish = "length"  # the backend overran max_tokens; it gets closed by the caller
        self._token_ids.extend(ids[:taken] if taken < len(ids) else ids)
        if len(event.logprobs) == len(ids):
            self._logprobs.extend(event.logprobs[:taken])
        self._finish = finish
        return finish is not None or bool(event.logprobs)

    def take(self) -> Delta:
        """The open delta, closed (with the held-back text released when it ends the output)."""
        finish = self._finish
        if finish is not None and not self._detok.stopped:
            self._parts.append(self._detok.finish())
        delta = Delta("".join(self._parts), finish, self.count, self._info if finish else {}, self._token_ids,
                      self._logprobs, self._received)
        self._open, self._parts, self._token_ids, self._logprobs, self._finish = False, [], [], [], None
        return delta

    def unfinished(self, request_id: str) -> Delta:
        """The last delta of a backend that ended without a final event: what is held back, finish "stop"."""
        log.warning("backend_ended_without_finish", request_id=request_id)
        return Delta(self._detok.finish(), "stop", self.count, self._info)


async def text_deltas(stream: BackendStream, builder: DeltaBuilder) -> AsyncIterator[Delta]:
    """Backend events -> text deltas (``DeltaBuilder``'s rule). Events already queued behind the one awaited
    (tokens that arrived together, e.g. while the router caught up) make one delta, so one SSE event."""
    while True:
        event: TokenEvent | None = await stream.next()
        if event is None:
            yield builder.unfinished(stream.request_id)
            return
        while not builder.add(event):
            event = stream.next_ready()
            if event is None:
                break
        delta = builder.take()
        yield delta
        if delta.finish_reason is not None:
            return
