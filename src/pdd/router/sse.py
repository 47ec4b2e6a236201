"""A streaming response's SSE events, written from the producer's callback instead of an HTTP task.

Why: per token, the streaming path used to cost a queue put, a task switch into the HTTP handler, an async
generator step, Starlette's StreamingResponse and five ASGI ``send`` wrappers before its bytes reached uvicorn.
Here the HTTP handler writes the response's start and first chunk, then attaches an ``SSEWriter`` to the stream
(``BackendStream.attach``): the orchestrator's bus callback hands each token event straight to it. The writer
gathers what arrived for its stream in one round of the event loop (all of a bus batch; a backlog) and, once the
producer's callback is done, turns it into SSE events (``DeltaBuilder``'s rule, JSON from constant parts encoded
once, ``Formatter.sse_chunk``) written in one call of the server's own ``send``. The handler waits for the
writer to end, then finishes the response: the in-band error if one came, and the body's end.

The ASGI middleware (FastAPI's telemetry, Starlette's error handling, the response counter) see the
response's start and its end, which is all they read; the events between go to the server's ``send``, which
``create_app``'s app keeps in the scope under ``RAW_SEND``. A client that reads slowly (the server's ``send``
waits for its socket to drain) holds its own stream only: that one write is finished in a task, and the events
that arrive meanwhile go out together when it is done. A disconnect ends the stream at once.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from starlette.responses import StreamingResponse

from pdd.router.openai_format import DONE_LINE, Formatter, final_usage, sse_line
from pdd.router.streaming import BackendStream, ClientDisconnected, Delta, DeltaBuilder, as_event, is_disconnect
from pdd.router.types import TokenEvent
from pdd.shared import metrics
from pdd.shared.telemetry import get_logger

log = get_logger("pdd.router.api")

RAW_SEND = "pdd.raw_send"  # the scope key of the server's own ``send`` (set by create_app's app)
Send = Callable[[dict], Awaitable[None]]


class _Round:
    """The writers that got events in this round of the event loop: each flushed once, after the callback that
    fed them (one ``call_soon`` for all of them), so a stream's tokens from one bus batch make one write."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._dirty: list[SSEWriter] = []

    def add(self, writer: SSEWriter) -> None:
        self._dirty.append(writer)
        if len(self._dirty) == 1:
            self._loop.call_soon(self._run)

    def _run(self) -> None:
        dirty, self._dirty = self._dirty, []
        for writer in dirty:
            try:
                writer.flush()
            except Exception:  # flush ends its own stream on errors; the others must still go out
                log.exception("sse_flush_failed")


_ROUNDS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Round] = weakref.WeakKeyDictionary()


def _round() -> _Round:
    loop = asyncio.get_running_loop()
    found = _ROUNDS.get(loop)
    if found is None:
        found = _ROUNDS[loop] = _Round(loop)
    return found


async def _resume(coro: Coroutine[Any, Any, Any], step: Any) -> None:
    """Run ``coro`` to its end after it suspended on ``step`` (what it yielded when driven by hand), as a task
    would have: take the future (clear its blocking flag, or awaiting it again is refused), wait for it, then
    resume the coroutine or throw it the exception, until it returns."""
    while True:
        try:
            if step is None:
                await asyncio.sleep(0)  # a bare yield: it asked to be run again on the next round
            else:
                step._asyncio_future_blocking = False  # taken, as a task takes a future it was handed
                await step
        except BaseException as exc:  # noqa: BLE001 - delivered to the coroutine, as its task would
            try:
                step = coro.throw(exc)
            except StopIteration:
                return
            continue
        try:
            step = coro.send(None)
        except StopIteration:
            return


def transport_writer(send: Send) -> Callable[[bytes], bool] | None:
    """For uvicorn's httptools protocol (the router's server) once a chunked response has started: a body chunk
    written to the connection's transport as uvicorn's ``send`` writes it (same framing, same checks), without the
    coroutine and message per event. It returns False when it cannot write now (the client reads slowly, is gone,
    or the response is complete): then ``send`` does, as for every other server (None)."""
    cycle = getattr(send, "__self__", None)
    if type(cycle).__module__ != "uvicorn.protocols.http.httptools_impl" or type(cycle).__name__ != \
            "RequestResponseCycle" or getattr(cycle, "chunked_encoding", None) is not True:
        return None
    transport, flow = cycle.transport, cycle.flow

    def write(body: bytes) -> bool:
        if flow.write_paused or cycle.disconnected or cycle.response_complete:
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    return write


class SSEWriter:
    """One stream's SSE events from its first token on; ``put`` is the stream's consumer (``BackendStream.attach``).
    ``done`` resolves when the stream ended and all of it is written: None after the final event (and usage and
    ``[DONE]``), else the exception that ended it (ClientDisconnected, the backend's error, the deadline's 504)."""

    def __init__(self, send: Send, fmt: Formatter, builder: DeltaBuilder, request_id: str, prompt_tokens: int):
        self._send = send
        self._direct = transport_writer(send)  # after the response's start: whether it is chunked is known then
        self._fmt = fmt
        self._builder = builder
        self._request_id = request_id
        self._prompt_tokens = prompt_tokens
        self._items: list[Any] = []  # what the stream handed over since the last flush
        self._round = _round()
        self._counted = 0  # tokens the client has been told of (continuous usage)
        self._busy: asyncio.Task | None = None  # a write the server's flow control suspended
        self._failure: BaseException | None = None
        self.ended = False  # the final event (and usage, [DONE]) is rendered
        self._over = False  # ``done`` is resolved: later items are dropped
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()

    def render(self, delta: Delta, out: list[str], now: float) -> None:
        """The SSE lines of one delta (none for a delta with nothing to tell); the final one adds usage and [DONE]."""
        fmt = self._fmt
        final = delta.finish_reason is not None
        # with usage on every chunk, a chunk also goes out for tokens whose text is not final yet (partial UTF-8,
        # a possible stop string): clients time positions by its count
        news = fmt.continuous_prompt_tokens is not None and delta.completion_tokens > self._counted
        if delta.text or final or news or delta.logprobs:
            self._counted = delta.completion_tokens
            out.append(fmt.sse_chunk(delta, delta.info if final else None))
            if delta.received:
                metrics.ROUTER_TOKEN_DELAY.observe(now - delta.received)
        if final:
            if fmt.include_usage:
                usage = final_usage(self._prompt_tokens, delta.completion_tokens, delta.info)
                out.append(sse_line(fmt.usage_chunk(usage, delta.info)))
            out.append(DONE_LINE)
            self.ended = True

    def put(self, item: Any) -> None:
        """An item of the stream (event, error, end, deadline, disconnect), in the producer's call: never raises."""
        if self._over:
            return
        if type(item) is not TokenEvent and is_disconnect(item):  # at once, even while a write waits for the client
            self._end(ClientDisconnected())
            return
        self._items.append(item)
        if len(self._items) == 1 and self._busy is None:
            self._round.add(self)

    def flush(self) -> None:
        """Render what arrived since the last flush as SSE events and write them in one ``send``."""
        if self._busy is not None or self._over or not self._items:
            return
        items, self._items = self._items, []
        out: list[str] = []
        try:
            self._render_items(items, out)
        except Exception as exc:  # noqa: BLE001 - a bug here must end this stream, not the producer's callback
            log.error("sse_render_failed", request_id=self._request_id, error_type=type(exc).__name__)
            self._failure = exc
        self._write("".join(out))

    def _render_items(self, items: list[Any], out: list[str]) -> None:
        builder, now = self._builder, time.monotonic()
        for item in items:
            if type(item) is TokenEvent:
                event: TokenEvent | None = item
            else:
                try:
                    event = as_event(item)
                except BaseException as exc:  # noqa: BLE001 - the stream's end: the tokens before it go out first
                    self._failure = exc
                    break
                if event is None:
                    self.render(builder.unfinished(self._request_id), out, now)
                    break
            if event.logprobs and builder.open:  # an event with logprobs starts a delta of its own
                self.render(builder.take(), out, now)
            if builder.add(event):
                self.render(builder.take(), out, now)
                if self.ended:
                    break
        if builder.open and not self.ended:
            self.render(builder.take(), out, now)

    def _write(self, text: str) -> None:
        """Write through the server's ``send`` driven by hand: it returns at once unless the client's socket is
        full; then a task finishes that write and the stream's later events wait for it."""
        if text:
            body = text.encode()
            if self._direct is not None and self._direct(body):
                self._settle()
                return
            coro = self._send({"type": "http.response.body", "body": body, "more_body": True})
            try:
                step = coro.send(None)
            except StopIteration:
                pass
            except Exception as exc:  # noqa: BLE001 - the server refused the write: this stream is over
                self._end(exc)
                return
            else:
                self._busy = asyncio.ensure_future(self._finish_write(coro, step))
                return
        self._settle()

    async def _finish_write(self, coro: Coroutine[Any, Any, Any], step: Any) -> None:
        try:
            await _resume(coro, step)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the server refused the write: this stream is over
            self._busy = None
            self._end(exc)
            return
        self._busy = None
        self._settle()

    def _settle(self) -> None:
        """After a write: end the stream when it is over, or write what arrived meanwhile."""
        if self._failure is not None:
            self._end(self._failure)
        elif self.ended:
            self._end(None)
        elif self._items:
            self.flush()

    def _end(self, failure: BaseException | None) -> None:
        if self._over:
            return
        self._over = True
        if self._busy is not None:
            self._busy.cancel()
            self._busy = None
        if failure is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(failure)


class SSEResponse(StreamingResponse):
    """The streaming answer: ``text/event-stream``, written by an ``SSEWriter`` from the first token on. Built
    after the first delta arrived (so errors before it got a real status); ``on_error`` renders a mid-stream error
    in-band, ``close`` stops the generation (shielded), whatever ended the stream."""

    def __init__(self, stream: BackendStream, builder: DeltaBuilder, fmt: Formatter, first: Delta,
                 prompt_tokens: int, on_error: Callable[[BaseException], str], close: Callable[[], Awaitable[None]]):
        super().__init__((), media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                      "X-Accel-Buffering": "no"})
        self._stream, self._builder, self._fmt, self._first = stream, builder, fmt, first
        self._prompt_tokens, self._on_error, self._close = prompt_tokens, on_error, close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raw: Send = scope.get(RAW_SEND, send)
        request_id = self._stream.request_id
        tail = ""
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            writer = SSEWriter(raw, self._fmt, self._builder, request_id, self._prompt_tokens)
            head = [sse_line(c) for c in self._fmt.start_chunks()]
            writer.render(self._first, head, time.monotonic())
            await raw({"type": "http.response.body", "body": "".join(head).encode(), "more_body": True})
            if not writer.ended:
                self._stream.attach(writer.put)
                await writer.done
        except ClientDisconnected:
            log.info("client_disconnected", request_id=request_id)
        except OSError:
            pass  # client gone mid-send; the watcher has or will cancel the generation
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band, as vLLM does
            tail = self._on_error(exc) + DONE_LINE
        finally:
            await self._close()
        try:
            await send({"type": "http.response.body", "body": tail.encode(), "more_body": False})
        except OSError:
            pass
