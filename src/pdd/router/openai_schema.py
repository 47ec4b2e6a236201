"""Request bodies of the OpenAI-compatible API, validated with pydantic v2.

Known fields are type-checked strictly (a string where a number belongs is a 400, not silently
coerced); unknown fields are accepted, as OpenAI does, and kept in ``model_extra`` so the API logs
each new name once. Every field vLLM accepts is declared here: implemented, or refused (``_refused``)
with a 400 naming it when set to anything but its neutral value, so a client never gets a silently
different answer than it asked for.

Why one module: it is the API's field list. Declaring every request shape (completions, chat, /tokenize,
/detokenize) side by side is what lets a reader check it against vLLM's and OpenAI's lists at a glance;
split, a field could be declared in one shape and forgotten in another.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdd.shared.pipelines import HandoffMode, Pipeline, routable
from pdd.shared.protocol import MAX_LOGPROBS
from pdd.shared.tokenizer import RESERVED_TEMPLATE_KWARGS

MAX_STOP_STRINGS = 16

Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Int64 = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


def _refused(why: str, *neutral: Any) -> Any:
    """A field PDD declares but does not implement: None (or one of ``neutral``, its do-nothing values) is
    accepted, anything else is a 400 that names the field and says why."""

    def check(value: Any) -> Any:
        if value is not None and not any(value == n and type(value) is type(n) for n in neutral):
            raise ValueError(f"not supported: {why}")
        return value

    return Annotated[Any, AfterValidator(check)]


_STRUCTURED = _refused("structured output (grammar-constrained decoding) is not implemented")
_IGNORED = Any  # OpenAI fields with no effect on the answer: accepted and ignored, as vLLM does


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

    model_config = ConfigDict(extra="allow", strict=True)  # unknown names are logged once (api.py)

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
    presence_penalty: Float | None = None  # over output tokens, in [-2, 2]
    frequency_penalty: Float | None = None  # over output tokens, in [-2, 2]
    repetition_penalty: Float | None = None  # extension (vLLM): over prompt and output tokens, > 0
    min_p: Float | None = None  # extension (vLLM): in [0, 1]
    min_tokens: StrictInt | None = None  # extension (vLLM): EOS and stop_token_ids masked until this many
    logit_bias: dict[str, Any] | None = None
    include_stop_str_in_output: StrictBool = False  # extension (vLLM)
    skip_special_tokens: StrictBool = True  # extension (vLLM)
    add_special_tokens: StrictBool | None = None  # extension (vLLM); default: True for completions, False for chat
    response_format: dict[str, Any] | None = None
    # OpenAI fields without effect on the answer
    metadata: _IGNORED = None
    store: _IGNORED = None
    service_tier: _IGNORED = None
    prompt_cache_key: _IGNORED = None
    safety_identifier: _IGNORED = None
    # structured output (vLLM): refused, see _text_only
    structured_outputs: _STRUCTURED = None
    guided_json: _STRUCTURED = None
    guided_regex: _STRUCTURED = None
    guided_choice: _STRUCTURED = None
    guided_grammar: _STRUCTURED = None
    structural_tag: _STRUCTURED = None
    guided_decoding_backend: _STRUCTURED = None
    guided_whitespace_pattern: _STRUCTURED = None
    # other vLLM extensions PDD refuses
    use_beam_search: _refused("beam search is not implemented", False) = None
    length_penalty: _refused("length_penalty applies to beam search, which is not implemented", 1.0, 1) = None
    allowed_token_ids: _refused("allowed_token_ids is not implemented") = None
    bad_words: _refused("bad_words is not implemented", []) = None
    truncate_prompt_tokens: _refused("prompt truncation is not implemented") = None
    prompt_logprobs: _refused("prompt logprobs are not implemented") = None
    logits_processors: _refused("custom logits processors are not supported") = None
    return_tokens_as_token_ids: _refused("use pdd.return_token_ids for the output token ids", False) = None
    return_token_ids: _refused("use pdd.return_token_ids for the output token ids", False) = None
    spaces_between_special_tokens: _refused("fast tokenizers always decode special tokens as they are",
                                            True) = None
    priority: _refused("request priorities are not implemented", 0) = None
    cache_salt: _refused("per-request prefix-cache isolation is not implemented") = None
    request_id: _refused("request ids are assigned by the router (see the response's id)") = None
    kv_transfer_params: _refused("PDD moves KV between its own instances; external KV transfer is not "
                                 "supported") = None
    vllm_xargs: _refused("vllm_xargs has no meaning in PDD") = None
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
    def _penalty_range(cls, v: float | None) -> float | None:
        if v is not None and not -2.0 <= v <= 2.0:
            raise ValueError("must be in [-2, 2]")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, v: float | None) -> float | None:
        if v is not None and v <= 0:
            raise ValueError("must be > 0 (1 disables it)")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v: float | None) -> float | None:
        if v is not None and not 0.0 <= v <= 1.0:
            raise ValueError("must be in [0, 1]")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError("must be >= 0")
        return v

    def logprob_count(self) -> int | None:
        """Top alternatives per output token, or None for no logprobs (each endpoint spells it its way)."""
        return None

    def sampling_fields(self) -> dict[str, Any]:
        """SamplingSpec fields of the penalties, min_p, min_tokens and logprobs (unset: off)."""
        return {"min_p": self.min_p or 0.0,
                "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
                "presence_penalty": self.presence_penalty or 0.0, "frequency_penalty": self.frequency_penalty or 0.0,
                "min_tokens": self.min_tokens or 0, "logprobs": self.logprob_count()}

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict | None) -> dict | None:
        if v is not None and v.get("type") not in ("text", None):
            raise ValueError("only {'type': 'text'} is supported: structured output (json_object, json_schema, "
                             "structural_tag) is not implemented")
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

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]  # ids: range checked by the API
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None
    prompt_embeds: _refused("prompt embeddings are not supported") = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"must be in [0, {MAX_LOGPROBS}]")
        return v

    def logprob_count(self) -> int | None:
        return self.logprobs

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


class _ChatPrompt(_Model):
    """A conversation and how the chat template renders it (vLLM's fields, transformers' semantics);
    shared by /v1/chat/completions and /tokenize."""

    messages: list[ChatMessage]
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _one_of_prompt_or_continue(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("add_generation_prompt"):
            raise ValueError("cannot be true together with add_generation_prompt (send add_generation_prompt: "
                             "false to continue the final message)")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_kwargs(cls, v: dict | None) -> dict | None:
        clash = sorted(set(v or ()) & RESERVED_TEMPLATE_KWARGS)
        if clash:
            raise ValueError(f"'{clash[0]}' is a parameter of the template rendering itself, not a template "
                             "variable; use the request field of that name where there is one")
        return v

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them."""
        return [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in self.messages]


class ChatCompletionRequest(_Common, _ChatPrompt):
    """POST /v1/chat/completions."""

    model_config = _Common.model_config
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: _IGNORED = None
    functions: _refused("function calling is not supported") = None
    function_call: _refused("function calling is not supported", "none") = None
    chat_template: _refused("a per-request chat template is not accepted (like vLLM without "
                            "--trust-request-chat-template); the model's template is used") = None
    documents: _refused("documents (RAG) are not supported by the chat template rendering") = None
    mm_processor_kwargs: _refused("multimodal input is not supported") = None
    media_io_kwargs: _refused("multimodal input is not supported") = None
    best_of: _refused("only best_of=1 is supported", 1) = None
    echo: _refused("echoing the last message is not implemented", False) = None
    include_reasoning: _IGNORED = None  # vLLM: only with a reasoning parser, which PDD has none of
    # OpenAI fields that would change the answer
    reasoning_effort: _refused("reasoning effort is not supported") = None
    verbosity: _refused("verbosity is not supported") = None
    modalities: _refused("only text output is supported", ["text"]) = None
    audio: _refused("audio output is not supported") = None
    prediction: _refused("predicted outputs are not supported") = None
    web_search_options: _refused("web search is not supported") = None

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

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"must be in [0, {MAX_LOGPROBS}]")
        if v and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return v

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list | None) -> list | None:
        if v:
            raise ValueError("tools are not supported")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v: Any) -> Any:
        if v not in (None, "none", "auto"):
            raise ValueError("tools are not supported; only 'none' or 'auto' (without tools)")
        return v

    @model_validator(mode="after")
    def _completion_tokens(self) -> "ChatCompletionRequest":
        """``max_completion_tokens`` is the newer name and wins over ``max_tokens``."""
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


AnyRequest = Union[CompletionRequest, ChatCompletionRequest]


class TokenizeCompletionRequest(_Model):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_ChatPrompt):
    """POST /tokenize with messages (vLLM's shape): the ids /v1/chat/completions would prefill."""

    model: StrictStr | None = None
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Model):
    """POST /detokenize (vLLM's shape)."""

    model: StrictStr | None = None
    tokens: list[TokenId]
