"""logprobs, min_p, repetition/presence/frequency penalties and min_tokens: real torch math on a tiny
model, checked against the formulas applied by hand to the engine's own logits, and identical when a
request continues on another engine (handoff by token ids, migration by recompute)."""

from __future__ import annotations

import pytest
import torch

from pdd.engine import InvalidSamplingParamsError, SamplingParams
from pdd.engine.torch_backend.sampling import sample_rows

from .conftest import make_engine, run_all

PROMPT = list(range(5, 25))
N = 24


def _run(engine, rid, prompt, params, n):
    """(tokens, logprobs per token, captured logits per sampled token) of one request run alone."""
    engine.capture_logits = True
    engine.captured_logits.pop(rid, None)
    engine.add_request(rid, prompt, params, max_new_tokens=n)
    tokens, lps = [], []
    while engine.has_work():
        for o in engine.step():
            if o.rid == rid and o.token_ids:
                tokens.extend(o.token_ids)
                lps.extend(o.logprobs or [])
    return tokens, lps, engine.captured_logits.pop(rid)


def _by_hand(logits, params, prompt, outputs, eos):
    """vLLM's order, written out: min_tokens mask, repetition (prompt+output), frequency and presence (output)."""
    x = logits.clone()
    if len(outputs) < params.min_tokens:
        for t in list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos)):
            x[t] = float("-inf")
    for t in set(prompt) | set(outputs):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(outputs):
        x[t] -= params.frequency_penalty * outputs.count(t) + params.presence_penalty
    return x


@pytest.mark.parametrize("bad, field", [
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"), ({"min_p": float("nan")}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("inf")}, "frequency_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 1.5}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"), ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
])
def test_bad_values_name_the_field_and_leave_nothing(llama_path, bad, field):
    engine = make_engine(llama_path)
    free = engine.num_free_blocks()
    with pytest.raises(InvalidSamplingParamsError, match=field):
        engine.add_request("bad", PROMPT, SamplingParams(**bad), 4)
    assert "bad" not in engine.requests and engine.num_free_blocks() == free


@pytest.mark.parametrize("params", [SamplingParams(ignore_eos=True, logprobs=5),
                                    SamplingParams(temperature=0.7, seed=3, ignore_eos=True, logprobs=20,
                                                   frequency_penalty=1.0)])
def test_logprobs_are_the_raw_log_softmax_of_the_engines_logits(llama_path, params):
    engine = make_engine(llama_path)
    tokens, lps, logits = _run(engine, "lp", PROMPT, params, N)
    assert len(lps) == len(tokens) == len(logits) == N
    for tok, lp, row in zip(tokens, lps, logits):
        direct = torch.log_softmax(row.float(), dim=-1)
        assert lp.logprob == pytest.approx(direct[tok].item(), abs=1e-6)
        top = torch.topk(direct, params.logprobs)
        assert lp.top_ids == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert sum(torch.tensor(lp.top_logprobs).exp().tolist()) <= 1.0 + 1e-6
        if params.greedy and not params.uses_history:
            assert lp.top_ids[0] == tok and lp.top_logprobs[0] == pytest.approx(lp.logprob)


def test_no_logprobs_unless_asked_and_zero_alternatives(llama_path):
    engine = make_engine(llama_path)
    _, lps, _ = _run(engine, "none", PROMPT, SamplingParams(ignore_eos=True), 4)
    assert lps == []
    _, lps, _ = _run(engine, "zero", PROMPT, SamplingParams(ignore_eos=True, logprobs=0), 4)
    assert len(lps) == 4 and all(lp.top_ids == [] and lp.top_logprobs == [] for lp in lps)


@pytest.mark.parametrize("params", [
    SamplingParams(ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0),
    SamplingParams(ignore_eos=True, repetition_penalty=1.5),
    SamplingParams(ignore_eos=True, repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=0.3),
])
def test_greedy_penalties_follow_the_formula(llama_path, params):
    """Each greedy token is the argmax of the engine's logits penalised by hand from the token history."""
    engine = make_engine(llama_path)
    tokens, _, logits = _run(engine, "pen", PROMPT, params, N)
    for i, row in enumerate(logits):
        want = int(torch.argmax(_by_hand(row, params, PROMPT, tokens[:i], engine.eos_token_ids)))
        assert tokens[i] == want, i
    plain, _, _ = _run(engine, "plain", PROMPT, SamplingParams(ignore_eos=True), N)
    assert tokens != plain


def test_large_frequency_penalty_prevents_repeats(llama_path):
    engine = make_engine(llama_path)
    plain, _, _ = _run(engine, "plain", PROMPT, SamplingParams(ignore_eos=True), 40)
    assert len(set(plain)) < len(plain)  # the tiny model loops when greedy
    pen, _, _ = _run(engine, "pen", PROMPT, SamplingParams(ignore_eos=True, frequency_penalty=2.0,
                                                           presence_penalty=2.0), 40)
    assert len(set(pen)) == len(pen)


def test_repetition_penalty_covers_the_prompt(llama_path):
    """A strong repetition penalty steers greedy decoding off the prompt's tokens, not only the output's."""
    engine = make_engine(llama_path)
    plain, _, _ = _run(engine, "plain", PROMPT, SamplingParams(ignore_eos=True), 12)
    i = next(i for i, t in enumerate(plain) if t in PROMPT + plain[:i])  # greedy repeats a token here
    prompt = PROMPT + plain[:i]  # so, as a prompt, this one is followed by one of its own tokens
    params = SamplingParams(ignore_eos=True, repetition_penalty=50.0)
    out, _, logits = _run(engine, "rep", prompt, params, 1)
    assert int(torch.argmax(logits[0])) in prompt  # unpenalised, the model would repeat a prompt token
    assert out[0] not in prompt
    assert out[0] == int(torch.argmax(_by_hand(logits[0], params, prompt, [], engine.eos_token_ids)))


def test_min_tokens_masks_eos_and_stop_token_ids(llama_path):
    engine = make_engine(llama_path)
    plain, _, _ = _run(engine, "plain", PROMPT, SamplingParams(ignore_eos=True), 12)
    engine.eos_token_ids = [plain[1]]  # this prompt's greedy output now ends at position 1
    out, _, _ = _run(engine, "eos", PROMPT, SamplingParams(), 12)
    assert out == plain[:2]
    out, _, logits = _run(engine, "min", PROMPT, SamplingParams(min_tokens=6), 12)
    assert len(out) >= 6 and plain[1] not in out[:6]
    assert int(torch.argmax(logits[1])) == plain[1]  # unmasked, position 1 would have been the EOS
    for i in range(6):
        row = logits[i].clone()
        row[plain[1]] = float("-inf")
        assert out[i] == int(torch.argmax(row))
    stop, _, _ = _run(engine, "stopid", PROMPT, SamplingParams(ignore_eos=True, stop_token_ids=[plain[2]],
                                                              min_tokens=4), 12)
    assert plain[2] not in stop[:4]
    if plain[2] in stop:
        assert stop[-1] == plain[2] and len(stop) > 4


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    counts = [0, 0, 0, 0]
    p = SamplingParams(temperature=1.0, seed=9, min_p=0.2)  # keeps tokens with p >= 0.1
    for i in range(1500):
        counts[sample_rows(logits, [p], [i])[0]] += 1
    assert counts[3] == 0 and min(counts[:3]) > 0
    p1 = SamplingParams(temperature=1.0, seed=9, min_p=1.0)  # only the most likely token survives
    assert {sample_rows(logits, [p1], [i])[0] for i in range(200)} == {0}


def test_greedy_fast_path_is_unchanged(llama_path):
    """Defaults draw exactly as before: no history needed, argmax of the raw logits."""
    logits = torch.randn(3, 50)
    assert sample_rows(logits, [SamplingParams()] * 3, [0, 1, 2]) == logits.argmax(-1).tolist()
    with pytest.raises(ValueError, match="histories"):
        sample_rows(logits, [SamplingParams(min_tokens=2)], [0])


def _copy_blocks(src, src_blocks, dst, dst_blocks):
    for layer in range(src.layout.num_layers):
        dst.k_cache[layer][dst_blocks] = src.k_cache[layer][src_blocks]
        dst.v_cache[layer][dst_blocks] = src.v_cache[layer][src_blocks]


FEATURES = SamplingParams(temperature=0.9, seed=1234, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5,
                          frequency_penalty=0.4, min_tokens=N - 2, logprobs=4)


def test_relay_to_main_decode_handoff_keeps_penalties_and_logprobs(llama_path):
    """P -> RLD decodes, MD learns the outputs by ids (commit_import, then extend_known) and continues:
    tokens and logprobs equal one engine's, because the penalty state is rebuilt from the token ids."""
    single = make_engine(llama_path)
    want, want_lp, _ = _run(single, "s", PROMPT, FEATURES, N)
    p_engine, rld, md = (make_engine(llama_path) for _ in range(3))
    p_engine.add_request("z", PROMPT, FEATURES, max_new_tokens=1, hold_kv=True)
    first = p_engine.step()[0]
    assert first.token_ids == want[:1] and first.logprobs == want_lp[:1]
    blocks = p_engine.request_blocks("z")
    for eng in (rld, md):
        plan = eng.prepare_import("z", PROMPT, use_cache=eng is md)
        _copy_blocks(p_engine, blocks[plan.cached_tokens // 4:], eng, plan.dst_blocks)
    p_engine.release("z")
    rld.commit_import("z", PROMPT, first.token_ids, FEATURES, max_new_tokens=N)
    relay, relay_lp = [], []
    for _ in range(6):
        for o in rld.step():
            relay += o.token_ids
            relay_lp += o.logprobs
    md.commit_import("z", PROMPT, first.token_ids + relay[:3], FEATURES, max_new_tokens=N)  # catch-up batch 1
    md.pause("z")
    md.step()
    rld.abort("z")
    md.extend_known("z", relay[3:], start_position=4)  # final batch
    md.resume("z")
    rest, rest_lp = [], []
    while md.has_work():
        for o in md.step():
            rest += o.token_ids
            rest_lp += o.logprobs or []
    assert first.token_ids + relay + rest == want
    got_lp = first.logprobs + relay_lp + rest_lp
    assert [lp.top_ids for lp in got_lp] == [lp.top_ids for lp in want_lp]
    for got, ref in zip(got_lp, want_lp):
        assert got.logprob == pytest.approx(ref.logprob, abs=1e-5)
        assert got.top_logprobs == pytest.approx(ref.top_logprobs, abs=1e-5)


def test_migration_by_recompute_keeps_penalties_and_logprobs(llama_path):
    engine = make_engine(llama_path)
    want, want_lp, _ = _run(engine, "full", PROMPT, FEATURES, N)
    for known in (1, 7, N - 1):
        engine.add_request(f"m{known}", PROMPT, FEATURES, N, known_outputs=want[:known])
        rest, rest_lp = [], []
        while engine.has_work():
            for o in engine.step():
                rest += o.token_ids
                rest_lp += o.logprobs or []
        assert want[:known] + rest == want
        for got, ref in zip(rest_lp, want_lp[known:]):
            assert got.top_ids == ref.top_ids and got.logprob == pytest.approx(ref.logprob, abs=1e-5)
    assert run_all(engine) == {}


def test_logprobs_travel_on_the_bus_and_are_decoded_strictly():
    """What the engine returns goes on the wire as is (msgpack), and a malformed entry is a ProtocolError."""
    import msgpack

    from pdd.shared.protocol import PrefillResult, ProtocolError, TokenChunk, TokenLogprobs, _to_wire, decode

    lp = TokenLogprobs(logprob=-0.25, top_ids=[3, 9], top_logprobs=[-0.25, -1.5])
    chunk = TokenChunk(request_id="r", instance_id="rld-0", role="relay", start=1, token_ids=[3], logprobs=[lp])
    assert decode(chunk.encode()) == chunk
    first = PrefillResult(request_id="r", instance_id="p-0", first_token=3, prompt_tokens=4, cached_tokens=0,
                          first_logprobs=lp)
    assert decode(first.encode()) == first
    for bad in ({"logprob": "x"}, {"logprob": -1.0, "top_ids": [1], "top_logprobs": []},
                {"logprob": -1.0, "top_ids": [1.5], "top_logprobs": [-1.0]}, {"logprob": -1.0, "extra": 1}):
        body = _to_wire(chunk)
        body["logprobs"] = [bad]
        with pytest.raises(ProtocolError):
            decode(msgpack.packb({"v": 1, "t": "tokens", "d": body}))
    body = _to_wire(chunk)
    body["logprobs"] = [_to_wire(lp), _to_wire(lp)]  # two logprobs for one token
    with pytest.raises(ProtocolError, match="one per token"):
        decode(msgpack.packb({"v": 1, "t": "tokens", "d": body}))
