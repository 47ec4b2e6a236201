"""The vLLM-compatible request surface of the HTTP layer: every field vLLM accepts is implemented or
refused with a 400 naming it; chat-template options; stop-string and stop-token text; usage's cached
tokens; /tokenize, /detokenize, /version; and streamed text equal to a full decode.

The backend is the fake of test_api.py (the HTTP layer's only collaborator); tokenizers are real: the
tiny byte-level BPE and the built-in SmolLM2's.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from pdd.engine.torch_backend.tiny import CHAT_TEMPLATE, build_tokenizer
from pdd.router import api as api_module
from pdd.router.api import create_app
from pdd.router.detokenize import IncrementalDetokenizer
from pdd.shared.tokenizer import render_messages
from tests.router.test_api import MODEL, FakeBackend, _sse_events

MESSAGES = [{"role": "user", "content": "Say hi"}]
UNICODE_TEXTS = ["Hello world! 中文字符 and émojis 🎉🎉 done.", " leading space\n\n  tabs\tx",
                 "ünïcödé ñ 日本語のテキスト 🤖 after", "Ωmega ∑ ≈ ∞ 👩‍👩‍👧 family", "a" * 40]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def smol_tokenizer():
    from pdd.shared.model_files import default_model_path
    from pdd.shared.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.fixture
def backend(tokenizer) -> FakeBackend:
    return FakeBackend(tokenizer)


@pytest.fixture
async def client(backend) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(backend)),
                                 base_url="http://router") as c:
        yield c


def _chat(**extra: Any) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 100, **extra}


def _completion(**extra: Any) -> dict:
    return {"model": MODEL, "prompt": "Hello world", "max_tokens": 100, **extra}


async def _text(client: httpx.AsyncClient, path: str, body: dict) -> str:
    """The output text, streamed or not."""
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        choice = r.json()["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    parts = []
    for ev in _sse_events(r.text):
        if ev != "[DONE]" and ev["choices"]:
            c = ev["choices"][0]
            parts.append(c["text"] if "text" in c else c["delta"].get("content", ""))
    return "".join(parts)


# ---- refused fields ---------------------------------------------------------------------------

# every vLLM/OpenAI field PDD refuses, with a value that asks for the feature
REFUSED_COMMON = {
    "structured_outputs": {"json": {"type": "object"}}, "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+", "guided_choice": ["yes", "no"], "guided_grammar": "root ::= 'a'",
    "structural_tag": "{}", "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ",
    "response_format": {"type": "json_object"}, "use_beam_search": True, "length_penalty": 0.5,
    "allowed_token_ids": [1, 2], "bad_words": ["x"], "truncate_prompt_tokens": 4, "prompt_logprobs": 1,
    "logits_processors": ["x"], "return_tokens_as_token_ids": True, "return_token_ids": True,
    "spaces_between_special_tokens": False, "priority": 1, "cache_salt": "s", "request_id": "r",
    "kv_transfer_params": {"do_remote_prefill": True}, "vllm_xargs": {"a": 1},
}
REFUSED_CHAT = {
    "tool_choice": "required", "functions": [{"name": "f"}], "function_call": "auto", "chat_template": "{{ x }}",
    "documents": [{"text": "d"}], "mm_processor_kwargs": {"a": 1}, "echo": True, "reasoning_effort": "low",
    "verbosity": "low", "modalities": ["text", "audio"], "audio": {"voice": "x"},
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {}, "media_io_kwargs": {"a": 1},
    "best_of": 2,
}
REFUSED_COMPLETION = {"prompt_embeds": "AAAA"}


@pytest.mark.parametrize("field,value", [*REFUSED_COMMON.items(), *REFUSED_CHAT.items()])
async def test_chat_refuses_unimplemented_fields_by_name(client, backend, field, value):
    r = await client.post("/v1/chat/completions", json=_chat(**{field: value}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err
    assert not backend.requests  # nothing reached the backend


@pytest.mark.parametrize("field,value", [*REFUSED_COMMON.items(), *REFUSED_COMPLETION.items()])
async def test_completions_refuse_unimplemented_fields_by_name(client, backend, field, value):
    r = await client.post("/v1/completions", json=_completion(**{field: value}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert not backend.requests


async def test_neutral_values_of_refused_fields_are_accepted(client, backend):
    """Clients that send a field's do-nothing value (null, false, the default) are not refused."""
    neutral = {"guided_json": None, "use_beam_search": False, "length_penalty": 1.0, "bad_words": [],
               "spaces_between_special_tokens": True, "priority": 0, "return_token_ids": False,
               "response_format": {"type": "text"}, "tool_choice": "none", "modalities": ["text"], "echo": False,
               "parallel_tool_calls": True, "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
               "function_call": "none", "include_reasoning": True}
    r = await client.post("/v1/chat/completions", json=_chat(**neutral))
    assert r.status_code == 200, r.text
    r = await client.post("/v1/chat/completions", json=_chat(tool_choice="auto"))
    assert r.status_code == 200, r.text


async def test_unknown_fields_are_accepted_and_logged_once_per_name(client, backend, monkeypatch):
    monkeypatch.setattr(api_module, "_unknown_logged", set())
    with capture_logs() as logs:
        for _ in range(3):
            r = await client.post("/v1/completions", json=_completion(frobnicate=1, wibble="x"))
            assert r.status_code == 200, r.text
    named = sorted(e["field"] for e in logs if e.get("event") == "unknown_request_field")
    assert named == ["frobnicate", "wibble"]


# ---- chat template ----------------------------------------------------------------------------

async def test_add_generation_prompt_and_continue_final_message(client, backend, tokenizer):
    r = await client.post("/v1/chat/completions", json=_chat(add_generation_prompt=False))
    assert r.status_code == 200, r.text
    assert backend.requests[-1].prompt_ids == render_messages(tokenizer, MESSAGES, add_generation_prompt=False)
    assert not tokenizer.decode(backend.requests[-1].prompt_ids).endswith("<|im_start|>assistant\n")

    partial = [*MESSAGES, {"role": "assistant", "content": "Hi the"}]
    r = await client.post("/v1/chat/completions", json={**_chat(add_generation_prompt=False,
                                                               continue_final_message=True), "messages": partial})
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(backend.requests[-1].prompt_ids)
    assert prompt.endswith("<|im_start|>assistant\nHi the"), prompt  # no end-of-turn: the model continues it

    r = await client.post("/v1/chat/completions", json={**_chat(continue_final_message=True), "messages": partial})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


async def test_chat_template_kwargs_reach_the_template():
    tok = build_tokenizer()
    tok.chat_template = "{% if shout %}LOUD {% endif %}" + CHAT_TEMPLATE
    backend = FakeBackend(tok)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(backend)), base_url="http://r") as c:
        r = await c.post("/v1/chat/completions", json=_chat(chat_template_kwargs={"shout": True}))
        assert r.status_code == 200, r.text
        assert tok.decode(backend.requests[-1].prompt_ids).startswith("LOUD ")
        r = await c.post("/v1/chat/completions", json=_chat())
        assert not tok.decode(backend.requests[-1].prompt_ids).startswith("LOUD")
        r = await c.post("/v1/chat/completions", json=_chat(chat_template_kwargs={"tokenize": True}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
        assert "tokenize" in r.json()["error"]["message"]


# ---- stop strings, stop tokens, special tokens ----------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body", [("/v1/completions", _completion), ("/v1/chat/completions", _chat)])
async def test_include_stop_str_in_output(client, backend, stream, path, body):
    assert await _text(client, path, body(stop=["How"], stream=stream)) == "Hello world! "
    text = await _text(client, path, body(stop=["How"], stream=stream, include_stop_str_in_output=True))
    assert text == "Hello world! How"
    assert (await _text(client, path, body(stop=["xyz"], stream=stream, include_stop_str_in_output=True))
            == "Hello world! How are you today? I am fine, thank you.")


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_token_text_and_skip_special_tokens(client, backend, tokenizer, stream):
    """EOS ends the output ("stop"): its text shows only with skip_special_tokens=false and
    include_stop_str_in_output (vLLM); a special token inside the output shows with skip_special_tokens=false."""
    backend.output_ids = tokenizer.encode("Hi<|im_start|>there") + [tokenizer.eos_token_id]
    assert await _text(client, "/v1/completions", _completion(stream=stream)) == "Hithere"
    assert (await _text(client, "/v1/completions", _completion(stream=stream, skip_special_tokens=False))
            == "Hi<|im_start|>there")
    assert (await _text(client, "/v1/completions", _completion(stream=stream, skip_special_tokens=False,
                                                                include_stop_str_in_output=True))
            == "Hi<|im_start|>there<|im_end|>")
    # a stop_token_ids entry that is an ordinary token: its text is left out, as vLLM does
    backend.output_ids = tokenizer.encode("Hi there!")
    last = backend.output_ids[-1]
    without = tokenizer.decode(backend.output_ids[:-1])
    assert without != "Hi there!"
    assert await _text(client, "/v1/completions", _completion(stream=stream, stop_token_ids=[last])) == without
    assert (await _text(client, "/v1/completions", _completion(stream=stream, stop_token_ids=[last],
                                                                include_stop_str_in_output=True)) == "Hi there!")


# ---- usage: cached tokens ---------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [("/v1/completions", _completion), ("/v1/chat/completions", _chat)])
async def test_usage_reports_cached_prompt_tokens(client, backend, path, body):
    backend.info = {**backend.info, "p_cached_tokens": 3}
    r = await client.post(path, json=body())
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    r = await client.post(path, json=body(stream=True, stream_options={"include_usage": True}))
    final = [ev for ev in _sse_events(r.text) if ev != "[DONE]" and ev.get("usage")][-1]
    assert final["choices"] == [] and final["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}


# ---- /tokenize, /detokenize, /version ---------------------------------------------------------

async def test_tokenize_detokenize_version(client, backend, tokenizer):
    r = await client.post("/tokenize", json={"model": MODEL, "prompt": "Hello 中文", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tokenizer.encode("Hello 中文")
    assert body == {"count": len(ids), "max_model_len": backend.max_context, "tokens": ids,
                    "token_strs": tokenizer.convert_ids_to_tokens(ids)}

    # messages: exactly the ids /v1/chat/completions prefills
    r = await client.post("/tokenize", json={"messages": MESSAGES})
    await client.post("/v1/chat/completions", json=_chat())
    assert r.json()["tokens"] == backend.requests[-1].prompt_ids and r.json()["token_strs"] is None
    r = await client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
    assert r.json()["tokens"] == render_messages(tokenizer, MESSAGES, add_generation_prompt=False)
    r = await client.post("/tokenize", json={"messages": MESSAGES, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"

    r = await client.post("/detokenize", json={"model": MODEL, "tokens": ids + [tokenizer.eos_token_id]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello 中文<|im_end|>"}
    r = await client.post("/detokenize", json={"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = await client.post("/detokenize", json={"model": "other", "tokens": [1]})
    assert r.status_code == 404

    r = await client.get("/version")
    assert r.status_code == 200 and r.json()["version"].count(".") >= 2


# ---- incremental detokenization ---------------------------------------------------------------

def _streamed(tok: Any, prompt: list[int], out: list[int], skip: bool) -> str:
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    return "".join(d.add(i).text for i in out) + d.finish()


@pytest.mark.parametrize("which", ["tiny", "smol"])
def test_streamed_text_equals_full_decode(which, tokenizer, smol_tokenizer):
    """Token by token, the text is the full decode of the output: for unicode text, and for random
    token sequences (stray bytes, special tokens) after the prompt's last whole character."""
    tok = tokenizer if which == "tiny" else smol_tokenizer
    prompt = tok.encode("User: please answer")
    for text in UNICODE_TEXTS:
        out = tok.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert _streamed(tok, prompt, out, skip) == tok.decode(out, skip_special_tokens=skip) == text
    rng = random.Random(0)
    vocab = len(tok)
    for _ in range(300):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]
        out = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            seed = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)._seed_ids
            assert "\ufffd" not in tok.decode(seed, skip_special_tokens=skip)
            full = tok.decode(seed + out, skip_special_tokens=skip)[len(tok.decode(seed, skip_special_tokens=skip)):]
            assert _streamed(tok, prompt, out, skip) == full


def test_stop_strings_count_only_from_min_tokens(tokenizer):
    """vLLM: a stop string in the first ``min_tokens`` outputs does not end the output."""
    prompt = tokenizer.encode("User: count")
    out = [tokenizer.encode(w, add_special_tokens=False) for w in ["one", " two", " one", " three"]]
    ids = [i for piece in out for i in piece]
    first_one_ends = len(out[0])
    for min_tokens, expected in [(0, ""), (first_one_ends + 1, "one two ")]:
        d = IncrementalDetokenizer(tokenizer, prompt, stop=["one"], min_tokens=min_tokens)
        text = ""
        for i in ids:
            step = d.add(i)
            text += step.text
            if step.stopped:
                break
        assert d.stopped and text == expected, (min_tokens, text)
