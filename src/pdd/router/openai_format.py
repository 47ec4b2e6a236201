"""What the OpenAI-compatible responses look like: JSON bodies and SSE chunks, per endpoint.

Apart from api.py (which handles HTTP: auth, limits, tokenizing, streaming, cancellation) because
these shapes are the API contract clients parse; one ``Formatter`` subclass per endpoint keeps
/v1/completions and /v1/chat/completions side by side.
"""

from __future__ import annotations

import json
import time
from json.encoder import encode_basestring  # what JSONEncoder(ensure_ascii=False) writes a str with (C)
from typing import Any

from pdd.router.streaming import Delta
from pdd.shared.protocol import TokenLogprobs

MIN_LOGPROB = -9999.0  # JSON has no -inf: the floor vLLM reports for impossible tokens


_JSON = json.JSONEncoder(ensure_ascii=False)  # one encoder: json.dumps with options builds one per call


def sse_line(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else _JSON.encode(obj)}\n\n"


DONE_LINE = sse_line("[DONE]")
_MARK = "\x00pdd-text\x00"  # stands for a delta's text while a chunk's constant parts are encoded once


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
        self._tokenizer: Any = None  # set by use_logprobs: the request asked for logprobs
        self._top_n = 0
        self._token_text: dict[int, str] = {}
        self._noted: list[tuple[int, TokenLogprobs]] = []  # non-streaming: every token's logprobs, in order
        self._around: tuple[str, str] | None = None  # a plain chunk's SSE line before and after its text

    def sse_chunk(self, delta: Delta, pdd: dict | None) -> str:
        """``sse_line(self.chunk(delta, pdd))``; a plain chunk (text, no finish, no logprobs: nearly every one of a
        stream) from its constant parts, encoded once per request, and the text: no dict or encoder per token."""
        if pdd is not None or delta.finish_reason is not None or delta.logprobs or not delta.text:
            return sse_line(self.chunk(delta, pdd))
        if self._around is None:
            line = sse_line(self.chunk(Delta(_MARK), None))
            mark = encode_basestring(_MARK)
            before, after = line.split(mark)
            if self.continuous_prompt_tokens is not None:  # the usage, last, is written per chunk
                after = after[:after.rindex(', "usage": ')]
            self._around = before, after
        before, after = self._around
        if self.continuous_prompt_tokens is None:
            return before + encode_basestring(delta.text) + after
        prompt, done = self.continuous_prompt_tokens, delta.completion_tokens
        return (f'{before}{encode_basestring(delta.text)}{after}, "usage": {{"prompt_tokens": {prompt}, '
                f'"completion_tokens": {done}, "total_tokens": {prompt + done}}}}}\n\n')

    def use_logprobs(self, tokenizer: Any, top_n: int | None) -> None:
        """The request asked for logprobs (``top_n`` alternatives per token; None: it did not)."""
        if top_n is not None:
            self._tokenizer, self._top_n = tokenizer, top_n

    def note(self, delta: Delta) -> None:
        """Non-streaming: remember a delta's tokens for the logprobs of the full body."""
        if self._tokenizer is not None:
            self._noted.extend(zip(delta.token_ids, delta.logprobs))

    def _text(self, token_id: int) -> str:
        """A token's own text, decoded alone (as vLLM reports it; special tokens included)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._tokenizer.decode([token_id])
        return text

    def _logprobs(self, items: list[tuple[int, TokenLogprobs]]) -> dict | None:
        """This endpoint's ``logprobs`` object for these tokens (None when not asked)."""
        return None

    def _delta_logprobs(self, delta: Delta) -> dict | None:
        if self._tokenizer is None or not delta.logprobs:
            return None
        return self._logprobs(list(zip(delta.token_ids, delta.logprobs)))

    def _full_logprobs(self) -> dict | None:
        return None if self._tokenizer is None else self._logprobs(self._noted)

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

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._offset = 0  # text_offset of the next token: the sum of the earlier tokens' text lengths

    def _logprobs(self, items: list[tuple[int, TokenLogprobs]]) -> dict:
        """Legacy shape: tokens, token_logprobs, top_logprobs ({text: logprob}, the top n and the chosen
        token) and text_offset (as vLLM: cumulative lengths of the tokens' own texts)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in items:
            text = self._text(token_id)
            top = {self._text(t): max(v, MIN_LOGPROB) for t, v in zip(lp.top_ids, lp.top_logprobs)}
            top.setdefault(text, max(lp.logprob, MIN_LOGPROB))
            out["tokens"].append(text)
            out["token_logprobs"].append(max(lp.logprob, MIN_LOGPROB))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out

    def chunk(self, delta: Delta, pdd: dict | None) -> dict:
        body = {**self._head(self.object_chunk),
                "choices": [{"index": 0, "text": delta.text, "logprobs": self._delta_logprobs(delta),
                             "finish_reason": delta.finish_reason}]}
        if pdd is not None:
            body["pdd"] = pdd
        return self._with_usage(body, delta.completion_tokens)

    def full(self, text: str, finish_reason: str, usage: dict, pdd: dict) -> dict:
        return {**self._head(self.object_full),
                "choices": [{"index": 0, "text": text, "logprobs": self._full_logprobs(),
                             "finish_reason": finish_reason}],
                "usage": usage, "pdd": pdd}


class ChatFormatter(Formatter):
    object_chunk = "chat.completion.chunk"
    object_full = "chat.completion"

    def start_chunks(self) -> list[dict]:
        return [self._with_usage({**self._head(self.object_chunk), "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})]

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, items: list[tuple[int, TokenLogprobs]]) -> dict:
        """``{"content": [{token, logprob, bytes, top_logprobs: [the top n, most likely first]}]}``."""
        return {"content": [{**self._entry(t, lp.logprob),
                             "top_logprobs": [self._entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]}
                            for t, lp in items]}

    def chunk(self, delta: Delta, pdd: dict | None) -> dict:
        body = {**self._head(self.object_chunk),
                "choices": [{"index": 0, "delta": {"content": delta.text} if delta.text else {},
                             "logprobs": self._delta_logprobs(delta), "finish_reason": delta.finish_reason}]}
        if pdd is not None:
            body["pdd"] = pdd
        return self._with_usage(body, delta.completion_tokens)

    def full(self, text: str, finish_reason: str, usage: dict, pdd: dict) -> dict:
        return {**self._head(self.object_full),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": self._full_logprobs(), "finish_reason": finish_reason}],
                "usage": usage, "pdd": pdd}


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def final_usage(prompt_tokens: int, completion_tokens: int, info: dict) -> dict[str, Any]:
    """The final ``usage``: OpenAI's counts plus, when the backend reports it, the prompt tokens the
    prefill instance found in its prefix cache (``prompt_tokens_details.cached_tokens``, as vLLM)."""
    usage: dict[str, Any] = usage_body(prompt_tokens, completion_tokens)
    if "p_cached_tokens" in info:
        usage["prompt_tokens_details"] = {"cached_tokens": int(info["p_cached_tokens"])}
    return usage
