"""The emulated backend (engine/emulated_backend/engine.py): the EngineBackend contract, handoff-exact oracle tokens, the real
KV pool and radix cache (prefix hits, freeing, export/import of real bytes) and cost-model pacing."""

from __future__ import annotations

import time

import pytest

from pdd.engine.emulated_backend.engine import EmulatedEngine, TokenOracle
from pdd.engine.core.errors import EngineInputError, UnknownRequestError
from pdd.engine.interface import EngineBackend, load_engine
from pdd.shared.config import PDDConfig
from pdd.engine.core.sampling_params import SamplingParams
from pdd.shared.cost_model import Chip, CostModel, ModelSpec

from .test_engine_interface import assert_conforms

FREE = CostModel(p0=0.0, p_tok=0.0, d0=0.0)  # every step modeled at 0 s: tests that are not about time


def make(**kw) -> EmulatedEngine:
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("vocab_size", 1000)
    kw.setdefault("eos_token_ids", (999,))
    return EmulatedEngine(kw.pop("cost_model", FREE), **kw)


def run_all(engine: EmulatedEngine) -> dict[str, list[int]]:
    """Step until idle; each request's new tokens (checking their output positions are contiguous)."""
    out: dict[str, list[int]] = {}
    first: dict[str, int] = {}
    while engine.has_work():
        for o in engine.step():
            toks = out.setdefault(o.rid, [])
            if o.token_ids:
                assert o.start_position == first.setdefault(o.rid, o.start_position) + len(toks)
            toks.extend(o.token_ids)
    return out


PROMPT = [(7 * i + 3) % 997 for i in range(21)]  # 5 full blocks of 4 and one token


# ---- the contract --------------------------------------------------------------------------------------
def test_satisfies_the_protocol() -> None:
    engine = make()
    assert_conforms(engine)
    k, v = engine.kv_buffers()
    assert len(k) == len(v) == engine.layout.num_layers
    assert k[0].shape == (engine.num_total_blocks(), engine.block_size, engine.layout.kv_heads, engine.layout.head_dim)
    assert engine.kv_buffers()[0][0] is k[0]  # the same tensors for the engine's lifetime
    assert engine.dtype_choice.kv_dtype == engine.layout.dtype == "float32"
    assert engine.eos_token_ids == [999] and engine.block_size == 4 and engine.max_context == 64 * 4
    assert "emulated" in engine.linear_kernel
    for key in ("running", "waiting", "free_blocks", "total_blocks", "cached_blocks", "evictable_blocks",
                "cache_queries", "cache_hit_tokens", "cache_query_tokens", "cache_hit_rate", "preemptions",
                "steps", "overrun_steps", "overrun_share", "modeled_seconds", "time_dilation"):
        assert key in engine.stats(), key


def test_load_engine_builds_it(tiny_model) -> None:
    config = PDDConfig(model={"backend": "emulated", "path": tiny_model, "block_size": 4},
                       emulation={"scenario": "small", "time_dilation": 0.5})
    eng = load_engine(config, "main-decode", True)
    assert isinstance(eng, EmulatedEngine) and isinstance(eng, EngineBackend)
    assert eng.block_size == 4 and eng.time_dilation == 0.5


def test_bad_input_is_refused_like_the_torch_engine() -> None:
    engine = make()
    with pytest.raises(EngineInputError):
        engine.add_request("a", [1, 5000])  # outside the vocabulary
    with pytest.raises(EngineInputError):
        engine.add_request("a", [])
    with pytest.raises(UnknownRequestError):
        engine.release("nope")
    engine.add_request("a", [1, 2])
    with pytest.raises(EngineInputError):
        engine.add_request("a", [1, 2])
    assert engine.has_request("a") and not engine.has_request("b")


# ---- tokens -----------------------------------------------------------------------------------------
def test_tokens_are_deterministic_and_independent_of_batch_and_engine() -> None:
    alone = make().generate([PROMPT], max_new_tokens=12)[0]
    assert len(alone) == 12 and all(0 <= t < 999 for t in alone)  # eos_rate 0: never the EOS id
    other = make(num_blocks=200)
    others = [[5, 6, 7, 8, 9] * i for i in range(1, 5)]
    batched = other.generate(others + [PROMPT], max_new_tokens=12)[-1]
    assert batched == alone
    assert make(oracle_seed=1).generate([PROMPT], max_new_tokens=12)[0] != alone  # the seed matters


def test_handoff_yields_one_engines_tokens() -> None:
    """P->RLD->MD: A runs the prompt and 7 outputs holding its KV; B imports the prompt's KV (reusing the
    block it already caches), commits with the first token, extends by the rest and continues: B's tokens
    equal one engine's. So does a migration (add_request with known_outputs)."""
    alone = make().generate([PROMPT], max_new_tokens=20)[0]

    a = make()
    a.add_request("r", PROMPT, max_new_tokens=7, hold_kv=True)
    first = run_all(a)["r"]
    assert first == alone[:7]
    src = a.request_blocks("r")
    assert len(src) == 6  # ceil(21 / 4)

    b = make()
    b.generate([PROMPT[:6]], max_new_tokens=1)  # B's cache now holds the prompt's first block
    res = b.prepare_import("r", PROMPT)
    assert res.cached_tokens == 4 and len(res.dst_blocks) == 5 and res.all_blocks[1:] == res.dst_blocks
    ka, va = a.kv_buffers()
    kb, vb = b.kv_buffers()
    for layer in range(a.layout.num_layers):  # what a transport does: copy the blocks B lacks
        kb[layer][res.dst_blocks] = ka[layer][src[1:]]
        vb[layer][res.dst_blocks] = va[layer][src[1:]]
    a.release("r")
    b.commit_import("r", PROMPT, first[:1], max_new_tokens=20)
    b.extend_known("r", first[1:])
    rest = run_all(b)["r"]
    assert first + rest == alone

    # the imported bytes are A's: K holds each prompt token's id, V its position
    table = res.all_blocks
    for i, tok in enumerate(PROMPT):
        blk, slot = table[i // 4], i % 4
        assert kb[1][blk, slot, 0, 0].item() == tok and vb[0][blk, slot, 0, 3].item() == i

    c = make()
    c.add_request("m", PROMPT, max_new_tokens=20, known_outputs=alone[:9])
    assert alone[:9] + run_all(c)["m"] == alone


def test_paused_catch_up_then_resume_yields_one_engines_tokens() -> None:
    """MD's catch-up: import, pause, extend by known tokens in batches (no sampling), resume, continue."""
    alone = make().generate([PROMPT], max_new_tokens=16)[0]
    md = make()
    md.prepare_import("r", PROMPT)  # KV content is not read by the oracle: the copy is the other test's
    md.commit_import("r", PROMPT, alone[:1], max_new_tokens=16)
    md.pause("r")
    assert run_all(md) == {}  # extends the first token, samples nothing
    md.extend_known("r", alone[1:4])
    md.extend_known("r", alone[4:6])
    assert run_all(md) == {}
    md.resume("r")
    assert alone[:6] + run_all(md)["r"] == alone
    assert md.num_free_blocks() + md.stats()["evictable_blocks"] == md.num_total_blocks()


def test_eos_stop_tokens_and_min_tokens() -> None:
    eng = make(eos_rate=0.5)
    eng.add_request("e", PROMPT, max_new_tokens=50)
    out = run_all(eng)["e"]
    assert out[-1] == 999 and 999 not in out[:-1] and len(out) < 50
    eng.add_request("i", PROMPT, SamplingParams(ignore_eos=True), max_new_tokens=50)
    assert 999 not in run_all(eng)["i"]
    eng.add_request("m", PROMPT, SamplingParams(min_tokens=30), max_new_tokens=50)
    assert 999 not in run_all(eng)["m"][:30]
    plain = make().generate([PROMPT], max_new_tokens=10)[0]
    stop = make()
    stop.add_request("s", PROMPT, SamplingParams(stop_token_ids=[plain[4]]), max_new_tokens=10)
    assert run_all(stop)["s"] == plain[:5]
    stop.add_request("s", PROMPT, max_new_tokens=10)
    stop.stop_at("s", 3)
    assert run_all(stop)["s"] == plain[:3]


def test_oracle_redraws_banned_tokens() -> None:
    oracle = TokenOracle(2, [1])  # a vocabulary of one token besides EOS
    assert {oracle.next_token([0, 0, 0][:n], 0, SamplingParams()) for n in range(1, 4)} == {0}


# ---- KV accounting -------------------------------------------------------------------------------------
def test_prefix_cache_hit_on_a_shared_prefix() -> None:
    engine = make()
    engine.generate([PROMPT], max_new_tokens=3)
    second = PROMPT[:16] + [1, 2, 3, 4, 5, 6]
    assert engine.cached_prefix_len(second) == 16
    before = engine.num_forward_tokens
    engine.add_request("b", second, max_new_tokens=1)
    run_all(engine)
    assert engine.num_forward_tokens - before == len(second) - 16  # only the uncached tokens are computed
    s = engine.stats()
    assert s["cache_hit_tokens"] >= 16 and s["cache_hit_rate"] > 0
    stored = [e for e in engine.drain_cache_events() if e.kind == "stored"]
    assert tuple(PROMPT[:4]) in {e.token_ids for e in stored}  # the router's prefix index hears of it
    assert engine.drain_cache_events() == []


def test_blocks_are_freed_after_finish_and_abort() -> None:
    engine = make()
    engine.add_request("f", PROMPT, max_new_tokens=5)
    engine.add_request("x", [3] * 30, max_new_tokens=50)
    engine.step()
    engine.step()
    assert engine.num_free_blocks() < engine.num_total_blocks()
    engine.abort("x")
    run_all(engine)
    s = engine.stats()
    assert s["cached_blocks"] == s["evictable_blocks"] > 0  # the finished request's KV, cached, unlocked
    assert engine.num_free_blocks() == engine.num_total_blocks() - s["evictable_blocks"]
    nocache = make(cache_finished=False)
    nocache.add_request("f", PROMPT, max_new_tokens=5)
    nocache.add_request("x", [3] * 30, max_new_tokens=50)
    nocache.step()
    nocache.abort("x")
    run_all(nocache)
    assert nocache.num_free_blocks() == nocache.num_total_blocks()


def test_a_small_pool_preempts_and_evicts_without_changing_tokens() -> None:
    prompts = [[(i * 31 + j) % 900 for j in range(17)] for i in range(6)]
    want = make(num_blocks=400).generate(prompts, max_new_tokens=16)
    small = make(num_blocks=24)
    assert small.generate(prompts, max_new_tokens=16) == want
    assert small.stats()["preemptions"] > 0
    assert small.num_free_blocks() + small.stats()["evictable_blocks"] == small.num_total_blocks()


def test_capacity_from_the_hardware_profile() -> None:
    chip = Chip(name="tiny", peak_tflops=100, mem_gb=1.0, mem_bw_tbs=1.0, interconnect_gbs=100)
    model = ModelSpec(name="m", layers=4, kv_bytes_per_token=1e6, active_params=1e8, weight_bytes=0.5e9)
    eng = EmulatedEngine.from_hardware(chip, 1, model, mem_util=1.0, block_size=4)
    assert eng.cost_model.kv_capacity_tokens == 500
    assert eng.num_total_blocks() == 125


# ---- pacing ---------------------------------------------------------------------------------------------
def test_a_step_waits_out_its_modeled_time() -> None:
    cm = CostModel(p0=0.05, p_tok=0.0, p_attn=0.0, d0=0.02, d_seq=0.001, d_ctx=0.0001)
    engine = make(cost_model=cm, time_dilation=2.0)
    engine.add_request("t", PROMPT, max_new_tokens=3)
    t = time.perf_counter()
    engine.step()  # the whole prompt in one prefill chunk: p0
    assert time.perf_counter() - t >= 0.1
    assert engine.last_step_modeled_s == pytest.approx(0.05)
    engine.step()  # one decode: d0 + d_seq + d_ctx x 22 attended tokens, right after (on the modeled timeline)
    want = 0.02 + 0.001 + 0.0001 * 22
    assert engine.last_step_modeled_s == pytest.approx(want)
    assert time.perf_counter() - t >= 2.0 * (0.05 + want)
    s = engine.stats()
    assert s["steps"] == 2 and s["modeled_seconds"] == pytest.approx(0.05 + want)


def test_overrun_steps_are_counted() -> None:
    engine = make(cost_model=CostModel(p0=0.01, d0=0.01), time_dilation=1e-12)  # deadlines already past
    engine.generate([PROMPT], max_new_tokens=4)
    s = engine.stats()
    assert s["steps"] == 4 and s["overrun_steps"] == 4 and s["overrun_share"] == 1.0


def test_batch_time_mixes_decode_prefill_and_extend() -> None:
    cm = CostModel(p0=1.0, p_tok=0.1, p_attn=0.01, d0=0.5, d_seq=0.2, d_ctx=0.001)
    assert cm.batch_time([]) == 0.0
    assert cm.batch_time([], [(10, 0, True)]) == pytest.approx(cm.prefill_time(10, 0))
    # two prompts begun in one step each pay the fixed cost, as the simulator's prefill queue charges them
    both = cm.batch_time([], [(10, 0, True), (4, 8, True)])
    assert both == pytest.approx(cm.prefill_time(10, 0) + cm.prefill_time(4, 8))
    # a prompt in chunks costs what it costs whole: the fixed cost once, the FLOPs of every chunk
    chunked = cm.batch_time([], [(6, 0, True)]) + cm.batch_time([], [(4, 6, False)])
    assert chunked == pytest.approx(cm.prefill_time(10, 0))
    assert cm.batch_time([30, 50]) == pytest.approx(cm.step_time(2, 80))
    assert cm.batch_time([30], extend_chunks=[(5, 20)]) == pytest.approx(cm.extend_time(5, 1, 55))


def test_a_chunked_prefill_is_timed_as_one_prefill() -> None:
    """The fixed prefill cost is paid once per prompt, not once per chunk: the live emulation and the
    simulator (which prefills a prompt whole) then agree on a long prompt's time to first token."""
    cm = CostModel(p0=0.5, p_tok=0.01, p_attn=0.001, d0=0.0)
    engine = make(cost_model=cm, time_dilation=1e-9, prefill_chunk_tokens=8, max_prefill_tokens=8)
    engine.generate([PROMPT], max_new_tokens=1)
    assert engine.stats()["steps"] == 3  # 21 prompt tokens in chunks of 8
    assert engine.stats()["modeled_seconds"] == pytest.approx(cm.prefill_time(len(PROMPT), 0))


class _Clock:
    """Stands in for ``time`` in engine/emulated_backend/engine.py: perf_counter reads it, sleep advances it."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_back_to_back_steps_pay_host_work_out_of_their_budget(monkeypatch) -> None:
    """A busy engine's steps follow each other on the modeled timeline: the host's work between two steps
    (outputs to the event loop, publishing, the next call) is absorbed, not added to every step; after an
    idle spell (or an overrun) a step's budget starts when it starts."""
    import pdd.engine.emulated_backend.engine as emulated

    clock = _Clock()
    monkeypatch.setattr(emulated, "time", clock)
    step_s, host_s = 0.02, 0.005
    engine = make(cost_model=CostModel(p0=step_s, p_tok=0.0, d0=step_s))
    engine.add_request("a", PROMPT, max_new_tokens=10)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        clock.now += host_s  # the service's work before the next step
    assert steps == 10 and engine.stats()["overrun_steps"] == 0
    assert clock.now == pytest.approx(steps * step_s + host_s)  # not 10 x 25 ms: timed per step from its call
    idle_s = 1.0
    clock.now += idle_s
    engine.add_request("b", PROMPT, max_new_tokens=1)
    t_arrive = clock.now
    engine.step()
    assert clock.now == pytest.approx(t_arrive + step_s)  # a fresh budget, not a burst to catch up


def test_the_first_step_after_idle_starts_when_its_request_arrived(monkeypatch) -> None:
    """The host's admission work (the prefix match of a long prompt, the hop onto the engine thread) is inside
    the cost model's fixed prefill cost: an idle engine's prefill ends its modeled time after the request
    arrived, not after the step was called."""
    import pdd.engine.emulated_backend.engine as emulated

    clock = _Clock()
    monkeypatch.setattr(emulated, "time", clock)
    step_s, host_s = 0.02, 0.005
    engine = make(cost_model=CostModel(p0=step_s, p_tok=0.0, d0=step_s))
    clock.now = 5.0
    engine.add_request("a", PROMPT, max_new_tokens=1)
    clock.now += host_s  # admission, the event loop, the runner's call
    engine.step()
    assert clock.now == pytest.approx(5.0 + step_s)


def test_a_held_prompt_serves_prefix_hits_before_its_release() -> None:
    """P holds a request's KV until its transfer is done (``hold_kv``). Its prompt goes into the radix cache
    when its prefill ends, locked until the release: the session's next turn, arriving while the KV still
    crosses the WAN, hits it (it missed the whole prompt before), and the held blocks are never evicted."""
    engine = make(num_blocks=16)
    engine.add_request("turn1", PROMPT, max_new_tokens=1, hold_kv=True)
    run_all(engine)  # prefilled, first token out, now held for export
    full_blocks = len(PROMPT) // engine.block_size * engine.block_size
    assert engine.cached_prefix_len(PROMPT + [5, 6, 7]) == full_blocks
    assert engine.stats()["evictable_blocks"] == 0  # locked while held
    held = engine.request_blocks("turn1")
    engine.add_request("turn2", PROMPT + [5, 6, 7], max_new_tokens=2)
    out = run_all(engine)
    assert len(out["turn2"]) == 2 and engine.stats()["cache_hit_tokens"] >= full_blocks
    assert engine.request_blocks("turn1") == held  # the export still reads the same blocks
    engine.release("turn1")
    assert engine.stats()["evictable_blocks"] == engine.stats()["cached_blocks"]  # unlocked, nothing leaked
    assert engine.num_free_blocks() + engine.stats()["cached_blocks"] == engine.num_total_blocks()
