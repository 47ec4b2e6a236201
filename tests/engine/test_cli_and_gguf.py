"""`pdd generate` end to end, and the built-in SmolLM2 GGUF against transformers' GGUF loader."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pdd.services.launch.cli import main


def test_generate_json(llama_path, capsys):
    rc = main(["generate", "--model", llama_path, "--prompt", "Hello world", "--max-tokens", "5", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["prompt"] == "Hello world" and len(data["output_token_ids"]) <= 5
    assert data["prompt_token_ids"]


def test_generate_chat_text_and_bad_input(llama_path, capsys):
    assert main(["generate", "--model", llama_path, "--prompt", "Hi", "--chat", "--max-tokens", "3",
                 "--temperature", "0.7", "--seed", "1"]) == 0
    assert main(["generate", "--model", llama_path, "--prompt", "Hi", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_smollm2_gguf_matches_transformers():
    """3 prompts x 32 greedy tokens equal transformers' own GGUF loading of the same file."""
    from transformers import AutoModelForCausalLM

    from pdd.engine import Engine, SamplingParams
    from pdd.shared.model_files import default_model_path
    from pdd.shared.tokenizer import render_chat

    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    engine = Engine.from_model(path, kv_memory_bytes=32 * 1024 * 1024)
    tok = engine.tokenizer
    prompts = [
        render_chat(tok, "What is the capital of France?"),
        list(tok("The quick brown fox").input_ids),
        render_chat(tok, "Write a haiku about the sea."),
    ]
    ours = engine.generate(prompts, SamplingParams(), max_new_tokens=32)  # both stop at EOS
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    for prompt, out in zip(prompts, ours):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
        assert out == ref
