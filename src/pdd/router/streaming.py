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
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import anyio

from pdd.router.detokenize import IncrementalDetokenizer
from pdd.router.types import Generation, GenerationError, TokenEvent
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
    queue itself; an async generator is iterated into it by a pump task."""

    def __init__(self, source: AsyncIterator[TokenEvent] | Generation, request_id: str, deadline_unix: float):
        """``deadline_unix``: the request's; ``DEADLINE_GRACE_S`` after it the consumer gets a 504 whatever the
        backend does (one timer per stream, none per event)."""
        self._request_id = request_id
        self._stash: list[Any] = []  # at most one item next_ready took and gave back
        if isinstance(source, Generation):
            self._queue, self._task = source.events, source.task
        else:
            self._agen = source
            self._queue = asyncio.Queue()  # unbounded: put never blocks the pump
            self._task = asyncio.create_task(self._pump(), name=f"pdd-gen-{request_id}")
        self._expiry = asyncio.get_running_loop().call_later(
            max(0.0, deadline_unix + DEADLINE_GRACE_S - time.time()), self._queue.put_nowait, _EXPIRED)

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
        item = self._stash.pop() if self._stash else await self._queue.get()
        if item is _EXPIRED:
            raise GenerationError(504, "timeout", "the request exceeded its deadline")
        if item is _DISCONNECTED:
            raise ClientDisconnected()
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

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


async def text_deltas(stream: BackendStream, detok: IncrementalDetokenizer, max_tokens: int) -> AsyncIterator[Delta]:
    """Backend events -> text deltas; ends on the backend's finish, a stop string, or max_tokens. Events already
    queued behind the one awaited (tokens that arrived together, e.g. while the router caught up) make one
    delta, so one SSE event: its token count tells the client how many output positions it carries."""
    count = 0
    info: dict = {}
    while True:
        event: TokenEvent | None = await stream.next()
        if event is None:
            log.warning("backend_ended_without_finish", request_id=stream._request_id)
            yield Delta(detok.finish(), "stop", count, info)
            return
        parts: list[str] = []
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs] = []
        finish: str | None = None
        received = event.received
        while event is not None:
            info = {**info, **(event.info or {})}
            taken = 0  # tokens of this event that count (a stop string or max_tokens may cut it short)
            last = len(event.token_ids) - 1
            for n, token_id in enumerate(event.token_ids):
                count += 1
                taken += 1
                ends = n == last and event.finish_reason == "stop"  # the event's last token may be a stop token
                step = detok.add_last(int(token_id)) if ends else detok.add(int(token_id))
                parts.append(step.text)
                if step.stopped:
                    finish = "stop"
                    break
                if count >= max_tokens:
                    break
            if finish is None and event.finish_reason is not None:
                finish = event.finish_reason
            elif finish is None and count >= max_tokens:
                finish = "length"  # the backend overran max_tokens; it gets closed by the caller
            token_ids.extend(event.token_ids[:taken])
            if len(event.logprobs) == len(event.token_ids):
                logprobs.extend(event.logprobs[:taken])
            if finish is not None or event.logprobs:
                break
            event = stream.next_ready()
        if finish is not None and not detok.stopped:
            parts.append(detok.finish())
        yield Delta("".join(parts), finish, count, info if finish else {}, token_ids, logprobs, received)
        if finish is not None:
            return
