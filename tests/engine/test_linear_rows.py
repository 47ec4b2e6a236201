"""kernels.Linear's row buckets: the packed (oneDNN) route runs only at ROW_BUCKETS row counts, with the
same results as running the input's own row count, and serving new row counts builds no new primitives
(before the buckets, each new row count kept ~0.5 MiB of oneDNN primitive in its caches: RSS grew for
as long as an engine served)."""

import ctypes

import pytest
import torch

import pdd.kernels.linear as linear_mod
from pdd.kernels import Linear, cpu_linear
from pdd.kernels.linear import ROW_BUCKETS, row_plan


@pytest.mark.parametrize("rows", [*range(300), 511, 512, 513, 700, 4096, 4099])
def test_row_plan_covers_the_rows_at_bucket_sizes(rows):
    plan = row_plan(rows)
    assert sum(take for take, _ in plan) == rows
    assert all(bucket in ROW_BUCKETS and take <= bucket for take, bucket in plan)
    assert all(take == bucket for take, bucket in plan[:-1])  # only the last slice is padded
    if plan:
        take, bucket = plan[-1]
        assert bucket - take < (0.25 if take > 32 else 0.5) * take


@pytest.fixture
def packed_linear(monkeypatch):
    monkeypatch.setattr(cpu_linear, "available", lambda: False)  # the oneDNN route, which has the buckets
    if linear_mod._pack(torch.randn(8, 8)) is None:
        pytest.skip("no oneDNN fp32 linear on this platform")
    g = torch.Generator().manual_seed(0)
    return Linear(torch.randn(48, 40, generator=g)), g


@pytest.mark.parametrize("rows", [1, 5, 9, 33, 100, 255, 257, 600])
def test_bucketed_rows_equal_the_unpadded_primitive(packed_linear, rows):
    lin, g = packed_linear
    x = torch.randn(rows, 40, generator=g)
    residual = torch.randn(rows, 48, generator=g)
    direct = torch.ops.mkldnn._linear_pointwise(x, lin.weight, None, "none", [], "")
    direct_add = torch.ops.mkldnn._linear_pointwise.binary(x, residual, lin.weight, None, "add")
    assert torch.equal(lin(x), direct)
    assert torch.equal(lin.add_to(residual, x), direct_add)


def test_new_row_counts_allocate_nothing_that_stays(packed_linear):
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc's mallinfo2")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    mallinfo2.restype = MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    lin, g = packed_linear
    inputs = [torch.randn(rows, 40, generator=g) for rows in range(1, 301)]
    lin(inputs[0])  # builds every bucket's primitive
    before = in_use()
    for x in inputs:
        lin(x)
    grown = in_use() - before
    # unbucketed, these 300 row counts kept ~150 MiB of primitives; the inputs above are already allocated
    assert grown < 8 * 2**20, f"{grown / 2**20:.1f} MiB retained after 300 new row counts"
