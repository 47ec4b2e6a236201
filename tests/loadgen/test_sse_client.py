"""The one SSE client (loadgen/client.py `stream`) against a real aiohttp SSE server started in the test:
per-position arrival times from the chunks' token counts, abort after N tokens or seconds, timeouts,
the response's `pdd` block, errors as results."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from pdd.loadgen.client import stream
from pdd.loadgen.scrape import parse, samples_of
from tests.loadgen.servers import serving

GAP = 0.05  # server-side pause between chunks



def _sse(obj) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


async def completions(request: web.Request) -> web.StreamResponse:
    """Test-only body fields: ``chunks`` (tokens per chunk), ``counts`` ("token_ids" per choice as vLLM's
    return_token_ids, "usage" cumulative per chunk as continuous_usage_stats, or "none" as PDD's router
    today), ``fail`` ("http" | "inband")."""
    body = await request.json()
    if body.get("fail") == "http":
        return web.json_response({"error": {"message": "no", "code": "bad_request"}}, status=400)
    sizes, counts = body.get("chunks", [1, 1]), body.get("counts", "none")
    ids = list(range(100, 100 + sum(sizes)))
    info = {"pipeline": "P-RLD-MD", "main_decode": "md-0", "token_ids": ids}
    if not body.get("stream"):
        return web.json_response({"id": "cmpl-1", "choices": [{"index": 0, "text": "x" * len(ids),
                                                                "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": len(ids)}, "pdd": info})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    sent = 0
    for i, n in enumerate(sizes):
        await asyncio.sleep(GAP)
        if body.get("fail") == "inband" and i == 1:
            await resp.write(_sse({"error": {"message": "boom", "code": "internal"}}))
            await resp.write(_sse("[DONE]"))
            return resp
        last = i == len(sizes) - 1
        choice = {"index": 0, "text": "ab" * n, "finish_reason": "length" if last else None}
        chunk = {"id": "cmpl-1", "choices": [choice], "usage": None}
        if counts == "token_ids":
            choice["token_ids"] = ids[sent:sent + n]
        elif counts == "usage":
            chunk["usage"] = {"prompt_tokens": 3, "completion_tokens": sent + n}
        sent += n
        if last:
            chunk["pdd"] = info
        await resp.write(_sse(chunk))
    await resp.write(_sse({"id": "cmpl-1", "choices": [], "pdd": info,
                           "usage": {"prompt_tokens": 3, "completion_tokens": sent}}))
    await resp.write(_sse("[DONE]"))
    return resp


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text='# TYPE pdd:wan_link_up gauge\npdd:wan_link_up{main_decode="md-0"} 0.0\n'
                             'pdd:wan_link_up{main_decode="md-1"} 1.0\n')


@pytest.fixture
async def base():
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    async with serving(app) as base:
        yield base


async def _go(base: str, **kw):
    body = {k: kw.pop(k) for k in ("chunks", "counts", "fail") if k in kw}
    async with aiohttp.ClientSession() as session:
        return await stream(session, base + "/v1/completions",
                            {"prompt": [1, 2, 3], "stream": kw.pop("stream_", True), **body}, **kw)


@pytest.mark.parametrize("counts", ["token_ids", "usage"])
async def test_multi_token_chunks_give_each_position_its_chunks_arrival(base, counts):
    sizes = [1, 3, 2, 4]
    s = await _go(base, chunks=sizes, counts=counts)
    assert s.status == 200 and s.done and s.error is None and s.exception is None
    content = s.content_chunks
    assert [c.tokens for c in content] == sizes
    times = s.token_times()
    assert times is not None and len(times) == sum(sizes) == s.output_tokens
    # position p arrives with the chunk that carried it: 0 | 1 2 3 | 4 5 | 6 7 8 9
    expected = [content[0].t] + [content[1].t] * 3 + [content[2].t] * 2 + [content[3].t] * 4
    assert times == expected
    assert times == sorted(times)
    assert times[-1] - s.t_send >= len(sizes) * GAP * 0.9  # the server paused before every chunk
    assert s.info["main_decode"] == "md-0" and s.info["pipeline"] == "P-RLD-MD"
    assert s.token_ids == list(range(100, 110)) and s.id == "cmpl-1" and s.finish_reason == "length"


async def test_without_per_chunk_counts_positions_only_when_unambiguous(base):
    one_each = await _go(base, chunks=[1, 1, 1], counts="none")  # total 3 over 3 text chunks: exact
    assert one_each.token_times() == [c.t for c in one_each.content_chunks]
    several = await _go(base, chunks=[1, 3, 2], counts="none")  # 6 tokens in 3 chunks: unknown split
    assert several.token_times() is None
    assert several.output_tokens == 6 and several.streamed_tokens == 3  # one per content chunk


async def test_abort_after_tokens_and_after_seconds(base):
    s = await _go(base, chunks=[1, 3, 2, 4], counts="token_ids", abort_after_tokens=4)
    assert s.aborted and not s.done and s.streamed_tokens == 4 and len(s.content_chunks) == 2
    first = await _go(base, chunks=[1, 1], abort_after_tokens=0)  # right after the first event
    assert first.aborted and len(first.chunks) == 1
    late = await _go(base, chunks=[1, 1], abort_after_tokens=50)  # the stream ended first: not aborted
    assert not late.aborted and late.done
    timed = await _go(base, chunks=[1] * 20, abort_after_s=3 * GAP, timeout_s=10)
    assert timed.aborted and not timed.timed_out and not timed.done
    hung = await _go(base, chunks=[1] * 20, timeout_s=3 * GAP)
    assert hung.timed_out and not hung.aborted


async def test_errors_are_results(base):
    http = await _go(base, fail="http")
    assert http.status == 400 and http.error_code == "bad_request" and "no" in http.body_text
    inband = await _go(base, chunks=[1, 1, 1], fail="inband")
    assert inband.status == 200 and inband.error_code == "internal" and len(inband.content_chunks) == 1
    async with aiohttp.ClientSession() as session:
        dead = await stream(session, "http://127.0.0.1:1/v1/completions", {"prompt": "x"})
    assert dead.status == 0 and isinstance(dead.exception, aiohttp.ClientError)


async def test_plain_json_answer(base):
    s = await _go(base, chunks=[2, 3], stream_=False)
    assert s.status == 200 and s.finish_reason == "length" and s.output_tokens == 5
    assert s.info["token_ids"] == list(range(100, 105)) and s.text == "xxxxx"


async def test_metrics_text_parsed_by_prometheus_client(base):
    from pdd.loadgen.scrape import scrape, scrape_sync

    samples = await scrape(base + "/metrics")
    assert samples is not None
    assert sorted((lab["main_decode"], v) for lab, v in samples_of(samples, "pdd:wan_link_up")) == [
        ("md-0", 0.0), ("md-1", 1.0)]
    assert await asyncio.to_thread(scrape_sync, base + "/metrics") == samples
    assert samples_of(parse("pdd_generation_tokens_total 4\n"), "pdd:generation_tokens_total") == [({}, 4.0)]
