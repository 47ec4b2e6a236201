"""Request bodies of the OpenAI-compatible API, validated with pydantic v2.

Known fields are type-checked strictly (a string where a number belongs is a 400, not silently
coerced); unknown fields are ignored, as OpenAI does. Features the engine does not have (logprobs,
n > 1, penalties, tools, ...) are rejected with a message naming the field rather than ignored, so a
client never gets a silently different answer than it asked for.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from pdd.shared.pipelines import HandoffMode, Pipeline, routable

MAX_STOP_STRINGS = 16

Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Int64 = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class PDDOptions(_Model):
    """The ``pdd`` extension object: force a pipeline and/or a handoff mode (tests, operators), and
    ask for the output token ids in the response's ``pdd`` info (token-exact comparisons)."""

    pipeline: Annotated[Pipeline, Field(strict=False)] | None = None  # enums from JSON strings
    handoff: Annotated[HandoffMode, Field(strict=False)] | None = None
    return_token_ids: StrictBool = False

    @field_validator("pipeline")
    @classmethod
    def _routable(cls, value: Pipeline | None) -> Pipeline | None:
        return routable(value)


class StreamOptions(_Model):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM: with include_usage, cumulative usage on every chunk


class _Common(_Model):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Annotated[StrictInt, Field(le=2**31 - 1)] | None = None  # extension (vLLM): 0 or -1 disables
    seed: Int64 | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = None  # extension (vLLM)
    ignore_eos: StrictBool = False  # extension (vLLM)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = 1
    user: Any = None  # accepted and ignored
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Any] | None = None
    pdd: PDDOptions | None = None

    @field_validator("max_tokens")
    @classmethod
    def _positive_max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("must be at least 1")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        if v is not None and v < 0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 1:
            raise ValueError("must be in (0, 1]")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise ValueError("must be -1 or 0 (disabled) or a positive number of tokens")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v:
            raise ValueError("penalties are not supported (only 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def stop_list(self) -> list[str]:
        """Stop strings as a list; empty strings dropped (they would stop before any output)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM's rule: needs include_usage too). Clients time output positions by
        the cumulative completion_tokens, since one chunk can carry several tokens."""
        return self.include_usage() and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: StrictStr | list[TokenId] | list[StrictStr] | list[list[TokenId]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("only best_of=1 is supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        """Accept one prompt: text, token ids, or a batch of exactly one of those."""
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            v = v[0]
        if not v:
            raise ValueError("must not be empty")
        return v


class TextPart(_Model):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        """The content as one string (text parts joined, as vLLM does for text-only models)."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("must contain at least one message")
        return v

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("must be at least 1")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list | None) -> list | None:
        if v:
            raise ValueError("tools are not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict | None) -> dict | None:
        if v is not None and v.get("type") not in ("text", None):
            raise ValueError("only response_format {'type': 'text'} is supported")
        return v

    @model_validator(mode="after")
    def _completion_tokens(self) -> "ChatCompletionRequest":
        """``max_completion_tokens`` is the newer name and wins over ``max_tokens``."""
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


AnyRequest = Union[CompletionRequest, ChatCompletionRequest]
