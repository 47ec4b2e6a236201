"""What the HTTP layer and the orchestrator exchange: a tokenized request in, token events out."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdd.shared.pipelines import HandoffMode, Pipeline
from pdd.shared.protocol import SamplingSpec, TokenLogprobs


class GenerationError(Exception):
    """A request failed; ``http_status`` and ``code`` go into the OpenAI-shaped error body."""

    def __init__(self, http_status: int, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.http_status = http_status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # sent as Retry-After: the condition is expected to pass


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    deadline_unix: float
    forced_pipeline: Pipeline | None = None
    forced_handoff: HandoffMode | None = None
    return_token_ids: bool = False  # put the output token ids into the final event's info


@dataclass
class TokenEvent:
    """New output tokens, in order, each position exactly once. The last event has finish_reason."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | None
    info: dict = field(default_factory=dict)  # on the last event: pipeline, instances, hit rates, handoff
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token id when the request asked
    received: float = 0.0  # time.monotonic() when the router took these tokens off the bus (0: not from the bus)


class EventQueue(asyncio.Queue):
    """A generation's events. Until a consumer is attached it is a plain queue (the HTTP layer awaits the first
    event, so an early error still gets a real HTTP status); once attached, ``put_nowait`` hands each item straight
    to the consumer, in the producer's call (the bus callback): no queue and no task switch per token."""

    _consumer: Callable[[Any], None] | None = None

    def put_nowait(self, item: Any) -> None:
        consumer = self._consumer
        if consumer is None:
            super().put_nowait(item)
        else:
            consumer(item)

    def attach(self, consumer: Callable[[Any], None]) -> None:
        """Hand the items already queued, in order, then every later one to ``consumer``, which must not raise."""
        while not self.empty():
            consumer(self.get_nowait())
        self._consumer = consumer


@dataclass
class Generation:
    """A generation whose producer fills the consumer's queue itself (the orchestrator: from the bus callback).
    ``events`` carries TokenEvents (the last with finish_reason), or an exception instance; cancelling ``task``
    stops the generation and cancels the request everywhere."""

    events: EventQueue
    task: asyncio.Task
