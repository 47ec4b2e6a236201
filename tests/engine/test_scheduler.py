"""The step plan: a long prompt's chunks leave room for the requests queued behind it."""

from __future__ import annotations

import pytest

from pdd.engine import SamplingParams

from .conftest import make_engine

LONG = [i % 190 + 3 for i in range(200)]
SHORT = [i % 190 + 7 for i in range(10)]


def _first_token_step(engine) -> dict[str, int]:
    """The step at which each request's first token came out; the short request arrives one step after
    the long one started."""
    engine.add_request("long", LONG, SamplingParams(ignore_eos=True), max_new_tokens=2)
    engine.step()
    engine.add_request("short", SHORT, SamplingParams(ignore_eos=True), max_new_tokens=2)
    first: dict[str, int] = {}
    step = 1
    while engine.has_work():
        step += 1
        for out in engine.step():
            if out.token_ids:
                first.setdefault(out.rid, step)
    return first


def test_a_long_prompt_shares_each_step_with_the_requests_behind_it(llama_path):
    capped = _first_token_step(make_engine(llama_path, max_prefill_tokens=64, prefill_chunk_tokens=16))
    assert capped["short"] == 2  # admitted beside the long prompt's next chunk
    assert capped["long"] == 13  # 200 tokens in chunks of 16
    # contrast: with the whole step budget per request, the short one waits out the long prefill
    whole = _first_token_step(make_engine(llama_path, max_prefill_tokens=64, prefill_chunk_tokens=64))
    assert whole["short"] == whole["long"] == 4


def test_prefill_chunk_tokens_must_be_positive(llama_path):
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        make_engine(llama_path, prefill_chunk_tokens=0)


def test_a_recompute_runs_its_prompt_then_its_known_outputs(llama_path):
    """A migrated request's known outputs are not computed in its prompt's pass (which attends in fp32), but
    as an extend of output tokens after it (float64, as the decode steps that produced them): one pass over
    both made a relay's bf16 resume drift from the undisturbed run (Scheduler.chunk)."""
    engine = make_engine(llama_path)
    known = [i % 190 + 5 for i in range(30)]
    engine.add_request("resumed", SHORT, SamplingParams(ignore_eos=True), max_new_tokens=32, known_outputs=known)
    plans, schedule = [], engine.scheduler.schedule

    def recorded():
        decode, prefill = schedule()
        plans.append([n for _, n in prefill] or ["decode"])
        return decode, prefill

    engine.scheduler.schedule = recorded
    engine.step(), engine.step(), engine.step()
    assert plans == [[len(SHORT)], [len(known)], ["decode"]]
