"""The one streaming client of every benchmark: one request in, its chunks, timings and `pdd` info out.

`stream()` posts a body to an OpenAI-compatible endpoint and reads the SSE answer (or a plain JSON
answer, for ``"stream": false``), recording each data chunk's arrival time, its text and — when the
server says so — how many output tokens it carried. From those counts `Stream.token_times()` gives
the arrival time of output position 0, 1, 2, ... (a chunk that carried k tokens gives its arrival to
its k positions). A chunk's count is read from, in order: the choice's ``token_ids`` (vLLM
``return_token_ids``), or the growth of a per-chunk ``usage.completion_tokens`` (vLLM/SGLang
``stream_options.continuous_usage_stats``, which PDD's router implements too). A server that reports
neither still gives positions when every content chunk must hold exactly one token (total = number
of content chunks); otherwise `token_times()` is None rather than a guess.

The client can go away early: after ``abort_after_tokens`` streamed tokens (counted from the chunks'
token counts, else one per content chunk; 0 = right after the first event) or ``abort_after_s``
seconds; ``timeout_s`` marks a request that has not ended by then as timed out. Errors never raise:
HTTP status, the in-band error object and any client exception are fields of the result.

`send()` is `pdd bench`'s use of it (loadgen/runner.py). It asks for usage on every chunk
(``stream_options.continuous_usage_stats``: vLLM, SGLang and PDD send it) so that timing is by output
position (loadgen/positions.py): TTFT = arrival of position 0; ITL = one gap per later position (a chunk
that carried k tokens gives its gap to the first of them and 0 to the other k - 1); E2EL = whole
request; TPOT = (E2EL - TTFT) / (output tokens - 1), the first token excluded. A server that says
nothing about tokens per chunk gets `vllm bench serve`'s rule instead: TTFT = first chunk carrying
text, ITL = gaps between text chunks. TTFE = first stream event of any kind (a chat stream's role
chunk, sent once the server has its first token). Token counts come from the server's `usage` when
it sends one (stream_options.include_usage), else one token per text chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

import aiohttp

from .positions import PositionTimes
from .workload import RequestSpec


@dataclass
class Chunk:
    """One data event of a stream (or the whole body of a non-streaming answer)."""

    t: float  # time.perf_counter() when its bytes arrived
    text: str = ""  # content (or reasoning content) it carried
    tokens: int | None = None  # output tokens it carried, when the server said so
    finish_reason: str | None = None


@dataclass
class Stream:
    """What one request got back. Times are ``time.perf_counter()`` values."""

    status: int = 0  # HTTP status (0: no answer)
    t_send: float = 0.0
    t_first_event: float | None = None  # first data event of any kind
    t_end: float | None = None  # the answer ended ([DONE], end of body), or the client gave up
    chunks: list[Chunk] = field(default_factory=list)
    id: str = ""  # the response id (the router's request id)
    info: dict = field(default_factory=dict)  # the response's `pdd` block (the last one seen)
    usage: dict | None = None  # the last `usage` object seen
    finish_reason: str | None = None
    done: bool = False  # "data: [DONE]" arrived
    error: Any = None  # the in-band error object, or the "error" of a non-200 JSON body
    body_text: str = ""  # the body of a non-200 answer
    exception: BaseException | None = None  # the client failed (connection, unparsable data, ...)
    aborted: bool = False  # the client closed it on purpose (abort_after_*)
    timed_out: bool = False  # no end by timeout_s
    streamed_tokens: int = 0  # tokens so far: the chunks' counts, else one per content chunk

    @property
    def content_chunks(self) -> list[Chunk]:
        return [c for c in self.chunks if c.text]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def token_ids(self) -> list[int]:
        return list(self.info.get("token_ids") or [])

    @property
    def output_tokens(self) -> int | None:
        """The server's count of output tokens: its usage, its `pdd` token ids, or the chunks' counts."""
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        if self.info.get("token_ids") is not None:
            return len(self.info["token_ids"])
        if self.chunks and all(c.tokens is not None for c in self.chunks):
            return sum(c.tokens or 0 for c in self.chunks)
        return None

    def token_times(self) -> list[float] | None:
        """Arrival time of each output position (index = position), from the chunks' token counts;
        None when the stream does not say how many tokens each chunk carried."""
        if self.chunks and all(c.tokens is not None for c in self.chunks):
            return [c.t for c in self.chunks for _ in range(c.tokens or 0)]
        content = self.content_chunks
        if content and self.output_tokens == len(content):  # every text chunk holds >= 1 token
            return [c.t for c in content]
        return None

    @property
    def error_code(self) -> str:
        return str(self.error.get("code") or "") if isinstance(self.error, dict) else ""


def _chunk_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        delta = choice["delta"] or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    if "message" in choice:
        return (choice["message"] or {}).get("content") or ""
    return choice.get("text") or ""


class _Abort(Exception):
    pass


async def stream(session: aiohttp.ClientSession, url: str, body: dict | bytes, *,
                 headers: dict[str, str] | None = None, method: str = "POST",
                 abort_after_tokens: int | None = None, abort_after_s: float | None = None,
                 timeout_s: float | None = None,
                 on_chunk: Callable[[Stream, Chunk], None] | None = None) -> Stream:
    """Send one request and read its answer to the end (or until the client gives up); never raises
    for a failed request. ``body``: a JSON object, or raw bytes sent as application/json."""
    s = Stream()
    limits = [v for v in (abort_after_s, timeout_s) if v is not None]
    limit = min(limits) if limits else None
    s.t_send = time.perf_counter()
    try:
        async with asyncio.timeout(limit) as cm:
            try:
                await _read(session, url, body, headers, method, s, abort_after_tokens, on_chunk)
            except _Abort:
                s.aborted = True
    except TimeoutError as exc:
        if not cm.expired():  # the client library's own timeout, not ours
            s.exception = exc
        elif abort_after_s is not None and (timeout_s is None or abort_after_s < timeout_s):
            s.aborted = True
        else:
            s.timed_out = True
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not an exception
        s.exception = exc
    if s.t_end is None:
        s.t_end = time.perf_counter()
    return s


async def _read(session: aiohttp.ClientSession, url: str, body: dict | bytes, headers: dict[str, str] | None,
                method: str, s: Stream, abort_after_tokens: int | None,
                on_chunk: Callable[[Stream, Chunk], None] | None) -> None:
    kwargs: dict[str, Any] = {"headers": dict(headers or {})}
    if isinstance(body, (bytes, bytearray)):
        kwargs["data"] = bytes(body)
        kwargs["headers"].setdefault("Content-Type", "application/json")
    else:
        kwargs["json"] = body
    async with session.request(method, url, **kwargs) as resp:
        s.status = resp.status
        if resp.status != 200:
            s.body_text = await resp.text(errors="replace")
            try:
                parsed = json.loads(s.body_text)
                s.error = parsed.get("error") if isinstance(parsed, dict) else None
            except ValueError:
                pass
            s.t_end = time.perf_counter()
            return
        if not resp.content_type.startswith("text/event-stream"):
            raw = await resp.read()
            now = time.perf_counter()
            s.t_first_event = now
            _event(s, json.loads(raw), now, whole=True)
            s.t_end = now
            if on_chunk and s.chunks:
                on_chunk(s, s.chunks[-1])
            return
        buf = b""
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    s.done = True
                    s.t_end = now
                    return
                if s.t_first_event is None:
                    s.t_first_event = now
                chunk = _event(s, json.loads(payload), now)
                if s.error is not None:
                    s.t_end = now
                    return
                if on_chunk and chunk is not None:
                    on_chunk(s, chunk)
                if abort_after_tokens is not None and s.streamed_tokens >= abort_after_tokens \
                        and s.finish_reason is None:
                    s.t_end = now
                    resp.close()  # the client goes away mid-stream
                    raise _Abort
        s.t_end = time.perf_counter()


def _event(s: Stream, msg: dict, now: float, whole: bool = False) -> Chunk | None:
    """Fold one parsed data event into ``s``; returns the chunk it made (None for an error event)."""
    if not s.id and msg.get("id"):
        s.id = str(msg["id"])
    prev_usage = s.usage
    if isinstance(msg.get("usage"), dict):
        s.usage = msg["usage"]
    if msg.get("pdd"):
        s.info = msg["pdd"]
    if "error" in msg:
        s.error = msg["error"]
        return None
    chunk = Chunk(now)
    choices = msg.get("choices") or []
    for choice in choices[:1]:
        chunk.text = _chunk_text(choice)
        chunk.finish_reason = choice.get("finish_reason")
        if isinstance(choice.get("token_ids"), list):
            chunk.tokens = len(choice["token_ids"])
    if chunk.finish_reason:
        s.finish_reason = chunk.finish_reason
    if chunk.tokens is None:
        if whole and s.usage:
            chunk.tokens = s.usage.get("completion_tokens")
        elif choices and isinstance(msg.get("usage"), dict) and msg["usage"].get("completion_tokens") is not None:
            before = (prev_usage or {}).get("completion_tokens") or 0
            chunk.tokens = int(msg["usage"]["completion_tokens"]) - int(before)
        elif not choices:
            chunk.tokens = 0  # a usage-only chunk carries no output
    s.streamed_tokens += chunk.tokens if chunk.tokens is not None else (1 if chunk.text else 0)
    s.chunks.append(chunk)
    return chunk


# ---------------------------------------------------------------------------------------------
# `pdd bench`: one RequestSpec -> one RequestResult
# ---------------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    rid: int
    success: bool = False
    error: str = ""
    start: float = 0.0  # seconds since the run began
    ttft: float | None = None
    ttfe: float | None = None  # time to the first stream event (any data chunk)
    e2el: float | None = None
    itl: list[float] = field(default_factory=list)
    itl_per_token: bool = False  # itl has one gap per output position (else one per text chunk)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    server_cached_tokens: int | None = None  # what the server reported as cache hits, if it did
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("text")
        d["tpot"] = self.tpot
        return d


def build_payload(spec: RequestSpec, model: str, endpoint: str) -> dict[str, Any]:
    """Chat or completions body for one spec; ignore_eos keeps the output length as specified. A spec of
    token ids goes out as the completions ``prompt`` (a list of ints), which chat has no field for."""
    body: dict[str, Any] = {
        "model": model, "stream": True, "temperature": 0.0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    max_tokens = spec.sent_max_tokens()
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if spec.ignore_eos:
        body["ignore_eos"] = True
    chat = endpoint.endswith("/chat/completions")
    prompt_ids = spec.prompt_token_ids()
    if prompt_ids is not None:
        if chat:
            raise ValueError(f"{endpoint}: a prompt of token ids needs a completions endpoint")
        body["prompt"] = prompt_ids
        return body
    messages = spec.messages or [{"role": "user", "content": "hello"}]
    if chat:
        body["messages"] = messages
    else:
        body["prompt"] = "\n".join(m["content"] for m in messages)
    return body


async def send(session: aiohttp.ClientSession, url: str, spec: RequestSpec, model: str,
               t0: float, timeout_s: float = 600.0, api_key: str | None = None) -> RequestResult:
    """Send one streaming request and time it; errors become a failed result, never an exception. A spec with
    a read limit is closed after that many output tokens (the server cancels the rest) and counts as a success
    of exactly that many tokens, as if the answer had ended there."""
    res = RequestResult(rid=spec.rid, start=time.perf_counter() - t0, prompt_tokens=spec.prompt_tokens,
                        cached_tokens=spec.cached_tokens)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = spec.read_limit()
    # built and encoded off the event loop: a replayed trace's prompt of 100K token ids takes tens of ms, which
    # would hold back the chunks of every stream being timed
    body = await asyncio.to_thread(lambda: json.dumps(build_payload(spec, model, url)).encode())
    s = await stream(session, url, body, headers=headers, timeout_s=timeout_s, abort_after_tokens=limit)
    if s.t_first_event is not None:
        res.ttfe = s.t_first_event - s.t_send
    content = s.content_chunks
    times = s.token_times() if content else None
    if times and limit is not None:  # the chunk that reached the limit may carry tokens past it
        times = times[:limit]
    if times:  # by output position
        positions = PositionTimes(s.t_send, times)
        res.ttft, res.itl, res.itl_per_token = positions.ttft, positions.gaps, True
    elif content:  # by text chunk, as vllm bench serve
        res.ttft = content[0].t - s.t_send
        res.itl = [b.t - a.t for a, b in pairwise(content)]
    res.text = s.text
    if s.exception is not None:
        res.error = f"{type(s.exception).__name__}: {s.exception}"[:300]
        return res
    if s.timed_out:
        res.error = f"TimeoutError: no end after {timeout_s}s"
        return res
    if s.status != 200:
        res.error = f"HTTP {s.status}: {s.body_text[:300]}"
        return res
    if s.error is not None:
        res.error = str(s.error)[:300]
        return res
    res.e2el = s.t_end - s.t_send
    if not content:
        res.error = "no tokens in the stream"
        return res
    usage = s.usage
    res.output_tokens = int(usage.get("completion_tokens", len(content))) if usage else len(content)
    if limit is not None:
        res.output_tokens = min(res.output_tokens, limit)
    if usage:
        res.prompt_tokens = int(usage.get("prompt_tokens", res.prompt_tokens))
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            res.server_cached_tokens = int(details["cached_tokens"])
    res.success = True
    return res
