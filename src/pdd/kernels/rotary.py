"""Rotary position embedding (the Hugging Face "rotate half" layout), with llama3/linear scaling.

cos/sin tables are precomputed once for every position up to the context length; a forward
pass gathers the rows for its positions once and every layer reuses them. The rotation is in place: our C
kernel (kernels/cpu_pointwise.c) rotates float32 rows where they are, views into the fused qkv output
included; the torch route is the reference and the fallback.
"""

from __future__ import annotations

import math

import torch

from pdd.kernels import native


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables of shape [max_positions, head_dim] (float32, then cast)."""

    SUPPORTED = ("default", "linear", "llama3")

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default"
        if rope_type not in self.SUPPORTED:
            raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {self.SUPPORTED}")
        if rope_type == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the given positions, shaped [T, 1, head_dim] to broadcast over heads (contiguous)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] in place by the per-token angles (rotate-half layout); returns x."""
    lib = native.lib()
    if (lib is not None and x.dtype == torch.float32 and cos.dtype == torch.float32 and x.device.type == "cpu"
            and x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos.is_contiguous() and sin.is_contiguous()):
        lib.pdd_rope(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2], cos.data_ptr(), sin.data_ptr())
        return x
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x.copy_(x * cos + rotated * sin)
