"""End to end through real processes: every pipeline is token-identical to one engine alone."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from tests.e2e.conftest import start_system

PIPELINES = [("P-MD", None), ("P-RLD-MD", "one-shot"), ("P-RLD-MD", "catch-up"), ("P-RLD", None)]


@pytest.fixture(scope="module")
def system(tmp_path_factory, nats_url, tiny_model):
    sys_ = start_system(tmp_path_factory.mktemp("pdd"), nats_url, tiny_model)
    yield sys_
    sys_.stop()


@pytest.fixture(scope="module")
def reference(tiny_model):
    from pdd.shared.engine import Engine

    return Engine.from_model(tiny_model, kv_memory_bytes=8 << 20, num_threads=1)


def session_prompts(n_sessions: int = 10, turns: int = 5, seed: int = 7) -> list[list[int]]:
    """Multi-turn sessions: each turn extends the previous prompt, so hit rates are mixed (first turns miss)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n_sessions):
        prompt = [rng.randrange(5, 380) for _ in range(rng.randrange(20, 60))]
        for _ in range(turns):
            prompts.append(list(prompt))
            prompt = prompt + [rng.randrange(5, 380) for _ in range(rng.randrange(8, 40))]
    return prompts


def complete(system, prompt: list[int], pipeline: str, handoff: str | None, max_tokens: int = 24) -> dict:
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "pdd": {"pipeline": pipeline, "return_token_ids": True, **({"handoff": handoff} if handoff else {})}}
    r = httpx.post(system.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("pipeline, handoff", PIPELINES)
def test_pipeline_matches_single_engine(system, reference, pipeline, handoff):
    from pdd.shared.engine import SamplingParams

    prompts = session_prompts()
    expected = reference.generate(prompts, SamplingParams(), max_new_tokens=24)
    for prompt, want in zip(prompts, expected):
        body = complete(system, prompt, pipeline, handoff)
        got = body["choices"][0]
        info = body["pdd"]
        assert info["pipeline"] == pipeline
        assert info["token_ids"] == want, (pipeline, handoff, len(prompt))
        assert body["usage"]["completion_tokens"] == len(want)
