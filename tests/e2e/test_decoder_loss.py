"""Decoder loss never strands a request while any decoder lives (issue 17).

One instance per role, as `pdd up` starts them: router-0, p-0, rld-0 and md-0 as real processes on
the tiny model. A greedy stream loses its main decoder to ``kill -9`` mid-stream and must end with
the same token ids as an undisturbed run of the same request, resumed on the relay (local finish by
extend from the token ids streamed so far); the response's `pdd` block and the router's metrics say
so. With no decoder left the client gets a clear error, not a hang.

Each fault is checked to land mid-stream: it is injected only after the client has streamed
``MIN_TOKENS`` tokens and while the victim reports the request in flight, and the `pdd` block shows the
resume point inside the output and the killed instance as the one the request left.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from pdd.loadgen.client import Stream, stream
from pdd.loadgen.scrape import samples_of, scrape_sync
from pdd.launch.local_cluster import LocalCluster, http_json, two_site_layout
from pdd.shared.pipelines import HandoffMode, Pipeline
from pdd.shared.roles import Role
from tests.e2e.conftest import EMULATION

MAX_TOKENS = 300  # long enough to still be streaming when the fault lands
# after a handoff the fault must wait for MD to own the request (health polled every 50 ms): the tiny model's
# ~0.5 ms/token would finish 300 tokens first now and then, so that stream is longer (the model's context 1024)
AFTER_HANDOFF_TOKENS = 900
MIN_TOKENS = 16  # streamed before the fault
REQUEST_TIMEOUT_S = 60.0
PROMPT = "alpha beta gamma river stone cloud paper light green north market table window"


@pytest.fixture(scope="module", params=["torch", "emulated"])
def cluster(request, tmp_path_factory, tiny_model):
    """The fleet on each engine backend (emulated: the small profile, tests/e2e/conftest.py)."""
    config = {
        "model": {"backend": request.param, "path": str(tiny_model), "kv_memory_mb": 8, "block_size": 16,
                  "max_num_seqs": 32, "threads": 1},
        "emulation": EMULATION,
        **two_site_layout(prefill=1, relay=1, main_decode=1),
        "transports": {"fast": {"name": "zmq", "options": {}},
                       "wan": {"name": "zmq", "options": {"streams": 2, "shape": {"delay": "20ms"}}}},
        "router": {"request_timeout_s": REQUEST_TIMEOUT_S},
        "service": {"heartbeat_ms": 500, "missed_heartbeats": 3, "drain_timeout_s": 30},
        "telemetry": {"exporter": "none", "log_format": "json"},
    }
    with LocalCluster(tmp_path_factory.mktemp("decoder-loss"), config) as c:
        c.start()
        yield c


@pytest.fixture
def fleet(cluster: LocalCluster) -> LocalCluster:
    """Every instance alive and known to the router as ready (a test before may have killed some)."""
    for member in list(cluster.members.values()):
        if not member.alive:
            member.stop()  # close its log
            cluster.spawn(member.instance_id)
    cluster.wait_ready()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen = {i["instance"]: i for i in http_json(cluster.base_url + "/health")[1].get("instances", [])}
        if all(iid in seen and seen[iid]["state"] == "ready" and seen[iid]["confirmed"]
               for iid in cluster.members if iid != "router-0"):
            return cluster
        time.sleep(0.2)
    raise TimeoutError("the router does not see every instance ready")


def _body(pipeline: Pipeline, handoff: HandoffMode | None = None, max_tokens: int = MAX_TOKENS) -> dict:
    pdd = {"return_token_ids": True, "pipeline": pipeline.value}
    if handoff is not None:
        pdd["handoff"] = handoff.value
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "pdd": pdd,  # usage on every chunk: MIN_TOKENS counts tokens, also when several share a chunk (load)
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def _in_flight(cluster: LocalCluster, instance_id: str) -> int:
    health = await asyncio.to_thread(cluster.members[instance_id].health)
    return int(health.get("in_flight", -1))


async def _run(cluster: LocalCluster, body: dict,
               fault: Callable[[asyncio.Task], Awaitable[None]] | None = None) -> Stream:
    """Stream ``body``; once ``MIN_TOKENS`` have arrived, ``fault`` runs while the stream goes on."""
    reached = asyncio.Event()

    def on_chunk(s: Stream, _chunk) -> None:
        if s.streamed_tokens >= MIN_TOKENS:
            reached.set()

    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(stream(session, cluster.base_url + "/v1/completions", body,
                                          timeout_s=REQUEST_TIMEOUT_S + 30, on_chunk=on_chunk))
        if fault is not None:
            waiter = asyncio.create_task(reached.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            assert not task.done(), "the stream ended before the fault could land"
            await fault(task)
        return await task


def _kill_holding(cluster: LocalCluster, victims: list[str]):
    """A fault: kill -9 of ``victims`` at once, after checking the first holds the request (mid-stream)."""
    async def fault(task: asyncio.Task) -> None:
        assert await _in_flight(cluster, victims[0]) >= 1, f"{victims[0]} does not hold the request"
        assert not task.done()
        for iid in victims:
            cluster.members[iid].kill()
    return fault


def _resumes(cluster: LocalCluster, role: Role) -> float:
    text = scrape_sync(cluster.base_url + "/metrics")
    return sum(v for labels, v in samples_of(text, "pdd:request_migrations_total")
               if labels.get("kind") == "resume" and labels.get("reason") == "decoder_lost"
               and labels.get("role") == role)


def _assert_resumed_on_relay(done: Stream, reference: Stream, cluster: LocalCluster, lost: str,
                             max_tokens: int = MAX_TOKENS) -> dict:
    assert done.status == 200 and done.error is None and done.exception is None and not done.timed_out, done.error
    assert done.finish_reason == "length"
    assert len(reference.token_ids) == max_tokens
    assert done.token_ids == reference.token_ids  # identical to the undisturbed run (greedy)
    info = done.info
    assert info["resumed_on"] == "rld-0" and info["resumed_on_role"] == Role.RELAY
    [move] = info["failovers"]
    assert move["kind"] == "resume" and move["reason"] == "decoder_lost" and move["left"] == lost
    assert move["to"] == "rld-0" and move["role"] == Role.RELAY
    assert MIN_TOKENS <= move["at"] < max_tokens  # the kill landed mid-stream
    assert info["resumed_at"] == move["at"]  # the relay continued from exactly there
    assert cluster.wait_idle() == {m.instance_id: 0 for m in cluster.engine_members()}  # no leaked KV block
    return move


def test_only_main_decode_killed_stream_finishes_on_relay(fleet):
    """P-MD, the one MD killed mid-stream: the relay resumes it from the streamed token ids."""
    body = _body(Pipeline.P_MD)
    reference = asyncio.run(_run(fleet, body))
    assert reference.info["main_decode"] == "md-0"
    before = _resumes(fleet, Role.RELAY)
    done = asyncio.run(_run(fleet, body, _kill_holding(fleet, ["md-0"])))
    assert done.info["pipeline"] == Pipeline.P_MD and done.info["main_decode"] == "md-0"
    _assert_resumed_on_relay(done, reference, fleet, lost="md-0")
    assert _resumes(fleet, Role.RELAY) == before + 1


def test_main_decode_killed_after_handoff_finishes_on_relay(fleet):
    """P-RLD-MD: the relay handed over (it holds nothing any more), then MD is killed mid-stream.

    The fault waits for MD to own the request (both /health endpoints polled together); on the tiny model a
    stream can still end first now and then (it decodes ~0.5 ms/token), so the run is retried (at most 3
    times) until the kill lands, and every check applies to the run where it did."""
    body = _body(Pipeline.P_RLD_MD, HandoffMode.ONE_SHOT, AFTER_HANDOFF_TOKENS)
    reference = asyncio.run(_run(fleet, body))
    landed: list[bool] = []

    async def after_handoff(task: asyncio.Task) -> None:
        while not task.done():  # MD owns the request once the relay no longer holds it
            rld, md = await asyncio.gather(_in_flight(fleet, "rld-0"), _in_flight(fleet, "md-0"))
            if rld == 0 and md >= 1 and not task.done():
                fleet.members["md-0"].kill()
                landed.append(True)
                return
            await asyncio.sleep(0.01)

    for _ in range(3):
        done = asyncio.run(_run(fleet, body, after_handoff))
        if landed:
            break
    assert landed, "the stream always ended before MD owned it: the fault never landed"
    assert done.info["pipeline"] == Pipeline.P_RLD_MD and done.info["handoff_mode"] == HandoffMode.ONE_SHOT
    move = _assert_resumed_on_relay(done, reference, fleet, lost="md-0", max_tokens=AFTER_HANDOFF_TOKENS)
    assert move["at"] > done.info["rld_tokens"]  # MD had taken over before it was killed


def test_no_decoder_left_is_a_clear_error(fleet):
    """MD and the relay killed together mid-stream: the stream ends with 503 no_decode, not at its deadline."""
    before = scrape_sync(fleet.base_url + "/metrics")
    done = asyncio.run(_run(fleet, _body(Pipeline.P_MD), _kill_holding(fleet, ["md-0", "rld-0"])))
    assert not done.timed_out and done.exception is None
    assert done.status == 200 and done.finish_reason is None  # headers went out with the first token: error in-band
    assert done.error["code"] == "no_decode", done.error
    assert "no decode instance is left to resume the request on" in done.error["message"]
    assert "md-0" in done.error["message"]  # it names what was given up on
    after = scrape_sync(fleet.base_url + "/metrics")
    errors = [sum(v for labels, v in samples_of(text, "pdd:request_errors_total") if labels.get("code") == "no_decode")
              for text in (before, after)]
    assert errors[1] == errors[0] + 1
    assert fleet.wait_idle() == {"p-0": 0}  # the prefill, the one engine left, holds no block
