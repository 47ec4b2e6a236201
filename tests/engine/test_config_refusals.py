"""Checkpoints the executor cannot compute are refused at load with an error naming the config field,
instead of loading and serving wrong logits; the configurations it does compute still load."""

from __future__ import annotations

import json
import shutil

import pytest

from pdd.engine.torch_backend.engine import TorchEngine
from pdd.engine.torch_backend.config import config_from_gguf, config_from_hf
from pdd.engine.core.errors import EngineInputError, UnsupportedArchitectureError


def _hf(**overrides) -> dict:
    cfg = {
        "model_type": "llama", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "hidden_act": "silu",
    }
    cfg.update(overrides)
    return cfg


@pytest.mark.parametrize("overrides, field", [
    ({"model_type": "mistral", "sliding_window": 1024}, "sliding_window"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 1024}, "sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"num_local_experts": 8, "num_experts_per_tok": 2}, "num_local_experts"),
    ({"num_experts": 60}, "num_experts"),
    ({"n_routed_experts": 64}, "n_routed_experts"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor"),
])
def test_hf_config_refused_naming_the_field(overrides, field):
    with pytest.raises(UnsupportedArchitectureError, match=field.replace(".", r"\.")) as info:
        config_from_hf(_hf(**overrides))
    assert isinstance(info.value, EngineInputError)  # a ValueError callers already map to "bad input"


@pytest.mark.parametrize("overrides", [
    {},
    {"model_type": "mistral", "sliding_window": None},
    {"model_type": "mistral", "sliding_window": 4096},  # window covers the whole context: full attention
    {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 1024},
    {"layer_types": ["full_attention", "full_attention"]},
    {"num_experts": 0},
    {"rope_scaling": {"type": "linear", "factor": 2.0}},
    {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
])
def test_hf_configs_the_engine_computes_still_load(overrides):
    assert config_from_hf(_hf(**overrides)).num_layers == 2


def _gguf(**extra) -> dict:
    meta = {
        "general.architecture": "llama", "llama.block_count": 2, "llama.context_length": 4096,
        "llama.embedding_length": 64, "llama.feed_forward_length": 128, "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2, "llama.rope.dimension_count": 16,
    }
    meta.update({f"llama.{k}": v for k, v in extra.items()})
    return meta


@pytest.mark.parametrize("extra, field", [
    ({"expert_count": 8, "expert_used_count": 2}, "llama.expert_count"),  # how llama.cpp stores Mixtral
    ({"attention.sliding_window": 1024}, "llama.attention.sliding_window"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, "llama.rope.scaling.type"),
    ({"rope.scaling.type": "linear"}, "llama.rope.scaling.factor"),
    ({"rope.dimension_count": 8}, "llama.rope.dimension_count"),
])
def test_gguf_metadata_refused_naming_the_field(extra, field):
    with pytest.raises(UnsupportedArchitectureError, match=field.replace(".", r"\.")):
        config_from_gguf(_gguf(**extra), vocab_size=384, has_output=True)


def test_gguf_linear_rope_and_dense_still_load():
    cfg = config_from_gguf(_gguf(**{"rope.scaling.type": "linear", "rope.scaling.factor": 2.0, "expert_count": 0}),
                           vocab_size=384, has_output=False)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0} and cfg.tie_word_embeddings


def test_engine_refuses_a_sliding_window_checkpoint_at_load(llama_path, tmp_path):
    """End to end: the refusal reaches TorchEngine.from_model before any weight is used."""
    bad = tmp_path / "swa"
    shutil.copytree(llama_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(model_type="mistral", sliding_window=64)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="sliding_window=64"):
        TorchEngine.from_model(str(bad), num_blocks=8)


def test_gguf_tensor_the_engine_does_not_compute_is_refused(tmp_path):
    """A tensor with no place in the executor (llama3.1's rope_freqs) is an error, not silently skipped."""
    import gguf
    import numpy as np

    from pdd.engine.torch_backend.loader import load_gguf

    path = str(tmp_path / "extra.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in _gguf().items():
        if key != "general.architecture":
            writer.add_uint32(key, value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((384, 64), dtype=np.float32))
    writer.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match=r"rope_freqs\.weight"):
        load_gguf(path)


def test_the_config_alone_is_the_config_the_weights_come_with(llama_path):
    """load_model_config (the launcher's dtype probe reads it) agrees with load_checkpoint, folder and GGUF."""
    from pdd.engine.torch_backend.loader import load_checkpoint, load_model_config

    for path in (llama_path, "default"):
        assert load_model_config(path) == load_checkpoint(path)[0]
