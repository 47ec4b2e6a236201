"""RMSNorm, computed in float32 like the Hugging Face reference, returned in the input dtype."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension."""
    if x.dtype == torch.float32:
        # explicit form: fewer ops and temporaries than F.rms_norm's CPU composite (same values)
        inv = torch.mean(x * x, dim=-1, keepdim=True).add_(eps).rsqrt_()
        return (x * inv).mul_(weight)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
