"""The gated MLP's activation, ``silu(gate) * up``, over the fused gate|up projection.

float32 rows go to our C kernel where it built (kernels/cpu_pointwise.c: one pass, no temporaries); the
torch route is the reference and the fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdd.kernels import native


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * inter] (gate columns, then up) -> [rows, inter]."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    lib = native.lib()
    if lib is not None and gate_up.dtype == torch.float32 and gate_up.device.type == "cpu" and gate_up.is_contiguous():
        out = torch.empty(rows, inter, dtype=torch.float32)
        lib.pdd_silu_mul(gate_up.data_ptr(), rows, inter, out.data_ptr())
        return out
    return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
