"""bench/codec.py in its quick mode on a tiny checkpoint: the last line is JSON with every key the issue asks for, each
a finite number in its range (no timing thresholds: the figures are measured, not judged here)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from pdd.engine.torch_backend.tiny import build_tiny_checkpoint


def test_quick_run_reports_every_codec_figure(tmp_path):
    model = build_tiny_checkpoint(tmp_path / "llama", "llama", seed=7)
    proc = subprocess.run([sys.executable, "-m", "pdd.bench.codec", "--quick", "--threads", "1", "--model", str(model)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert lines[0].startswith("cpu: ") and "avx512_bf16: " in lines[0]
    for key in ("lossless_ratio_fp32", "lossless_ratio_bf16", "lossless_mb_s_per_core", "fp8_ratio_bf16"):
        assert isinstance(figures[key], (int, float)) and math.isfinite(figures[key]) and figures[key] > 0, key
    for key in ("fp8_top1_agreement", "fp8_greedy_prefix_agreement"):
        assert 0.0 <= figures[key] <= 1.0, key
    assert 0 <= figures["fp8_first_divergence_p50"] <= figures["generated_tokens"]
    assert figures["fp8_positions"] == figures["prompts"] * figures["generated_tokens"]
    assert figures["control_exact_top1_agreement"] == 1.0  # exact KV through the same import path: no divergence
    assert figures["prompt_source"].startswith("real text")


def test_memory_mode_reports_every_codec(tmp_path):
    """--memory with a small transfer (2,048 tokens, ~45 MiB per pool): sender and receiver processes per codec; the
    last line is JSON with a finite, non-negative peak-RSS growth per codec and side, the pool size and the tokens."""
    proc = subprocess.run([sys.executable, "-m", "pdd.bench.codec", "--memory", "--tokens", "2048"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["kv_tokens"] == 2048
    # 30 layers x K,V x 128 blocks x 16 tokens x 3 heads x 64 dims x 2 bytes
    assert figures["pool_mb"] == round(2 * 30 * 128 * 16 * 3 * 64 * 2 / 2**20, 1)
    assert set(figures["memory_peak_extra_mb"]) == {"none", "lossless", "fp8", "fp8+lossless"}
    for codec, sides in figures["memory_peak_extra_mb"].items():
        assert set(sides) == {"sender", "receiver"}, codec
        for side, mb in sides.items():
            assert isinstance(mb, (int, float)) and math.isfinite(mb) and mb >= 0, (codec, side, mb)
    for key in ("transfer_seconds", "wire_bytes"):
        for codec, value in figures[key].items():
            assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, codec)
    assert figures["wire_bytes"]["none"] == figures["raw_bytes"]
    assert figures["bit_exact"] == {"none": True, "lossless": True}
