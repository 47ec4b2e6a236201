"""kernels.Linear: the row-invariant (our C kernel), packed (oneDNN) and plain (torch.mm) routes compute the
same projection."""

import pytest
import torch

import pdd.kernels.linear as linear_mod
from pdd.kernels import Linear, cpu_linear


@pytest.fixture(params=["row_invariant", "packed", "plain"])
def route(request, monkeypatch):
    if request.param == "row_invariant":
        if not cpu_linear.available():
            pytest.skip(f"row-invariant kernel unavailable: {cpu_linear.unavailable_reason()}")
        return request.param
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    if request.param == "plain":
        monkeypatch.setattr(linear_mod, "_pack", lambda weight: None)
    elif linear_mod._pack(torch.randn(8, 8)) is None:
        pytest.skip("no oneDNN fp32 linear on this platform")
    return request.param


@pytest.mark.parametrize("rows", [1, 8, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_projection_and_fused_residual(route, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=g)
    bias = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(rows, 64, generator=g)
    residual = torch.randn(rows, 96, generator=g)
    lin = Linear(weight, bias)
    assert lin.packed == (route == "packed") and lin.row_invariant == (route == "row_invariant")
    want = x @ weight.t() + (bias if bias is not None else 0)
    torch.testing.assert_close(lin(x), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lin.add_to(residual, x), residual + want, rtol=1e-4, atol=1e-4)
    # a non-contiguous view (as the engine passes gate/up halves and attention outputs)
    wide = torch.randn(rows, 128, generator=g)
    torch.testing.assert_close(lin(wide[:, :64]), wide[:, :64] @ weight.t() + (bias if bias is not None else 0),
                               rtol=1e-4, atol=1e-4)


def test_other_dtypes_give_the_same_projection():
    half = torch.randn(16, 8).to(torch.float16)  # packed only where the CPU has fp16 oneDNN kernels
    lin = Linear(half)
    x = torch.randn(4, 8).to(torch.float16)
    torch.testing.assert_close(lin(x).float(), x.float() @ half.float().t(), rtol=1e-2, atol=1e-2)
