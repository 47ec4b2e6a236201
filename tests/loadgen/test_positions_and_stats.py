"""Position timing and the shared statistics: pure functions, checked against hand-computed values."""

from __future__ import annotations

import math

import pytest

from pdd.loadgen.client import Chunk, Stream
from pdd.loadgen.positions import PositionTimes
from pdd.loadgen.stats import bisect_geometric, highest_passing, mean_ci95, pct


def test_positions_from_chunks_that_carry_several_tokens() -> None:
    # a baseline that held position 0: its first chunk carries positions 0 and 1 together
    s = Stream(t_send=10.0, chunks=[Chunk(10.5, "ab", tokens=2), Chunk(10.6, "c", tokens=1),
                                   Chunk(10.9, "de", tokens=2), Chunk(10.95, "", tokens=0)])
    p = PositionTimes(s.t_send, s.token_times())
    assert p.times == [10.5, 10.5, 10.6, 10.9, 10.9]
    assert p.ttft == pytest.approx(0.5) and p.tt2 == pytest.approx(0.5)  # not the second chunk's 0.6
    assert p.gaps == pytest.approx([0.0, 0.1, 0.3, 0.0])
    assert p.mean_itl == pytest.approx(0.4 / 4)
    assert p.e2e == pytest.approx(0.9)


def test_handoff_stall_is_the_largest_gap_at_the_handover_over_the_median() -> None:
    # the relay emits positions 1..99, main decode from 100: a 50 ms pause into position 100, else 10 ms
    times = [0.0] + [0.2 + 0.01 * i for i in range(99)] + [1.23 + 0.01 * i for i in range(100)]
    p = PositionTimes(0.0, times)
    assert p.stall(100) == pytest.approx(0.05 / 0.01)
    assert p.stall(150) == pytest.approx(1.0)  # elsewhere the stream is even
    assert p.stall(1) == pytest.approx(1.0)  # position 1 (prefill -> relay, 200 ms: TT2) is no handoff
    assert PositionTimes(0.0, [0.01 * i for i in range(100)]).stall(50) == pytest.approx(1.0)
    assert PositionTimes(0.0, [0.01 * i for i in range(10)]).stall(40) is None  # ended before the handover
    bursty = [0.0, 0.0, 0.0, 0.3, 0.3, 0.3]  # median gap 0 -> the mean gap stands in
    assert PositionTimes(0.0, bursty).stall(3) == pytest.approx(0.3 / 0.06)


def test_percentile_and_interval() -> None:
    assert pct([3, 1, 2, None], 50) == 2 and pct([], 90) is None
    assert pct([0.0, 10.0], 90) == pytest.approx(9.0)
    ci = mean_ci95([1.0, 2.0, 3.0])
    assert ci["mean"] == 2.0 and ci["n"] == 3
    assert ci["ci95"] == pytest.approx(4.303 * 1.0 / math.sqrt(3), abs=1e-3)
    assert mean_ci95([5.0])["ci95"] is None and mean_ci95([None])["mean"] is None


def test_calibration_stops_at_the_first_probe_within_tolerance() -> None:
    def ratio(rate: float) -> float:  # a falling curve: 1 + 100 / rate
        seen.append(rate)
        return 1 + 100 / rate

    seen: list[float] = []
    found = bisect_geometric(ratio, target=1.6, tolerance=0.1, lo=1.0, hi=10_000.0, max_steps=20)
    assert found.converged and abs(ratio(found.value) - 1.6) <= 0.1
    assert len(found.probes) == len(seen) - 1  # stopped right after the first probe in tolerance
    assert all(abs(p["y"] - 1.6) > 0.1 for p in found.probes[:-1])
    ys = [p["y"] for p in found.probes]
    for (a, b), x in zip(zip(ys, ys[1:]), found.probes[1:]):  # each step moves toward the target
        assert (b < a) == (a > 1.6)


def test_calibration_reports_the_closest_probe_when_it_cannot_converge() -> None:
    found = bisect_geometric(lambda r: 3.0, target=1.6, tolerance=0.1, lo=1.0, hi=100.0, max_steps=3)
    assert not found.converged and len(found.probes) == 3 and "closest 3.000" in found.note


def test_sustainable_rate_search() -> None:
    edge = 1.3
    found = highest_passing(lambda r: r <= edge, lo=0.2, hi=3.2, steps=6)
    assert found.converged and found.value <= edge and found.value > edge / 1.2
    assert found.probes[0]["x"] == pytest.approx(0.8)  # starts mid-range (log scale), not at the slow end
    never = highest_passing(lambda r: False, lo=0.2, hi=3.2, steps=3)
    assert not never.converged and never.value == 0.2 and "< 0.2" in never.note  # an upper bound, flagged
    assert never.probes[-1] == {"x": 0.2, "passed": False}


def test_histogram_quantile_between_two_scrapes() -> None:
    """Quantiles of a Prometheus histogram over one interval (bench/control_plane.py's router delay): only the
    observations between the scrapes count, linear inside a bucket, the last finite bound above it."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from pdd.loadgen.scrape import histogram_quantile, parse

    registry = CollectorRegistry()
    h = Histogram("delay_seconds", "d", buckets=(0.001, 0.002, 0.005, 0.01), registry=registry)
    for _ in range(50):
        h.observe(0.02)  # before the interval: must not count
    before = parse(generate_latest(registry).decode())
    assert histogram_quantile(before, before, "delay_seconds", 0.5) is None
    for v in [0.0015] * 98 + [0.004, 0.009]:
        h.observe(v)
    after = parse(generate_latest(registry).decode())
    assert histogram_quantile(before, after, "delay_seconds", 0.5) == pytest.approx(0.001 + 0.001 * 50 / 98)
    assert histogram_quantile(before, after, "delay_seconds", 0.99) == pytest.approx(0.005)
    h.observe(1.0)
    assert histogram_quantile(before, parse(generate_latest(registry).decode()), "delay_seconds", 1.0) == 0.01
