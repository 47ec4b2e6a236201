"""What the OpenAI-compatible responses look like: JSON bodies and SSE chunks, per endpoint.

Apart from api.py (which handles HTTP: auth, limits, tokenizing, streaming, cancellation) because
these shapes are the API contract clients parse; one ``Formatter`` subclass per endpoint keeps
/v1/completions and /v1/chat/completions side by side.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pdd.services.router.streaming import Delta


def sse_line(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class Formatter:
    """OpenAI response shapes; one subclass per endpoint."""

    object_chunk: str
    object_full: str

    def __init__(self, request_id: str, model: str, include_usage: bool, continuous_prompt_tokens: int | None = None):
        """``continuous_prompt_tokens``: set (to the prompt's length) for usage on every chunk."""
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.continuous_prompt_tokens = continuous_prompt_tokens

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def start_chunks(self) -> list[dict]:
        return []

    def chunk(self, delta: Delta, pdd: dict | None) -> dict: ...

    def full(self, text: str, finish_reason: str, usage: dict, pdd: dict) -> dict: ...

    def _with_usage(self, body: dict, completion_tokens: int = 0) -> dict:
        if self.continuous_prompt_tokens is not None:
            body["usage"] = usage_body(self.continuous_prompt_tokens, completion_tokens)
        elif self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict, pdd: dict) -> dict:
        return {**self._head(self.object_chunk), "choices": [], "usage": usage, "pdd": pdd}


class CompletionFormatter(Formatter):
    object_chunk = object_full = "text_completion"

    def chunk(self, delta: Delta, pdd: dict | None) -> dict:
        body = {**self._head(self.object_chunk),
                "choices": [{"index": 0, "text": delta.text, "logprobs": None,
                             "finish_reason": delta.finish_reason}]}
        if pdd is not None:
            body["pdd"] = pdd
        return self._with_usage(body, delta.completion_tokens)

    def full(self, text: str, finish_reason: str, usage: dict, pdd: dict) -> dict:
        return {**self._head(self.object_full),
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
                "usage": usage, "pdd": pdd}


class ChatFormatter(Formatter):
    object_chunk = "chat.completion.chunk"
    object_full = "chat.completion"

    def start_chunks(self) -> list[dict]:
        return [self._with_usage({**self._head(self.object_chunk), "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})]

    def chunk(self, delta: Delta, pdd: dict | None) -> dict:
        body = {**self._head(self.object_chunk),
                "choices": [{"index": 0, "delta": {"content": delta.text} if delta.text else {},
                             "logprobs": None, "finish_reason": delta.finish_reason}]}
        if pdd is not None:
            body["pdd"] = pdd
        return self._with_usage(body, delta.completion_tokens)

    def full(self, text: str, finish_reason: str, usage: dict, pdd: dict) -> dict:
        return {**self._head(self.object_full),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": finish_reason}],
                "usage": usage, "pdd": pdd}


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
