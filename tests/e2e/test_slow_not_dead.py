"""Slow is not dead: an instance frozen (SIGSTOP) for 2 s under load is only suspected by the router (no new
work, its requests kept), so nothing fails and nothing migrates; frozen past `service.suspect_timeout_s` it
is declared lost and its requests migrate, as a killed one's do. A request that arrives while the one prefill
is frozen waits for it (router.instance_wait_s) instead of failing with 503.

Real processes (router-0, p-0, rld-0, md-0) on the tiny model, heartbeats 500 ms, 3 missed beats (1.5 s: a
2 s freeze is past it), the default 5 s suspicion."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest

from pdd.launch.local_cluster import LocalCluster, http_json, two_site_layout
from pdd.loadgen.client import Stream, stream
from pdd.loadgen.scrape import samples_of, scrape_sync
from pdd.shared.pipelines import Pipeline

MAX_TOKENS = 300
STREAMS = 4
FREEZE_S = 2.0
PROMPTS = [f"alpha beta gamma river stone cloud paper light {i} green north market table window" for i in range(STREAMS)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    config = {
        "model": {"path": str(tiny_model), "kv_memory_mb": 8, "block_size": 16, "max_num_seqs": 32, "threads": 1},
        **two_site_layout(prefill=1, relay=1, main_decode=1),
        "transports": {"fast": {"name": "zmq", "options": {}},
                       "wan": {"name": "zmq", "options": {"streams": 2, "shape": {"delay": "20ms"}}}},
        "router": {"request_timeout_s": 90.0},
        "service": {"heartbeat_ms": 500, "missed_heartbeats": 3, "drain_timeout_s": 30},
        "telemetry": {"exporter": "none", "log_format": "json"},
    }
    with LocalCluster(tmp_path_factory.mktemp("slow-not-dead"), config) as c:
        c.start()
        yield c


def _all_ready(cluster: LocalCluster) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen = {i["instance"]: i for i in http_json(cluster.base_url + "/health")[1].get("instances", [])}
        if all(iid in seen and seen[iid]["state"] == "ready" and seen[iid]["confirmed"] and not seen[iid]["suspected"]
               for iid in cluster.members if iid != "router-0"):
            return
        time.sleep(0.2)
    raise TimeoutError("the router does not see every instance ready")


def _body(prompt: str, pipeline: Pipeline) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True,
            "pdd": {"return_token_ids": True, "pipeline": pipeline.value}}


def _migrations(cluster: LocalCluster) -> float:
    return sum(v for _, v in samples_of(scrape_sync(cluster.base_url + "/metrics"), "pdd:request_migrations_total"))


async def _streams(cluster: LocalCluster, pipeline: Pipeline, freeze: str | None = None, freeze_s: float = FREEZE_S,
                   before_first: bool = False) -> list[Stream]:
    """STREAMS concurrent greedy streams; ``freeze`` is SIGSTOPped for ``freeze_s`` once they stream (or, with
    ``before_first``, before they are sent, so they arrive while it is frozen), then SIGCONTed."""
    member = cluster.members[freeze] if freeze else None
    started = asyncio.Event()

    def on_chunk(s: Stream, _chunk) -> None:
        if s.streamed_tokens >= 16:
            started.set()

    async def freeze_for() -> None:
        member.kill(signal.SIGSTOP)
        try:
            await asyncio.sleep(freeze_s)
        finally:
            member.kill(signal.SIGCONT)

    async with aiohttp.ClientSession() as session:
        if member is not None and before_first:
            pause = asyncio.create_task(freeze_for())
            await asyncio.sleep(1.8)  # past the missed beats: the router already suspects it
        tasks = [asyncio.create_task(stream(session, cluster.base_url + "/v1/completions", _body(p, pipeline),
                                            timeout_s=120, on_chunk=on_chunk)) for p in PROMPTS]
        if member is not None and not before_first:
            await asyncio.wait_for(started.wait(), 60)
            pause = asyncio.create_task(freeze_for())
        done = await asyncio.gather(*tasks)
        if member is not None:
            await pause
    return done


def _assert_complete(done: list[Stream], reference: list[Stream]) -> None:
    for d, ref in zip(done, reference):
        assert d.status == 200 and d.error is None and d.exception is None and not d.timed_out, (d.status, d.error)
        assert d.finish_reason == "length" and d.token_ids == ref.token_ids


@pytest.mark.parametrize("victim, pipeline", [("md-0", Pipeline.P_MD), ("rld-0", Pipeline.P_RLD),
                                              ("p-0", Pipeline.P_MD)])
def test_a_two_second_freeze_fails_nothing_and_moves_nothing(cluster, victim, pipeline):
    _all_ready(cluster)
    reference = asyncio.run(_streams(cluster, pipeline))
    before = _migrations(cluster)
    lost_before = cluster.members["router-0"].log_event("instance_lost")
    # a frozen prefill is frozen before the requests come: they find no live prefill and wait for it
    done = asyncio.run(_streams(cluster, pipeline, freeze=victim, before_first=victim == "p-0"))
    _assert_complete(done, reference)
    assert _migrations(cluster) == before
    assert cluster.members["router-0"].log_event("instance_lost") == lost_before
    assert cluster.members["router-0"].log_event("instance_suspected") is not None  # the freeze was noticed
    assert cluster.wait_idle() == {m.instance_id: 0 for m in cluster.engine_members()}


def test_frozen_past_the_suspicion_timeout_migrates(cluster):
    """md-0 frozen 1.5 s + 5 s + margin: declared lost, its streams resume on the relay, identical."""
    _all_ready(cluster)
    reference = asyncio.run(_streams(cluster, Pipeline.P_MD))
    before = _migrations(cluster)
    done = asyncio.run(_streams(cluster, Pipeline.P_MD, freeze="md-0", freeze_s=9.0))
    _assert_complete(done, reference)
    assert _migrations(cluster) >= before + 1
    assert any(d.info.get("failovers") for d in done)
    _all_ready(cluster)  # md-0 beats again after SIGCONT and is offered work again
    assert cluster.wait_idle() == {m.instance_id: 0 for m in cluster.engine_members()}
