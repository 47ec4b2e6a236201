"""Binding of the row-invariant projection kernel (cpu_linear.c, built at install into ``_native``).

Why our own kernel: batch-1 decode reads every weight once per token, and oneDNN's and MKL's GEMV
streamed SmolLM2's 538 MB at under half the read bandwidth of two cores (docs/ENGINE.md), while the
engine's batch invariance needs a row's result to be the same bits for every row count, which MKL does
not give. The C kernel accumulates each output over k in one fixed order, so it is row-invariant by
construction, and reads weights packed in 24-column panels, fp32 or bf16 (widened exactly to fp32 in
registers: bf16 weights halve the bytes a decode step reads on any AVX2 CPU, with fp32 arithmetic).

``available()`` is False where the extension did not build or the CPU lacks AVX2/FMA (kernels/native.py);
callers then fall back to torch.
"""

from __future__ import annotations

import torch

from pdd.kernels import native

WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """The kernel is built and this CPU runs it."""
    return native.lib() is not None


def unavailable_reason() -> str:
    """Why ``available()`` is False, for the startup log."""
    return native.unavailable_reason()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] checkpoint weight -> panels [ceil(out / W), in, W] (W columns each, zero-padded)."""
    lib = native.lib()
    if lib is None:
        raise RuntimeError(f"row-invariant kernel unavailable: {unavailable_reason()}")
    if weight.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"row-invariant kernel takes float32 or bfloat16 weights, not {weight.dtype}")
    width = lib.pdd_linear_panel_width()
    out_features, in_features = weight.shape
    panels = -(-out_features // width)
    padded = weight.new_zeros(panels * width, in_features)
    padded[:out_features] = weight
    return padded.view(panels, width, in_features).transpose(1, 2).contiguous()


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + (x @ W^T + bias)`` in float32 for a ``pack``-ed W; x [rows, in] float32."""
    lib = native.lib()
    assert lib is not None, "pack() refuses weights when the kernel is unavailable"
    x = x.contiguous()
    rows, in_features = x.shape
    if x.dtype != torch.float32 or in_features != packed.shape[1]:
        raise ValueError(f"expected float32 input [rows, {packed.shape[1]}], got {x.dtype} {list(x.shape)}")
    out = torch.empty(rows, out_features, dtype=torch.float32)
    if rows == 0:
        return out
    if residual is not None:
        residual = residual.contiguous()
        if residual.dtype != torch.float32 or residual.shape != out.shape:
            raise ValueError(f"residual must be float32 {list(out.shape)}, got {residual.dtype} {list(residual.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    status = lib.pdd_linear(
        x.data_ptr(), rows, in_features, packed.data_ptr(), int(packed.dtype == torch.bfloat16), out_features,
        None if bias is None else bias.data_ptr(), None if residual is None else residual.data_ptr(),
        out.data_ptr(), torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("row-invariant kernel could not allocate its bf16 widening buffer")
    return out
