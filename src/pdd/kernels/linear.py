"""Dense projections ``x @ W^T (+ bias) (+ residual)`` in the fastest form the platform offers.

On x86 CPUs with AVX2/FMA, float32 and bf16 weights go to our own kernel (kernels/cpu_linear.py):
row-invariant by construction, faster than oneDNN at every row count measured (docs/ENGINE.md), float32
activations in and out (``activation_dtype``). Elsewhere, on CPUs with oneDNN the weight is packed once, at
load, into oneDNN's blocked layout and applied with its linear primitive (residual add fused). The plain
route, ``torch.mm`` with a transposed weight, goes to MKL's sgemm, which on AMD EPYC re-packs the whole weight
on every call when the batch has few rows: a decode step of 8-32 sequences ran 3-5x slower per GEMM than
oneDNN with the packed weight (1 row: on par; 4,096-row prefill: 1.2-1.4x). Where packing is not available
(GPU, bf16 on CPUs without AVX512-BF16/AVX-NE-CONVERT, builds without oneDNN) or disagrees with the plain
route on a probe input, the weight stays ``[in, out]`` contiguous for ``torch.mm``/``addmm``.

Row buckets (packed route): oneDNN JIT-compiles one primitive per input shape, about 0.5 MiB each
(tiny model), and keeps it in two 1,024-entry caches (oneDNN's and ideep's). With every batch size and
prompt length a new row count, an engine's RSS grew for as long as it served: the soak saw main
decode +17 % after warm-up in 10 minutes, and heaptrack on it found 90 % of the memory retained over
110 s allocated by ``dnnl::impl::malloc`` under ``mkldnn_linear_pointwise``. So rows are padded up to
the next of ``ROW_BUCKETS`` (an output row depends only on its input row: the real rows' results are
bitwise the same), and longer inputs run in slices of the largest bucket. A weight shape thus has at
most ``len(ROW_BUCKETS)`` primitives per form (plain, residual-fused), all built on its first call,
so the caches, and RSS, stop growing once the engine has served its first request of each form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdd.kernels import cpu_linear

# Rows the packed layout is tuned for (a typical decode batch); any row count works with it.
_PACK_ROWS_HINT = 32
# Row counts the packed route runs at: padding stays under 50 % of the rows up to 32 (a decode batch of a
# few rows costs the weight read, not the rows) and under 25 % above; the largest is the slice longer
# inputs run in.
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
_warmed: set[tuple] = set()  # (weight shape, dtype, bias, form) whose every bucket has a primitive


def row_plan(rows: int) -> list[tuple[int, int]]:
    """(rows taken, bucket they run at) per slice: full slices of the largest bucket, the rest padded up."""
    top = ROW_BUCKETS[-1]
    plan = [(top, top)] * (rows // top)
    if rows % top:
        plan.append((rows % top, next(b for b in ROW_BUCKETS if b >= rows % top)))
    return plan


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-packed copy of an [out, in] weight, or None where it is unavailable or wrong."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS_HINT)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    want = probe.float() @ weight.float().t()
    tol = 1e-3 if weight.dtype == torch.float32 else 5e-2
    if not torch.allclose(got.float(), want, rtol=tol, atol=tol * float(want.abs().max().clamp(min=1.0))):
        return None
    return packed


def activation_dtype(weight_dtype: torch.dtype, device: str = "cpu") -> torch.dtype:
    """The dtype a projection of ``weight_dtype`` weights takes and returns: float32 on our kernel's route
    (bf16 weights too: bf16 storage, fp32 arithmetic), the weights' own dtype elsewhere."""
    return torch.float32 if _row_invariant_route(weight_dtype, device) else weight_dtype


def products_dtype(weight_dtype: torch.dtype, device: str = "cpu") -> torch.dtype:
    """The dtype a projection of ``weight_dtype`` weights multiplies in: bf16 weights take bf16 products on our
    kernel where the CPU has AVX512-BF16, fp32 ones elsewhere on it; off our kernel, the weights' dtype."""
    if _row_invariant_route(weight_dtype, device):
        return cpu_linear.format_for(weight_dtype).arithmetic
    return weight_dtype


def _row_invariant_route(weight_dtype: torch.dtype, device: str) -> bool:
    return device == "cpu" and weight_dtype in cpu_linear.WEIGHT_DTYPES and cpu_linear.available()


class Linear:
    """One projection; built from an ``[out_features, in_features]`` weight (checkpoint layout)."""

    __slots__ = ("bias", "format", "packed", "row_invariant", "shape", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, fp32_inputs: bool = False) -> None:
        """``fp32_inputs``: bf16 weights keep fp32 arithmetic (inputs not rounded to bf16) where our kernel runs:
        for the projection whose rounding the output is most sensitive to (lm_head: docs/ENGINE.md)."""
        self.shape = (tuple(weight.shape), weight.dtype, bias is not None)
        self.row_invariant = _row_invariant_route(weight.dtype, weight.device.type)
        self.bias = bias.float() if bias is not None and self.row_invariant else bias
        packed = None if self.row_invariant else _pack(weight)
        self.packed = packed is not None
        self.format: cpu_linear.WeightFormat | None = None
        if self.row_invariant:
            fmt = cpu_linear.WeightFormat.BF16 if fp32_inputs and weight.dtype == torch.bfloat16 else None
            self.weight, self.format = cpu_linear.pack(weight, fmt)
        else:
            self.weight = packed if packed is not None else weight.t().contiguous()

    @property
    def kernel(self) -> str:
        """Which route this projection runs (logged at startup: fleets should agree, for exact handoffs)."""
        if self.format is cpu_linear.WeightFormat.BF16_DOT:
            return "pdd-row-invariant-bf16-products"
        if self.row_invariant:
            return "pdd-row-invariant"
        return "onednn-packed" if self.packed else "torch-mm"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_invariant:
            return cpu_linear.linear(x, self.weight, self.format, self.shape[0][1], self.shape[0][0], self.bias)
        if self.packed:
            return self._bucketed(x, None)
        if self.bias is None:
            return torch.mm(x, self.weight)
        return torch.addmm(self.bias, x, self.weight)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x @ W^T (+ bias)``, the add fused into the GEMM where the backend can."""
        if self.row_invariant:
            return cpu_linear.linear(x, self.weight, self.format, self.shape[0][1], self.shape[0][0], self.bias,
                                     residual)
        if self.bias is not None:
            return residual + self(x)
        if self.packed:
            return self._bucketed(x, residual)
        return torch.addmm(residual, x, self.weight)

    def _packed(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, None, "add")

    def _bucketed(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The packed route at bucketed row counts only (module docstring: why)."""
        form = (self.shape, residual is None)
        if form not in _warmed:  # every bucket's primitive now, so none is built later in the run
            _warmed.add(form)
            for b in ROW_BUCKETS:
                rows = None if residual is None else residual.new_zeros(b, residual.shape[1])
                self._packed(x.new_zeros(b, x.shape[1]), rows)
        if x.shape[0] == 0:
            return self._packed(x, residual)
        outs, start = [], 0
        for take, bucket in row_plan(x.shape[0]):
            xs = x[start:start + take]
            rs = None if residual is None else residual[start:start + take]
            if bucket != take:
                xs = F.pad(xs, (0, 0, 0, bucket - take))
                rs = None if rs is None else F.pad(rs, (0, 0, 0, bucket - take))
            out = self._packed(xs, rs)
            outs.append(out if bucket == take else out[:take])
            start += take
        return outs[0] if len(outs) == 1 else torch.cat(outs)
