"""RMSNorm, computed in float32 like the Hugging Face reference, returned in the input dtype.

float32 inputs go to our C kernel where it built (kernels/cpu_pointwise.c: one pass, no temporaries, the
mean of squares in float64 in a fixed order per row); the torch route is the reference and the fallback.
"""

from __future__ import annotations

import torch

from pdd.kernels import native


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension; x [rows, dim] or [rows, groups, dim]."""
    lib = native.lib()
    if lib is not None and _native_layout(x, weight):
        rows, dim = x.shape[0], x.shape[-1]
        groups = x.shape[1] if x.dim() == 3 else 1
        out = torch.empty(x.shape, dtype=torch.float32)
        lib.pdd_rms_norm(x.data_ptr(), x.stride(0), rows, groups, dim, weight.data_ptr(), eps, out.data_ptr(),
                         groups * dim)
        return out
    if x.dtype == torch.float32:
        # explicit form: fewer ops and temporaries than F.rms_norm's CPU composite (same values)
        inv = torch.mean(x * x, dim=-1, keepdim=True).add_(eps).rsqrt_()
        return (x * inv).mul_(weight)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _native_layout(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """float32 CPU rows whose vectors are contiguous (rows may be strided: views into a fused projection)."""
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
            or not weight.is_contiguous() or weight.shape != x.shape[-1:]):
        return False
    if x.dim() == 2:
        return x.stride(1) == 1
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
