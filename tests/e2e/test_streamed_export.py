"""P streams a prompt's KV while its prefill runs (roles/kv_export.py): each prefill chunk's finished blocks go
to MD and to the relay at once, while later chunks compute.

Real processes (router, P, RLD, MD), real NATS, zmq WAN behind the shaper's delay; the torch engine prefills in
chunks of 512 tokens (its default), so a prompt of 900 tokens is two chunks.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from pdd.roles.kv_export import BLOCKS_FINAL_EVENT
from pdd.shared.pipelines import Pipeline
from tests.e2e.test_pipelines import body_for, wait_for_spans, wait_no_kv_held

PROMPT_TOKENS = 900  # two prefill chunks of the torch engine's 512
ATTEMPTS = 3  # the first chunk goes out at once only if MD's import plan is back by then (a NATS round trip)


def long_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 380) for _ in range(PROMPT_TOKENS)]


def spans_of(system, rid: str) -> dict[str, dict]:
    """The request's prefill and WAN transfer spans, by name."""
    spans = {}
    for name in ("prefill", "kv.transfer.wan"):
        spans[name] = wait_for_spans(system, lambda s, n=name: s["name"] == n
                                     and s["attributes"].get("request_id") == rid)[-1]
    return spans


@pytest.mark.parametrize("pipeline", [Pipeline.P_MD, Pipeline.P_RLD_MD])
def test_kv_streams_while_the_prefill_runs(system, reference, pipeline):
    """The WAN transfer starts before the prefill ends, in one send per chunk, and the answer is one engine's."""
    from pdd.engine import SamplingParams

    for attempt in range(ATTEMPTS):
        prompt = long_prompt(seed=attempt + 10 * list(Pipeline).index(pipeline))
        body = body_for(prompt, pipeline, ignore_eos=True)
        body["max_tokens"] = 24
        r = httpx.post(system.base_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        want = reference.generate([prompt], SamplingParams(ignore_eos=True), max_new_tokens=24)[0]
        assert out["pdd"]["token_ids"] == want
        spans = spans_of(system, out["id"])
        wan, prefill = spans["kv.transfer.wan"], spans["prefill"]
        assert wan["attributes"]["blocks"] == -(-PROMPT_TOKENS // 16)  # MD had none of this prompt
        # the span marks when each chunk's KV became final (the benchmark's KV-ready floor is computed from these)
        assert [e["attributes"]["tokens"] for e in prefill.get("events") or []
                if e["name"] == BLOCKS_FINAL_EVENT] == [512, PROMPT_TOKENS]
        if wan["attributes"]["sends"] >= 2 and wan["start_ns"] < prefill["end_ns"]:
            return
    pytest.fail(f"the KV never streamed: last transfer {wan['attributes']}, {wan['start_ns']=} "
                f"{prefill['end_ns']=}")


def test_hanging_up_mid_transfer_leaves_no_kv_anywhere(system):
    """Clients that hang up while P prefills and streams (at several moments) leave no block held on any side."""
    async def hang_up_after(delay_s: float, seed: int) -> None:
        body = body_for(long_prompt(seed), Pipeline.P_RLD_MD, ignore_eos=True)
        async with httpx.AsyncClient(timeout=60) as client:
            try:
                await asyncio.wait_for(client.post(system.base_url + "/v1/completions", json=body), delay_s)
            except TimeoutError:
                pass

    async def run() -> None:
        await asyncio.gather(*(hang_up_after(d, 100 + i) for i, d in enumerate((0.02, 0.05, 0.1, 0.2, 0.4))))
    asyncio.run(run())
    wait_no_kv_held(system, 20, "after the clients hung up mid-transfer")


@pytest.fixture(scope="module")
def lossless_system(tmp_path_factory, tiny_model):
    """The torch system with the WAN's codec `lossless` on a slow emulated line (20 Mbit/s), where compressing
    pays, on its own nats-server."""
    from pdd.launch.natsserver import start_nats_server
    from tests.e2e.conftest import start_system

    nats = start_nats_server()
    try:
        system = start_system(tmp_path_factory.mktemp("pdd-lossless"), nats.url, tiny_model,
                              wan_options={"shape": {"rate": "20mbit", "delay": "20ms"}}, wan_codec="lossless")
        yield system
        system.stop()
    finally:
        nats.stop()


def test_a_lossless_wan_gives_the_same_tokens_and_says_so(lossless_system, reference):
    """KV streamed through byte shuffle + zstd: every token as one engine alone, the response names the codec, and
    P's WAN bytes are the coded ones (fewer than the KV they carry)."""
    from pdd.engine import SamplingParams

    codecs = set()
    for seed in range(3):
        prompt = long_prompt(seed=50 + seed)
        body = body_for(prompt, Pipeline.P_MD, ignore_eos=True)
        body["max_tokens"] = 16
        r = httpx.post(lossless_system.base_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        info = r.json()["pdd"]
        assert info["token_ids"] == reference.generate([prompt], SamplingParams(ignore_eos=True),
                                                       max_new_tokens=16)[0]
        codecs.add(info["kv_codec"])
        wan = spans_of(lossless_system, r.json()["id"])["kv.transfer.wan"]["attributes"]
        assert wan["codec"] == info["kv_codec"]
        if info["kv_codec"] == "lossless":
            assert wan["bytes"] < wan["kv_bytes"]
    assert codecs <= {"lossless", "lossless(partial)", "none"} and codecs & {"lossless", "lossless(partial)"}
