"""`pdd bench --dataset-name mooncake_trace`: a Mooncake trace replayed live (loadgen/replay.py).

Against a recording OpenAI-shaped server started here: flag errors and bad trace lines exit 2 before anything
is contacted, prompts are token ids of the server's /tokenize pool (equal hash ids give equal blocks, blocks
scaled to --trace-block-tokens), prompts beyond the model's context are skipped and counted, and without
max_tokens the client hangs up at the trace's output length. Against a real PDD system on the tiny seeded
model: shared hash ids become prefix-cache hits on P and MD, whole engine blocks only.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from aiohttp import web

from pdd.loadgen.replay import plan_replay
from pdd.loadgen.scrape import samples_of, scrape_sync
from pdd.loadgen.trace import MaxTokensRule, TraceRequest, hit_tokens, read_trace
from tests.loadgen.servers import run_bench, serving

MODEL = "trace-model"
POOL = [7, 9, 11, 13, 17, 19, 23, 29, 31, 37]  # the fake server's /tokenize answer (deduplicated by the client)
TOKENS_PER_CHUNK = 2



def _line(ts: float, n_in: int, n_out: int, ids: list[int], **extra) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids, **extra})


def write_trace(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


class Recorder:
    """An OpenAI-shaped server that records every request. Completions stream TOKENS_PER_CHUNK tokens a chunk
    with cumulative usage, up to max_tokens or, without it, to the model's context: a client that does not
    hang up is caught by its --timeout."""

    def __init__(self, max_model_len: int = 100_000, tokenize: bool = True) -> None:
        self.max_model_len, self.tokenize_enabled = max_model_len, tokenize
        self.paths: list[str] = []
        self.bodies: list[dict] = []
        self.hung_up = 0  # streams the client closed before their end

    async def models(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        return web.json_response({"object": "list", "data": [{"id": MODEL, "max_model_len": self.max_model_len}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        body = await request.json()
        assert body["add_special_tokens"] is False and body["model"] == MODEL
        return web.json_response({"count": 2 * len(POOL), "max_model_len": self.max_model_len,
                                  "tokens": POOL[::-1] + POOL, "token_strs": None})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(request.path)
        body = await request.json()
        self.bodies.append(body)
        n = body.get("max_tokens") or self.max_model_len - len(body["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = 0
        try:
            while sent < n:
                await asyncio.sleep(0.001)
                k = min(TOKENS_PER_CHUNK, n - sent)
                sent += k
                last = sent == n
                msg = {"choices": [{"index": 0, "text": "ab" * k, "finish_reason": "length" if last else None}],
                       "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": sent}}
                await resp.write(f"data: {json.dumps(msg)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.hung_up += 1
            raise
        return resp


@pytest.fixture
async def recorder(request):
    fake = Recorder(**getattr(request, "param", {}))
    app = web.Application()
    app.router.add_get("/v1/models", fake.models)
    if fake.tokenize_enabled:
        app.router.add_post("/tokenize", fake.tokenize)
    app.router.add_post("/v1/completions", fake.completions)
    app.router.add_post("/v1/chat/completions", fake.completions)
    async with serving(app) as base:
        yield fake, base



def _replay_argv(base: str, trace: Path, *flags: str) -> list[str]:
    return ["--base-url", base, "--dataset-name", "mooncake_trace", "--dataset-path", str(trace),
            "--metrics-url", "none", "--disable-tqdm", "--timeout", "30", *flags]


@pytest.fixture
def small_trace(tmp_path) -> Path:
    """Three requests: the second shares the first's two leading blocks, the third shares nothing."""
    return write_trace(tmp_path / "trace.jsonl", [
        _line(0, 1024 + 100, 5, [1, 2, 3]),
        _line(500, 1024 + 300, 3, [1, 2, 4]),
        _line(1500, 200, 4, [5]),
    ])


# ---- flags and bad input: exit 2 before anything is contacted ----------------------------------------------
@pytest.mark.parametrize("flags, named", [
    (["--request-rate", "5"], "--request-rate"),
    (["--burstiness", "0.5"], "--burstiness"),
    (["--max-tokens", "zero"], "--max-tokens"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--num-warmups", "2"], "--num-warmups"),
    (["--backend", "openai-chat"], "--backend"),
    (["--endpoint", "/v1/chat/completions"], "--endpoint"),
    (["--trace-time-scale", "-1"], "--trace-time-scale"),
    (["--trace-block-tokens", "0"], "--trace-block-tokens"),
])
async def test_bad_replay_flags_exit_2_naming_the_flag(recorder, small_trace, capsys, flags, named):
    fake, base = recorder
    assert await run_bench(_replay_argv(base, small_trace, *flags)) == 2
    assert named in capsys.readouterr().err
    assert fake.paths == []  # nothing was contacted


async def test_trace_flags_without_a_trace_are_errors(recorder, capsys):
    fake, base = recorder
    rc = await run_bench(["--base-url", base, "--dataset-name", "random", "--max-tokens", "output", "--disable-tqdm"])
    assert rc == 2 and "--max-tokens" in capsys.readouterr().err and fake.paths == []


@pytest.mark.parametrize("line, field", [
    ('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1]}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 0, "hash_ids": [1]}', "output_length"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2', "<json>"),
])
async def test_bad_trace_line_names_line_and_field_and_sends_nothing(recorder, tmp_path, capsys, line, field):
    fake, base = recorder
    trace = write_trace(tmp_path / "bad.jsonl", [_line(0, 10, 2, [1]), _line(5, 10, 2, [2]), line])
    assert await run_bench(_replay_argv(base, trace)) == 2
    err = capsys.readouterr().err
    assert f"bad.jsonl:3: field {field!r}" in err
    assert fake.paths == []


@pytest.mark.parametrize("recorder", [{"tokenize": False}], indirect=True)
async def test_a_server_without_tokenize_is_a_clear_error(recorder, small_trace, capsys):
    fake, base = recorder
    assert await run_bench(_replay_argv(base, small_trace)) == 2
    assert "/tokenize" in capsys.readouterr().err
    assert "/v1/completions" not in fake.paths


# ---- what goes out ----------------------------------------------------------------------------------------
def test_equal_hash_ids_give_equal_token_blocks_scaled_to_block_tokens():
    reqs = [TraceRequest(1, 0.0, 1024 + 256, 4, (1, 2, 3)), TraceRequest(2, 10.0, 1024 + 512, 4, (1, 2, 4)),
            TraceRequest(3, 20.0, 100, 4, (1,))]
    plan = plan_replay(reqs, MaxTokensRule(), 24, 1.0, POOL, None)
    a, b, c = (s.prompt_token_ids() for s in plan.specs)
    assert (len(a), len(b), len(c)) == (24 + 24 + 12, 24 * 3, round(100 * 24 / 512))  # partial blocks keep their share
    assert [s.prompt_tokens for s in plan.specs] == [len(a), len(b), len(c)]
    assert a[:48] == b[:48] and a[48:] != b[48:60]  # two shared leading blocks, then different ones
    assert c == a[: len(c)]  # the same first id: a prefix of the same block
    assert set(a + b + c) <= set(POOL)
    assert [s.cached_tokens for s in plan.specs] == [0, 48, len(c) - 1]  # the trace's bound on reuse
    assert plan.specs[0].prompt_token_ids() == a  # built again when sent: the same ids


def test_arrivals_follow_the_trace_times_the_scale_and_long_prompts_are_skipped():
    reqs = [TraceRequest(1, 1000.0, 2000, 4, (1, 2, 3, 4)), TraceRequest(2, 1500.0, 100, 4, (5,)),
            TraceRequest(3, 4000.0, 600, 4, (6, 7)), TraceRequest(4, 4500.0, 512, 4, (8,))]
    plan = plan_replay(reqs, MaxTokensRule.parse("output"), 16, 0.5, POOL, 33)
    # 2000 tokens scale to 3 x 16 + 14 = 62 (>= the context of 33: skipped); 512 -> 16 tokens
    assert plan.skipped_too_long == 1 and [s.request.line for s in plan.specs] == [2, 3, 4]
    assert plan.arrivals == [0.0, 1.25, 1.5]  # from the first request kept, halved
    assert [s.sent_max_tokens() for s in plan.specs] == [4, 4, 4] and [s.read_limit() for s in plan.specs] == [4] * 3
    assert [s.prompt_tokens for s in plan.specs] == [3, 16 + 3, 16]
    plan = plan_replay(reqs, MaxTokensRule(), 16, 1.0, POOL, 63)
    assert plan.skipped_too_long == 0  # 62 tokens + 1 output token fit in 63
    with pytest.raises(ValueError, match="longer than the model's context"):
        plan_replay(reqs[:1], MaxTokensRule(), 16, 1.0, POOL, 62)


async def test_replay_sends_token_ids_without_max_tokens_and_hangs_up_at_the_output_length(
        recorder, small_trace, tmp_path):
    fake, base = recorder
    out = tmp_path / "result.json"
    assert await run_bench(_replay_argv(base, small_trace, "--trace-block-tokens", "32", "--trace-time-scale", "0.1",
                                     "--save-json", str(out))) == 0
    assert fake.paths.index("/tokenize") < fake.paths.index("/v1/completions")  # the pool first, once
    assert fake.paths.count("/tokenize") == 1 and len(fake.bodies) == 3
    for body in fake.bodies:
        assert "max_tokens" not in body and body["ignore_eos"] is True and body["model"] == MODEL
        assert all(isinstance(t, int) for t in body["prompt"]) and set(body["prompt"]) <= set(POOL)
    prompts = sorted((b["prompt"] for b in fake.bodies), key=len)
    # 200/512 of a block; 2 blocks + 100/512; 2 blocks + 300/512 (blocks of 32 tokens, partial ones rounded)
    assert [len(p) for p in prompts] == sorted(r.input_tokens(32) for r in read_trace(small_trace)) == [12, 70, 83]
    assert prompts[1][:64] == prompts[2][:64] and prompts[1][64:70] != prompts[2][64:70]
    for _ in range(1000):  # the server notices a closed stream at its next write
        if fake.hung_up == 3:
            break
        await asyncio.sleep(0.01)
    assert fake.hung_up == 3  # every stream closed by the client
    data = json.loads(out.read_text())
    assert data["completed"] == 3 and data["failed"] == 0 and data["request_rate"] == "trace"
    # 5 and 3 tokens arrive in chunks of 2: the client counts exactly the trace's output lengths
    assert [r["output_tokens"] for r in data["requests"]] == [5, 3, 4]
    assert [len(r["itl"]) for r in data["requests"]] == [4, 2, 3]
    starts = [r["start"] for r in data["requests"]]
    assert starts[1] >= 0.05 - 1e-3 and starts[2] >= 0.15 - 1e-3  # not before the recorded time x 0.1
    assert data["pdd"]["trace"] == {"file": "trace.jsonl", "requests": 3, "time_scale": 0.1, "block_tokens": 32,
                                    "blocks_scaled": True, "max_tokens": "none", "skipped_too_long": 0,
                                    "max_model_len": 100_000}


@pytest.mark.parametrize("recorder", [{"max_model_len": 60}], indirect=True)
async def test_prompts_beyond_the_context_are_skipped_and_counted(recorder, small_trace, tmp_path):
    fake, base = recorder
    out = tmp_path / "result.json"
    assert await run_bench(_replay_argv(base, small_trace, "--trace-block-tokens", "32", "--max-tokens", "3",
                                     "--save-json", str(out))) == 0
    assert [len(b["prompt"]) for b in fake.bodies] == [12]  # 70 and 83 tokens leave no room in 60: not sent
    assert [b["max_tokens"] for b in fake.bodies] == [3]
    data = json.loads(out.read_text())
    assert data["completed"] == 1 and data["pdd"]["trace"]["skipped_too_long"] == 2
    assert data["pdd"]["trace"]["max_tokens"] == "3" and data["pdd"]["trace"]["max_model_len"] == 60


async def test_max_tokens_output_sends_the_trace_output_and_num_prompts_slices_the_file(recorder, small_trace, tmp_path):
    fake, base = recorder
    out = tmp_path / "result.json"
    assert await run_bench(_replay_argv(base, small_trace, "--max-tokens", "output", "--num-prompts", "2",
                                     "--trace-time-scale", "0", "--save-json", str(out))) == 0
    assert sorted(b["max_tokens"] for b in fake.bodies) == [3, 5]
    assert fake.hung_up == 0  # the server ended each stream at max_tokens
    data = json.loads(out.read_text())
    assert [r["output_tokens"] for r in data["requests"]] == [5, 3]
    assert data["pdd"]["trace"]["blocks_scaled"] is False and data["pdd"]["trace"]["requests"] == 2


def test_real_traces_parse_and_plan_at_a_small_block():
    """The first requests of each shipped Mooncake trace (read in place, never copied) plan at 16-token blocks."""
    for name in ("conversation_trace.jsonl", "synthetic_trace.jsonl"):
        path = Path("/work/shared/traces") / name
        if not path.is_file():
            pytest.skip(f"{path} is not on this machine")
        reqs = read_trace(path, 200)
        plan = plan_replay(reqs, MaxTokensRule(), 16, 1.0, POOL, 1024)
        kept = [s.request for s in plan.specs]
        assert len(kept) + plan.skipped_too_long == 200 and plan.arrivals == sorted(plan.arrivals)
        bound = hit_tokens([r.hash_ids for r in kept], [s.prompt_tokens for s in plan.specs], 16)
        assert [s.cached_tokens for s in plan.specs] == bound.tolist()
        assert sum(bound) > 0  # the traces reuse prefixes


# ---- live: a PDD system on the tiny model -----------------------------------------------------------------
ENGINE_BLOCK = 16  # tests/e2e/conftest.py start_system's model.block_size
HITS = "pdd:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def p_md_system(tmp_path_factory, tiny_model):
    """The e2e system (tests/e2e/conftest.py), routing every request P-MD (every WAN transfer counts as small),
    so that each prompt reaches P and MD; on its own nats-server, so the e2e session's system may run beside."""
    from pdd.launch.natsserver import start_nats_server
    from tests.e2e.conftest import start_system

    nats = start_nats_server()
    try:
        system = start_system(tmp_path_factory.mktemp("pdd-trace"), nats.url, tiny_model,
                              policy={"wan_masking_threshold_s": 1e9})
        yield system
        system.stop()
    finally:
        nats.stop()


def _hits(system, instance: str) -> float:
    samples = scrape_sync(system.procs[instance].wait_log("service_ready")["metrics"])
    assert samples is not None, f"{instance}: no /metrics"
    return sum(v for _, v in samples_of(samples, HITS))


def _wait_hits(system, instance: str, at_least: float, timeout_s: float = 30.0) -> float:
    """The counter once it reaches ``at_least`` (engines publish it at their heartbeat), or its last value."""
    deadline = time.monotonic() + timeout_s
    value = _hits(system, instance)
    while value < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
        value = _hits(system, instance)
    return value


def _wait_idle(system, timeout_s: float = 30.0) -> dict[str, dict]:
    """The engines that still run, queue or hold KV outside their cache, once none does or at the deadline
    (a closed stream is cancelled on every instance: tests/e2e/test_pipelines.py checks it per pipeline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {i: system.instance_health(i)["engine"] for i in ("p-0", "rld-0", "md-0")}
        busy = {i: e for i, e in stats.items()
                if e["running"] or e["waiting"] or e["free_blocks"] + e["cached_blocks"] != e["total_blocks"]}
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.2)


def _shared_trace(base_id: int) -> list[str]:
    """Prefix chains over ids base_id+...: shares of 0, 3, 4, 0, 1 leading blocks, then one request too long
    for the tiny model's context at any tested block size. Partial last blocks have ids of their own."""
    a = [base_id + i for i in range(4)]
    return [
        _line(0, 4 * 512 + 200, 12, a + [base_id + 10]),
        _line(100, 4 * 512 + 300, 9, a[:3] + [base_id + 11, base_id + 12]),
        _line(200, 5 * 512 + 100, 10, a + [base_id + 13, base_id + 14]),
        _line(300, 2 * 512 + 50, 7, [base_id + 20, base_id + 21, base_id + 15]),
        _line(400, 2 * 512 + 400, 11, [base_id, base_id + 22, base_id + 16]),
        _line(500, 60 * 512, 5, [base_id + 100 + i for i in range(60)]),
    ]


@pytest.mark.parametrize("block_tokens, base_id, rule", [
    (32, 1000, "output"),  # a multiple of the engine's 16-token block
    (24, 2000, "output"),  # not a multiple: shared prefixes hit their whole engine blocks only
    (24, 3000, "none"),  # no max_tokens: the client hangs up at the output length
])
def test_live_replay_shared_hash_ids_hit_p_and_md_prefix_caches(p_md_system, tmp_path, block_tokens, base_id, rule):
    from pdd.launch.cli import main

    trace = write_trace(tmp_path / "shared.jsonl", _shared_trace(base_id))
    reqs = read_trace(trace)
    kept = reqs[:-1]
    shared = [k * block_tokens for k in (0, 3, 4, 0, 1)]
    assert hit_tokens([r.hash_ids for r in kept], [r.input_tokens(block_tokens) for r in kept],
                      block_tokens).tolist() == shared  # the trace's own bound: no prompt is all shared
    expected = sum(n // ENGINE_BLOCK * ENGINE_BLOCK for n in shared)
    before = {i: _hits(p_md_system, i) for i in ("p-0", "md-0")}
    out = tmp_path / "result.json"
    rc = main(["bench", *_replay_argv(p_md_system.base_url, trace, "--trace-block-tokens", str(block_tokens),
                                      "--trace-time-scale", "0", "--max-concurrency", "1", "--max-tokens", rule,
                                      "--save-json", str(out))])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["completed"] == 5 and data["failed"] == 0, data["pdd"].get("errors")
    assert data["pdd"]["trace"]["skipped_too_long"] == 1 and data["pdd"]["trace"]["block_tokens"] == block_tokens
    assert [r["output_tokens"] for r in data["requests"]] == [r.output_length for r in kept]
    assert [r["prompt_tokens"] for r in data["requests"]] == [r.input_tokens(block_tokens) for r in kept]
    assert _wait_idle(p_md_system) == {}
    p_hits = _wait_hits(p_md_system, "p-0", before["p-0"] + expected) - before["p-0"]
    assert p_hits == expected
    # with "none" every stream is closed by the client: MD keeps a cancelled request's KV in its cache all the same
    md_hits = _wait_hits(p_md_system, "md-0", before["md-0"] + expected) - before["md-0"]
    assert md_hits == expected
