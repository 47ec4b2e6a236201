"""Shared fixtures: tiny seeded checkpoints (built once per session) and their HF reference models."""

from __future__ import annotations

import pytest
import torch

from pdd.engine.torch_backend.engine import TorchEngine
from pdd.engine.torch_backend.tiny import build_tiny_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_checkpoint(root / arch, arch, seed=7) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def llama_path(tiny_paths) -> str:
    return tiny_paths["llama"]


@pytest.fixture(scope="session")
def hf_models(tiny_paths):
    from transformers import AutoModelForCausalLM

    return {a: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for a, p in tiny_paths.items()}


def make_engine(path: str, **kw) -> TorchEngine:
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_seqs", 16)
    kw.setdefault("max_prefill_tokens", 256)
    return TorchEngine.from_model(path, **kw)


def run_all(engine: TorchEngine) -> dict[str, list[int]]:
    """Step until idle; collect each request's emitted tokens (checking positions are contiguous)."""
    out: dict[str, list[int]] = {}
    guard = 0
    while engine.has_work():
        for o in engine.step():
            toks = out.setdefault(o.rid, [])
            if o.token_ids:
                assert o.start_position >= 0
                toks.extend(o.token_ids)
        guard += 1
        assert guard < 100_000
    return out
