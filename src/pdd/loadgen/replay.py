"""`pdd bench --dataset-name mooncake_trace`: a Mooncake trace (loadgen/trace.py) replayed live.

Why token ids: a trace holds block hash ids, no text. Each id becomes a fixed block of the served model's
own ordinary tokens (`trace.prompt_token_ids`), so equal ids give identical token blocks and the prefix
reuse the trace recorded reaches the server's prefix caches as recorded; text would be re-tokenized and the
blocks lost. The pool of tokens is asked of the server once, before the run (``POST /tokenize``, vLLM's and
PDD's), from a fixed text without special tokens.

What is sent and read follows `MaxTokensRule`, as in the simulator: with no ``max_tokens`` the server may go
up to the model's context, and the client closes the stream after the trace's output length (the server
cancels the rest). A prompt that leaves no room for one output token in the model's context
(``max_model_len`` of ``GET /v1/models``, else of /tokenize; a server that reports neither gets every prompt)
is skipped and counted, never truncated: a cut prompt would be another request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .runner import list_models
from .trace import TRACE_BLOCK_TOKENS, MaxTokensRule, TraceRequest, hit_tokens, prompt_token_ids
from .workload import WORDS, RequestSpec

TOKEN_POOL_TEXT = " ".join(WORDS)  # tokenized once: its distinct ids are the replay's vocabulary


@dataclass
class ReplaySpec(RequestSpec):
    """One trace request as a live client sends it: token ids built when sent, ``max_tokens`` as the rule
    says (None: left out), and the stream closed after ``output_tokens``."""

    request: TraceRequest | None = None
    block_tokens: int = TRACE_BLOCK_TOKENS
    pool: Sequence[int] = field(default=(), repr=False)
    max_tokens: int | None = None

    def sent_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_token_ids(self) -> list[int] | None:
        if self.request is None:
            raise ValueError(f"replayed request {self.rid} has no trace request")
        return prompt_token_ids(self.request, self.block_tokens, self.pool)

    def read_limit(self) -> int | None:
        return self.output_tokens


@dataclass(frozen=True)
class ReplayPlan:
    """The requests of a replay and when each goes out (seconds after the run's start)."""

    specs: list[ReplaySpec]
    arrivals: list[float]
    skipped_too_long: int
    max_model_len: int | None


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


async def token_pool(base_url: str, model: str, api_key: str | None = None,
                     timeout_s: float = 30.0) -> tuple[list[int], int | None]:
    """The served model's ordinary token ids (distinct, sorted) and the context /tokenize reports, if any."""
    url = base_url.rstrip("/") + "/tokenize"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "prompt": TOKEN_POOL_TEXT, "add_special_tokens": False}
    try:
        async with aiohttp.ClientSession() as session, \
                session.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                why = " (no /tokenize on this server?)" if resp.status in (404, 405) else ""
                raise ValueError(f"POST {url}: HTTP {resp.status}{why}: {(await resp.text())[:200]}; a trace replay "
                                 "needs /tokenize to build its prompts of the served model's token ids")
            data = await resp.json(content_type=None)
    except aiohttp.ClientError as exc:
        raise ValueError(f"POST {url} failed ({exc}); is the server up?") from None
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not tokens or not isinstance(tokens, list) or not all(_is_token_id(t) for t in tokens):
        raise ValueError(f"POST {url}: no token ids in the reply (expected vLLM's shape, {{\"tokens\": [...]}})")
    return sorted(set(tokens)), _positive_int(data.get("max_model_len"))


async def model_context(base_url: str, model: str, api_key: str | None = None) -> int | None:
    """``max_model_len`` of the served model's card in ``GET /v1/models`` (None when the card has none)."""
    cards = await list_models(base_url, api_key)
    card = next((c for c in cards if c.get("id") == model), cards[0] if cards else {})
    return _positive_int(card.get("max_model_len"))


def plan_replay(reqs: Sequence[TraceRequest], rule: MaxTokensRule, block_tokens: int, time_scale: float,
                pool: Sequence[int], max_model_len: int | None) -> ReplayPlan:
    """Specs and send times of a trace slice: arrivals relative to the first request kept, times
    ``time_scale``; prompts that leave no room for an output token are skipped (counted)."""
    kept = [r for r in reqs if max_model_len is None or r.input_tokens(block_tokens) < max_model_len]
    if not kept:
        raise ValueError(f"every one of the {len(reqs)} trace requests is longer than the model's context "
                         f"({max_model_len} tokens) at --trace-block-tokens {block_tokens}")
    prompts = [r.input_tokens(block_tokens) for r in kept]
    cached = hit_tokens([r.hash_ids for r in kept], prompts, block_tokens)
    specs = [ReplaySpec(rid=i, prompt_tokens=n, cached_tokens=int(hit), output_tokens=rule.output_tokens(r),
                        request=r, block_tokens=block_tokens, pool=pool, max_tokens=rule.sent(r))
             for i, (r, n, hit) in enumerate(zip(kept, prompts, cached.tolist()))]
    start = kept[0].arrival_s
    return ReplayPlan(specs, [(r.arrival_s - start) * time_scale for r in kept], len(reqs) - len(kept),
                      max_model_len)


async def prepare_replay(base_url: str, served_model: str, reqs: Sequence[TraceRequest], rule: MaxTokensRule,
                         block_tokens: int, time_scale: float, api_key: str | None = None) -> ReplayPlan:
    """Ask the server for its token pool and context, then plan the replay (nothing is generated yet)."""
    pool, tokenize_context = await token_pool(base_url, served_model, api_key)
    context = await model_context(base_url, served_model, api_key) or tokenize_context
    return plan_replay(reqs, rule, block_tokens, time_scale, pool, context)


def trace_summary(path: str | Path, plan: ReplayPlan, rule: MaxTokensRule, block_tokens: int,
                  time_scale: float) -> dict[str, Any]:
    """The result JSON's ``pdd.trace`` block: what was replayed and how it was scaled."""
    return {
        "file": Path(path).name, "requests": len(plan.specs), "time_scale": time_scale,
        "block_tokens": block_tokens, "blocks_scaled": block_tokens != TRACE_BLOCK_TOKENS,
        "max_tokens": str(rule), "skipped_too_long": plan.skipped_too_long, "max_model_len": plan.max_model_len,
    }
