"""kernels/cpu_linear: our projection kernel is right, and row-invariant by construction: a row's output is
the same bits whatever else is in the batch, however many threads run it, and whichever weight load (fp32,
bf16 direct, bf16 widened per panel) or one-row route computed it. Each weight format is checked: fp32,
bf16 widened to fp32 arithmetic, and bf16 products (AVX512-BF16 CPUs only)."""

import pytest
import torch

from pdd.kernels import cpu_linear
from pdd.kernels.cpu_linear import WeightFormat

pytestmark = pytest.mark.skipif(
    not cpu_linear.available(), reason=f"row-invariant kernel unavailable: {cpu_linear.unavailable_reason()}"
)
NEEDS_BF16_ARITHMETIC = pytest.mark.skipif(
    not cpu_linear.available() or not cpu_linear.bf16_arithmetic_available(),
    reason="bf16-product kernel: this CPU has no AVX512-BF16 (or PDD_NATIVE_BF16=0)")
FORMATS = [WeightFormat.FP32, WeightFormat.BF16, pytest.param(WeightFormat.BF16_DOT, marks=NEEDS_BF16_ARITHMETIC)]

# shapes: a multiple of the panel widths (24, 48), ragged tails, in_features odd / not a multiple of 8, one column
SHAPES = [(96, 64), (50, 40), (37, 101), (1, 24), (200, 33)]


def _inputs(out_features: int, in_features: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    residual = torch.randn(rows, out_features, generator=g)
    return weight, bias, x, residual


def _pack(weight: torch.Tensor, fmt: WeightFormat):
    dtype = torch.float32 if fmt is WeightFormat.FP32 else torch.bfloat16
    packed, got = cpu_linear.pack(weight.to(dtype), fmt)
    assert got is fmt
    return packed


def _linear(x, packed, fmt, out_features, bias=None, residual=None):
    return cpu_linear.linear(x, packed, fmt, x.shape[1], out_features, bias, residual)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_float64_reference(shape, fmt):
    weight, bias, x, residual = _inputs(*shape, rows=19)
    packed = _pack(weight, fmt)
    w = weight if fmt is WeightFormat.FP32 else weight.to(torch.bfloat16)
    # bf16 products: the kernel rounds x to bf16 (nearest even), then multiplies exactly, accumulating in fp32
    xs = x.to(torch.bfloat16) if fmt is WeightFormat.BF16_DOT else x
    want = xs.double() @ w.double().t() + bias.double()
    got = _linear(x, packed, fmt, shape[0], bias)
    assert got.dtype == torch.float32 and got.shape == (19, shape[0])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    fused = _linear(x, packed, fmt, shape[0], bias, residual)
    torch.testing.assert_close(fused.double(), residual.double() + want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(_linear(x, packed, fmt, shape[0]).double(), want - bias.double(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_is_the_same_bits_in_every_batch(fmt):
    # 9 / 5 panels (24 / 48 columns), the last partial: one row takes 3 / 4 at a time, then single panels
    weight, bias, x, residual = _inputs(200, 40, rows=40)
    packed = _pack(weight, fmt)
    full = _linear(x, packed, fmt, 200, bias, residual)
    # every row count 1..40 (micro-tile tails, the bf16 widening from 8 rows) at several offsets
    for rows in range(1, 41):
        for start in {0, 1, 40 - rows}:
            if start + rows <= 40:
                part = _linear(x[start:start + rows], packed, fmt, 200, bias, residual[start:start + rows])
                assert torch.equal(part, full[start:start + rows]), (rows, start)


@pytest.mark.parametrize("fmt", FORMATS)
def test_thread_count_does_not_change_the_bits(fmt):
    weight, bias, x, residual = _inputs(480, 64, rows=13)
    packed = _pack(weight, fmt)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outputs.append((_linear(x, packed, fmt, 480, bias, residual),
                            _linear(x[:1], packed, fmt, 480, bias, residual[:1])))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outputs[0][0]) and torch.equal(one, out[:1]) for out, one in outputs)


def test_bf16_weights_give_the_bits_of_their_fp32_widening():
    weight, bias, x, _ = _inputs(50, 40, rows=12)
    rounded = weight.to(torch.bfloat16)
    for rows in (1, 3, 12):  # direct bf16 loads below 8 rows, one widened panel from 8
        got = _linear(x[:rows], _pack(rounded, WeightFormat.BF16), WeightFormat.BF16, 50, bias)
        want = _linear(x[:rows], _pack(rounded.float(), WeightFormat.FP32), WeightFormat.FP32, 50, bias)
        assert torch.equal(got, want), rows


def test_the_format_follows_the_cpu_and_the_override(monkeypatch):
    assert cpu_linear.format_for(torch.float32) is WeightFormat.FP32
    monkeypatch.setenv("PDD_NATIVE_BF16", "0")  # as a CPU without AVX512-BF16 runs
    assert cpu_linear.format_for(torch.bfloat16) is WeightFormat.BF16
    assert cpu_linear.pack(torch.zeros(4, 4, dtype=torch.bfloat16))[1] is WeightFormat.BF16
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        cpu_linear.pack(torch.zeros(4, 4, dtype=torch.bfloat16), WeightFormat.BF16_DOT)
    monkeypatch.delenv("PDD_NATIVE_BF16")
    expected = WeightFormat.BF16_DOT if cpu_linear.bf16_arithmetic_available() else WeightFormat.BF16
    assert cpu_linear.format_for(torch.bfloat16) is expected
    assert expected.arithmetic == (torch.bfloat16 if expected is WeightFormat.BF16_DOT else torch.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_views_zero_rows_and_bad_inputs(fmt):
    weight, _, x, residual = _inputs(50, 40, rows=6)
    packed = _pack(weight, fmt)
    wide = torch.cat([x, x], dim=1)
    assert torch.equal(_linear(wide[:, :40], packed, fmt, 50), _linear(x, packed, fmt, 50))
    assert _linear(x[:0], packed, fmt, 50).shape == (0, 50)
    with pytest.raises(ValueError, match="float32 input"):
        _linear(x.double(), packed, fmt, 50)
    with pytest.raises(ValueError, match="float32 input"):
        cpu_linear.linear(x[:, :30], packed, fmt, 40, 50)
    with pytest.raises(ValueError, match="residual"):
        _linear(x, packed, fmt, 50, None, residual[:, :10])
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        cpu_linear.pack(weight.half())
    with pytest.raises(TypeError, match="does not hold"):
        cpu_linear.pack(weight, WeightFormat.BF16)
    with pytest.raises(ValueError, match="does not hold"):
        cpu_linear.linear(x, packed, fmt, 40, 500)
