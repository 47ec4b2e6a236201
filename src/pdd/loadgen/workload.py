"""Workload generators shared by `pdd bench` (live) and `pdd sim` (simulated).

One generator feeds both tools so a simulated run and a live run see the same request mix.
A request is a token-count spec (prompt, cached prefix, output); for live runs it also carries a
prompt (chat messages) whose shared prefixes reproduce the spec's hit rate on a prefix cache.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

# The report's hit-rate bins (fractions). 75% of requests fall above 0.95; the mean is ~0.895.
DEFAULT_HIT_BINS: tuple[tuple[float, float], ...] = (
    (0.00, 0.90), (0.90, 0.95), (0.95, 0.97), (0.97, 0.98), (0.98, 0.99), (0.99, 1.00),
)
DEFAULT_HIT_WEIGHTS: tuple[float, ...] = (0.15, 0.10, 0.15, 0.15, 0.20, 0.25)

# Roughly one BPE token each (common English words with a leading space).
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there one all we their can has more will would been if no "
    "when so what time up out them some could into other then two than its only new these may "
    "any over such after most also made many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take three"
).split()


@dataclass(frozen=True)
class HitDistribution:
    """Per-request prefix-hit rate: pick a bin by weight, then uniform inside it."""

    bins: tuple[tuple[float, float], ...] = DEFAULT_HIT_BINS
    weights: tuple[float, ...] = DEFAULT_HIT_WEIGHTS

    def __post_init__(self) -> None:
        if len(self.bins) != len(self.weights) or not self.bins:
            raise ValueError("hit bins and weights must be non-empty and the same length")
        if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ValueError("hit weights must be non-negative with a positive sum")
        for lo, hi in self.bins:
            if not 0.0 <= lo <= hi <= 1.0:
                raise ValueError(f"bad hit bin {(lo, hi)}: need 0 <= lo <= hi <= 1")

    @property
    def probabilities(self) -> np.ndarray:
        w = np.asarray(self.weights, dtype=float)
        return w / w.sum()

    def mean(self) -> float:
        return float(sum(p * (lo + hi) / 2 for p, (lo, hi) in zip(self.probabilities, self.bins)))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        idx = rng.choice(len(self.bins), size=n, p=self.probabilities)
        lo = np.array([b[0] for b in self.bins])[idx]
        hi = np.array([b[1] for b in self.bins])[idx]
        return lo + (hi - lo) * rng.random(n)

    def bin_index(self, hits: np.ndarray) -> np.ndarray:
        """Bin of each hit rate (upper edges inclusive for the last bin)."""
        edges = np.array([b[1] for b in self.bins[:-1]])
        return np.searchsorted(edges, np.asarray(hits), side="right")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "HitDistribution":
        if not data:
            return cls()
        return cls(tuple(tuple(b) for b in data["bins"]), tuple(data["weights"]))


@dataclass
class RequestSpec:
    """One request as both tools see it. Token counts are what the cost model needs."""

    rid: int
    prompt_tokens: int
    cached_tokens: int  # leading prompt tokens a warm prefix cache already holds
    output_tokens: int
    session: int = 0
    turn: int = 0
    messages: list[dict[str, str]] | None = None  # live runs only
    ignore_eos: bool = True

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def sent_max_tokens(self) -> int | None:
        """The ``max_tokens`` a live client sends (None: the field is left out): the output length here, so
        the server stops there; a replayed trace sends what its rule says (loadgen/replay.py)."""
        return self.output_tokens

    def prompt_token_ids(self) -> list[int] | None:
        """Live runs: the prompt as token ids for /v1/completions (None: ``messages`` are the prompt). A method,
        so that a replayed trace builds each prompt when it is sent rather than holding them all."""
        return None

    def read_limit(self) -> int | None:
        """Output tokens after which a live client closes the stream (None: it reads to the server's end)."""
        return None


@dataclass
class Workload:
    """Column arrays for the simulator (fast) plus the specs for live runs."""

    prompt: np.ndarray
    cached: np.ndarray
    output: np.ndarray
    specs: list[RequestSpec] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.prompt.shape[0])

    @property
    def hit(self) -> np.ndarray:
        return self.cached / np.maximum(self.prompt, 1)

    @classmethod
    def from_specs(cls, specs: Sequence[RequestSpec]) -> "Workload":
        return cls(
            np.array([s.prompt_tokens for s in specs], dtype=np.int64),
            np.array([s.cached_tokens for s in specs], dtype=np.int64),
            np.array([s.output_tokens for s in specs], dtype=np.int64),
            list(specs),
        )


@dataclass(frozen=True)
class AgenticConfig:
    """Synthetic agent sessions: long shared context, short new turn, skewed hit rates."""

    num_requests: int = 1000
    context_tokens: int = 64512  # prompt length target (report: 64K total with 1K output)
    context_jitter: float = 0.0  # +-fraction of uniform jitter on the prompt length
    output_tokens: int = 1024
    output_jitter: float = 0.0
    hits: HitDistribution = HitDistribution()
    turns_per_session: int = 8
    anomalous_fraction: float = 0.0  # long input, short output (report: ~3-4% of traffic)
    anomalous_output: tuple[int, int] = (32, 499)
    seed: int = 0


def agentic_arrays(cfg: AgenticConfig) -> Workload:
    """Vectorised token-count specs (no prompt text): what the simulator consumes at scale."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_requests
    prompt = _jittered(rng, cfg.context_tokens, cfg.context_jitter, n)
    output = _jittered(rng, cfg.output_tokens, cfg.output_jitter, n)
    hit = cfg.hits.sample(rng, n)
    cached = np.minimum(np.floor(hit * prompt).astype(np.int64), prompt - 1)
    if cfg.anomalous_fraction > 0:
        anomalous = rng.random(n) < cfg.anomalous_fraction
        lo, hi = cfg.anomalous_output
        output = np.where(anomalous, rng.integers(lo, hi + 1, size=n), output)
    return Workload(prompt, np.maximum(cached, 0), np.maximum(output, 1))


def _jittered(rng: np.random.Generator, mean: int, jitter: float, n: int) -> np.ndarray:
    if jitter <= 0:
        return np.full(n, int(mean), dtype=np.int64)
    lo, hi = int(mean * (1 - jitter)), int(mean * (1 + jitter))
    return rng.integers(max(1, lo), max(2, hi + 1), size=n).astype(np.int64)


def agentic_sessions(cfg: AgenticConfig, with_text: bool = True) -> list[RequestSpec]:
    """Multi-turn sessions whose turn k+1 prompt extends turn k's prompt + answer.

    The new text appended per turn is sized so that the part already seen (previous prompt and
    answer) is the drawn hit fraction of the new prompt. When that would overflow the context
    target the session "compacts": it keeps only the drawn fraction of its previous prompt as
    the prefix and refills with new text, which is how low-hit requests arise in agent traffic.
    """
    arrays = agentic_arrays(cfg)
    rng = random.Random(cfg.seed + 1)
    # A prefix every session starts from (system prompt, tool schemas): a session's first turn hits
    # its drawn fraction of it, so first turns follow the configured hit distribution too.
    common = [rng.choice(WORDS) for _ in range(int(arrays.prompt.max(initial=1)))]
    specs: list[RequestSpec] = []
    session, turn = -1, cfg.turns_per_session
    words: list[str] = []  # the session's token stream so far (prompt + answers)
    segments: list[tuple[str, int]] = []  # (role, end index in words)
    for i in range(len(arrays)):
        target, hit_rate, out = int(arrays.prompt[i]), float(arrays.hit[i]), int(arrays.output[i])
        keep = min(int(hit_rate * target), target - 1)
        if turn >= cfg.turns_per_session:
            session, turn = session + 1, 0
            words, segments = list(common[:keep]), ([("system", keep)] if keep else [])
        elif keep <= len(words):
            words, segments = _truncate(words, segments, keep)
        cached = len(words)
        _append(words, segments, "user", max(1, target - len(words)), rng)
        spec = RequestSpec(
            rid=i, prompt_tokens=len(words), cached_tokens=min(cached, len(words) - 1),
            output_tokens=out, session=session, turn=turn,
            messages=_messages(words, segments) if with_text else None,
        )
        specs.append(spec)
        _append(words, segments, "assistant", out, rng)  # the answer becomes context
        turn += 1
    return specs


def _append(words: list[str], segments: list[tuple[str, int]], role: str, n: int, rng: random.Random) -> None:
    words.extend(rng.choice(WORDS) for _ in range(max(0, n)))
    if segments and segments[-1][0] == role:
        segments[-1] = (role, len(words))
    else:
        segments.append((role, len(words)))


def _truncate(words: list[str], segments: list[tuple[str, int]], keep: int) -> tuple[list[str], list[tuple[str, int]]]:
    kept_segments = []
    for role, end in segments:
        kept_segments.append((role, min(end, keep)))
        if end >= keep:
            break
    return words[:keep], [s for s in kept_segments if s[1] > 0]


def _messages(words: list[str], segments: list[tuple[str, int]]) -> list[dict[str, str]]:
    msgs, start = [], 0
    for role, end in segments:
        msgs.append({"role": role, "content": " ".join(words[start:end])})
        start = end
    if msgs and msgs[-1]["role"] == "assistant":  # a chat request must end on a user turn
        msgs.append({"role": "user", "content": "continue"})
    return msgs


def random_specs(
    num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
    prefix_len: int = 0, seed: int = 0, with_text: bool = True,
) -> list[RequestSpec]:
    """Random lengths like `vllm bench serve --dataset-name random`; `prefix_len` words shared by all."""
    rng = np.random.default_rng(seed)
    wrng = random.Random(seed)
    lo_in, hi_in = int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio))
    lo_out, hi_out = int(output_len * (1 - range_ratio)), int(output_len * (1 + range_ratio))
    prefix = [wrng.choice(WORDS) for _ in range(prefix_len)]
    specs = []
    for i in range(num_requests):
        n_in = int(rng.integers(max(1, lo_in), max(1, hi_in) + 1))
        n_out = int(rng.integers(max(1, lo_out), max(1, hi_out) + 1))
        text = None
        if with_text:
            text = [{"role": "user", "content": " ".join(prefix + [wrng.choice(WORDS) for _ in range(n_in)])}]
        specs.append(RequestSpec(i, prefix_len + n_in, prefix_len if i else 0, n_out, session=i, messages=text))
    return specs


def approx_tokens(text: str) -> int:
    """Token count estimate when no tokenizer is at hand: ~4 characters per BPE token."""
    return max(1, (len(text) + 3) // 4)


def sharegpt_specs(path: str | Path, num_requests: int, seed: int = 0, max_output: int = 2048) -> list[RequestSpec]:
    """ShareGPT JSON: each conversation becomes a session; turn k's prompt is every earlier turn."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    rng = random.Random(seed)
    rng.shuffle(data)
    specs: list[RequestSpec] = []
    for session, conv in enumerate(data):
        turns = conv.get("conversations") or conv.get("conversation") or []
        history: list[dict[str, str]] = []
        seen_tokens = 0
        for turn_idx in range(0, len(turns) - 1, 2):
            human, gpt = turns[turn_idx], turns[turn_idx + 1]
            if human.get("from") not in ("human", "user") or gpt.get("from") not in ("gpt", "assistant", "chatgpt"):
                break
            history = history + [{"role": "user", "content": str(human.get("value", ""))}]
            prompt_tokens = sum(approx_tokens(m["content"]) for m in history)
            out = min(max_output, approx_tokens(str(gpt.get("value", ""))))
            specs.append(RequestSpec(
                len(specs), prompt_tokens, min(seen_tokens, prompt_tokens - 1), out,
                session=session, turn=turn_idx // 2, messages=list(history),
            ))
            history = history + [{"role": "assistant", "content": str(gpt.get("value", ""))}]
            seen_tokens = prompt_tokens + out
            if len(specs) >= num_requests:
                return specs
    if not specs:
        raise ValueError(f"{path}: no usable human/gpt turns found")
    return specs
