"""Bad input gets a typed ValueError naming the problem, and leaves no blocks behind."""

from __future__ import annotations

import json
import shutil

import pytest

from pdd.engine import (
    DuplicateRequestError,
    EmptyPromptError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    SamplingParams,
    UnknownRequestError,
    UnsupportedArchitectureError,
)
from pdd.engine.torch_backend.engine import TorchEngine

from .conftest import make_engine


@pytest.fixture(scope="module")
def engine(llama_path):
    return make_engine(llama_path)


def test_empty_prompt(engine):
    with pytest.raises(EmptyPromptError, match="empty"):
        engine.add_request("e", [], SamplingParams(), 4)
    assert isinstance(EmptyPromptError("x"), ValueError)


def test_prompt_over_context(engine):
    with pytest.raises(PromptTooLongError, match="context limit"):
        engine.add_request("long", [1] * engine.max_context, SamplingParams(), 4)


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-5), "top_k"),
        (SamplingParams(seed="x"), "seed"),
        (SamplingParams(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params(engine, params, field):
    with pytest.raises(InvalidSamplingParamsError, match=field):
        engine.add_request("s", [1, 2, 3], params, 4)
    assert "s" not in engine.requests


def test_bad_max_tokens_and_token_ids(engine):
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request("m", [1, 2], SamplingParams(), 0)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("v", [1, 10**9], SamplingParams(), 2)


def test_duplicate_and_unknown_ids(engine):
    engine.add_request("d", [1, 2, 3], SamplingParams(), 2)
    with pytest.raises(DuplicateRequestError, match="'d'"):
        engine.add_request("d", [1, 2, 3], SamplingParams(), 2)
    engine.abort("d")
    with pytest.raises(UnknownRequestError, match="unknown request"):
        engine.request_blocks("nope")
    assert engine.num_free_blocks() == engine.num_total_blocks() - engine.cache.cached_blocks


def test_unknown_architecture(llama_path, tmp_path):
    bad = tmp_path / "gpt2ish"
    shutil.copytree(llama_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        TorchEngine.from_model(str(bad), num_blocks=8)


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        TorchEngine.from_model(str(tmp_path / "nothing"), num_blocks=8)
