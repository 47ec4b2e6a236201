"""Model-math kernels for the torch engine: torch implementations (CPU and any device), and our C kernels
(``native``: row-invariant projections, exact-path paged attention, a layer's row-wise ops) behind the same
functions where they built. The torch routes stay the reference the tests compare against and are always
available.

The names below load their module on first use (PEP 562), so ``pdd.kernels.native`` (the CPU's bf16 override,
read when any backend resolves its dtype) loads without the rest.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AttentionMetadata": "attention", "build_attention_metadata": "attention", "paged_attention": "attention",
    "write_kv": "attention", "DecoderLayers": "decoder", "Linear": "linear", "activation_dtype": "linear",
    "products_dtype": "linear", "rms_norm": "norm", "RotaryEmbedding": "rotary", "apply_rotary_": "rotary",
    "silu_mul": "activation",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pdd.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pdd.kernels.{_EXPORTS[name]}"), name)
