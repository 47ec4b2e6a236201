"""The torch engine's token sampler (its parameters: engine/core/sampling_params.py).

The random draw for output position i of a request depends only on (seed, i): each sampled
row gets its own generator seeded from a hash of the pair, and draws with the Gumbel-max trick.
So a relay decoder and a main decoder that continue the same request from the same position
pick the same token, whatever else shares their batches.

Penalties and ``min_tokens`` (vLLM's semantics and order) depend only on the request's token
history (prompt and outputs so far), recomputed from it at every draw: an engine that learned
the outputs by ids (handoff, migration, preemption) holds the same state as the one that sampled
them. Logprobs are vLLM's default ``raw_logprobs``: the log-softmax of the model's logits, before
penalties, temperature and filters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdd.engine.core.sampling_params import SamplingParams
from pdd.shared.protocol import TokenLogprobs

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): the generator seed for one output position."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _filtered_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min_p, top-k, top-p (vLLM's order); log-probabilities to draw from."""
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        drop = before >= params.top_p
        drop[0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return torch.log_softmax(logits, dim=-1)


def apply_history(logits: torch.Tensor, params: SamplingParams, tokens: Sequence[int], prompt_len: int,
                  eos_token_ids: Sequence[int] = ()) -> torch.Tensor:
    """min_tokens, then repetition, frequency and presence penalties (vLLM's order) on one row of logits.

    ``tokens``: the prompt followed by every output so far; only they decide the result.
    """
    vocab = logits.shape[-1]
    outputs = tokens[prompt_len:]
    if len(outputs) < params.min_tokens:
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
        banned = [t for t in banned if t < vocab]
        if banned:
            logits = logits.index_fill(0, torch.tensor(banned, dtype=torch.long), float("-inf"))
    if params.repetition_penalty != 1.0 and tokens:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(list(tokens), dtype=torch.long)] = True
        rp = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and outputs:
        counts = torch.bincount(torch.tensor(list(outputs), dtype=torch.long), minlength=vocab)[:vocab]
        counts = counts.to(logits.dtype)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                histories: Sequence[tuple[Sequence[int], int]] | None = None,
                eos_token_ids: Sequence[int] = ()) -> list[int]:
    """One token per row of float32 logits [R, V]; positions[r] is the output index being drawn.

    histories[r] = (prompt + outputs so far, prompt length): needed by rows whose params use it
    (penalties, min_tokens); eos_token_ids are what min_tokens masks besides stop_token_ids.
    Greedy rows without penalties take the argmax of the raw logits (no softmax).
    """
    tokens = torch.argmax(logits, dim=-1).tolist()
    for row, (p, pos) in enumerate(zip(params, positions)):
        row_logits = logits[row]
        if p.uses_history:
            if histories is None:
                raise ValueError("sample_rows: penalties and min_tokens need the rows' token histories")
            hist, prompt_len = histories[row]
            row_logits = apply_history(row_logits, p, hist, prompt_len, eos_token_ids)
            if p.greedy:
                tokens[row] = int(torch.argmax(row_logits))
        if p.greedy:
            continue
        logp = _filtered_logprobs(row_logits, p)
        gen = torch.Generator().manual_seed(position_seed(int(p.seed or 0), pos))
        u = torch.rand(logp.shape[0], generator=gen, dtype=torch.float64).clamp_(min=1e-300)
        gumbel = -torch.log(-torch.log(u))
        tokens[row] = int(torch.argmax(logp.double() + gumbel))
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: list[int], counts: list[int | None]) -> list[TokenLogprobs | None]:
    """Raw logprobs per row: log-softmax of the model's logits (vLLM's default ``raw_logprobs``).

    counts[r]: None (row asked for none) or n, the number of top alternatives (most likely first).
    """
    rows = [r for r, n in enumerate(counts) if n is not None]
    out: list[TokenLogprobs | None] = [None] * len(counts)
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = logp[torch.arange(len(rows)), torch.tensor([tokens[r] for r in rows])].tolist()
    width = max(counts[r] for r in rows)  # type: ignore[type-var]
    top_v, top_i = torch.topk(logp, width, dim=-1) if width > 0 else (None, None)
    for k, r in enumerate(rows):
        n = counts[r] or 0
        ids = top_i[k, :n].tolist() if n else []
        vals = top_v[k, :n].tolist() if n else []
        out[r] = TokenLogprobs(logprob=chosen[k], top_ids=ids, top_logprobs=vals)
    return out
