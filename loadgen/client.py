"""Async streaming client for OpenAI-compatible servers: one request in, its timings out.

TTFT = first chunk carrying text; ITL = gaps between later text chunks; E2EL = whole request;
TPOT = (E2EL - TTFT) / (output tokens - 1). TTFE = first stream event of any kind (a chat stream's
role chunk, sent once the server has its first token): when the first tokens decode to no visible
text yet (partial UTF-8, as a random tiny model often emits), TTFE is still the time to first token.
Token counts come from the server's `usage` when it sends one (stream_options.include_usage), else
one token per text chunk.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from .workload import RequestSpec


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
    """Chat or completions body for one spec; ignore_eos keeps the output length as specified."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": spec.output_tokens, "stream": True, "temperature": 0.0,
        "stream_options": {"include_usage": True},
    }
    if spec.ignore_eos:
        body["ignore_eos"] = True
    messages = spec.messages or [{"role": "user", "content": "hello"}]
    if endpoint.endswith("/chat/completions"):
        body["messages"] = messages
    else:
        body["prompt"] = "\n".join(m["content"] for m in messages)
    return body


async def send(session: aiohttp.ClientSession, url: str, spec: RequestSpec, model: str,
               t0: float, timeout_s: float = 600.0, api_key: str | None = None) -> RequestResult:
    """Send one streaming request and time it; errors become a failed result, never an exception."""
    res = RequestResult(rid=spec.rid, start=time.perf_counter() - t0, prompt_tokens=spec.prompt_tokens,
                        cached_tokens=spec.cached_tokens)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    last = start
    chunks = 0
    usage: dict[str, Any] | None = None
    try:
        async with session.post(url, json=build_payload(spec, model, url), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            buf = b""
            async for raw in resp.content.iter_any():
                buf += raw
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    if res.ttfe is None:
                        res.ttfe = time.perf_counter() - start
                    msg = json.loads(data)
                    if msg.get("usage"):
                        usage = msg["usage"]
                    if "error" in msg:
                        res.error = str(msg["error"])[:300]
                        return res
                    text = _chunk_text(msg)
                    if text:
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
                        res.text += text
        res.e2el = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 - every failure is a counted failed request
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        return res
    if res.ttft is None:
        res.error = "no tokens in the stream"
        return res
    res.output_tokens = int(usage.get("completion_tokens", chunks)) if usage else chunks
    if usage:
        res.prompt_tokens = int(usage.get("prompt_tokens", res.prompt_tokens))
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            res.server_cached_tokens = int(details["cached_tokens"])
    res.success = True
    return res


def _chunk_text(msg: dict[str, Any]) -> str:
    choices = msg.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        return c["delta"].get("content") or c["delta"].get("reasoning_content") or ""
    return c.get("text") or ""
