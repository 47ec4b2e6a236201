"""End to end through real processes (router, P, RLD, MD; real NATS, zmq WAN, ucx fast path).

The WAN carries an in-process shaper delay, so MD's KV lands after the relay has started: handoffs
happen mid-stream, as across real datacenters.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import httpx
import pytest

from pdd.shared.pipelines import ROUTABLE, HandoffMode, Pipeline, spec
from tests.e2e.conftest import until_handed_over

# every routable pipeline, and each handoff mode where the pipeline hands over
PIPELINES = [(p, mode) for p in ROUTABLE for mode in (list(HandoffMode) if spec(p).hands_over else [None])]
MAX_TOKENS = 400  # long enough that MD's KV lands mid-stream (the tiny model decodes fast)


def sessions(n_sessions: int, turns: int, seed: int) -> list[list[list[int]]]:
    """Multi-turn sessions: each turn extends the previous prompt, so hit rates are mixed (first turns miss)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_sessions):
        prompt = [rng.randrange(5, 380) for _ in range(rng.randrange(20, 60))]
        turns_ = []
        for _ in range(turns):
            turns_.append(list(prompt))
            prompt = prompt + [rng.randrange(5, 380) for _ in range(rng.randrange(8, 40))]
        out.append(turns_)
    return out


def body_for(prompt: list[int], pipeline: str | None, handoff: str | None = None, **extra) -> dict:
    pdd = {"return_token_ids": True}
    if pipeline:
        pdd["pipeline"] = pipeline
    if handoff:
        pdd["handoff"] = handoff
    return {"model": "model", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "pdd": pdd, **extra}


async def run_sessions(base_url: str, all_sessions, pipeline, handoff) -> list[tuple[list[int], dict]]:
    results = []

    async def one_session(client: httpx.AsyncClient, turns):
        for prompt in turns:
            r = await client.post(base_url + "/v1/completions",
                                  json=body_for(prompt, pipeline, handoff, ignore_eos=True))
            assert r.status_code == 200, r.text
            results.append((prompt, r.json()))

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(one_session(client, s) for s in all_sessions))
    return results


@pytest.mark.parametrize("pipeline, handoff", PIPELINES)
def test_pipeline_matches_single_engine(fleet, pipeline, handoff):
    """50 prompts (10 sessions x 5 turns) per pipeline, token-for-token equal to one engine alone, on each
    backend; torch: in the dtype the system serves (`auto`: bf16 or fp32 by the CPU; the `reference` fixture
    resolves the same)."""
    from pdd.engine import SamplingParams

    system, reference = fleet

    all_sessions = sessions(10, 5, seed=PIPELINES.index((pipeline, handoff)))
    results = asyncio.run(run_sessions(system.base_url, all_sessions, pipeline, handoff))
    assert len(results) == 50
    prompts = [p for p, _ in results]
    expected = reference.generate(prompts, SamplingParams(ignore_eos=True), max_new_tokens=MAX_TOKENS)
    handed_over = 0
    for (prompt, body), want in zip(results, expected):
        info = body["pdd"]
        assert info["pipeline"] == pipeline
        assert info["token_ids"] == want, (pipeline, handoff, len(prompt))
        assert body["usage"]["completion_tokens"] == len(want)
        if handoff and info.get("handoff_mode"):
            assert info["handoff_mode"] == handoff
            handed_over += 1
    if handoff:
        assert handed_over > 0, "no request was handed over to MD"


def test_eager_tokens_reach_client_before_md_kv_lands(system):
    """P-RLD-MD over a slow WAN: relay tokens are emitted to the client before MD even has the KV."""
    warm = httpx.post(system.base_url + "/v1/completions", json=body_for([5, 6, 7], "P-RLD-MD"), timeout=60)
    assert warm.status_code == 200  # first use opens the ucx/zmq links; measure a request on warm links
    body = body_for(list(range(7, 7 + 90)), "P-RLD-MD", "catch-up", stream=True, ignore_eos=True)
    body["max_tokens"] = 900  # long enough that MD takes over (the tiny model decodes ~0.5-5 ms/token)

    def stream() -> dict:
        """The request's id and its `pdd` block."""
        seen = {"pdd": {}}
        with httpx.Client(timeout=60) as client, client.stream("POST", system.base_url + "/v1/completions",
                                                               json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    seen["id"] = chunk["id"]
                    seen["pdd"] = chunk.get("pdd") or seen["pdd"]
        return seen

    request_id = until_handed_over(stream, lambda seen: seen["pdd"])["id"]
    md_landed = wait_for_spans(system, lambda s: s["name"] == "kv.receive" and s["service"] == "pdd-main-decode"
                               and s["attributes"].get("request_id") == request_id)[-1]["end_ns"]
    root = wait_for_spans(system, lambda s: s["name"] == "router.request"
                          and s["attributes"].get("request_id") == request_id)[-1]
    before = [e for e in root["events"] if e["name"] == "tokens" and e["ts_ns"] < md_landed]
    assert before and before[-1]["attributes"]["relay_tokens"] >= 2, root["events"][:5]
    assert root["attributes"]["output_tokens"] == 900


def wait_for_spans(system, predicate, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = system.root / "spans.jsonl"
        if path.exists():
            found = [s for s in (json.loads(x) for x in path.read_text().splitlines() if x) if predicate(s)]
            if found:
                return found
        time.sleep(0.2)
    raise AssertionError("span not found")


def metric_value(url: str, name: str) -> float:
    text = httpx.get(url, timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_second_turn_moves_only_new_kv_over_wan(system, reference):
    """Decode-side RadixCache: turn 2 reuses turn 1's KV at MD; only the new tokens' blocks cross.

    Bytes per block come from the KV layout P loaded (its dtype is what `auto` resolved to: bf16 KV is half
    of fp32's), which is the reference engine's layout too."""
    from pdd.shared.kv_layout import KVLayout

    p_metrics = system.procs["p-0"].wait_log("service_ready")["metrics"]
    layout = KVLayout.from_dict(system.procs["p-0"].wait_log("model_loaded")["layout"])
    assert layout == reference.layout, (layout, reference.layout)
    block_size = layout.block_size
    bytes_per_block = layout.bytes_per_block_per_tensor * 2 * layout.num_layers
    rng = random.Random(99)
    turn1 = [rng.randrange(5, 380) for _ in range(200)]
    before = metric_value(p_metrics, "pdd:wan_bytes_total")
    first = httpx.post(system.base_url + "/v1/completions", json=body_for(turn1, "P-MD"), timeout=60).json()
    mid = metric_value(p_metrics, "pdd:wan_bytes_total")
    answer = first["pdd"]["token_ids"]
    new = [rng.randrange(5, 380) for _ in range(20)]
    turn2 = turn1 + answer + new
    second = httpx.post(system.base_url + "/v1/completions", json=body_for(turn2, "P-MD"), timeout=60).json()
    after = metric_value(p_metrics, "pdd:wan_bytes_total")
    turn1_bytes, turn2_bytes = mid - before, after - mid
    assert turn1_bytes == -(-len(turn1) // block_size) * bytes_per_block
    # MD holds turn 1's prompt and answer in full blocks; only the rest crosses the WAN
    cached = (len(turn1) + len(answer) - 1) // block_size * block_size
    assert second["pdd"]["md_cached_tokens"] >= cached - block_size
    missing_blocks = -(-(len(turn2) - cached) // block_size)
    assert turn2_bytes <= (missing_blocks + 1) * bytes_per_block
    assert turn2_bytes * 4 < turn1_bytes


def test_prefill_heartbeat_reports_its_wan_backlog(system, nats_url):
    """What every router's WAN queue is made of (router/routing.py `wan_queue_s`): after a WAN transfer P's
    heartbeat carries a measured egress rate, and nothing left queued once the transfer is done."""
    from pdd.bench.soak import announced_summaries
    from pdd.shared.protocol import WAN_EGRESS_KEY, WAN_QUEUED_KEY

    prompt = [random.Random(7).randrange(5, 380) for _ in range(300)]
    r = httpx.post(system.base_url + "/v1/completions", json=body_for(prompt, "P-MD"), timeout=60)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while True:
        p = announced_summaries(nats_url).get("p-0", {})
        if p.get(WAN_EGRESS_KEY, 0) > 0 or time.monotonic() > deadline:
            break
    assert p.get(WAN_EGRESS_KEY, 0) > 0 and p.get(WAN_QUEUED_KEY) == 0.0, p


def test_openai_client_chat_and_completions(system):
    from openai import OpenAI

    client = OpenAI(base_url=system.base_url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello there"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello there"}],
                                            max_tokens=8, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content
    comp = client.completions.create(model=model, prompt="once upon a time", max_tokens=8, temperature=0)
    assert comp.usage.completion_tokens >= 1
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="once upon a time", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert text == comp.choices[0].text


@pytest.mark.parametrize("raw, status", [
    (b"{not json", 400),
    (json.dumps({"model": "model", "prompt": "hi", "max_tokens": "ten"}).encode(), 400),
    (json.dumps({"model": "model", "prompt": "hi", "max_tokens": 0}).encode(), 400),
    (json.dumps({"model": "model", "prompt": "hi", "max_tokens": -5}).encode(), 400),
    (json.dumps({"model": "nope", "prompt": "hi", "max_tokens": 4}).encode(), 404),
    (json.dumps({"model": "model", "prompt": list(range(5, 300)) * 4, "max_tokens": 4}).encode(), 400),
])
def test_bad_requests_get_openai_errors(system, raw, status):
    r = httpx.post(system.base_url + "/v1/completions", content=raw,
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]


def engines_idle(system) -> dict[str, dict]:
    out = {}
    for iid in ("p-0", "rld-0", "md-0"):
        eng = system.instance_health(iid)["engine"]
        out[iid] = eng
    return out


def wait_no_kv_held(system, timeout_s: float, what: str) -> None:
    """Until no engine runs, queues or holds a KV block beyond its cache; fails naming the busy ones."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = engines_idle(system)
        busy = {k: v for k, v in state.items()
                if v["running"] or v["waiting"] or v["free_blocks"] + v["cached_blocks"] != v["total_blocks"]}
        if not busy:
            return
        assert time.monotonic() < deadline, f"{what}: KV still held: {busy}"
        time.sleep(0.2)


def test_client_disconnect_cancels_and_frees_kv_everywhere(system):
    for pipeline in ROUTABLE:
        body = body_for(list(range(20, 120)), pipeline, HandoffMode.CATCH_UP if spec(pipeline).hands_over else None,
                        stream=True)
        body["max_tokens"] = 400
        body["ignore_eos"] = True
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", system.base_url + "/v1/completions", json=body) as r:
                got = 0
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        got += 1
                    if got >= 3:
                        break  # hang up mid-stream
        wait_no_kv_held(system, 15, f"{pipeline}, after the client disconnected")


def test_benchmark_client_times_every_output_position(system):
    """The one benchmark client against the real router: per-chunk token counts (continuous usage) give
    an arrival time for every output position, in order, whatever the chunking."""
    from pdd.loadgen.client import stream

    async def run():
        async with aiohttp.ClientSession() as session:
            body = body_for(list(range(30, 90)), Pipeline.P_RLD_MD, stream=True, ignore_eos=True)
            body.update(max_tokens=120, stream_options={"include_usage": True, "continuous_usage_stats": True})
            return await stream(session, system.base_url + "/v1/completions", body, timeout_s=120)

    s = asyncio.run(run())
    assert s.status == 200 and s.error is None and s.exception is None
    times = s.token_times()
    assert times is not None and len(times) == s.output_tokens == len(s.token_ids) == 120
    assert times == sorted(times) and times[0] > s.t_send
