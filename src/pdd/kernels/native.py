"""The C kernels built at install (``pdd.kernels._native`` from cpu_linear.c, cpu_attention.c,
cpu_pointwise.c and cpu_decoder.c; native.h declares them), loaded
with ctypes (a call releases the GIL). ``lib()`` is None where the extension did not build (no C compiler
with OpenMP at install, not x86-64) or the CPU lacks AVX2/FMA; callers then run their torch routes."""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Mapping
from functools import cache

import torch

EXTENSION = "pdd.kernels._native"
NATIVE_BF16_ENV = "PDD_NATIVE_BF16"  # "1": treat the CPU as having native bf16, "0": as not; unset: detect
_CPU_CAPABILITIES = ("AVX2", "AVX512")  # torch's names for CPUs with AVX2 + FMA (AVX512 implies both)

_P, _I64, _INT, _DBL, _FLT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double, ctypes.c_float
_SIGNATURES = {
    # x, rows, in, w, w_format, out_features, bias, residual, out, threads
    "pdd_linear": (_INT, [_P, _I64, _I64, _P, _INT, _I64, _P, _P, _P, _INT]),
    "pdd_linear_panel_width": (_INT, []),
    "pdd_linear_bf16_supported": (_INT, []),
    "pdd_linear_bf16_panel_width": (_INT, []),
    # q, q_stride, out, hq, hkv, d, k_cache, v_cache, kv_bf16, block_size, rows, tables, table_offsets, lens,
    # nrows, scale, threads
    "pdd_paged_attention": (_INT, [_P, _I64, _P, _I64, _I64, _I64, _P, _P, _INT, _I64, _P, _P, _P, _P, _I64, _DBL,
                                   _INT]),
    # x, x_stride, rows, groups, dim, w, eps, out, out_stride
    "pdd_rms_norm": (None, [_P, _I64, _I64, _I64, _I64, _P, _FLT, _P, _I64]),
    # x, x_stride, rows, heads, dim, cos_rows, sin_rows
    "pdd_rope": (None, [_P, _I64, _I64, _I64, _I64, _P, _P]),
    # gate_up, rows, inter, out
    "pdd_silu_mul": (None, [_P, _I64, _I64, _P]),
    # src, src_stride, rows, width, slots, pool, num_slots, pool_bf16
    "pdd_store_rows": (_INT, [_P, _I64, _I64, _I64, _P, _P, _I64, _INT]),
    # dims, layers, nlayers, k_pools, v_pools, hidden, rows, cos, sin, slots, att_rows, tables, offsets, lens,
    # work, threads
    "pdd_decoder_layers": (_INT, [_P, _P, _I64, _P, _P, _P, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _INT]),
}


@cache
def lib() -> ctypes.CDLL | None:
    if torch.backends.cpu.get_cpu_capability() not in _CPU_CAPABILITIES:
        return None
    spec = importlib.util.find_spec(EXTENSION)
    if spec is None or spec.origin is None:
        return None
    library = ctypes.CDLL(spec.origin)
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(library, name)
        fn.restype, fn.argtypes = restype, argtypes
    return library


def unavailable_reason() -> str:
    """Why ``lib()`` is None, for logs and test skips."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _CPU_CAPABILITIES:
        return f"CPU capability {capability} has no AVX2/FMA"
    return f"extension {EXTENSION} was not built at install (needs a C compiler with OpenMP on x86-64)"


def native_bf16_override(environ: Mapping[str, str] | None = None) -> bool | None:
    """``PDD_NATIVE_BF16`` from the environment: True ("1"), False ("0"), None (unset or empty). "0" makes the
    whole engine run as on a CPU without native bf16 (``dtype: auto`` and the projection kernel alike)."""
    value = (os.environ if environ is None else environ).get(NATIVE_BF16_ENV, "").strip()
    if value == "":
        return None
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"{NATIVE_BF16_ENV} must be 1 (treat the CPU as having native bf16), 0 (as not) or unset "
                     f"(detect from the CPU); got {value!r}")
