"""Model configuration: the few numbers the executor needs, parsed from config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdd.engine.errors import UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


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


def config_from_hf(cfg: dict) -> ModelConfig:
    """From a Hugging Face config.json dict (transformers 4.x and 5.x spellings)."""
    arch = check_architecture(cfg.get("model_type", ""))
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
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings=not has_output,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        eos_token_ids=_eos_list(meta.get("tokenizer.ggml.eos_token_id")),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
    )
