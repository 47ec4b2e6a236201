"""The streaming path that writes SSE events from the bus callback (router/sse.py), for real: a real nats-server,
the router's orchestrator on a real bus, its HTTP API on uvicorn with the router's httptools protocol, and this
test playing prefill and main decode on the bus (it answers the router's submit with the first token, then
publishes token chunks as a decoder's batches).

- tokens of one stream that arrive in one bus batch go out as one SSE event, whose usage counts them, with the
  same text as the full decode; two streams in one batch each get theirs;
- the events are written to the connection's transport directly (uvicorn's httptools protocol);
- a client that hangs up mid-stream cancels its request on the bus, and the router forgets it;
- a client that reads slowly (the server's writes wait for its socket) still gets every event, in order.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import httpx
import pytest
import uvicorn

from pdd.router import sse
from pdd.router.api import create_app
from pdd.router.orchestrator import Orchestrator
from pdd.router.routing import Route
from pdd.router.types import GenerationRequest, TokenEvent
from pdd.shared.bus import Bus
from pdd.shared.config import NatsConfig, PDDConfig
from pdd.shared.pipelines import Pipeline
from pdd.shared.protocol import Announce, Cancel, PrefillResult, Subjects, SubmitRequest, TokenChunk
from pdd.shared.roles import Role

MODEL = "tiny-test"
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the green forest."


def _announce(instance_id: str, role: Role) -> Announce:
    return Announce(instance_id, role, "site-a", "ready", 0.0, 0, 100, 100, 500, max_context=4096)


class _Registry:
    """The two instances the test plays, always live."""

    def __init__(self) -> None:
        self.known = {a.instance_id: a for a in (_announce("p-0", Role.PREFILL), _announce("md-0", Role.MAIN_DECODE))}
        self.changed = asyncio.Event()

    def get(self, instance_id: str) -> Announce | None:
        return self.known.get(instance_id)

    def instances(self, role: Role | None = None) -> list[Announce]:
        return [a for a in self.known.values() if role is None or a.role == role]


class _Routing:
    def __init__(self, registry: _Registry) -> None:
        self.registry = registry

    async def route(self, req: GenerationRequest, exclude: Any = frozenset()) -> Route:
        return Route(Pipeline.P_MD, "forced", self.registry.known["p-0"], None, self.registry.known["md-0"], 0, 0, 0)


class _Backend:
    """The router service's face to the HTTP layer (service.RouterService), over the orchestrator."""

    model_name = MODEL
    max_body_bytes = 1 << 20
    api_keys: ClassVar[list[str]] = []
    request_timeout_s = 60.0

    def __init__(self, orchestrator: Orchestrator, tokenizer: Any) -> None:
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer
        self.max_context = 4096

    def ready(self) -> bool:
        return True

    def health(self) -> dict:
        return {}

    def generate(self, req: GenerationRequest) -> Any:
        return self.orchestrator.generate(req)


class _Engines:
    """Prefill and main decode, played over the bus: submits and cancels are recorded; tokens are published."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.submits: asyncio.Queue[SubmitRequest] = asyncio.Queue()
        self.cancels: list[str] = []

    async def start(self) -> None:
        async def on_submit(message: SubmitRequest, _envelope: Any) -> None:
            self.submits.put_nowait(message)

        async def on_cancel(message: Cancel, _envelope: Any) -> None:
            self.cancels.append(message.request_id)

        await self.bus.subscribe(Subjects.instance("p-0", "submit"), on_submit, expect=SubmitRequest)
        await self.bus.subscribe(Subjects.CANCEL, on_cancel, expect=Cancel)
        await self.bus.sync()

    async def first_token(self, submit: SubmitRequest, token: int) -> None:
        await self.bus.publish(submit.events_subject, PrefillResult(
            request_id=submit.request_id, instance_id="p-0", first_token=token, cached_tokens=0,
            prompt_tokens=len(submit.prompt_ids)))

    async def batch(self, chunks: list[tuple[SubmitRequest, int, list[int], str | None]]) -> None:
        """One decoder batch: (request, start position, token ids, finish) each, all in one bus message."""
        subject = chunks[0][0].events_subject
        await self.bus.publish_batch(subject, [TokenChunk(s.request_id, "md-0", Role.MAIN_DECODE, start, ids, finish)
                                               for s, start, ids, finish in chunks])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from pdd.shared.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def nats_url():
    """A nats-server of this module's own: the played engines answer as p-0, rld-0 and md-0, and the session's
    systems (tests/e2e) have real instances of those names on the session's server, whose first tokens would
    race the played ones."""
    from pdd.launch.natsserver import start_nats_server

    server = start_nats_server()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
async def router(nats_url, tokenizer) -> AsyncIterator[tuple[str, Orchestrator, _Engines]]:
    """The router's orchestrator and HTTP API (uvicorn, httptools) on a real bus; yields its URL, the orchestrator
    and the played engines."""
    config = PDDConfig()
    config.nats.url = nats_url
    router_bus, engine_bus = Bus(config.nats, "router-t"), Bus(NatsConfig(url=nats_url), "engines-t")
    await router_bus.connect()
    await engine_bus.connect()
    registry = _Registry()
    router_id = f"router-t{time.monotonic_ns()}"
    orchestrator = Orchestrator(config, router_bus, registry, router_id)  # type: ignore[arg-type]
    orchestrator.routing = _Routing(registry)  # type: ignore[assignment]
    await orchestrator.start()
    await router_bus.sync()
    engines = _Engines(engine_bus)
    await engines.start()
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(_Backend(orchestrator, tokenizer)), host="127.0.0.1",
                                           port=port, log_level="warning", lifespan="off", http="httptools"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", orchestrator, engines
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        await orchestrator.stop()
        await router_bus.close()
        await engine_bus.close()


def _events(lines: list[str]) -> list[Any]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


_LINES: dict[int, Any] = {}  # one line iterator per response: a body is streamed once


async def _read_events(resp: httpx.Response, until: int, into: list[Any]) -> None:
    """Read SSE events into ``into`` until it holds ``until`` of them (or the body ends)."""
    lines = _LINES.setdefault(id(resp), resp.aiter_lines())
    while len(into) < until:
        try:
            line = await lines.__anext__()
        except StopAsyncIteration:
            return
        if line.startswith("data: "):
            into.extend(_events([line]))


def _body(max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def test_tokens_in_one_bus_batch_make_one_sse_event_with_the_full_decode(router, tokenizer, monkeypatch) -> None:
    url, orchestrator, engines = router
    direct: list[bool] = []
    real_writer = sse.transport_writer

    def spy(send: Any) -> Any:
        found = real_writer(send)
        direct.append(found is not None)
        return found

    monkeypatch.setattr(sse, "transport_writer", spy)
    ids_a = tokenizer.encode(TEXT)[:12]
    ids_b = tokenizer.encode(TEXT[::-1])[:12]
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        # the response's headers come with the first token: open the stream while playing prefill
        opening_a = asyncio.create_task(client.send(client.build_request("POST", "/v1/completions", json=_body(12)),
                                                    stream=True))
        first = await engines.submits.get()
        opening_b = asyncio.create_task(client.send(client.build_request("POST", "/v1/completions", json=_body(12)),
                                                    stream=True))
        second = await engines.submits.get()
        await engines.first_token(first, ids_a[0])
        await engines.first_token(second, ids_b[0])
        resp_a, resp_b = await opening_a, await opening_b
        try:
            got_a: list[Any] = []
            got_b: list[Any] = []
            await _read_events(resp_a, 1, got_a)
            await _read_events(resp_b, 1, got_b)
            # one decoder batch: positions 1-5 of both streams, interleaved; then the rest with the finish
            await engines.batch([(s, p, [ids[p]], None) for p in range(1, 6)
                                 for s, ids in ((first, ids_a), (second, ids_b))])
            await _read_events(resp_a, 2, got_a)
            await _read_events(resp_b, 2, got_b)
            await engines.batch([(first, 6, ids_a[6:], "length"), (second, 6, ids_b[6:], "length")])
            for resp, got in ((resp_a, got_a), (resp_b, got_b)):
                await _read_events(resp, 10**6, got)
        finally:
            await resp_a.aclose()
            await resp_b.aclose()
    for got, ids in ((got_a, ids_a), (got_b, ids_b)):
        assert got[-1] == "[DONE]"
        chunks = [e for e in got[:-1] if e["choices"]]
        # the first token, the batch's five as one event, the rest with the finish
        assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 6, 12]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "pdd" in chunks[-1]
        assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(ids, skip_special_tokens=True)
        assert got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] == 12
    assert direct == [True, True]  # uvicorn's httptools cycle: the events went to the transport directly
    assert not orchestrator.inflight


async def test_client_hanging_up_mid_stream_cancels_the_request_on_the_bus(router, tokenizer) -> None:
    url, orchestrator, engines = router
    ids = tokenizer.encode(TEXT)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        opening = asyncio.create_task(client.send(client.build_request("POST", "/v1/completions",
                                                                       json=_body(len(ids))), stream=True))
        submit = await engines.submits.get()
        await engines.first_token(submit, ids[0])
        resp = await opening
        try:
            got: list[Any] = []
            await _read_events(resp, 1, got)
            await engines.batch([(submit, 1, ids[1:4], None)])
            await _read_events(resp, 2, got)
            assert got[1]["usage"]["completion_tokens"] == 4
        finally:
            await resp.aclose()  # hang up mid-stream
    # the connection is closed: the router cancels the request everywhere and forgets it
    for _ in range(500):
        if submit.request_id in engines.cancels and not orchestrator.inflight:
            break
        await asyncio.sleep(0.01)
    assert submit.request_id in engines.cancels
    assert not orchestrator.inflight
    await engines.batch([(submit, 4, ids[4:6], None)])  # a decoder that has not heard yet: dropped, nothing breaks
    await asyncio.sleep(0.05)
    assert not orchestrator.inflight


class _LongBackend:
    """Many tokens fast, no NATS: enough output that a client which does not read fills the socket buffers."""

    model_name = MODEL
    max_body_bytes = 1 << 20
    api_keys: ClassVar[list[str]] = []
    request_timeout_s = 60.0
    max_context = 1 << 20

    def __init__(self, tokenizer: Any, events: int, per_event: int) -> None:
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(TEXT)
        self.events, self.per_event = events, per_event
        self.closed: list[str] = []  # requests whose generation was stopped before its end

    def ready(self) -> bool:
        return True

    def health(self) -> dict:
        return {}

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        n = 0
        try:
            for n in range(self.events):
                ids = [self.ids[(n * self.per_event + i) % len(self.ids)] for i in range(self.per_event)]
                yield TokenEvent(ids, "length" if n == self.events - 1 else None)
                if n % 8 == 0:
                    await asyncio.sleep(0)
        finally:
            if n < self.events - 1:
                self.closed.append(req.request_id)


@pytest.fixture
async def slow_client(tokenizer, monkeypatch) -> AsyncIterator[tuple[_LongBackend, list[int], Any]]:
    """A server with small send buffers and a long stream; yields the backend, the writes that had to wait for
    the client (the slow path), and ``connect()``: a client with a small receive window that sent its request
    and does not read until the server had to wait for it."""
    waited: list[int] = []
    real_finish = sse.SSEWriter._finish_write

    async def counted(self: sse.SSEWriter, coro: Any, step: Any) -> None:
        waited.append(1)
        await real_finish(self, coro, step)

    monkeypatch.setattr(sse.SSEWriter, "_finish_write", counted)
    backend = _LongBackend(tokenizer, events=3000, per_event=20)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(backend), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off", http="httptools"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    for listening in server.servers[0].sockets:  # accepted connections inherit it: no send buffer autotuning
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        body = json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": backend.events * backend.per_event,
                           "stream": True,
                           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small receive window
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        for _ in range(500):  # do not read until the server had to wait for this client at least once
            if waited:
                break
            await asyncio.sleep(0.01)
        assert waited, "the client's socket never filled: the slow path was not exercised"
        return reader, writer

    try:
        yield backend, waited, connect
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


async def test_a_slow_reader_gets_every_event_in_order(slow_client, tokenizer) -> None:
    backend, _waited, connect = slow_client
    events, per_event = backend.events, backend.per_event
    reader, writer = await connect()
    try:
        raw = b""
        while not raw.endswith(b"0\r\n\r\n"):
            piece = await asyncio.wait_for(reader.read(1 << 20), 30)
            assert piece, "connection closed before the end of the stream"
            raw += piece
    finally:
        writer.close()
    assert not backend.closed
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    payload = b""
    while True:  # undo the chunked framing
        size_line, _, chunked = chunked.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        payload, chunked = payload + chunked[:size], chunked[size + 2:]
    got = _events(payload.decode().split("\n\n"))
    assert got[-1] == "[DONE]" and got[-2]["usage"]["completion_tokens"] == events * per_event
    counts = [e["usage"]["completion_tokens"] for e in got[:-2]]
    assert counts == sorted(counts) and counts[-1] == events * per_event
    expected = tokenizer.decode([backend.ids[i % len(backend.ids)] for i in range(events * per_event)],
                                skip_special_tokens=True)
    assert "".join(e["choices"][0]["text"] for e in got[:-2]) == expected


async def test_hanging_up_while_the_server_waits_on_the_client_stops_the_generation(slow_client) -> None:
    backend, _waited, connect = slow_client
    backend.events = 50_000  # far more than the pump makes before the hang-up (1M tokens, inside the context)
    _reader, writer = await connect()  # the server's write now waits for this client's socket
    writer.transport.abort()  # gone without reading
    for _ in range(500):
        if backend.closed:
            break
        await asyncio.sleep(0.01)
    assert len(backend.closed) == 1
