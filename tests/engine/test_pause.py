"""MD's catch-up path: paused extends of known-token batches, then resume == uninterrupted decoding."""

import pytest

from pdd.engine import SamplingParams
from tests.engine.conftest import make_engine, run_all


@pytest.mark.parametrize("batches", [[5], [3, 4, 2], [1, 1, 1, 6], [4, 0]])
def test_paused_catch_up_batches_then_resume_equals_plain(llama_path, batches):
    prompt = list(range(3, 40))
    total = 24
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    plain = make_engine(llama_path)
    plain.add_request("r", prompt, params, max_new_tokens=total)
    want = run_all(plain)["r"]

    src = make_engine(llama_path)
    src.add_request("p", prompt, params, max_new_tokens=1, hold_kv=True)
    run_all(src)
    dst = make_engine(llama_path)
    plan = dst.prepare_import("r", prompt)
    blocks = src.request_blocks("p")[plan.cached_tokens // dst.block_size:]
    for layer in range(dst.layout.num_layers):
        dst.k_cache[layer][plan.dst_blocks] = src.k_cache[layer][blocks]
        dst.v_cache[layer][plan.dst_blocks] = src.v_cache[layer][blocks]

    known = want[: 1 + batches[0]]
    dst.commit_import("r", prompt, known, params, max_new_tokens=total)
    dst.pause("r")
    assert run_all(dst) == {}, "a paused request must not sample"
    pos = len(known)
    for size in batches[1:]:
        dst.extend_known("r", want[pos: pos + size], start_position=pos)
        pos += size
        assert run_all(dst) == {}
        assert not dst.has_work()
    dst.resume("r")
    rest = run_all(dst)["r"]
    assert want[:pos] + rest == want
