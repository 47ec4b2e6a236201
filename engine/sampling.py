"""Sampling parameters and the token sampler.

The random draw for output position i of a request depends only on (seed, i): each sampled
row gets its own generator seeded from a hash of the pair, and draws with the Gumbel-max trick.
So a relay decoder and a main decoder that continue the same request from the same position
pick the same token, whatever else shares their batches.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from pdd.engine.errors import InvalidSamplingParamsError

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingParams:
    """temperature 0 means greedy. top_k <= 0 and top_p == 1 disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidSamplingParamsError naming the bad field."""
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise InvalidSamplingParamsError(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 < p <= 1.0:
            raise InvalidSamplingParamsError(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise InvalidSamplingParamsError(f"top_k must be an integer >= -1 (0 or -1: off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InvalidSamplingParamsError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidSamplingParamsError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(not isinstance(s, int) or s < 0 for s in self.stop_token_ids):
            raise InvalidSamplingParamsError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    def with_seed(self) -> "SamplingParams":
        """A copy with a concrete seed (a fresh random one if unset), so draws are reproducible."""
        if self.seed is not None:
            return self
        copy = SamplingParams(**self.__dict__)
        copy.seed = random.getrandbits(63)
        return copy


def position_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): the generator seed for one output position."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _filtered_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = logits / params.temperature
    vocab = logits.shape[-1]
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


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """One token per row of float32 logits [R, V]; positions[r] is the output index being drawn."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for row, (p, pos) in enumerate(zip(params, positions)):
        if p.greedy:
            continue
        logp = _filtered_logprobs(logits[row], p)
        gen = torch.Generator().manual_seed(position_seed(int(p.seed or 0), pos))
        u = torch.rand(logp.shape[0], generator=gen, dtype=torch.float64).clamp_(min=1e-300)
        gumbel = -torch.log(-torch.log(u))
        tokens[row] = int(torch.argmax(logp.double() + gumbel))
    return tokens
