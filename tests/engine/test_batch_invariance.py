"""Batch invariance on the real model (SmolLM2-135M): a request's greedy tokens do not depend on what
else is in the batch, nor on whether its KV was prefilled here, imported from another engine, or
extended from known tokens. Handoff and migration promise exactly this.

The engine runs in its default batch-invariant mode (decode-phase attention accumulates in float64,
docs/ENGINE.md "Batch invariance"); tests/engine/test_exact_attention.py checks the logits bitwise on a
tiny model, this file checks the greedy tokens on the real one, in fp32 and bf16.
"""

from __future__ import annotations

import pytest

from pdd.engine import SamplingParams
from pdd.engine.torch_backend.engine import TorchEngine
from pdd.engine.core.dtypes import bf16_support

from .conftest import run_all

N = 32  # greedy tokens compared per request
GREEDY = SamplingParams(ignore_eos=True)
# bf16 GEMMs are emulated (about 50x slower) on CPUs without native bf16: slow there
_SLOW_BF16 = [] if bf16_support()[0] else [pytest.mark.slow]


@pytest.fixture(scope="module", params=["float32", pytest.param("bfloat16", marks=_SLOW_BF16)])
def engine(request) -> TorchEngine:
    from pdd.shared.model_files import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return TorchEngine.from_model("default", dtype=request.param, kv_memory_bytes=256 << 20,
                             max_num_seqs=64, enable_prefix_cache=False)


@pytest.fixture(scope="module")
def texts(engine) -> list[list[int]]:
    """Real text (Python's own reference manual, fixed per Python version) cut into prompts."""
    from pydoc_data.topics import topics

    ids = engine.tokenizer(topics["compound"]).input_ids
    target = ids[:64]
    others = [ids[100 + 23 * i : 100 + 23 * i + 5 + (i * 7) % 50] for i in range(31)]  # 5..54 tokens
    return [target] + others


@pytest.fixture(scope="module")
def alone(engine, texts) -> list[int]:
    engine.add_request("alone", texts[0], GREEDY, max_new_tokens=N)
    return run_all(engine)["alone"]


def _step_until_first(engine: TorchEngine, rid: str) -> list[int]:
    while True:
        toks = [t for o in engine.step() if o.rid == rid for t in o.token_ids]
        if toks:
            return toks


@pytest.mark.parametrize("batch", [8, 32])
def test_batch_mates_do_not_change_tokens(engine, texts, alone, batch):
    """The target arrives while half its batch mates decode (mixed prefill + decode steps)."""
    others = texts[1:batch]
    half = len(others) // 2
    for i, p in enumerate(others[:half]):
        engine.add_request(f"b{batch}-{i}", p, GREEDY, max_new_tokens=N + 8)
    outs = {}
    for _ in range(2):
        for o in engine.step():
            outs.setdefault(o.rid, []).extend(o.token_ids)
    engine.add_request("target", texts[0], GREEDY, max_new_tokens=N)
    for i, p in enumerate(others[half:], start=half):
        engine.add_request(f"b{batch}-{i}", p, GREEDY, max_new_tokens=N - 4)
    assert engine.stats()["running"] + engine.stats()["waiting"] == batch
    got = run_all(engine)
    assert got["target"] == alone


@pytest.mark.parametrize("k", [1, 8])
def test_extend_known_after_k_tokens(engine, texts, alone, k):
    """First token from prefill, then k known tokens in one extend pass, then decode."""
    engine.add_request("ext", texts[0], GREEDY, max_new_tokens=N)
    first = _step_until_first(engine, "ext")
    engine.extend_known("ext", alone[1 : 1 + k])
    assert first + alone[1 : 1 + k] + run_all(engine)["ext"] == alone


@pytest.mark.parametrize("known", [0, 8])
def test_imported_kv_continues_identically(engine, texts, alone, known):
    """P prefills and exports; a second engine (as RLD/MD) imports the blocks and continues after the
    first token, or after the first token plus `known` relay tokens (the main decoder's catch-up)."""
    decoder = TorchEngine(engine.model, engine.tokenizer, num_blocks=64, enable_prefix_cache=False)
    prompt = texts[0]
    engine.add_request("x", prompt, GREEDY, max_new_tokens=1, hold_kv=True)
    first = run_all(engine)["x"]
    assert first == alone[:1]
    src = engine.request_blocks("x")
    plan = decoder.prepare_import("x", prompt, use_cache=False)
    assert decoder.layout.compatible_with(engine.layout)
    for layer in range(engine.layout.num_layers):
        decoder.k_cache[layer][plan.dst_blocks] = engine.k_cache[layer][src]
        decoder.v_cache[layer][plan.dst_blocks] = engine.v_cache[layer][src]
    engine.release("x")
    so_far = alone[: 1 + known]
    decoder.commit_import("x", prompt, so_far, GREEDY, max_new_tokens=N)
    assert so_far + run_all(decoder)["x"] == alone
    assert decoder.num_free_blocks() == decoder.num_total_blocks() - decoder.cache.cached_blocks


def test_alone_reference_is_reproducible(engine, texts, alone):
    """The reference itself: the same request alone twice gives the same tokens (and it is not trivial)."""
    engine.add_request("again", texts[0], GREEDY, max_new_tokens=N)
    assert run_all(engine)["again"] == alone
    assert len(set(alone)) > 4
