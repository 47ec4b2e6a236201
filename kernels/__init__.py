"""Model-math kernels for the engine: torch implementations (CPU and any device), and our C kernels
(``native``: row-invariant projections, exact-path paged attention) behind the same functions where they
built. The torch routes stay the reference the tests compare against and are always available.
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
