"""The HTTP layer's stream (router/streaming.py): token events that are already queued when the
client's stream asks for the next one go out as one delta (one SSE event, its token count the positions it
carries); events that arrive one by one stay one delta each; events with logprobs are never merged; a stop
string or max_tokens inside merged events cuts at the same token as unmerged. With the tiny model's real
tokenizer."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdd.router.detokenize import IncrementalDetokenizer
from pdd.router.streaming import BackendStream, DeltaBuilder, text_deltas
from pdd.router.types import TokenEvent
from pdd.shared.protocol import TokenLogprobs

IDS = [300, 301, 302, 303, 304, 305]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from pdd.shared.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model)


async def _deltas(tokenizer, events: list[TokenEvent], gap_s: float, max_tokens: int = 100, stop=()) -> list:
    async def gen():
        for e in events:
            if gap_s:
                await asyncio.sleep(gap_s)
            yield e

    stream = BackendStream(gen(), "r", time.time() + 30)
    if not gap_s:
        for _ in range(3 * len(events)):  # let the pump queue everything first
            await asyncio.sleep(0)
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], stop=stop)
    out = [d async for d in text_deltas(stream, DeltaBuilder(detok, max_tokens))]
    await stream.close()
    return out


def _events(ids: list[int], logprobs: bool = False) -> list[TokenEvent]:
    lp = (lambda t: [TokenLogprobs(logprob=-0.5)]) if logprobs else (lambda t: [])
    return [TokenEvent([t], "length" if i == len(ids) - 1 else None, logprobs=lp(t)) for i, t in enumerate(ids)]


async def test_queued_events_make_one_delta_and_paced_ones_stay_apart(tokenizer) -> None:
    merged = await _deltas(tokenizer, _events(IDS), gap_s=0)
    paced = await _deltas(tokenizer, _events(IDS), gap_s=0.02)
    assert len(merged) == 1 and merged[0].token_ids == IDS and merged[0].completion_tokens == len(IDS)
    assert merged[0].finish_reason == "length"
    assert [d.completion_tokens for d in paced] == list(range(1, len(IDS) + 1))
    assert "".join(d.text for d in merged) == "".join(d.text for d in paced)  # the same text either way


async def test_events_with_logprobs_are_never_merged(tokenizer) -> None:
    deltas = await _deltas(tokenizer, _events(IDS, logprobs=True), gap_s=0)
    assert [len(d.token_ids) for d in deltas] == [1] * len(IDS)
    assert all(len(d.logprobs) == 1 for d in deltas)


async def test_max_tokens_cuts_merged_events_at_the_same_token(tokenizer) -> None:
    merged = await _deltas(tokenizer, _events(IDS), gap_s=0, max_tokens=4)
    assert merged[-1].finish_reason == "length" and merged[-1].completion_tokens == 4
    assert [t for d in merged for t in d.token_ids] == IDS[:4]
