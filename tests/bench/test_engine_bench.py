"""bench/engine.py in its quick mode on a tiny checkpoint: the last line is JSON with every fraction key per dtype,
each a positive finite number (no timing thresholds: the figures are measured, not judged here)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from pdd.engine.torch_backend.tiny import build_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_reports_every_fraction(tmp_path):
    model = build_tiny_checkpoint(tmp_path / "llama", "llama", seed=7)
    proc = subprocess.run([sys.executable, "-m", "pdd.bench.engine", "--quick", "--threads", "1",
                           "--model", str(model)], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert any(line.startswith("dtype") for line in lines[:-1])  # the table header
    keys = [f"{name}_{sfx}" for sfx in ("fp32", "bf16") for name in
            ("b1_fraction_of_bandwidth_limit", "b8_fraction_of_gemm_peak", "prefill_fraction_of_gemm_peak")]
    keys += ["bf16_prefill_speedup_over_fp32", "bf16_b1_speedup_over_fp32", "read_bandwidth_gb_s",
             "gemm_peak_gflop_s_fp32", "gemm_peak_gflop_s_bf16", "ratio_vs_hf_batch1", "prefill_ratio_vs_hf"]
    for key in keys:
        value = figures[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, value)
