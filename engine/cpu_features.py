"""Which dtype to serve in: ``dtype: auto`` resolves here, from the CPU's bf16 instructions.

bf16 weights halve the bytes every decode step reads (batch-1 decode is memory-bandwidth bound), but
only CPUs with native bf16 arithmetic (AVX512-BF16, or AMX tiles) run bf16 GEMMs fast; elsewhere torch
emulates bf16 through fp32 conversions and serving would slow down. So ``auto`` picks bf16 only where
one of those flags is present, and fp32 otherwise. On Linux the flags come from /proc/cpuinfo (the
kernel's word, also true inside containers); elsewhere from torch's own CPU probe.

``PDD_NATIVE_BF16=1`` / ``=0`` in the environment overrides the detection (and says so in the reason):
to check either resolution of ``auto`` on one machine, e.g. run the tests as an AVX2-only CPU would.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pdd.shared.kv_layout import DTYPE_NAMES

AUTO = "auto"
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo names of native bf16 arithmetic
SERVING_DTYPES = DTYPE_NAMES
NATIVE_BF16_ENV = "PDD_NATIVE_BF16"  # "1": treat the CPU as having native bf16, "0": as not; unset: detect


@dataclass(frozen=True)
class DtypeChoice:
    """The resolved dtypes and why: logged at startup and announced to the fleet."""

    dtype: str  # weights and activations
    kv_dtype: str  # KV pool (and every KV transfer)
    reason: str


def cpu_flags(cpuinfo_text: str) -> set[str]:
    """Flags of the first CPU in /proc/cpuinfo text (x86 ``flags``, ARM ``Features``)."""
    for line in cpuinfo_text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def native_bf16_override(environ: Mapping[str, str] | None = None) -> bool | None:
    """``PDD_NATIVE_BF16`` from the environment: True ("1"), False ("0"), None (unset or empty)."""
    value = (os.environ if environ is None else environ).get(NATIVE_BF16_ENV, "").strip()
    if value == "":
        return None
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"{NATIVE_BF16_ENV} must be 1 (treat the CPU as having native bf16), 0 (as not) or unset "
                     f"(detect from the CPU); got {value!r}")


def bf16_support(cpuinfo_text: str | None = None, environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """(native bf16?, reason naming the flag, the probe or the environment variable that decided).

    ``PDD_NATIVE_BF16`` (0 or 1) in ``environ`` (default ``os.environ``) wins over any CPU detection, the
    injected text included. ``cpuinfo_text``: /proc/cpuinfo contents (tests inject them); read from the
    system when None.
    """
    override = native_bf16_override(environ)
    if override is not None:
        return override, f"{NATIVE_BF16_ENV}={int(override)} in the environment"
    if cpuinfo_text is None and sys.platform.startswith("linux"):
        try:
            cpuinfo_text = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo_text = None
    if cpuinfo_text is not None:
        flags = cpu_flags(cpuinfo_text)
        found = [f for f in BF16_CPU_FLAGS if f in flags]
        if found:
            return True, f"/proc/cpuinfo has {', '.join(found)}"
        return False, f"/proc/cpuinfo has none of {', '.join(BF16_CPU_FLAGS)}"
    return _torch_probe()


def _torch_probe() -> tuple[bool, str]:
    """Non-Linux: torch's cpuinfo-based probe, where this torch build has it."""
    import torch

    probes = (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx_tile", "_is_amx_tile_supported"))
    for name, attr in probes:
        probe = getattr(torch.cpu, attr, None)
        if probe is not None and probe():
            return True, f"torch reports {name}"
    return False, f"torch reports no native bf16 (capability {torch.backends.cpu.get_cpu_capability()})"


def resolve_dtypes(dtype: str = AUTO, kv_dtype: str = AUTO, cpuinfo_text: str | None = None) -> DtypeChoice:
    """``dtype`` auto -> bfloat16 on CPUs with native bf16 (or ``PDD_NATIVE_BF16=1``), else float32;
    ``kv_dtype`` auto -> ``dtype``. A bad name, or a bad ``PDD_NATIVE_BF16`` (even with both set), is a ValueError.
    """
    for field, value in (("dtype", dtype), ("kv_dtype", kv_dtype)):
        if value != AUTO and value not in SERVING_DTYPES:
            raise ValueError(f"{field} must be one of {AUTO}, {', '.join(SERVING_DTYPES)}; got {value!r}")
    native_bf16_override()  # a typo in the override fails here, not only where it would have mattered
    if dtype == AUTO:
        native, why = bf16_support(cpuinfo_text)
        dtype = "bfloat16" if native else "float32"
        reason = f"dtype auto -> {dtype}: {why}"
    else:
        reason = f"dtype {dtype} set in config"
    if kv_dtype == AUTO:
        kv_dtype = dtype
        reason += f"; kv_dtype auto -> {kv_dtype} (the weights' dtype)"
    else:
        reason += f"; kv_dtype {kv_dtype} set in config"
    return DtypeChoice(dtype, kv_dtype, reason)
