"""kernels/cpu_linear: our projection kernel is right, and row-invariant by construction: a row's output is
the same bits whatever else is in the batch, however many threads run it, and whichever weight load (fp32,
bf16 direct, bf16 widened per panel) computed it."""

import pytest
import torch

from pdd.kernels import cpu_linear

pytestmark = pytest.mark.skipif(
    not cpu_linear.available(), reason=f"row-invariant kernel unavailable: {cpu_linear.unavailable_reason()}"
)

# shapes: a multiple of the panel width, a ragged tail, in_features not a multiple of 8, one column
SHAPES = [(96, 64), (50, 40), (37, 100), (1, 24)]


def _inputs(out_features: int, in_features: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    residual = torch.randn(rows, out_features, generator=g)
    return weight, bias, x, residual


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(shape, dtype):
    weight, bias, x, residual = _inputs(*shape, rows=19)
    weight = weight.to(dtype)
    packed = cpu_linear.pack(weight)
    want = x.double() @ weight.double().t() + bias.double()
    got = cpu_linear.linear(x, packed, shape[0], bias)
    assert got.dtype == torch.float32 and got.shape == (19, shape[0])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    fused = cpu_linear.linear(x, packed, shape[0], bias, residual)
    torch.testing.assert_close(fused.double(), residual.double() + want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_linear.linear(x, packed, shape[0]).double(), want - bias.double(),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_in_every_batch(dtype):
    weight, bias, x, residual = _inputs(200, 40, rows=40)  # 9 panels, the last partial: 1 row takes 3 at a time
    packed = cpu_linear.pack(weight.to(dtype))
    full = cpu_linear.linear(x, packed, 200, bias, residual)
    # every row count 1..40 (micro-tile tails 1-3, the bf16 widening from 8 rows) at several offsets
    for rows in range(1, 41):
        for start in {0, 1, 40 - rows}:
            if start + rows <= 40:
                part = cpu_linear.linear(x[start:start + rows], packed, 200, bias, residual[start:start + rows])
                assert torch.equal(part, full[start:start + rows]), (rows, start)


def test_thread_count_does_not_change_the_bits():
    weight, bias, x, residual = _inputs(240, 64, rows=13)
    packed = cpu_linear.pack(weight)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outputs.append((cpu_linear.linear(x, packed, 240, bias, residual),
                            cpu_linear.linear(x[:1], packed, 240, bias, residual[:1])))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outputs[0][0]) and torch.equal(one, out[:1]) for out, one in outputs)


def test_bf16_weights_give_the_bits_of_their_fp32_widening():
    weight, bias, x, _ = _inputs(50, 40, rows=12)
    rounded = weight.to(torch.bfloat16)
    for rows in (1, 3, 12):  # direct bf16 loads below 8 rows, one widened panel from 8
        got = cpu_linear.linear(x[:rows], cpu_linear.pack(rounded), 50, bias)
        want = cpu_linear.linear(x[:rows], cpu_linear.pack(rounded.float()), 50, bias)
        assert torch.equal(got, want), rows


def test_views_zero_rows_and_bad_inputs():
    weight, _, x, residual = _inputs(50, 40, rows=6)
    packed = cpu_linear.pack(weight)
    wide = torch.cat([x, x], dim=1)
    assert torch.equal(cpu_linear.linear(wide[:, :40], packed, 50), cpu_linear.linear(x, packed, 50))
    assert cpu_linear.linear(x[:0], packed, 50).shape == (0, 50)
    with pytest.raises(ValueError, match="float32 input"):
        cpu_linear.linear(x.double(), packed, 50)
    with pytest.raises(ValueError, match="float32 input"):
        cpu_linear.linear(x[:, :30], packed, 50)
    with pytest.raises(ValueError, match="residual"):
        cpu_linear.linear(x, packed, 50, None, residual[:, :10])
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        cpu_linear.pack(weight.half())
