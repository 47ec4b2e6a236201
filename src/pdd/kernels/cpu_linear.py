"""Binding of the row-invariant projection kernel (cpu_linear.c, built at install into ``_native``).

Why our own kernel: batch-1 decode reads every weight once per token, and oneDNN's and MKL's GEMV
streamed SmolLM2's 538 MB at under half the read bandwidth of two cores (docs/ENGINE.md), while the
engine's batch invariance needs a row's result to be the same bits for every row count, which MKL does
not give. The C kernel accumulates each output over k in one fixed order, so it is row-invariant by
construction, and reads weights packed in 24-column panels, fp32 or bf16 (widened exactly to fp32 in
registers: bf16 weights halve the bytes a decode step reads on any AVX2 CPU, with fp32 arithmetic).
Where the CPU has AVX512-BF16, bf16 weights take cpu_linear_bf16.c instead: bf16 products (``vdpbf16ps``,
twice the products per instruction of an fp32 FMA) with fp32 accumulation, same row invariance
(``WeightFormat``, chosen once per weight at ``pack``).

``available()`` is False where the extension did not build or the CPU lacks AVX2/FMA (kernels/native.py);
callers then fall back to torch.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from pdd.kernels import native

WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


class WeightFormat(IntEnum):
    """How a packed weight is laid out and multiplied (``PDD_W_*`` in native.h)."""

    FP32 = 0  # fp32 panels, fp32 FMAs
    BF16 = 1  # bf16 panels widened to fp32 in registers: bf16 storage, fp32 arithmetic (any AVX2 CPU)
    BF16_DOT = 2  # bf16 k-pair panels, bf16 products with fp32 accumulation (AVX512-BF16)

    @property
    def arithmetic(self) -> torch.dtype:
        """The dtype the products are computed in."""
        return torch.bfloat16 if self is WeightFormat.BF16_DOT else torch.float32


def available() -> bool:
    """The kernel is built and this CPU runs it."""
    return native.lib() is not None


def unavailable_reason() -> str:
    """Why ``available()`` is False, for the startup log."""
    return native.unavailable_reason()


def bf16_arithmetic_available() -> bool:
    """bf16 weights can take the bf16-product route: the kernel is built, the CPU has AVX512-BF16, and
    ``PDD_NATIVE_BF16`` does not say 0 (``native.native_bf16_override``: run as a CPU without it would)."""
    lib = native.lib()
    return lib is not None and bool(lib.pdd_linear_bf16_supported()) and native.native_bf16_override() is not False


def format_for(dtype: torch.dtype) -> WeightFormat:
    """The format ``pack`` gives weights of ``dtype`` on this CPU."""
    if dtype == torch.float32:
        return WeightFormat.FP32
    return WeightFormat.BF16_DOT if bf16_arithmetic_available() else WeightFormat.BF16


def pack(weight: torch.Tensor, fmt: WeightFormat | None = None) -> tuple[torch.Tensor, WeightFormat]:
    """[out, in] checkpoint weight -> (packed weight, its format; default ``format_for(weight.dtype)``).

    FP32 / BF16: panels [ceil(out / W), in, W] (W columns each, zero-padded). BF16_DOT: panels
    [ceil(out / W), ceil(in / 2), W, 2], k in pairs (cpu_linear_bf16.c)."""
    lib = native.lib()
    if lib is None:
        raise RuntimeError(f"row-invariant kernel unavailable: {unavailable_reason()}")
    if weight.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"row-invariant kernel takes float32 or bfloat16 weights, not {weight.dtype}")
    fmt = format_for(weight.dtype) if fmt is None else fmt
    if (fmt is WeightFormat.FP32) != (weight.dtype == torch.float32):
        raise TypeError(f"format {fmt.name} does not hold {weight.dtype} weights")
    if fmt is WeightFormat.BF16_DOT and not bf16_arithmetic_available():
        raise RuntimeError("format BF16_DOT needs a CPU with AVX512-BF16")
    out_features, in_features = weight.shape
    if fmt is WeightFormat.BF16_DOT:
        width = lib.pdd_linear_bf16_panel_width()
        panels, pairs = -(-out_features // width), -(-in_features // 2)
        padded = weight.new_zeros(panels * width, pairs * 2)
        padded[:out_features, :in_features] = weight
        return padded.view(panels, width, pairs, 2).transpose(1, 2).contiguous(), fmt
    width = lib.pdd_linear_panel_width()
    panels = -(-out_features // width)
    padded = weight.new_zeros(panels * width, in_features)
    padded[:out_features] = weight
    return padded.view(panels, width, in_features).transpose(1, 2).contiguous(), fmt


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    fmt: WeightFormat,
    in_features: int,
    out_features: int,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + (x @ W^T + bias)`` in float32 for a ``pack``-ed W of ``fmt``; x [rows, in] float32."""
    lib = native.lib()
    assert lib is not None, "pack() refuses weights when the kernel is unavailable"
    pairs = fmt is WeightFormat.BF16_DOT  # [panels, in / 2, width, 2], else [panels, in, width]
    depth, width = (-(-in_features // 2), packed.shape[2]) if pairs else (in_features, packed.shape[-1])
    if packed.shape[1] != depth or packed.shape[0] * width < out_features:
        raise ValueError(f"packed weight {list(packed.shape)} does not hold [{out_features}, {in_features}] "
                         f"as {fmt.name}")
    x = x.contiguous()
    rows = x.shape[0]
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"expected float32 input [rows, {in_features}], got {x.dtype} {list(x.shape)}")
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
        x.data_ptr(), rows, in_features, packed.data_ptr(), int(fmt), out_features,
        None if bias is None else bias.data_ptr(), None if residual is None else residual.data_ptr(),
        out.data_ptr(), torch.get_num_threads(),
    )
    if status == -3:
        raise RuntimeError("the bf16-product kernel needs a CPU with AVX512-BF16")
    if status != 0:
        raise MemoryError("row-invariant kernel could not allocate its bf16 buffer")
    return out
