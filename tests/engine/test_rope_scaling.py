"""RoPE scaling (linear, llama3) equals transformers on seeded tiny Llama checkpoints, fp32, through
a chunked prefill over the paged cache and decode steps, at positions where the scaling matters."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from pdd.engine import SamplingParams
from pdd.engine.torch_backend.tiny import build_tiny_checkpoint

from .conftest import make_engine, run_all

TOL = 1e-4  # as the unscaled tiny models in test_logits_vs_hf.py
# head_dim 16: wavelengths 6, 20, 63, 199, 628, ... tokens; with original_max_position_embeddings 64
# and high/low_freq_factor 4/1, llama3 keeps the first, smooths the next two, and divides the rest.
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


def _checkpoint(root: Path, scaling: dict | None, legacy: bool = False) -> str:
    params = {"rope_theta": 10000.0, **(scaling or {"rope_type": "default"})}
    path = build_tiny_checkpoint(root, "llama", seed=11, rope_parameters=params)
    if legacy:  # a transformers-4 config.json: rope_theta + rope_scaling {"type": ...}
        cfg_path = Path(path) / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("rope_parameters")
        cfg["rope_theta"] = 10000.0
        cfg["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
        cfg_path.write_text(json.dumps(cfg))
    return path


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("kind, legacy", [("linear", False), ("llama3", False), ("linear", True)])
def test_rope_scaling_matches_transformers(kind, legacy, tmp_path):
    path = _checkpoint(tmp_path / kind, SCALINGS[kind], legacy)
    hf = _hf(path)
    rope = hf.config.rope_parameters
    assert rope["rope_type"] == kind and rope["factor"] == SCALINGS[kind]["factor"]  # HF read it as we wrote it
    engine = make_engine(path, num_blocks=160, max_prefill_tokens=128)  # 3 prefill chunks: extends over the cache
    assert engine.config.rope_scaling["factor"] == SCALINGS[kind]["factor"]
    engine.capture_logits = True
    rng = random.Random(3)
    prompt = [rng.randrange(engine.config.vocab_size) for _ in range(300)]
    engine.add_request("r", prompt, SamplingParams(ignore_eos=True), max_new_tokens=8)
    out = run_all(engine)["r"]
    got = torch.stack(engine.captured_logits["r"])
    ref = _hf_logits(hf, prompt + out[:-1])[len(prompt) - 1 :]
    diff = (got - ref).abs().max().item()
    assert diff <= TOL, f"{kind}: max abs logit diff {diff}"
    # the scaling changes these logits: an engine that ignored it would fail the comparison above
    plain = _hf_logits(_hf(_checkpoint(tmp_path / "plain", None)), prompt + out[:-1])[len(prompt) - 1 :]
    assert (plain - ref).abs().max().item() > 100 * TOL
