"""Logprobs and penalties across a forced P-RLD-MD catch-up handoff, through the official ``openai`` client.

The relay decodes the first positions, main decode learns them by token ids and continues: every token
and every logprob must equal what one engine computes alone for the same request (and what the P-RLD
path, where the relay finishes locally, returns), in streaming and non-streaming form. The system serves
`dtype: auto` (bf16 or fp32 as the dtype probe measured on this CPU, or PDD_NATIVE_BF16); the `reference`
engine resolves the same.
"""

from __future__ import annotations

import openai
import pytest

from pdd.engine import SamplingParams
from tests.e2e.conftest import until_handed_over

MAX_TOKENS = 800  # MD's KV lands mid-stream and MD takes over (at 300 the relay, one C call a step, could finish first)
PROMPT = [7, 300, 41, 41, 41, 12, 99, 250, 250, 13, 5, 77, 140, 6, 6, 6, 310, 88, 19, 201] * 3
ABS = 1e-4  # logprobs (float32 in every dtype) of the same position from another engine's forward pass: rounding


@pytest.fixture(scope="module")
def client(system) -> openai.OpenAI:
    return openai.OpenAI(base_url=system.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


def _single_engine(engine, prompt, params, n):
    """Tokens and logprobs of one engine running the request alone."""
    rid = f"ref-{id(params)}-{len(prompt)}"
    engine.add_request(rid, prompt, params, max_new_tokens=n)
    tokens, lps = [], []
    while rid in engine.requests:
        for o in engine.step():
            if o.rid == rid:
                tokens += o.token_ids
                lps += o.logprobs or []
    return tokens, lps


def _pdd(pipeline: str, handoff: str | None = None) -> dict:
    return {"pdd": {"pipeline": pipeline, "return_token_ids": True, **({"handoff": handoff} if handoff else {})}}


PENALISED = {"frequency_penalty": 0.6, "presence_penalty": 0.4, "repetition_penalty": 1.3, "min_tokens": MAX_TOKENS - 5}


def _stream_info(chunks: list) -> dict:
    """The `pdd` block of a streamed response."""
    return next(c.model_extra["pdd"] for c in chunks if c.model_extra.get("pdd"))


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_and_penalties_match_one_engine_across_catch_up(system, reference, client, stream):
    kwargs = {"model": client.models.list().data[0].id, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                  "logprobs": 5, "frequency_penalty": PENALISED["frequency_penalty"],
                  "presence_penalty": PENALISED["presence_penalty"]}
    extra = {"repetition_penalty": PENALISED["repetition_penalty"], "min_tokens": PENALISED["min_tokens"]}
    want, want_lp = _single_engine(reference, PROMPT, SamplingParams(logprobs=5, **PENALISED), MAX_TOKENS)
    plain, _ = _single_engine(reference, PROMPT, SamplingParams(ignore_eos=True), MAX_TOKENS)
    assert want != plain  # the penalties change the answer, so matching it means they were applied

    if stream:
        chunks = until_handed_over(lambda: list(client.completions.create(**kwargs, stream=True, extra_body={
            **extra, **_pdd("P-RLD-MD", "catch-up")})), _stream_info)
        info = _stream_info(chunks)
        lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for lp in lps for t in lp.tokens]
        token_logprobs = [v for lp in lps for v in lp.token_logprobs]
        top = [d for lp in lps for d in lp.top_logprobs]
        offsets = [o for lp in lps for o in lp.text_offset]
    else:
        resp = until_handed_over(lambda: client.completions.create(**kwargs, extra_body={
            **extra, **_pdd("P-RLD-MD", "catch-up")}), lambda r: r.model_extra["pdd"])
        info = resp.model_extra["pdd"]
        lp = resp.choices[0].logprobs
        tokens, token_logprobs, top, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    assert info["pipeline"] == "P-RLD-MD" and info.get("handoff_mode") == "catch-up", info
    assert 0 < info["rld_tokens"] < len(want) - 1  # the relay produced some positions, MD the rest
    assert info["token_ids"] == want
    tok = reference.tokenizer
    assert tokens == [tok.decode([t]) for t in want]
    assert token_logprobs == pytest.approx([lp.logprob for lp in want_lp], abs=ABS)
    for got, ref, chosen in zip(top, want_lp, want):
        want_top = {tok.decode([i]): v for i, v in zip(ref.top_ids, ref.top_logprobs)}
        want_top.setdefault(tok.decode([chosen]), ref.logprob)
        assert got.keys() == want_top.keys()
        assert list(got.values()) == pytest.approx(list(want_top.values()), abs=ABS)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_chat_sampled_logprobs_identical_across_catch_up_and_local_finish(system, client):
    """A sampled request (seed, temperature, min_p, penalties) streamed through P-RLD-MD catch-up equals
    the same request finished by the relay alone (P-RLD), token by token and logprob by logprob."""
    kwargs = {"model": client.models.list().data[0].id, "messages": [{"role": "user", "content": "tell me a story"}],
                  "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 4242, "logprobs": True, "top_logprobs": 3,
                  "frequency_penalty": 0.3, "presence_penalty": 0.2}
    extra = {"min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": MAX_TOKENS - 5}
    local = client.chat.completions.create(**kwargs, extra_body={**extra, **_pdd("P-RLD")})
    chunks = until_handed_over(lambda: list(client.chat.completions.create(
        **kwargs, stream=True, extra_body={**extra, **_pdd("P-RLD-MD", "catch-up")})), _stream_info)
    info = _stream_info(chunks)
    assert info.get("handoff_mode") == "catch-up" and 0 < info["rld_tokens"], info
    assert info["token_ids"] == local.model_extra["pdd"]["token_ids"]
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    full = local.choices[0].logprobs.content
    assert len(streamed) == len(full) == len(info["token_ids"]) == local.usage.completion_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == local.choices[0].message.content
    for s, f in zip(streamed, full):
        assert (s.token, s.bytes) == (f.token, f.bytes) and s.bytes == list(s.token.encode())
        assert s.logprob == pytest.approx(f.logprob, abs=ABS)
        assert [t.token for t in s.top_logprobs] == [t.token for t in f.top_logprobs] and len(s.top_logprobs) == 3
        assert [t.logprob for t in s.top_logprobs] == pytest.approx([t.logprob for t in f.top_logprobs], abs=ABS)
        assert [t.logprob for t in s.top_logprobs] == sorted((t.logprob for t in s.top_logprobs), reverse=True)


@pytest.mark.parametrize("field, value", [("top_logprobs", 21), ("min_p", 1.5), ("repetition_penalty", 0),
                                          ("min_tokens", 50), ("presence_penalty", -2.5)])
def test_bad_values_are_400s_naming_the_field(system, client, field, value):
    kwargs = {"model": client.models.list().data[0].id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                  "logprobs": True}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**kwargs, extra_body={field: value})
    assert exc.value.status_code == 400 and field in exc.value.message
