"""Production request traces in Mooncake's JSONL format, read once for `pdd bench` (live replay), `pdd sim
trace` and `pdd plan` (simulated), so every tool replays the very same requests.

One line per request: ``timestamp`` (ms from the trace's start), ``input_length`` and ``output_length``
(tokens) and ``hash_ids``, one id per 512-token block of the prompt (the last block may be partial). Ids are
prefix chains: two prompts share their first k blocks exactly when their first k ids are equal. Optional
``session_id`` and ``max_tokens`` are read where present. A bad line is an error naming the line and the
field, raised before anything is sent or simulated.

Why the ``max_tokens`` rule lives here: a trace records how long each answer was, which no live router
knows in advance. What the client sends (and so what a router may use) is decided once, by
`MaxTokensRule`, for the replay and the simulator alike.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TRACE_BLOCK_TOKENS = 512  # Mooncake's block: one hash id per 512 prompt tokens
_REQUIRED = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace line that cannot be replayed: names the file, the line (1-based) and the field."""

    def __init__(self, path: str | Path, line: int, field: str, problem: str) -> None:
        self.path, self.line, self.field = str(path), line, field
        super().__init__(f"{path}:{line}: field {field!r}: {problem}")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, in the trace's own units (512-token blocks)."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None
    max_tokens: int | None = None

    @property
    def arrival_s(self) -> float:
        return self.timestamp_ms / 1000.0

    def input_tokens(self, block_tokens: int = TRACE_BLOCK_TOKENS) -> int:
        """The prompt's length once every 512-token block is scaled to ``block_tokens`` (the last block,
        partial in the trace, keeps its fraction and at least one token)."""
        if block_tokens == TRACE_BLOCK_TOKENS:
            return self.input_length
        last = self.input_length - (len(self.hash_ids) - 1) * TRACE_BLOCK_TOKENS
        return (len(self.hash_ids) - 1) * block_tokens + max(1, round(last * block_tokens / TRACE_BLOCK_TOKENS))


def _int_field(path: Path, line: int, obj: dict[str, Any], name: str, minimum: int) -> int:
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise TraceError(path, line, name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(path, line, name, f"must be >= {minimum}, got {value!r}")
    return int(value)


def _parse_line(path: Path, line: int, text: str) -> TraceRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(path, line, "<json>", f"malformed JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(path, line, "<json>", f"a line is one JSON object, got {type(obj).__name__}")
    for name in _REQUIRED:
        if name not in obj:
            raise TraceError(path, line, name, "missing")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise TraceError(path, line, "timestamp", f"must be a finite number of ms >= 0, got {ts!r}")
    input_length = _int_field(path, line, obj, "input_length", 1)
    output_length = _int_field(path, line, obj, "output_length", 1)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise TraceError(path, line, "hash_ids", "must be a list of integers")
    need = math.ceil(input_length / TRACE_BLOCK_TOKENS)
    if len(ids) != need:
        raise TraceError(path, line, "hash_ids", f"{len(ids)} ids do not cover input_length {input_length}: "
                                                 f"{need} blocks of {TRACE_BLOCK_TOKENS} tokens expected")
    max_tokens = None
    if obj.get("max_tokens") is not None:
        max_tokens = _int_field(path, line, obj, "max_tokens", 1)
    session = obj.get("session_id")
    return TraceRequest(line, float(ts), input_length, output_length, tuple(ids),
                        None if session is None else str(session), max_tokens)


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of a trace (all when None), validated; blank lines are skipped.
    Timestamps must not go backwards: a replay sends in file order at the recorded times."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"trace file not found: {p}")
    out: list[TraceRequest] = []
    with p.open() as fh:
        for line, text in enumerate(fh, 1):
            if limit is not None and len(out) >= limit:
                break
            if not text.strip():
                continue
            req = _parse_line(p, line, text)
            if out and req.timestamp_ms < out[-1].timestamp_ms:
                raise TraceError(p, line, "timestamp", f"goes backwards: {req.timestamp_ms:g} ms after "
                                                       f"{out[-1].timestamp_ms:g} ms on line {out[-1].line}")
            out.append(req)
    if not out:
        raise ValueError(f"{p}: no requests in the trace")
    return out


@dataclass(frozen=True)
class MaxTokensRule:
    """What a replay sends as ``max_tokens`` (and so all a router can know of the output length).

    ``none`` (default): nothing, as most chat clients send; the router knows only the model's limit, and the
    client stops reading after the trace's output length. ``output``: the trace's output length, as vLLM's
    timed trace replay does (an oracle no real client has). A number N: every request capped at N. A trace's
    own ``max_tokens`` field wins where present (a cap N still applies to it)."""

    kind: str = "none"  # "none" | "output" | "cap"
    cap: int = 0

    @classmethod
    def parse(cls, text: str | None) -> "MaxTokensRule":
        if text is None or text == "none":
            return cls()
        if text == "output":
            return cls("output")
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"--max-tokens: 'none', 'output' or a positive integer, got {text!r}") from None
        if n < 1:
            raise ValueError(f"--max-tokens: a cap must be >= 1, got {n}")
        return cls("cap", n)

    def __str__(self) -> str:
        return str(self.cap) if self.kind == "cap" else self.kind

    def sent(self, req: TraceRequest) -> int | None:
        """The ``max_tokens`` a client sends for ``req`` (None: the field is left out)."""
        value = req.max_tokens
        if value is None and self.kind == "output":
            value = req.output_length
        if self.kind == "cap":
            value = self.cap if value is None else min(value, self.cap)
        return value

    def columns(self, output: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """For requests without their own ``max_tokens``: what is sent (None: nothing) and what is read."""
        output = np.asarray(output, dtype=np.int64)
        if self.kind == "output":
            return output, output
        if self.kind == "cap":
            return np.full_like(output, self.cap), np.minimum(output, self.cap)
        return None, output

    def output_tokens(self, req: TraceRequest) -> int:
        """Tokens the replay reads before it closes the stream: the trace's output, cut by what was sent."""
        sent = self.sent(req)
        return req.output_length if sent is None else min(req.output_length, sent)


@dataclass(frozen=True)
class TraceArrays:
    """A trace as the simulator's columns: arrival (s), prompt tokens, output tokens the client reads, the
    ``max_tokens`` the router sees (the model's room when none is sent), and each prompt's block chain."""

    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    route_max_tokens: np.ndarray
    chains: list[tuple[int, ...]]
    block_tokens: int
    skipped_too_long: int

    def __len__(self) -> int:
        return int(self.prompt.shape[0])


def trace_arrays(reqs: Sequence[TraceRequest], rule: MaxTokensRule, max_context_tokens: int,
                 block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceArrays:
    """Columns for the simulator; a request whose prompt plus one output token exceeds the model's context is
    skipped and counted (a live server rejects it), never truncated."""
    kept = [r for r in reqs if r.input_tokens(block_tokens) < max_context_tokens]
    prompt = np.array([r.input_tokens(block_tokens) for r in kept], dtype=np.int64)
    sent = [rule.sent(r) for r in kept]
    route = np.array([max_context_tokens - p if s is None else s for s, p in zip(sent, prompt.tolist())],
                     dtype=np.int64)
    output = np.array([rule.output_tokens(r) for r in kept], dtype=np.int64)
    arrival = np.array([r.arrival_s for r in kept], dtype=float)
    return TraceArrays(arrival - (arrival[0] if len(arrival) else 0.0), prompt, np.minimum(output, route), route,
                       [r.hash_ids for r in kept], block_tokens, len(reqs) - len(kept))


def block_token_ids(hash_id: int, block_tokens: int, pool: Sequence[int]) -> list[int]:
    """The tokens standing for one trace block: drawn from ``pool`` (ordinary tokens of the served model) with
    the hash id as the seed, so equal ids give identical blocks and so identical prefixes."""
    picks = np.random.default_rng(hash_id & 0xFFFF_FFFF_FFFF_FFFF).integers(0, len(pool), block_tokens)
    return [pool[i] for i in picks.tolist()]


def prompt_token_ids(req: TraceRequest, block_tokens: int, pool: Sequence[int]) -> list[int]:
    """A request's prompt as token ids: its blocks in order, the last one cut to the scaled length."""
    if not pool:
        raise ValueError("the token pool is empty: no ordinary token ids to build prompts from")
    ids: list[int] = []
    for h in req.hash_ids:
        ids.extend(block_token_ids(h, block_tokens, pool))
    return ids[: req.input_tokens(block_tokens)]


def hit_tokens(chains: Sequence[Sequence[int]], prompt: Sequence[int], block_tokens: int) -> np.ndarray:
    """Per request, the prompt tokens an unbounded prefix cache would already hold (leading blocks seen
    before, at most the prompt minus one token): the trace's upper bound on reuse."""
    seen: set[int] = set()
    out = np.zeros(len(chains), dtype=np.int64)
    for i, (chain, n) in enumerate(zip(chains, prompt)):
        k = 0
        while k < len(chain) and chain[k] in seen:
            k += 1
        out[i] = min(k * block_tokens, int(n) - 1)
        seen.update(chain)
    return out
