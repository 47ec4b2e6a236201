"""Serving dtype: `auto` by the dtype probe's measurement (engine/torch_backend/dtype_probe.py: the choice, its cache, the real
timing), from the CPU's bf16 flags (injected /proc/cpuinfo text) where there is nothing to measure, or as
PDD_NATIVE_BF16 says; the KV dtype option, and a bfloat16 engine end to end (this machine may lack native bf16;
torch still computes it)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from pdd.engine import SamplingParams
from pdd.engine.torch_backend import dtype_probe
from pdd.engine.core.dtypes import NATIVE_BF16_ENV, bf16_support, cpu_flags, resolve_dtypes
from pdd.kernels import activation_dtype

from .conftest import make_engine, run_all

# trimmed /proc/cpuinfo of three machine kinds
AVX2_ONLY = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B12
flags\t\t: fpu vme sse sse2 avx avx2 fma bmi2
"""
AVX512_BF16 = AVX2_ONLY.replace("bmi2", "bmi2 avx512f avx512bw avx512_vnni avx512_bf16")
SAPPHIRE_RAPIDS = AVX2_ONLY.replace("bmi2", "bmi2 avx512f amx_bf16 amx_tile amx_int8")
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32\n"


@pytest.fixture
def detect(monkeypatch):
    """Detection from the (injected) CPU flags: no PDD_NATIVE_BF16 override from the test run's environment."""
    monkeypatch.delenv(NATIVE_BF16_ENV, raising=False)


def test_cpu_flags_reads_x86_and_arm_lines():
    assert {"avx2", "fma"} <= cpu_flags(AVX2_ONLY)
    assert "asimd" in cpu_flags(ARM)
    assert cpu_flags("") == set()


@pytest.mark.parametrize("cpuinfo, native, flag", [
    (AVX512_BF16, True, "avx512_bf16"),
    (SAPPHIRE_RAPIDS, True, "amx_bf16"),
    (AVX2_ONLY, False, None),
    (ARM, False, None),
    ("", False, None),
])
def test_auto_picks_bf16_only_with_native_bf16(detect, cpuinfo, native, flag):
    ok, reason = bf16_support(cpuinfo)
    assert ok is native
    choice = resolve_dtypes("auto", "auto", cpuinfo_text=cpuinfo)
    assert choice.dtype == ("bfloat16" if native else "float32")
    assert choice.kv_dtype == choice.dtype  # kv auto follows the weights
    if flag:
        assert flag in reason and flag in choice.reason  # the log says which flag decided
    else:
        assert "none of avx512_bf16, amx_bf16" in choice.reason


def test_explicit_dtypes_win_over_the_cpu(detect):
    assert resolve_dtypes("float32", "auto", cpuinfo_text=AVX512_BF16).dtype == "float32"
    choice = resolve_dtypes("bfloat16", "auto", cpuinfo_text=AVX2_ONLY)
    assert (choice.dtype, choice.kv_dtype) == ("bfloat16", "bfloat16")
    assert "set in config" in choice.reason
    assert resolve_dtypes("auto", "float32", cpuinfo_text=AVX2_ONLY).kv_dtype == "float32"


@pytest.mark.parametrize("value, native", [("1", True), ("0", False), (" 1 ", True)])
@pytest.mark.parametrize("cpuinfo", [AVX512_BF16, AVX2_ONLY, None])  # None: this machine's /proc/cpuinfo
def test_env_override_wins_over_the_cpu_and_is_named(monkeypatch, value, native, cpuinfo):
    monkeypatch.setenv(NATIVE_BF16_ENV, value)
    ok, reason = bf16_support(cpuinfo)
    assert ok is native and reason == f"PDD_NATIVE_BF16={int(native)} in the environment"
    choice = resolve_dtypes("auto", "auto", cpuinfo_text=cpuinfo)
    assert (choice.dtype, choice.kv_dtype) == (("bfloat16",) * 2 if native else ("float32",) * 2)
    assert choice.reason.startswith(f"dtype auto -> {choice.dtype}: PDD_NATIVE_BF16={int(native)} in the environment")
    # explicit dtypes still win over the override
    assert resolve_dtypes("float32", "auto", cpuinfo_text=cpuinfo).dtype == "float32"
    assert resolve_dtypes("bfloat16", "auto", cpuinfo_text=cpuinfo).dtype == "bfloat16"


def test_env_override_unset_or_empty_detects(monkeypatch):
    monkeypatch.setenv(NATIVE_BF16_ENV, "")
    assert bf16_support(AVX512_BF16) == (True, "/proc/cpuinfo has avx512_bf16")
    assert bf16_support(AVX2_ONLY, environ={}) == (False, "/proc/cpuinfo has none of avx512_bf16, amx_bf16")
    assert bf16_support(AVX2_ONLY, environ={NATIVE_BF16_ENV: "1"})[0] is True  # an explicit mapping, not os.environ


@pytest.mark.parametrize("value", ["yes", "true", "2", "bf16", "-1"])
def test_bad_env_override_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv(NATIVE_BF16_ENV, value)
    with pytest.raises(ValueError, match=rf"PDD_NATIVE_BF16 must be 1 .*, 0 .* or unset .*; got '{value}'"):
        bf16_support(AVX512_BF16)
    with pytest.raises(ValueError, match="PDD_NATIVE_BF16 must be"):
        resolve_dtypes("auto", "auto")
    with pytest.raises(ValueError, match="PDD_NATIVE_BF16 must be"):  # a typo fails even where it would not decide
        resolve_dtypes("float32", "float32")


def test_bad_dtype_names_are_refused():
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        resolve_dtypes("auto", "int8")
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtypes("fp32")


def test_fp32_weights_with_bf16_kv(llama_path):
    """A mixed pair runs (attention casts on write and computes in fp32): half the KV bytes with fp32
    weights, logits within bf16 rounding of all-fp32, and KV moved between two such engines continues
    exactly as one of them."""
    fp32 = make_engine(llama_path, dtype="float32")
    mixed = make_engine(llama_path, dtype="float32", kv_dtype="bfloat16")
    assert mixed.model.dtype == torch.float32 and all(t.dtype == torch.bfloat16 for t in mixed.k_cache)
    assert mixed.layout.bytes_per_token * 2 == fp32.layout.bytes_per_token
    prompts = _prompts(fp32.config.vocab_size, 6, seed=5)
    captured = {}
    for name, engine in (("fp32", fp32), ("mixed", mixed)):
        engine.capture_logits = True
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(ignore_eos=True), max_new_tokens=1)
        run_all(engine)
        captured[name] = torch.cat([engine.captured_logits[f"r{i}"][0].reshape(1, -1) for i in range(len(prompts))])
    assert (captured["mixed"] - captured["fp32"]).abs().max().item() <= 0.04 * captured["fp32"].abs().max().item()

    params, n = SamplingParams(ignore_eos=True), 12
    ref = make_engine(llama_path, dtype="float32", kv_dtype="bfloat16")
    ref.add_request("r", prompts[0], params, max_new_tokens=n)
    expected = run_all(ref)["r"]
    src, dst = (make_engine(llama_path, dtype="float32", kv_dtype="bfloat16") for _ in range(2))
    src.add_request("x", prompts[0], params, max_new_tokens=1, hold_kv=True)
    first = run_all(src)["x"]
    plan = dst.prepare_import("x", prompts[0])
    _copy_blocks(src, src.request_blocks("x"), dst, plan.dst_blocks)
    src.release("x")
    dst.commit_import("x", prompts[0], first, params, max_new_tokens=n)
    assert first + run_all(dst)["x"] == expected


def test_engine_resolves_auto_by_the_probe_and_keeps_the_reason(detect, llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PDD_CACHE_DIR", str(tmp_path))
    engine = make_engine(llama_path, dtype="auto")
    shapes = dtype_probe.layer_shapes(engine.config)
    choice = engine.dtype_choice
    if bf16_support()[0] or activation_dtype(torch.bfloat16) == torch.float32:  # something to measure
        times, source = dtype_probe.cached_times(shapes, measure_fn=lambda _: pytest.fail("measured twice"))
        assert source.startswith("cached probe") and choice.dtype == dtype_probe.choose(times)[0]
        assert "probe measured now" in choice.reason and str(tmp_path) in choice.reason
        again = make_engine(llama_path, dtype="auto").dtype_choice  # a second engine reads the cache
        assert again.dtype == choice.dtype and "cached probe" in again.reason
    else:
        assert choice.dtype == "float32" and "no kernel for bf16 weights" in choice.reason
    assert engine.layout.dtype == choice.kv_dtype == choice.dtype
    assert engine.model.dtype == (torch.bfloat16 if choice.dtype == "bfloat16" else torch.float32)
    assert make_engine(llama_path, dtype="float32").dtype_choice.dtype == "float32"  # config still forces either
    assert make_engine(llama_path, dtype="bfloat16").dtype_choice.dtype == "bfloat16"


WORKLOADS = list(dtype_probe.WORKLOADS)


def _config(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> SimpleNamespace:
    return SimpleNamespace(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                           intermediate_size=inter)


def _times(**ratios: float) -> dtype_probe.Times:
    return {"float32": {w: 1.0 for w in WORKLOADS}, "bfloat16": {w: ratios.get(w, 1.0) for w in WORKLOADS}}


def test_the_probe_picks_the_dtype_no_slower_on_every_workload_and_says_why():
    dtype, why = dtype_probe.choose(_times(prefill=0.5, decode_b1=0.6, decode_b32=0.55))
    assert dtype == "bfloat16" and "prefill 0.50" in why and "no slower on any workload" in why
    dtype, why = dtype_probe.choose(_times(prefill=1.3, decode_b1=1.1, decode_b32=1.2))
    assert dtype == "float32" and "slower on every workload" in why
    # a split (an AVX2 CPU: bf16 weights halve decode's bytes, its prefill runs fp32 FLOPs plus the widening)
    dtype, why = dtype_probe.choose(_times(prefill=1.1, decode_b1=0.6, decode_b32=1.05))
    assert dtype == "bfloat16" and "slower on prefill, decode_b32" in why and "one dtype per fleet" in why
    dtype, why = dtype_probe.choose(_times(prefill=1.5, decode_b1=0.9, decode_b32=1.3))
    assert dtype == "float32" and "slower on decode_b1" in why


def test_resolve_takes_the_probe_unless_the_environment_or_the_config_decides(detect, monkeypatch):
    probe = lambda: ("bfloat16", "probe says so")  # noqa: E731
    if activation_dtype(torch.bfloat16) == torch.float32:  # our kernel runs bf16 weights: the probe decides
        choice = resolve_dtypes("auto", "auto", cpuinfo_text=AVX2_ONLY, probe=probe)
        assert (choice.dtype, choice.kv_dtype) == ("bfloat16", "bfloat16") and "probe says so" in choice.reason
    choice = resolve_dtypes("auto", "auto", cpuinfo_text=AVX512_BF16, probe=lambda: ("float32", "measured"))
    assert choice.dtype == "float32" and choice.reason.startswith("dtype auto -> float32: measured")
    assert resolve_dtypes("bfloat16", "auto", probe=lambda: pytest.fail("probed")).dtype == "bfloat16"
    monkeypatch.setenv(NATIVE_BF16_ENV, "0")
    assert resolve_dtypes("auto", "auto", probe=lambda: pytest.fail("probed")).dtype == "float32"


def test_the_probe_is_measured_once_per_key_and_survives_a_corrupt_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDD_CACHE_DIR", str(tmp_path))
    calls = []

    def fake(shapes):
        calls.append(shapes)
        return _times(prefill=0.5, decode_b1=0.5, decode_b32=0.5)

    shapes = dtype_probe.layer_shapes(_config(64, 4, 2, 16, 128))
    times, source = dtype_probe.cached_times(shapes, fake)
    assert times == _times(prefill=0.5, decode_b1=0.5, decode_b32=0.5) and source.startswith("probe measured now")
    times, source = dtype_probe.cached_times(shapes, fake)
    assert source.startswith("cached probe") and "at load" in source and len(calls) == 1
    assert times == _times(prefill=0.5, decode_b1=0.5, decode_b32=0.5)
    other = dtype_probe.layer_shapes(_config(128, 4, 2, 32, 256))
    assert dtype_probe.cached_times(other, fake)[1].startswith("probe measured now")  # another model's shapes
    (tmp_path / dtype_probe.CACHE_FILE).write_text("{not json")
    assert dtype_probe.cached_times(shapes, fake)[1].startswith("probe measured now") and len(calls) == 3
    # an entry of the right key but wrong contents (a hand edit, another version) is measured again, not trusted
    key = dtype_probe.cache_key(shapes)
    for bad in ({"float32": {"prefill": "fast"}}, {"float32": None, "bfloat16": {}},
                {d: {w: -1.0 for w in WORKLOADS} for d in ("float32", "bfloat16")}, [1, 2]):
        (tmp_path / dtype_probe.CACHE_FILE).write_text(json.dumps({key: bad}))
        assert dtype_probe.cached_times(shapes, fake)[1].startswith("probe measured now"), bad
    assert len(calls) == 7


def test_an_unusable_cache_costs_the_caching_not_the_start(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("PDD_CACHE_DIR", str(tmp_path / "file" / "pdd"))  # its parent is a file: mkdir fails
    times, source = dtype_probe.cached_times(dtype_probe.layer_shapes(_config(64, 4, 2, 16, 128)),
                                             lambda _: _times(prefill=0.5))
    assert times == _times(prefill=0.5) and source.startswith("probe measured now, not cached")


def test_the_real_probe_times_every_workload_in_both_dtypes():
    times = dtype_probe.measure(dtype_probe.layer_shapes(_config(64, 4, 2, 16, 128)))
    assert set(times) == {"float32", "bfloat16"}
    for per_workload in times.values():
        assert set(per_workload) == set(WORKLOADS)
        assert all(0 < t < 10 for t in per_workload.values())
    assert dtype_probe.choose(times)[0] in ("float32", "bfloat16")


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def test_bf16_engine_weights_kv_and_bytes(llama_path):
    fp32 = make_engine(llama_path, dtype="float32")
    bf16 = make_engine(llama_path, dtype="bfloat16")
    assert bf16.model.dtype == torch.bfloat16 and bf16.model.embed.dtype == torch.bfloat16
    assert bf16.layout.dtype == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in bf16.k_cache + bf16.v_cache)
    # half the KV bytes per token, so half of every KV transfer (the WAN included)
    assert bf16.layout.bytes_per_token * 2 == fp32.layout.bytes_per_token
    assert bf16.kv_pool_bytes() * 2 == fp32.kv_pool_bytes()
    assert not bf16.layout.compatible_with(fp32.layout)


def test_bf16_logits_track_fp32(llama_path):
    """Same prompts in both dtypes: bf16 logits within bf16 rounding of fp32, top-1 mostly equal."""
    engines = {d: make_engine(llama_path, dtype=d) for d in ("float32", "bfloat16")}
    prompts = _prompts(engines["float32"].config.vocab_size, 12, seed=3)
    captured = {}
    for name, engine in engines.items():
        engine.capture_logits = True
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(ignore_eos=True), max_new_tokens=1)
        run_all(engine)
        captured[name] = torch.cat([engine.captured_logits[f"r{i}"][0].reshape(1, -1) for i in range(len(prompts))])
    ref, got = captured["float32"], captured["bfloat16"]
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 0.04 * scale  # measured: about 0.011 * scale
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.75


def _copy_blocks(src, src_blocks, dst, dst_blocks):
    assert src.layout.compatible_with(dst.layout)
    for layer in range(src.layout.num_layers):
        dst.k_cache[layer][dst_blocks] = src.k_cache[layer][src_blocks]
        dst.v_cache[layer][dst_blocks] = src.v_cache[layer][src_blocks]


def test_bf16_export_import_extend_equals_one_engine(llama_path):
    """P -> MD in bf16: imported KV, then extended known tokens, continue exactly as one bf16 engine."""
    params = SamplingParams(ignore_eos=True)
    n = 14
    ref = make_engine(llama_path, dtype="bfloat16")
    prompt = _prompts(ref.config.vocab_size, 1, seed=11)[0]
    ref.add_request("r", prompt, params, max_new_tokens=n)
    expected = run_all(ref)["r"]
    p_engine, d_engine = make_engine(llama_path, dtype="bfloat16"), make_engine(llama_path, dtype="bfloat16")
    p_engine.add_request("x", prompt, params, max_new_tokens=1, hold_kv=True)
    first = run_all(p_engine)["x"]
    assert first == expected[:1]
    plan = d_engine.prepare_import("x", prompt)
    _copy_blocks(p_engine, p_engine.request_blocks("x"), d_engine, plan.dst_blocks)
    p_engine.release("x")
    d_engine.commit_import("x", prompt, first, params, max_new_tokens=n)
    d_engine.extend_known("x", expected[1:5])  # a relay's tokens handed over by id
    out = run_all(d_engine)["x"]
    assert first + expected[1:5] + out == expected
