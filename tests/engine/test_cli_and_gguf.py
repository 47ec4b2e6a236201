"""`pdd generate` end to end, and the built-in SmolLM2 GGUF against transformers' GGUF loader."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pdd.launch.cli import main


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


def test_generate_sampling_flags_reach_the_engine(llama_path, capsys):
    """The penalties and ignore_eos given on the command line draw exactly what the engine draws with them."""
    from pdd.engine import SamplingParams
    from pdd.engine.torch_backend.engine import TorchEngine

    flags = ["--max-tokens", "12", "--ignore-eos", "--repetition-penalty", "1.8", "--frequency-penalty", "0.7",
             "--presence-penalty", "0.4", "--min-p", "0.05", "--temperature", "0.9", "--seed", "3",
             "--dtype", "float32"]
    assert main(["generate", "--model", llama_path, "--prompt", "Hello world", "--json", *flags]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    engine = TorchEngine.from_model(llama_path, dtype="float32", kv_memory_bytes=16 << 20)  # as --dtype above
    params = SamplingParams(temperature=0.9, seed=3, ignore_eos=True, repetition_penalty=1.8, frequency_penalty=0.7,
                            presence_penalty=0.4, min_p=0.05)
    engine.add_request("r", got["prompt_token_ids"], params, max_new_tokens=12)
    want = [t for _ in iter(engine.has_work, False) for o in engine.step() for t in o.token_ids]
    plain = SamplingParams(temperature=0.9, seed=3, ignore_eos=True)
    engine.add_request("p", got["prompt_token_ids"], plain, max_new_tokens=12)
    without = [t for _ in iter(engine.has_work, False) for o in engine.step() for t in o.token_ids]
    assert got["output_token_ids"] == want and len(want) == 12
    assert without != want  # the flags changed the draw (else the comparison above proves nothing)
    assert main(["generate", "--model", llama_path, "--prompt", "Hi", "--repetition-penalty", "0"]) == 2
    assert "repetition_penalty" in capsys.readouterr().err


def test_smollm2_gguf_matches_transformers():
    """3 prompts x 32 greedy tokens equal transformers' own GGUF loading of the same file."""
    from transformers import AutoModelForCausalLM

    from pdd.engine import SamplingParams
    from pdd.engine.torch_backend.engine import TorchEngine
    from pdd.shared.model_files import default_model_path
    from pdd.shared.tokenizer import render_chat

    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    engine = TorchEngine.from_model(path, dtype="float32", kv_memory_bytes=32 * 1024 * 1024)  # as transformers below
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
