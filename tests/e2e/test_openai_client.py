"""The official ``openai`` client against a running system (real NATS, router, P, RLD, MD on the tiny
model): the vLLM fields PDD implements behave as in vLLM, the ones it refuses give a 400 naming them.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from pdd.shared.tokenizer import load_tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
MESSAGES = [{"role": "user", "content": "Tell me about 中文 and émojis 🎉"}]


@pytest.fixture(scope="module")
def client(system) -> openai.OpenAI:
    return openai.OpenAI(base_url=system.base_url + "/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(tiny_model)


def _complete(client, model, stream: bool = False, **extra) -> tuple[str, dict]:
    """(text, pdd info) of a greedy completion; ``extra`` goes into the body as is."""
    body = {"temperature": 0, "max_tokens": 40, "extra_body": {"ignore_eos": True, "pdd": {"return_token_ids": True},
                                                             **extra}}
    if not stream:
        r = client.completions.create(model=model, prompt=PROMPT, **body)
        return r.choices[0].text, r.model_extra["pdd"]
    parts, info = [], {}
    for chunk in client.completions.create(model=model, prompt=PROMPT, stream=True, **body):
        if chunk.choices:
            parts.append(chunk.choices[0].text)
        info = (chunk.model_extra or {}).get("pdd") or info
    return "".join(parts), info


@pytest.mark.parametrize("stream", [False, True])
def test_streamed_and_plain_text_is_the_decode_of_the_tokens(client, model, tokenizer, stream):
    text, info = _complete(client, model, stream=stream)
    assert text == tokenizer.decode(info["token_ids"], skip_special_tokens=True)
    raw, info = _complete(client, model, stream=stream, skip_special_tokens=False)
    assert raw == tokenizer.decode(info["token_ids"], skip_special_tokens=False)


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(client, model, stream):
    full, _ = _complete(client, model)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    cut = full.index(stop)
    without, _ = _complete(client, model, stream=stream, stop=[stop])
    assert without == full[:cut]
    with_stop, _ = _complete(client, model, stream=stream, stop=[stop], include_stop_str_in_output=True)
    assert with_stop == full[:cut + len(stop)]


def test_chat_template_fields_and_tokenize(system, client, model, tokenizer):
    def prompt_tokens(**extra) -> int:
        r = client.chat.completions.create(model=model, messages=MESSAGES + extra.pop("more", []), max_tokens=4,
                                           temperature=0, extra_body=extra)
        return r.usage.prompt_tokens

    tok = httpx.post(system.base_url + "/tokenize", json={"model": model, "messages": MESSAGES}).json()
    assert prompt_tokens() == tok["count"]
    assert tok["tokens"] == list(tokenizer.encode(tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False), add_special_tokens=False))
    no_gen = httpx.post(system.base_url + "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
    assert prompt_tokens(add_generation_prompt=False) == no_gen.json()["count"] < tok["count"]
    partial = [{"role": "assistant", "content": "Sure"}]
    cont = httpx.post(system.base_url + "/tokenize", json={"messages": MESSAGES + partial,
                                                          "add_generation_prompt": False,
                                                          "continue_final_message": True}).json()
    assert tokenizer.decode(cont["tokens"]).endswith("assistant\nSure")
    assert prompt_tokens(more=partial, add_generation_prompt=False, continue_final_message=True) == cont["count"]
    with pytest.raises(openai.BadRequestError) as exc:
        prompt_tokens(more=partial, continue_final_message=True)  # add_generation_prompt defaults to true
    assert exc.value.body["param"] == "continue_final_message"
    with pytest.raises(openai.BadRequestError) as exc:
        prompt_tokens(chat_template_kwargs={"add_generation_prompt": False})
    assert exc.value.body["param"] == "chat_template_kwargs"


def test_detokenize_and_version(system, model, tokenizer):
    ids = tokenizer.encode("Hello 中文 🎉")
    r = httpx.post(system.base_url + "/detokenize", json={"model": model, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(ids)}
    r = httpx.get(system.base_url + "/version")
    assert r.status_code == 200 and r.json()["version"]


@pytest.mark.parametrize("stream", [False, True])
def test_usage_reports_cached_prompt_tokens(client, model, stream):
    prompt = "A prompt long enough to fill whole KV blocks, repeated for the prefix cache. " * 4
    kwargs = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0,
              "extra_body": {"pdd": {"pipeline": "P-MD"}, "ignore_eos": True}}
    client.completions.create(**kwargs)  # warms the prefix cache
    if not stream:
        r = client.completions.create(**kwargs)
        usage, info = r.usage, r.model_extra["pdd"]
    else:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        usage, info = chunks[-1].usage, chunks[-1].model_extra["pdd"]
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == info["p_cached_tokens"] > 0


def test_refused_fields_name_themselves(client, model):
    chat = {"model": model, "messages": MESSAGES, "max_tokens": 4}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
         "response_format"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"extra_body": {"structured_outputs": {"choice": ["a", "b"]}}}, "structured_outputs"),
        ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
        ({"extra_body": {"guided_choice": ["a", "b"]}}, "guided_choice"),
        ({"extra_body": {"guided_regex": "a+"}}, "guided_regex"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
        ({"extra_body": {"chat_template": "{{ messages }}"}}, "chat_template"),
    ]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(**chat, **kwargs)
        assert exc.value.body["param"] == field, (field, exc.value.body)
        assert field in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert exc.value.body["param"] == "response_format"
    # unknown fields are accepted (and logged by the router)
    r = client.chat.completions.create(**chat, extra_body={"not_a_field": 1, "tool_choice": "none"})
    assert r.choices[0].finish_reason in ("stop", "length")
