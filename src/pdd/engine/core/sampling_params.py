"""Sampling parameters: what a request asks of the sampler, checked once for every backend.

The torch engine's sampler (engine/torch_backend/sampling.py) draws with them; the emulated backend's oracle
reads the few that matter to it; the vLLM backend maps them onto vLLM's.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from pdd.engine.core.errors import InvalidSamplingParamsError
from pdd.shared.protocol import MAX_LOGPROBS


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
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (after temperature)
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or the output
    presence_penalty: float = 0.0  # subtracted once from every token seen in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many outputs exist
    logprobs: int | None = None  # None: none; n >= 0: the chosen token's and the top n alternatives'

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_history(self) -> bool:
        """Whether the draw depends on the token history (penalties, min_tokens)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0)

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
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParamsError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidSamplingParamsError(f"repetition_penalty must be a finite number > 0, got "
                                             f"{self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _finite(v) or not -2.0 <= v <= 2.0:
                raise InvalidSamplingParamsError(f"{name} must be in [-2, 2], got {v!r}")
        if not _int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidSamplingParamsError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.logprobs is not None and (not _int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidSamplingParamsError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    def with_seed(self) -> SamplingParams:
        """A copy with a concrete seed (a fresh random one if unset), so draws are reproducible."""
        if self.seed is not None:
            return self
        copy = SamplingParams(**self.__dict__)
        copy.seed = random.getrandbits(63)
        return copy


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
