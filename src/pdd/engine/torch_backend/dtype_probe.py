"""``dtype: auto`` by measurement: one decoder layer's projections timed in float32 and bfloat16 on this CPU.

Which dtype is faster depends on the CPU and on the workload, not on a flag: bf16 weights halve the bytes a
decode step reads everywhere, but multiply fast only where the CPU has bf16 products (AVX512-BF16: our
kernel's bf16-product route); on AVX2 CPUs our kernel widens them to fp32, and a compute-bound prefill then
runs no faster than fp32 (docs/ENGINE.md). So at an engine's first start on a CPU this times the model's
layer shapes, with random weights, through the routes the engine will run (``kernels.Linear``):

* ``prefill``: a 512-row pass (the scheduler's prefill chunk), compute bound;
* ``decode_b1`` / ``decode_b32``: one-row and 32-row passes over enough copies of the layer to exceed the
  last-level cache, as a decode step streams every layer's weights from memory.

Both dtypes are timed interleaved (a disturbance hits both alike), every copy warmed first, and the best of
ROUNDS rounds counts. The result is cached per CPU, torch and kernel build and layer shapes (``PDD_CACHE_DIR``,
default ~/.cache/pdd, ``dtype_probe.json``; a lock makes concurrent starts measure once) and never re-measured
by itself: every engine of a machine resolves ``auto`` alike, now and after a restart, because P, RLD and MD
must share one KV layout and one arithmetic for exact handoffs. For the same reason the choice is one dtype
for all roles (``choose``), not one per role. Delete the file to measure again (a probe taken while the
machine was busy says so: ``load`` in the entry).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from pdd.engine.torch_backend.config import ModelConfig
from pdd.engine.core.dtypes import cpu_flags
from pdd.kernels import Linear, activation_dtype, native
from pdd.shared.kv_layout import dtype_from_name
from pdd.shared.model_files import cache_dir

WORKLOADS = {"prefill": 512, "decode_b1": 1, "decode_b32": 32}  # rows of one pass
DTYPES = ("float32", "bfloat16")
STREAM_BYTES = 64 << 20  # weights a decode pass streams: beyond the last-level cache of the CPUs we run on
MAX_COPIES = 64
ROUNDS = 5
CACHE_FILE = "dtype_probe.json"

Times = dict[str, dict[str, float]]  # dtype -> workload -> seconds per pass of one layer


def layer_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """[out, in] of a Llama layer's fused projections: qkv, o, gate|up, down (model.py)."""
    c = config
    return [((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size), (c.hidden_size, c.num_heads * c.head_dim),
            (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]


def _cpu_identity() -> str:
    """Model name and a hash of the flags (cpu_features.cpu_flags) of /proc/cpuinfo's first CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    model = next((line.partition(":")[2].strip() for line in text.splitlines()
                  if line.partition(":")[0].strip() == "model name"), platform.processor())
    flags = " ".join(sorted(cpu_flags(text)))
    return f"{model}|{hashlib.sha256(flags.encode()).hexdigest()[:12]}"


def _kernel_identity() -> str:
    lib = native.lib()
    if lib is None:
        return "no-kernel"
    stat = Path(lib._name).stat()
    return f"{stat.st_size}-{int(stat.st_mtime)}"


def cache_key(shapes: list[tuple[int, int]]) -> str:
    """What a measurement depends on: CPU, torch, our kernel build, the layer's shapes. Not the thread count:
    every engine of a machine must resolve ``auto`` alike (a reference engine of 1 thread beside services of
    2 included), so the first engine's measurement, at its thread count, holds for all."""
    return "|".join([_cpu_identity(), f"torch={torch.__version__}",
                     f"kernel={_kernel_identity()}", f"shapes={shapes}"])


def _time_once(layers: list[list[Linear]], xs: dict[int, torch.Tensor]) -> float:
    t = time.perf_counter()
    for layer in layers:
        for proj in layer:
            proj(xs[proj.shape[0][1]])
    return (time.perf_counter() - t) / len(layers)


def measure(shapes: list[tuple[int, int]]) -> Times:
    """Seconds per layer pass, per dtype and workload (module docstring), best of ROUNDS interleaved rounds."""
    g = torch.Generator().manual_seed(0)
    layer_bytes = {d: sum(o * i for o, i in shapes) * dtype_from_name(d).itemsize for d in DTYPES}
    copies = {d: max(2, min(MAX_COPIES, math.ceil(STREAM_BYTES / layer_bytes[d]))) for d in DTYPES}
    base = [torch.randn(o, i, generator=g) for o, i in shapes]  # copies share values, not memory
    layers = {d: [[Linear(w.to(dtype_from_name(d))) for w in base] for _ in range(copies[d])] for d in DTYPES}
    # inputs in the dtype each route takes (fp32 on our kernel, the weights' dtype elsewhere)
    inputs = {(w, d): {i: torch.randn(rows, i, generator=g).to(activation_dtype(dtype_from_name(d)))
                       for _, i in shapes} for w, rows in WORKLOADS.items() for d in DTYPES}
    best: Times = {d: {w: math.inf for w in WORKLOADS} for d in DTYPES}
    for w in WORKLOADS:
        for d in DTYPES:  # warm: first touches of every copy and, on oneDNN routes, primitive builds
            _time_once(layers[d], inputs[w, d])
    for _ in range(ROUNDS):
        for w, rows in WORKLOADS.items():
            for d in DTYPES:
                # prefill is compute bound: two copies suffice, and keep the probe short
                use = layers[d][:2] if rows >= 128 else layers[d]
                best[d][w] = min(best[d][w], _time_once(use, inputs[w, d]))
    return best


def choose(times: Times) -> tuple[str, str]:
    """(dtype, why): bf16 where it is not slower on any workload, fp32 where bf16 is slower on all; where they
    split, the dtype with the lower geometric-mean time, the why naming the workloads it loses."""
    ratio = {w: times["bfloat16"][w] / times["float32"][w] for w in WORKLOADS}
    said = ", ".join(f"{w} {r:.2f}" for w, r in ratio.items())
    if all(r <= 1.0 for r in ratio.values()):
        return "bfloat16", f"measured bf16/fp32 time {said}: bf16 no slower on any workload"
    if all(r >= 1.0 for r in ratio.values()):
        return "float32", f"measured bf16/fp32 time {said}: bf16 slower on every workload"
    mean = math.exp(sum(math.log(r) for r in ratio.values()) / len(ratio))
    dtype = "bfloat16" if mean < 1.0 else "float32"
    loses = [w for w, r in ratio.items() if (r > 1.0) == (dtype == "bfloat16")]
    return dtype, (f"measured bf16/fp32 time {said} (geometric mean {mean:.2f}): {dtype} for every role, "
                   f"slower on {', '.join(loses)} (one dtype per fleet: shared KV layout, exact handoffs)")


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_entry(entry: object) -> Times | None:
    """An entry's timings, or None where it is not a whole and sane one (another version's, a hand edit)."""
    try:
        times = {d: {w: float(entry[d][w]) for w in WORKLOADS} for d in DTYPES}  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return None
    return times if all(0 < t < math.inf for per in times.values() for t in per.values()) else None


def cached_times(shapes: list[tuple[int, int]], measure_fn: Callable[[list[tuple[int, int]]], Times] = measure
                 ) -> tuple[Times, str]:
    """(times, where they come from): measured once per cache key, under a file lock, then read. A cache that
    cannot be used (a read-only home, a file where the folder should be) costs the caching, not the start."""
    path = cache_dir() / CACHE_FILE
    key = cache_key(shapes)
    try:
        with _locked(path):
            try:
                entries = json.loads(path.read_text())
            except (OSError, ValueError):
                entries = {}
            if not isinstance(entries, dict):
                entries = {}
            entry = entries.get(key)
            times = _read_entry(entry)
            if times is not None:
                return times, f"cached probe of {entry.get('measured')} at load {entry.get('load_avg_1min')}, {path}"
            times = measure_fn(shapes)
            load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
            entries[key] = {**times, "load_avg_1min": load, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(entries, indent=1))
            tmp.replace(path)
            return times, f"probe measured now at load {load}, {path}"
    except OSError as exc:
        return measure_fn(shapes), f"probe measured now, not cached ({exc})"


def probe_dtype(config: ModelConfig) -> tuple[str, str]:
    """(dtype, why) for ``auto`` on this CPU and model: cached or measured now."""
    times, source = cached_times(layer_shapes(config))
    dtype, why = choose(times)
    return dtype, f"{why} ({source})"
