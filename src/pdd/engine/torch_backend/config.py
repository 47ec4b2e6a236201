"""Model configuration: the few numbers the executor needs, parsed from config.json or GGUF metadata.

A checkpoint whose config asks for something the executor does not compute (sliding-window attention,
mixture-of-experts, a rope type without a kernel, another activation, ...) is refused here, with an
UnsupportedArchitectureError naming the config field, instead of loading and serving wrong logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdd.engine.core.errors import UnsupportedArchitectureError
from pdd.kernels.rotary import RotaryEmbedding

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = RotaryEmbedding.SUPPORTED
# config.json keys whose positive value means a mixture-of-experts MLP (Mixtral, Qwen-MoE, DeepSeek, ...)
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def check_architecture(name: str) -> str:
    arch = (name or "").lower()
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported model architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _refuse(field_name: str, value: Any, why: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(f"unsupported model configuration {field_name}={value!r}: {why}")


def check_rope_scaling(scaling: dict | None, field_name: str) -> None:
    """Refuse rope types without a kernel (yarn, dynamic, longrope, ...) and scalings missing their factor."""
    if not scaling:
        return
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _refuse(f"{field_name}.rope_type", rope_type, f"supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type != "default" and scaling.get("factor") is None:
        raise _refuse(f"{field_name}.factor", None, f"rope type {rope_type!r} needs a scaling factor")


def check_hf_features(cfg: dict) -> None:
    """Refuse config.json features the executor does not compute; the error names the field."""
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    if window is not None and cfg.get("use_sliding_window", True) and int(window) < max_pos:
        raise _refuse("sliding_window", window, f"sliding-window attention is not implemented (the engine attends "
                      f"over the whole context, up to max_position_embeddings={max_pos})")
    layer_types = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if layer_types:
        raise _refuse("layer_types", sorted(set(layer_types)), "only full_attention layers are implemented")
    for key in _MOE_KEYS:
        if int(cfg.get(key) or 0) > 0:
            raise _refuse(key, cfg[key], "mixture-of-experts MLPs are not implemented")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "the MLP is SiLU-gated")
    if cfg.get("mlp_bias"):
        raise _refuse("mlp_bias", cfg["mlp_bias"], "MLP projections have no bias")
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _refuse("partial_rotary_factor", cfg["partial_rotary_factor"], "RoPE rotates the whole head")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise _refuse("quantization_config.quant_method", method, "load a float checkpoint or a GGUF file")
    check_rope_scaling(cfg.get("rope_scaling"), "rope_scaling")
    check_rope_scaling(cfg.get("rope_parameters"), "rope_parameters")


def config_from_hf(cfg: dict) -> ModelConfig:
    """From a Hugging Face config.json dict (transformers 4.x and 5.x spellings)."""
    arch = check_architecture(cfg.get("model_type", ""))
    check_hf_features(cfg)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    if scaling is None and rope and rope.get("rope_type", "default") != "default":
        scaling = dict(rope)
    if arch == "qwen2":
        qkv_bias = True
    else:
        qkv_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=bool(cfg.get("attention_bias", False)) and arch in ("llama", "mistral"),
        qk_norm=arch == "qwen3",
        eos_token_ids=_eos_list(cfg.get("eos_token_id")),
        bos_token_id=cfg.get("bos_token_id"),
    )


def check_gguf_features(meta: dict[str, Any], arch_name: str, head_dim: int, context: int) -> None:
    """Refuse GGUF metadata the executor does not compute (llama.cpp stores Mixtral as arch ``llama``)."""

    def key(name: str) -> str:
        return f"{arch_name}.{name}"

    experts = meta.get(key("expert_count"))
    if experts:
        raise _refuse(key("expert_count"), experts, "mixture-of-experts MLPs are not implemented")
    window = meta.get(key("attention.sliding_window"))
    if window and int(window) < context:
        raise _refuse(key("attention.sliding_window"), window, "sliding-window attention is not implemented")
    rope_type = meta.get(key("rope.scaling.type"))
    if rope_type not in (None, "none", "linear"):
        raise _refuse(key("rope.scaling.type"), rope_type, "supported GGUF rope scaling: none, linear")
    if rope_type == "linear" and meta.get(key("rope.scaling.factor")) is None:
        raise _refuse(key("rope.scaling.factor"), None, "linear rope scaling needs a factor")
    rope_dims = meta.get(key("rope.dimension_count"))
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise _refuse(key("rope.dimension_count"), rope_dims, f"RoPE rotates the whole head ({head_dim} dims)")


def config_from_gguf(meta: dict[str, Any], vocab_size: int, has_output: bool) -> ModelConfig:
    """From GGUF key/values (``{arch}.block_count`` etc.)."""
    arch_name = str(meta.get("general.architecture", ""))
    arch = check_architecture(arch_name)

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch_name}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    context = int(get("context_length", 2048))
    check_gguf_features(meta, arch_name, head_dim, context)
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=context,
        tie_word_embeddings=not has_output,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        eos_token_ids=_eos_list(meta.get("tokenizer.ggml.eos_token_id")),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
    )
