"""Per-request state and the small records the engine API returns."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from pdd.engine.core.radix_cache import RadixNode
from pdd.engine.core.sampling_params import SamplingParams
from pdd.shared.protocol import TokenLogprobs

_arrival = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"  # queued for admission (prefill not started, or preempted)
    RUNNING = "running"  # holds blocks; prefill chunks / extend / decode each step
    IMPORTING = "importing"  # blocks allocated for an incoming KV transfer
    HELD = "held"  # finished but KV pinned for export (hold_kv)


@dataclass
class Request:
    rid: str
    tokens: list[int]  # prompt followed by every output token known so far
    prompt_len: int
    params: SamplingParams
    max_new_tokens: int
    hold_kv: bool = False
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose KV is in block_table
    cache_node: RadixNode | None = None  # locked radix node of the matched prefix
    cached_tokens: int = 0
    stop_position: int | None = None  # produce outputs with index < stop_position
    check_known: bool = False  # known tokens were appended: check finish before sampling
    paused: bool = False  # compute known tokens' KV but sample nothing (MD between catch-up batches)
    arrival: int = field(default_factory=lambda: next(_arrival))

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def prompt_ids(self) -> list[int]:
        return self.tokens[: self.prompt_len]

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass
class StepOutput:
    rid: str
    token_ids: list[int]  # new tokens produced this step
    start_position: int  # output index of token_ids[0]
    finished: bool
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort' | None
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asked for logprobs


@dataclass
class ImportReservation:
    """Blocks an engine reserved for a request whose prompt KV arrives from elsewhere (prepare_import)."""

    cached_tokens: int  # block-aligned prompt prefix already in this engine's radix cache (locked)
    dst_blocks: list[int]  # fresh blocks for prompt tokens [cached_tokens:], in order
    all_blocks: list[int]  # the whole block table covering the prompt
