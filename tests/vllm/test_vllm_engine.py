"""The vLLM engine and PDD's connector, one class at a time: bad input gets a clear error and leaks no block.

Needs vLLM (skipped elsewhere, tests/vllm/conftest.py); one engine for the session.
"""

from __future__ import annotations

import pytest
import torch

from pdd.engine import SamplingParams
from pdd.engine.core.errors import EngineInputError, UnknownRequestError
from tests.vllm.conftest import run_to_end


def _no_leak(engine) -> None:
    assert not engine.entries
    assert engine.num_free_blocks() + engine.cache.evictable_blocks == engine.num_total_blocks()


# ---- connector pieces ------------------------------------------------------------------------------------
def test_block_range_refuses_a_short_table_and_an_unaligned_start():
    from pdd.engine.vllm_backend.connector import ConnectorError, block_range

    assert block_range([7, 8, 9], 32, 32, 70).tolist() == [8, 9]
    with pytest.raises(ConnectorError, match="need 3 blocks; the block table has 2"):
        block_range([7, 8], 32, 0, 70)  # a block-count mismatch: would read or write another request's blocks
    with pytest.raises(ConnectorError, match="do not start on a block"):
        block_range([7, 8, 9], 32, 5, 40)


def test_paged_view_reads_back_what_it_wrote_in_both_layouts():
    from pdd.engine.vllm_backend.connector import PagedView

    heads, dim, bs = 3, 8, 32
    cpu = torch.zeros(6, heads, bs, 2 * dim)
    flash = torch.zeros(2, 6, bs, heads, dim)
    k = torch.randn(2, bs, heads, dim)  # staging blocks: [blocks, block_size, kv_heads, head_dim]
    v = torch.randn(2, bs, heads, dim)
    blocks = torch.tensor([4, 1])
    for cache in (cpu, flash):
        view = PagedView(cache, heads, dim, bs)
        view.write(blocks, k, v)
        rk, rv = view.read(blocks)
        assert torch.equal(rk.reshape(k.shape), k) and torch.equal(rv.reshape(v.shape), v)
        assert int((cache != 0).sum()) == k.numel() + v.numel()  # nothing written outside the two blocks
    assert torch.equal(flash[0, 4], k[0])  # the flash layout's blocks are PDD's own layout


def test_paged_view_refuses_an_unknown_layout():
    from pdd.engine.vllm_backend.connector import ConnectorError, PagedView

    with pytest.raises(ConnectorError, match="not a layout the PDD connector reads"):
        PagedView(torch.zeros(4, 32, 3, 16), 3, 8, 32)


def test_layer_index_names_the_decoder_layer():
    from pdd.engine.vllm_backend.connector import ConnectorError, layer_index

    assert layer_index("model.layers.17.self_attn.attn") == 17
    with pytest.raises(ConnectorError):
        layer_index("lm_head")


# ---- the engine ----------------------------------------------------------------------------------------
def test_a_second_engine_in_one_process_is_refused(vllm_engine):
    from pdd.engine.vllm_backend.engine import VllmEngine

    with pytest.raises(RuntimeError, match="one vLLM engine per process"):
        VllmEngine(dtype="float32")


def test_bad_requests_get_clear_errors_and_hold_nothing(vllm_engine):
    e = vllm_engine
    with pytest.raises(EngineInputError, match="outside the vocabulary"):
        e.add_request("bad-ids", [1, 2, 10**9], max_new_tokens=4)
    with pytest.raises(EngineInputError, match="prompt is empty"):
        e.add_request("empty", [], max_new_tokens=4)
    with pytest.raises(EngineInputError, match="context limit"):
        e.add_request("long", [5] * e.max_context, max_new_tokens=4)
    with pytest.raises(UnknownRequestError):
        e.commit_import("never-prepared", [1, 2, 3], [4])
    with pytest.raises(UnknownRequestError):
        e.extend_known("never-prepared", [4])
    e.abort("never-prepared")  # a no-op
    _no_leak(e)


def test_import_refusals_keep_the_reservation_until_abort(vllm_engine):
    e = vllm_engine
    prompt = list(range(300, 400))
    plan = e.prepare_import("imp", prompt)
    assert len(plan.dst_blocks) == -(-len(prompt) // e.block_size)
    with pytest.raises(EngineInputError, match="prompt differs"):
        e.commit_import("imp", prompt[:-1], [7])
    with pytest.raises(EngineInputError, match="at least the first generated token"):
        e.commit_import("imp", prompt, [])
    with pytest.raises(EngineInputError, match="outside the vocabulary"):
        e.commit_import("imp", prompt, [-3])
    assert e.has_request("imp")
    e.abort("imp")
    _no_leak(e)


def test_extend_of_a_request_running_in_vllm_is_refused_and_it_finishes(vllm_engine):
    e = vllm_engine
    e.add_request("run", list(range(500, 540)), SamplingParams(ignore_eos=True), max_new_tokens=12)
    first = e.step()  # now inside vLLM
    with pytest.raises(EngineInputError, match="cannot append tokens to a running request"):
        e.extend_known("run", [5, 6])
    with pytest.raises(EngineInputError, match="cannot pause"):
        e.pause("run")
    rest = run_to_end(e, "run")
    assert sum(len(o.token_ids) for o in first if o.rid == "run") + len(rest) == 12
    _no_leak(e)


def test_held_prefill_exports_staging_blocks_and_release_caches_them(vllm_engine):
    """P's path: the prompt's KV lands in staging blocks that name it; release files them in the radix cache."""
    e = vllm_engine
    e.cache_finished = True  # as P's engine (the session's engine is a reference that caches nothing)
    prompt = list(range(1000, 1000 + 3 * e.block_size + 5))
    e.add_request("p", prompt, SamplingParams(), max_new_tokens=1, hold_kv=True)
    assert len(run_to_end(e, "p")) == 1
    blocks = e.request_blocks("p")
    assert len(blocks) == 4
    assert all(e.pool.k_cache[0][b].abs().sum() > 0 for b in blocks)  # the connector saved them
    e.release("p")
    assert e.cached_prefix_len(prompt) == 3 * e.block_size
    e.add_request("p2", prompt + [9], SamplingParams(), max_new_tokens=1, hold_kv=True)  # a staging hit
    run_to_end(e, "p2")
    assert e.request_blocks("p2")[:3] == blocks[:3]  # the cached prefix is shared, not saved again
    e.release("p2")
    e.cache_finished = False
    _no_leak(e)


def test_stop_at_drops_outputs_past_the_position(vllm_engine):
    e = vllm_engine
    e.add_request("s", list(range(700, 760)), SamplingParams(ignore_eos=True), max_new_tokens=50)
    e.stop_at("s", 5)
    outs = []
    while e.has_work():
        outs.extend(o for o in e.step() if o.rid == "s")
    assert sum(len(o.token_ids) for o in outs) == 5 and outs[-1].finish_reason == "length"
    _no_leak(e)


def test_vllm_engine_satisfies_the_engine_interface(vllm_engine):
    from pdd.engine.interface import EngineBackend

    assert isinstance(vllm_engine, EngineBackend)
    assert vllm_engine.layout.backend.startswith("vllm-")


async def test_corrupt_kv_frames_leave_the_staging_pool_untouched(vllm_engine):
    """The connector's input is the staging pool the transports fill: corrupt frames for a reserved import, a
    frame for a block the import did not reserve (a block-count mismatch) and one for an unknown request are
    refused by the real zmq receiver without a byte written; a good frame lands; abort frees everything."""
    from pdd.transports.errors import TransferError
    from tests.transports.conftest import Pair, snapshot, unchanged
    from tests.transports.test_bad_frames import flip, frame, inject

    e = vllm_engine
    plan = e.prepare_import("frames", list(range(2000, 2000 + 3 * e.block_size)))
    mine = tuple(plan.dst_blocks[:2])
    spare = next(b for b in range(e.num_total_blocks()) if b not in plan.all_blocks)
    pair = Pair("zmq", e.layout, send_blocks=2, recv_blocks=1)
    pair.dst_pool = e.kv_buffers()  # the receiver writes into the vLLM engine's staging pool
    async with pair:  # frames are built by the registered sender
        header, payload = frame(pair, "frames", dst=mine)
        cases = {
            "payload bit flip": ((header, flip(payload, 17)), "ChecksumMismatch"),
            "truncated payload": ((header, payload[:-8]), "FrameTruncated"),
            "block not reserved": (frame(pair, "frames", dst=(mine[0], spare)), "UnexpectedFrame"),
            "unknown request": (frame(pair, "nobody", dst=mine), "UnexpectedFrame"),
        }
        snap = snapshot(pair.dst_pool)
        for name, ((header, payload), verdict) in cases.items():
            handle = pair.receiver.expect("frames", plan.dst_blocks, timeout_s=30)
            assert await inject(pair, header, payload) == verdict, name
            assert unchanged(pair.dst_pool, snap), f"{name} wrote into the staging pool"
            if name != "unknown request":
                with pytest.raises(TransferError):
                    await handle
            pair.receiver.cancel("frames")
        pair.receiver.expect("frames", list(mine), timeout_s=30)
        assert await inject(pair, *frame(pair, "frames", dst=mine)) == "ok"
        assert not unchanged(pair.dst_pool, snap)
    e.abort("frames")
    _no_leak(e)


def test_pdd_up_backend_vllm_writes_a_vllm_fleet(tmp_path):
    """`pdd up --backend vllm`: every role's model.backend is vllm (without vLLM it refuses: test_up_emulate.py)."""
    from pdd.launch.up import build_config
    from tests.e2e.test_up import _args

    config = build_config(_args("--backend", "vllm"), "nats://127.0.0.1:4222", tmp_path, {})
    assert config["model"]["backend"] == "vllm"


def test_logprobs_are_the_chosen_tokens_and_the_top_n(vllm_engine):
    e = vllm_engine
    e.add_request("lp", list(range(900, 940)), SamplingParams(logprobs=3, ignore_eos=True), max_new_tokens=4)
    outs = []
    while e.has_work():
        outs.extend(o for o in e.step() if o.rid == "lp")
    tokens = [t for o in outs for t in o.token_ids]
    logprobs = [lp for o in outs for lp in o.logprobs]
    assert len(tokens) == len(logprobs) == 4
    for tok, lp in zip(tokens, logprobs):
        assert len(lp.top_ids) == 3 and lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert lp.top_ids[0] == tok and lp.logprob == lp.top_logprobs[0]  # greedy: the chosen token is the top one
    _no_leak(e)


def test_resume_with_known_outputs_continues_the_same_tokens(vllm_engine):
    """Migration to another decoder (the router's resume): prompt + the outputs streamed so far are recomputed,
    sampling continues exactly where the lost decoder was, here on an engine that caches (as MD does)."""
    e = vllm_engine
    prompt = list(range(3000, 3000 + 2 * e.block_size + 7))
    e.add_request("whole", prompt, SamplingParams(ignore_eos=True), max_new_tokens=12)
    whole = run_to_end(e, "whole")
    e.cache_finished = True
    try:
        e.add_request("moved", prompt, SamplingParams(ignore_eos=True), max_new_tokens=12, known_outputs=whole[:5])
        assert run_to_end(e, "moved") == whole[5:]
        assert e.cached_prefix_len(prompt + whole) == (len(prompt) + 11) // e.block_size * e.block_size
    finally:
        e.cache_finished = False
    _no_leak(e)


def test_a_prompt_whole_in_staging_is_loaded_but_its_last_token(vllm_engine):
    """P again: a block-aligned prompt whose every block the staging cache holds, after vLLM's own cache
    forgot it: vLLM is handed all but the last token (it must compute one), and the first token is the same."""
    e = vllm_engine
    e.cache_finished = True
    try:
        prompt = list(range(4000, 4000 + 2 * e.block_size))  # block aligned
        e.add_request("first", prompt, SamplingParams(), max_new_tokens=1, hold_kv=True)
        first = run_to_end(e, "first")
        e.release("first")
        assert e.cached_prefix_len(prompt) == len(prompt)
        assert e.vllm.reset_prefix_cache()  # vLLM's own copy gone: only staging holds the prompt
        e.add_request("again", prompt, SamplingParams(), max_new_tokens=1, hold_kv=True)
        assert e.entries["again"].plan.load_tokens == len(prompt) - 1
        assert run_to_end(e, "again") == first
        e.request_blocks("again")  # exportable: nothing failed
        e.release("again")
    finally:
        e.cache_finished = False
    _no_leak(e)
