"""Disaggregation paths: export after prefill -> import -> continue equals one engine decoding
alone; extend k known tokens then decode equals plain decoding; relay stop_at; sampled
continuation is identical because draws depend only on (seed, position)."""

from __future__ import annotations

import random

import pytest

from pdd.engine import EngineInputError, OutOfBlocks, SamplingParams

from .conftest import make_engine, run_all

N = 12


def _prompt(engine, n=23, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(engine.config.vocab_size) for _ in range(n)]


def _copy_blocks(src, src_blocks, dst, dst_blocks):
    assert src.layout.compatible_with(dst.layout)
    for l in range(src.layout.num_layers):
        dst.k_cache[l][dst_blocks] = src.k_cache[l][src_blocks]
        dst.v_cache[l][dst_blocks] = src.v_cache[l][src_blocks]


def _reference(path, prompt, params, n):
    ref = make_engine(path)
    ref.add_request("r", prompt, params, max_new_tokens=n)
    return run_all(ref)["r"]


@pytest.mark.parametrize("params", [SamplingParams(ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)])
def test_export_import_continue_identical(llama_path, params):
    p_engine, d_engine = make_engine(llama_path), make_engine(llama_path)
    prompt = _prompt(p_engine)
    expected = _reference(llama_path, prompt, params, N)
    p_engine.add_request("x", prompt, params, max_new_tokens=1, hold_kv=True)
    first = run_all(p_engine)["x"]
    assert first == expected[:1]
    src = p_engine.request_blocks("x")
    assert len(src) == -(-len(prompt) // p_engine.block_size)
    plan = d_engine.prepare_import("x", prompt)
    assert plan.cached_tokens == 0 and plan.all_blocks == plan.dst_blocks
    _copy_blocks(p_engine, src, d_engine, plan.dst_blocks)
    p_engine.release("x")
    assert p_engine.cached_prefix_len(prompt) == (len(prompt) // 4) * 4  # released into P's radix cache
    d_engine.commit_import("x", prompt, first, params, max_new_tokens=N)
    out = run_all(d_engine)["x"]
    assert first + out == expected


def test_md_imports_only_missing_blocks(llama_path):
    p_engine, md = make_engine(llama_path), make_engine(llama_path)
    prompt = _prompt(p_engine, 30)
    params = SamplingParams(ignore_eos=True)
    # MD already served an earlier turn sharing the first 16 tokens
    md.add_request("old", prompt[:16] + [5, 6, 7], params, max_new_tokens=2)
    run_all(md)
    assert md.cached_prefix_len(prompt) == 16
    expected = _reference(llama_path, prompt, params, N)
    p_engine.add_request("y", prompt, params, max_new_tokens=1, hold_kv=True)
    first = run_all(p_engine)["y"]
    plan = md.prepare_import("y", prompt)
    assert plan.cached_tokens == 16
    assert plan.all_blocks[: 16 // 4] != plan.dst_blocks[:1]
    src = p_engine.request_blocks("y")[plan.cached_tokens // 4 :]
    _copy_blocks(p_engine, src, md, plan.dst_blocks)
    p_engine.release("y")
    md.commit_import("y", prompt, first, params, max_new_tokens=N)
    assert first + run_all(md)["y"] == expected
    # the finished request went into MD's radix cache (prompt + output), so the next turn hits
    assert md.cached_prefix_len(prompt + expected) >= len(prompt)


@pytest.mark.parametrize("params", [SamplingParams(ignore_eos=True),
                                    SamplingParams(temperature=1.0, seed=99, ignore_eos=True)])
def test_relay_then_main_decode_catch_up(llama_path, params):
    """P -> RLD (decodes eagerly) and P -> MD; MD extends the relay's tokens in batches and continues."""
    p_engine, rld, md = (make_engine(llama_path) for _ in range(3))
    prompt = _prompt(p_engine, 19, seed=3)
    expected = _reference(llama_path, prompt, params, N)
    p_engine.add_request("z", prompt, params, max_new_tokens=1, hold_kv=True)
    first = run_all(p_engine)["z"]
    blocks = p_engine.request_blocks("z")
    for eng in (rld, md):
        plan = eng.prepare_import("z", prompt, use_cache=eng is md)
        _copy_blocks(p_engine, blocks[plan.cached_tokens // 4 :], eng, plan.dst_blocks)
    p_engine.release("z")
    rld.commit_import("z", prompt, first, params, max_new_tokens=N)
    relay_out = []
    for _ in range(4):
        for o in rld.step():
            assert o.start_position == 1 + len(relay_out)
            relay_out.extend(o.token_ids)
    # catch-up batch 1: what the relay has so far
    md.commit_import("z", prompt, first + relay_out, params, max_new_tokens=N)
    md_first = md.step()  # extends, samples one position itself
    assert md_first[0].start_position == 1 + len(relay_out)
    for _ in range(2):
        for o in rld.step():
            relay_out.extend(o.token_ids)
    final = 1 + len(relay_out)
    rld.stop_at("z", final)
    tail = run_all(rld)
    assert tail.get("z", []) == []
    assert "z" not in rld.requests and rld.num_free_blocks() + rld.cache.cached_blocks == rld.num_total_blocks()
    # batch 2 replaces MD's own sample at that position with the relay's tokens
    md.extend_known("z", relay_out[len(relay_out) - 2 :], start_position=final - 2)
    rest = run_all(md)["z"]
    assert first + relay_out + rest == expected


@pytest.mark.parametrize("k", [1, 5])
def test_extend_known_then_decode_equals_plain(llama_path, k):
    params = SamplingParams(ignore_eos=True)
    engine = make_engine(llama_path)
    prompt = _prompt(engine, 10, seed=5)
    expected = _reference(llama_path, prompt, params, N)
    engine.add_request("e", prompt, params, max_new_tokens=N)
    got = []
    got.extend(engine.step()[0].token_ids)  # prefill -> first token
    engine.extend_known("e", expected[1 : 1 + k])  # known tokens (no KV yet): one extend pass
    outs = run_all(engine)["e"]
    assert got + expected[1 : 1 + k] + outs == expected


def test_import_errors_and_abort_frees(llama_path):
    engine = make_engine(llama_path, num_blocks=8)
    prompt = _prompt(engine, 20)
    plan = engine.prepare_import("a", prompt)
    assert len(plan.dst_blocks) == 5
    with pytest.raises(OutOfBlocks, match="'b'"):
        engine.prepare_import("b", _prompt(engine, 20, seed=9))
    assert "b" not in engine.requests and engine.num_free_blocks() == 3
    with pytest.raises(EngineInputError):
        engine.commit_import("a", prompt, [], SamplingParams(), 4)
    engine.abort("a")
    assert engine.num_free_blocks() == 8
    engine.add_request("h", prompt, SamplingParams(), max_new_tokens=1, hold_kv=True)
    run_all(engine)
    assert engine.num_free_blocks() == 3
    engine.abort("h")
    # its prompt went into the prefix cache when its prefill ended (held for export): it stays there, evictable
    assert engine.num_free_blocks() + engine.stats()["evictable_blocks"] == 8



def test_known_outputs_continue_a_migrated_request_exactly(llama_path):
    """add_request(known_outputs=...) recomputes prompt + outputs and samples the very next position."""
    engine = make_engine(llama_path)
    prompt = list(range(5, 41))
    params = SamplingParams(temperature=0.8, seed=11, ignore_eos=True)
    full = engine.generate([prompt], params, max_new_tokens=24)[0]
    for known in (1, 9, 23):
        engine.add_request(f"r{known}", prompt, params, 24, known_outputs=full[:known])
        assert full[:known] + run_all(engine)[f"r{known}"] == full
    with pytest.raises(EngineInputError):  # nothing left to generate
        engine.add_request("done", prompt, params, 24, known_outputs=full)
    assert engine.num_free_blocks() + engine.cache.evictable_blocks == engine.num_total_blocks()
