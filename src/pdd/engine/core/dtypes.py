"""Which dtype to serve in: ``dtype: auto`` resolves here, by measurement where there is a model to measure.

bf16 weights halve the bytes every decode step reads (batch-1 decode is memory-bandwidth bound), but only
CPUs with native bf16 arithmetic (AVX512-BF16, or AMX tiles) multiply them fast; elsewhere our kernel widens
them to fp32 (prefill no faster than fp32) and torch's own routes emulate bf16 (far slower). So an engine
resolves ``auto`` by timing its model's layer shapes in both dtypes (engine/torch_backend/dtype_probe.py, cached per CPU).
Without a model to measure (a config check, the launcher's summary) or without our kernel, the CPU's flags
decide: bf16 where one of them is present, fp32 otherwise. On Linux the flags come from /proc/cpuinfo (the
kernel's word, also true inside containers); elsewhere from torch's own CPU probe.

``PDD_NATIVE_BF16=1`` / ``=0`` in the environment overrides the detection (and says so in the reason):
to check either resolution of ``auto`` on one machine, e.g. run the tests as an AVX2-only CPU would.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from pdd.kernels.native import NATIVE_BF16_ENV, native_bf16_override
from pdd.shared.kv_layout import DTYPE_NAMES

AUTO = "auto"
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo names of native bf16 arithmetic
SERVING_DTYPES = DTYPE_NAMES


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


def _kernel_widens_bf16() -> bool:
    """Whether the torch engine's projection kernel runs bf16 weights at fp32 speed (our kernel built) on a CPU
    without native bf16: only then is there something to measure."""
    from pdd.kernels.linear import activation_dtype

    return activation_dtype(torch.bfloat16) == torch.float32


def resolve_dtypes(dtype: str = AUTO, kv_dtype: str = AUTO, cpuinfo_text: str | None = None,
                   probe: Callable[[], tuple[str, str]] | None = None) -> DtypeChoice:
    """``dtype`` auto -> what ``probe`` measured faster on this CPU (engine/torch_backend/dtype_probe.py; the engine passes
    one for its model), else, with no model to measure or no kernel of ours to run bf16 weights, bfloat16 on
    CPUs with native bf16 and float32 elsewhere. ``PDD_NATIVE_BF16`` (0 / 1) wins over both. ``kv_dtype`` auto ->
    ``dtype``. A bad name, or a bad ``PDD_NATIVE_BF16`` (even with both set), is a ValueError.
    """
    for field, value in (("dtype", dtype), ("kv_dtype", kv_dtype)):
        if value != AUTO and value not in SERVING_DTYPES:
            raise ValueError(f"{field} must be one of {AUTO}, {', '.join(SERVING_DTYPES)}; got {value!r}")
    override = native_bf16_override()  # a typo in the override fails here, not only where it would have mattered
    if dtype == AUTO:
        native, why = bf16_support(cpuinfo_text)
        if override is None and probe is not None and (native or _kernel_widens_bf16()):
            dtype, why = probe()
        else:
            dtype = "bfloat16" if native else "float32"
            if override is None:
                why += " (by flag: " + ("no model to measure)" if probe is None else "no kernel for bf16 weights)")
        reason = f"dtype auto -> {dtype}: {why}"
    else:
        reason = f"dtype {dtype} set in config"
    if kv_dtype == AUTO:
        kv_dtype = dtype
        reason += f"; kv_dtype auto -> {kv_dtype} (the weights' dtype)"
    else:
        reason += f"; kv_dtype {kv_dtype} set in config"
    return DtypeChoice(dtype, kv_dtype, reason)
