"""Model-math kernels for the engine: torch implementations (CPU and any device), and our C kernels
(``native``: row-invariant projections, exact-path paged attention, a layer's row-wise ops) behind the same functions where they
built. The torch routes stay the reference the tests compare against and are always available.
"""

from pdd.kernels.activation import silu_mul
from pdd.kernels.attention import (
    AttentionMetadata,
    build_attention_metadata,
    paged_attention,
    write_kv,
)
from pdd.kernels.decoder import DecoderLayers
from pdd.kernels.linear import Linear, activation_dtype, products_dtype
from pdd.kernels.norm import rms_norm
from pdd.kernels.rotary import RotaryEmbedding, apply_rotary_

__all__ = [
    "AttentionMetadata",
    "DecoderLayers",
    "Linear",
    "RotaryEmbedding",
    "activation_dtype",
    "apply_rotary_",
    "build_attention_metadata",
    "paged_attention",
    "products_dtype",
    "rms_norm",
    "silu_mul",
    "write_kv",
]
