"""Model-math kernels for the engine: torch reference implementations (CPU and any device).

Optional accelerated paths (Triton) may be added behind the same function names; the torch
versions are the reference the tests compare against and are always available.
"""

from pdd.kernels.attention import (
    AttentionMetadata,
    build_attention_metadata,
    paged_attention,
    write_kv,
)
from pdd.kernels.linear import Linear, activation_dtype
from pdd.kernels.norm import rms_norm
from pdd.kernels.rotary import RotaryEmbedding, apply_rotary

__all__ = [
    "AttentionMetadata",
    "build_attention_metadata",
    "paged_attention",
    "write_kv",
    "Linear",
    "activation_dtype",
    "rms_norm",
    "RotaryEmbedding",
    "apply_rotary",
]
