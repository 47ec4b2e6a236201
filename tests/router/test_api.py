"""The router's OpenAI-compatible HTTP layer against a fake backend and a real tiny tokenizer.

The backend is faked here (it is the unit under test's only collaborator); the tokenizer is real
(the engine's seeded byte-level BPE with a ChatML template), the server is real uvicorn for the
official ``openai`` client and for client disconnects.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any, AsyncIterator

import httpx
import openai
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdd.engine.torch_backend.tiny import build_tokenizer
from pdd.router.api import create_app
from pdd.router.detokenize import IncrementalDetokenizer
from pdd.router.types import GenerationError, GenerationRequest, TokenEvent

MODEL = "tiny-test"
OUTPUT = "Hello world! How are you today? I am fine, thank you."


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


class FakeBackend:
    """Yields a fixed text's token ids, ``chunk`` per event; records requests and how each ended."""

    def __init__(self, tokenizer: Any, text: str = OUTPUT, chunk: int = 1, delay: float = 0.0):
        self.model_name = MODEL
        self.tokenizer = tokenizer
        self.max_context = 256
        self.max_body_bytes = 16 * 1024
        self.api_keys: list[str] = []
        self.request_timeout_s = 30.0
        self.output_ids = list(tokenizer.encode(text))
        self.chunk = chunk
        self.delay = delay
        self.forever = False  # keep yielding until closed
        self.error: GenerationError | None = None
        self.error_after: int | None = None  # raise self.error after this many events
        self.info = {"pipeline": "P-RLD-MD", "handoff": "catch-up"}
        self.is_ready = True
        self.requests: list[GenerationRequest] = []
        self.ended: dict[str, dict] = {}  # request_id -> {"final_sent", "how", "cleanup_done"}

    def ready(self) -> bool:
        return self.is_ready

    def health(self) -> dict:
        return {"instances": {"prefill": 1, "relay": 1, "main-decode": 1}}

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(req)
        state = {"final_sent": False, "how": "returned", "cleanup_done": False}
        try:
            if self.error is not None and self.error_after is None:
                raise self.error
            ids = self.output_ids[: req.sampling.max_tokens]
            events = 0
            i = 0
            while self.forever or i < len(ids):
                if self.delay:
                    await asyncio.sleep(self.delay)
                if self.error is not None and events == self.error_after:
                    raise self.error
                part = ids[i: i + self.chunk] if not self.forever else [self.output_ids[i % len(self.output_ids)]]
                i += len(part)
                last = not self.forever and i >= len(ids)
                finish = ("length" if len(ids) < len(self.output_ids) else "stop") if last else None
                events += 1
                if last:
                    state["final_sent"] = True
                yield TokenEvent(part, finish, dict(self.info) if last else {"pipeline": self.info["pipeline"]})
        except GeneratorExit:
            state["how"] = "aclose"
            raise
        except asyncio.CancelledError:
            state["how"] = "cancelled"
            raise
        finally:
            self.ended[req.request_id] = state
            await asyncio.sleep(0.01)  # like telling the instances over NATS: must not be cut short
            state["cleanup_done"] = True


@pytest.fixture
def backend(tokenizer) -> FakeBackend:
    return FakeBackend(tokenizer)


@pytest.fixture
async def client(backend) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(backend))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
        yield c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def server(backend) -> AsyncIterator[str]:
    """A real uvicorn server in this event loop; yields its base URL."""
    port = _free_port()
    config = uvicorn.Config(create_app(backend), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    task = asyncio.create_task(srv.serve())
    while not srv.started:
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    await asyncio.wait_for(task, 10)


def _sse_events(body: str) -> list[Any]:
    out = []
    for block in body.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


async def _wait_for(cond, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


# ---- endpoints ---------------------------------------------------------------------------------

async def test_models_health_metrics(client, backend):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL]
    assert (await client.get(f"/v1/models/{MODEL}")).status_code == 200
    _assert_openai_error(await client.get("/v1/models/other"), 404, "model_not_found")
    r = await client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and "instances" in r.json()
    backend.is_ready = False
    r = await client.get("/health")
    assert r.status_code == 503 and r.json()["status"] != "ok"
    await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    r = await client.get("/metrics")
    assert r.status_code == 200
    assert 'pdd:http_responses_total{route="/v1/completions",status="200"}' in r.text


async def test_completion_non_streaming(client, backend, tokenizer):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello world", "max_tokens": 100,
                                                   "temperature": 0, "seed": 7, "user": "someone"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"][0]["text"] == OUTPUT
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt_ids = tokenizer.encode("Hello world")
    n = len(backend.output_ids)
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": n,
                             "total_tokens": len(prompt_ids) + n}
    assert body["pdd"] == backend.info
    req = backend.requests[0]
    assert req.prompt_ids == prompt_ids and req.request_id == body["id"]
    assert req.sampling.temperature == 0 and req.sampling.seed == 7 and req.sampling.max_tokens == 100


async def test_completion_token_ids_and_length(client, backend):
    r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})
    body = r.json()
    assert backend.requests[0].prompt_ids == [5, 6, 7]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4


async def test_sampling_and_extension_fields(client, backend):
    r = await client.post("/v1/completions", json={
        "prompt": ["Hi"], "max_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "seed": -3,
        "stop_token_ids": [2, 9], "ignore_eos": True,
        "pdd": {"pipeline": "P-MD", "handoff": "one-shot", "return_token_ids": True},
        "unknown_field": {"anything": [1, 2]}})
    assert r.status_code == 200, r.text
    req = backend.requests[0]
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.stop_token_ids, s.ignore_eos) == (0.7, 0.9, 0, -3, [2, 9], True)
    assert (req.forced_pipeline, req.forced_handoff, req.return_token_ids) == ("P-MD", "one-shot", True)
    assert 25 < req.deadline_unix - __import__("time").time() <= 30


async def test_max_tokens_defaults_to_remaining_context(client, backend, tokenizer):
    r = await client.post("/v1/completions", json={"prompt": "Hello world"})
    assert r.status_code == 200
    assert backend.requests[0].sampling.max_tokens == backend.max_context - len(tokenizer.encode("Hello world"))


async def test_chat_non_streaming(client, backend, tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "How are you?"}]}]
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                        "max_tokens": 1, "max_completion_tokens": 50})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": OUTPUT}
    assert body["pdd"]["pipeline"] == "P-RLD-MD"
    flat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How are you?"}]
    text = tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert backend.requests[0].prompt_ids == tokenizer.encode(text, add_special_tokens=False)
    assert backend.requests[0].sampling.max_tokens == 50  # max_completion_tokens wins


@pytest.mark.parametrize("include_usage", [False, True])
async def test_chat_streaming(client, backend, include_usage):
    payload = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 100}
    if include_usage:
        payload["stream_options"] = {"include_usage": True}
    r = await client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == OUTPUT
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices[-1]["choices"][0]["finish_reason"] == "stop"
    assert with_choices[-1]["pdd"] == backend.info
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(backend.output_ids)
        assert all(c["usage"] is None for c in chunks[:-1])
    else:
        assert all("usage" not in c for c in chunks)


async def test_completion_streaming(client, backend):
    backend.chunk = 3
    r = await client.post("/v1/completions", json={"prompt": "Hi", "stream": True, "max_tokens": 5,
                                                   "stream_options": {"include_usage": True}})
    events = _sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == backend.tokenizer.decode(backend.output_ids[:5])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "Hi"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
async def test_continuous_usage_counts_the_tokens_each_chunk_carries(client, backend, path, body):
    """vLLM's continuous_usage_stats: cumulative usage on every chunk, so a client can time each output
    position even when one chunk carries several tokens (here 3 per backend event)."""
    backend.chunk = 3
    r = await client.post(path, json={**body, "stream": True, "max_tokens": 7, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    chunks = _sse_events(r.text)[:-1]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"] > 0 for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 7
    content = [c for c in chunks if c["choices"] and (c["choices"][0].get("text") or c["choices"][0].get("delta", {})
                                                      .get("content"))]
    grew = [b - a for a, b in zip([0] + counts, counts)]
    assert max(grew) == 3 and sum(grew) == 7  # a chunk that carried 3 tokens says so
    assert len(content) < 7


async def test_continuous_usage_needs_include_usage(client, backend):
    r = await client.post("/v1/completions", json={"prompt": "Hi", "stream": True, "max_tokens": 4,
                                                   "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in _sse_events(r.text)[:-1])


# ---- stop strings and UTF-8 --------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_truncates_and_closes_backend(client, backend, stream):
    backend.forever = True  # only the stop string can end this generation
    r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 100, "stream": stream,
                                                   "stop": ["zzz", "are you"]})
    if stream:
        chunks = [c for c in _sse_events(r.text)[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        text = r.json()["choices"][0]["text"]
        finish = r.json()["choices"][0]["finish_reason"]
    assert text == "Hello world! How " and finish == "stop"
    end = backend.ended[backend.requests[0].request_id]
    assert end["how"] in ("aclose", "cancelled") and end["cleanup_done"] is True  # closed early, cleanup ran


async def test_backend_overrunning_max_tokens_is_cut(client, backend):
    backend.forever = True  # ignores max_tokens
    r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["text"] == backend.tokenizer.decode(backend.output_ids[:3])
    assert next(iter(backend.ended.values()))["how"] in ("aclose", "cancelled")


async def test_stop_string_split_over_tokens_is_never_streamed(client, backend, tokenizer):
    backend.output_ids = tokenizer.encode("abcXYZdef")
    r = await client.post("/v1/completions", json={"prompt": "Hi", "stream": True, "stop": "XYZ", "max_tokens": 50})
    texts = [c["choices"][0]["text"] for c in _sse_events(r.text)[:-1]]
    assert "".join(texts) == "abc"
    assert not any("X" in t for t in texts)


async def test_utf8_holdback_in_stream(client, backend, tokenizer):
    text = "héllo 中文 ✓ ok"
    backend.output_ids = tokenizer.encode(text)
    assert len(backend.output_ids) > len(text)  # multi-byte chars span several tokens
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                        "stream": True})
    pieces = [c["choices"][0]["delta"].get("content", "") for c in _sse_events(r.text)[:-1]]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


async def test_continuous_usage_reports_tokens_whose_text_is_held_back(client, backend, tokenizer):
    """A multi-byte character spans several tokens: its first tokens have no text yet, but with usage on
    every chunk each token still shows up in a chunk's count when it arrives (position timing)."""
    text = "中文✓"
    backend.output_ids = tokenizer.encode(text)
    r = await client.post("/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 50, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    chunks = [c for c in _sse_events(r.text)[:-1] if c["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [c["usage"]["completion_tokens"] for c in chunks] == list(range(1, len(backend.output_ids) + 1))
    assert any(c["choices"][0]["text"] == "" for c in chunks)  # counted before its text could be sent


def test_detokenizer_releases_prefix_only_when_ruled_out(tokenizer):
    d = IncrementalDetokenizer(tokenizer, [], stop=["world!"])
    ids = tokenizer.encode("Hello wor")
    out = "".join(d.add(i).text for i in ids)
    assert out == "Hello "  # "wor" could still become "world!"
    out += "".join(d.add(i).text for i in tokenizer.encode("ds"))
    assert out + d.finish() == "Hello words"


_ALPHABET = st.sampled_from(list("abc XYZé中✓!\n") + ["ab", "€", "😀"])


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(_ALPHABET, max_size=12), stops=st.lists(st.text("abcX中😀", min_size=1, max_size=3), max_size=3))
def test_detokenizer_property(tokenizer, pieces, stops):
    text = "".join(pieces)
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    d = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt"), stop=stops)
    out = []
    for i in ids:
        step = d.add(i)
        assert "\ufffd" not in step.text
        out.append(step.text)
        if step.stopped:
            break
    else:
        out.append(d.finish())
    got = "".join(out)
    assert full.startswith(got)
    assert not any(s in got for s in stops)
    if d.stopped:
        assert any(full[len(got):].startswith(s) for s in stops)
    else:
        assert got == full


# ---- bad requests ------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"prompt": "PRMT", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "PRMT", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "PRMT", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "PRMT", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "PRMT", "temperature": -0.1}, "temperature"),
    ({"prompt": "PRMT", "temperature": "hot"}, "temperature"),
    ({"prompt": "PRMT", "top_p": 0}, "top_p"),
    ({"prompt": "PRMT", "top_p": 1.5}, "top_p"),
    ({"prompt": "PRMT", "stream": "yes"}, "stream"),
    ({"prompt": "PRMT", "n": 2}, "n"),
    ({"prompt": "PRMT", "logprobs": 21}, "logprobs"),
    ({"prompt": "PRMT", "logprobs": -1}, "logprobs"),
    ({"prompt": "PRMT", "min_p": 1.5}, "min_p"),
    ({"prompt": "PRMT", "min_p": -0.1}, "min_p"),
    ({"prompt": "PRMT", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "PRMT", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "PRMT", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "PRMT", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "PRMT", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "PRMT", "stop": 3}, "stop"),
    ({"prompt": "PRMT", "seed": 2**70}, "seed"),
    ({"prompt": "PRMT", "pdd": {"pipeline": "P-X"}}, "pdd.pipeline"),
    ({"prompt": "PRMT", "pdd": {"handoff": "sometimes"}}, "pdd.handoff"),
    ({"prompt": "PRMT", "pdd": "P-MD"}, "pdd"),
    ({"prompt": "PRMT", "pdd": {"return_token_ids": 1}}, "pdd.return_token_ids"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "PRMT", "model": 3}, "model"),
]


@pytest.mark.parametrize("payload,param", BAD_COMPLETIONS)
async def test_bad_completion_requests(client, backend, payload, param):
    err = _assert_openai_error(await client.post("/v1/completions", json=payload), 400)
    assert err["param"] == param, err
    assert param.split(".")[0] in err["message"]
    assert "PRMT" not in err["message"]  # request content never echoed
    assert backend.requests == []


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "min_tokens": 5, "max_completion_tokens": 2}, "min_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
]


@pytest.mark.parametrize("payload,param", BAD_CHATS)
async def test_bad_chat_requests(client, payload, param):
    err = _assert_openai_error(await client.post("/v1/chat/completions", json=payload), 400)
    assert err["param"] == param, err


async def test_malformed_json_and_non_object(client):
    for raw in (b"{not json", b"", b"[1, 2]", b"null", b"\xff\xfe"):
        r = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        _assert_openai_error(r, 400)


async def test_unknown_model_is_404(client):
    r = await client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
    err = _assert_openai_error(r, 404, "model_not_found")
    assert err["param"] == "model"


async def test_prompt_over_context(client, backend):
    backend.max_context = 16
    long = "Hello world! " * 20
    _assert_openai_error(await client.post("/v1/completions", json={"prompt": long}), 400, "context_length_exceeded")
    r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 16})
    err = _assert_openai_error(r, 400, "context_length_exceeded")
    assert err["param"] == "max_tokens"
    r = await client.post("/v1/completions", json={"prompt": [1] * 17, "max_tokens": 1})
    _assert_openai_error(r, 400, "context_length_exceeded")
    backend.max_context = 0  # no instance announced yet: unknown context is not the client's fault
    _assert_openai_error(await client.post("/v1/completions", json={"prompt": "Hi"}), 503)
    assert backend.requests == []


async def test_body_too_large(client, backend):
    big = {"prompt": "a" * (backend.max_body_bytes + 1)}
    _assert_openai_error(await client.post("/v1/completions", json=big), 413)

    async def chunked() -> AsyncIterator[bytes]:  # no content-length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * 1024
        yield b'"}'

    _assert_openai_error(await client.post("/v1/completions", content=chunked()), 413)


async def test_api_keys(client, backend):
    backend_keys = ["sk-one", "sk-two"]
    app = create_app(type("B", (), {**vars(backend), "api_keys": backend_keys, "ready": lambda s: True,
                                    "health": lambda s: {}, "generate": backend.generate})())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as c:
        payload = {"prompt": "Hi", "max_tokens": 2}
        _assert_openai_error(await c.post("/v1/completions", json=payload), 401, "invalid_api_key")
        for header in ("Bearer sk-three", "sk-one", "Basic sk-one", "Bearer sk-oné"):
            r = await c.post("/v1/completions", json=payload, headers={"Authorization": header.encode()})
            _assert_openai_error(r, 401, "invalid_api_key")
        _assert_openai_error(await c.get("/v1/models"), 401)
        r = await c.post("/v1/completions", json=payload, headers={"Authorization": "Bearer sk-two"})
        assert r.status_code == 200
        assert (await c.get("/health")).status_code == 200  # probes need no key


@pytest.mark.parametrize("stream", [False, True])
async def test_generation_error_maps_to_status(client, backend, stream):
    backend.error = GenerationError(503, "no_capacity", "no decode instance is ready")
    r = await client.post("/v1/completions", json={"prompt": "Hi", "stream": stream})
    err = _assert_openai_error(r, 503, "no_capacity")
    assert err["message"] == "no decode instance is ready"


async def test_generation_error_mid_stream_is_in_band(client, backend):
    backend.error = GenerationError(502, "instance_lost", "decode instance lost")
    backend.error_after = 3
    r = await client.post("/v1/completions", json={"prompt": "Hi", "stream": True})
    assert r.status_code == 200
    events = _sse_events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "instance_lost"


async def test_unknown_route_and_method_are_openai_shaped(client):
    _assert_openai_error(await client.get("/v1/nothing"), 404)
    _assert_openai_error(await client.get("/v1/completions"), 405)


async def test_prompt_never_logged(client, backend, capsys):
    secret = "my-secret-prompt-text"
    await client.post("/v1/completions", json={"prompt": secret, "max_tokens": 2})
    await client.post("/v1/completions", json={"prompt": secret, "max_tokens": "x"})
    backend.error = GenerationError(500, "boom", "internal")
    await client.post("/v1/completions", json={"prompt": secret})
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err


# ---- cancellation ------------------------------------------------------------------------------

async def test_stream_disconnect_closes_backend(server, backend):
    backend.forever = True
    backend.delay = 0.02
    async with httpx.AsyncClient(base_url=server) as c:
        async with c.stream("POST", "/v1/completions", json={"prompt": "Hi", "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    break
    await _wait_for(lambda: len(backend.ended) == 1)
    end = next(iter(backend.ended.values()))
    assert end["final_sent"] is False and end["how"] in ("aclose", "cancelled")
    await _wait_for(lambda: end["cleanup_done"])


async def test_non_streaming_disconnect_cancels_backend(server, backend):
    backend.forever = True
    backend.delay = 0.02
    async with httpx.AsyncClient(base_url=server, timeout=0.3) as c:
        with pytest.raises(httpx.TimeoutException):
            await c.post("/v1/completions", json={"prompt": "Hi"})
    await _wait_for(lambda: len(backend.ended) == 1)
    end = next(iter(backend.ended.values()))
    assert end["final_sent"] is False and end["how"] == "cancelled"
    await _wait_for(lambda: end["cleanup_done"])


async def test_silent_backend_is_cancelled_on_disconnect(server, backend):
    """No token flows at all (e.g. a long prefill): the disconnect alone must cancel the request."""
    backend.forever = True
    backend.delay = 30
    async with httpx.AsyncClient(base_url=server, timeout=0.3) as c:
        with pytest.raises(httpx.TimeoutException):
            async with c.stream("POST", "/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "x"}], "stream": True}) as r:
                await r.aread()
    await _wait_for(lambda: len(backend.ended) == 1)
    assert next(iter(backend.ended.values()))["how"] == "cancelled"


# ---- the official openai client ----------------------------------------------------------------

async def test_openai_client(server, backend):
    oc = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    models = await oc.models.list()
    assert [m.id for m in models.data] == [MODEL]

    comp = await oc.completions.create(model=MODEL, prompt="Hello", max_tokens=100, temperature=0)
    assert comp.choices[0].text == OUTPUT and comp.usage.completion_tokens == len(backend.output_ids)

    chat = await oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            extra_body={"pdd": {"pipeline": "P-RLD"}})
    assert chat.choices[0].message.content == OUTPUT and chat.choices[0].finish_reason == "stop"
    assert chat.model_extra["pdd"]["pipeline"] == "P-RLD-MD"
    assert backend.requests[-1].forced_pipeline == "P-RLD"

    stream = await oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
                                              stream_options={"include_usage": True})
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text == OUTPUT and usage.total_tokens == usage.prompt_tokens + len(backend.output_ids)

    cstream = await oc.completions.create(model=MODEL, prompt="Hello", max_tokens=50, stream=True, stop=["world"])
    pieces = [c.choices[0].text async for c in cstream]
    assert "".join(pieces) == "Hello "

    with pytest.raises(openai.NotFoundError):
        await oc.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError) as info:
        await oc.completions.create(model=MODEL, prompt="Hi", max_tokens=0)
    assert "max_tokens" in str(info.value)
    await oc.close()


# ---- fuzzing -----------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "seed", "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options", "n", "user", "logprobs",
           "pdd", "echo", "presence_penalty", "logit_bias", "response_format", "tools"]
_plausible = {
    "model": st.sampled_from([MODEL, "other", ""]),
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-2, 400), max_size=8)),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                                "content": st.one_of(st.text(max_size=20), st.none())}), max_size=3),
    "max_tokens": st.integers(-2, 300),
    "stream": st.booleans(),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    "pdd": st.fixed_dictionaries({}, optional={"pipeline": st.sampled_from(["P-MD", "P-RLD-MD", "P-RLD", "Q"]),
                                               "handoff": st.sampled_from(["one-shot", "catch-up", "?"])}),
}
_plausible.update({
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-2, 50),
    "seed": st.integers(-(2**64), 2**64), "ignore_eos": st.booleans(), "n": st.integers(0, 2),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop_token_ids": st.lists(st.integers(-1, 400), max_size=3),
})
_BASE = {"/v1/completions": {"model": MODEL, "prompt": "Hello", "max_tokens": 5},
         "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}}
# A valid request with some fields replaced (by plausible or arbitrary JSON) or dropped, plus unknown keys.
_overrides = st.dictionaries(
    st.sampled_from(_FIELDS) | st.text(max_size=6), st.just(None), max_size=4,
).flatmap(lambda d: st.fixed_dictionaries(
    {k: (_plausible[k] | _json) if k in _plausible else _json for k in d}))
_drops = st.sets(st.sampled_from(["model", "prompt", "messages", "max_tokens"]), max_size=2)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), overrides=_overrides, drops=_drops,
       other=st.one_of(st.none(), st.none(), st.none(), _json, st.binary(max_size=40)))
def test_fuzz_never_500(tokenizer, path, overrides, drops, other):
    body = {k: v for k, v in {**_BASE[path], **overrides}.items() if k not in drops}
    backend = FakeBackend(tokenizer)
    backend.output_ids = backend.output_ids[:6]

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(backend)),
                                     base_url="http://r") as c:
            content = other if isinstance(other, bytes) else json.dumps(body if other is None else other).encode()
            return await c.post(path, content=content)

    r = asyncio.run(go())
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text)
    if r.status_code != 200:
        _assert_openai_error(r, r.status_code)
    for req_id in (req.request_id for req in backend.requests):
        assert req_id in backend.ended  # every started generation was finished or closed
