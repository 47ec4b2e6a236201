"""The router's per-token histogram (ITL) queues its observations: a scrape must read what Histogram would."""

import math
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from pdd.shared import metrics
from pdd.shared.metrics import QueuedHistogram

BUCKETS = (0.005, 0.01, 0.025, 0.05, 1.0)


def _pair() -> tuple[CollectorRegistry, Histogram, QueuedHistogram]:
    registry = CollectorRegistry()
    plain = Histogram("plain", "h", ["m"], buckets=BUCKETS, registry=registry)
    queued = QueuedHistogram("queued", "h", ["m"], buckets=BUCKETS, registry=registry)
    return registry, plain, queued


def _samples(registry: CollectorRegistry, name: str) -> list[tuple[str, dict, float]]:
    return [(s.name.removeprefix(name), s.labels, s.value) for metric in registry.collect() if metric.name == name
            for s in metric.samples if not s.name.endswith("_created")]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.sampled_from([0.0, *BUCKETS, -1.0, math.inf]), st.floats(-1, 100)), max_size=300),
       st.integers(1, 64))
def test_a_scrape_reads_what_histogram_would(values: list[float], fold_at: int) -> None:
    registry, plain, queued = _pair()
    reference, child = plain.labels("x"), queued.labels("x")
    child.FOLD_AT = fold_at  # folds along the way too
    for v in values:
        reference.observe(v)
        child.observe(v)
    got, want = _samples(registry, "queued"), _samples(registry, "plain")
    assert [(n, lab) for n, lab, _ in got] == [(n, lab) for n, lab, _ in want]
    assert [v for _, _, v in got] == pytest.approx([v for _, _, v in want], rel=1e-9, abs=1e-12)
    assert not child._queued  # a read folds the queue


def test_nan_counts_in_the_sum_and_in_no_bucket_as_histogram() -> None:
    registry, plain, queued = _pair()
    for h in (plain, queued):
        h.labels("x").observe(float("nan"))
        h.labels("x").observe(0.02)
    got, want = _samples(registry, "queued"), _samples(registry, "plain")
    assert [(n, v) for n, _, v in got if not math.isnan(v)] == [(n, v) for n, _, v in want if not math.isnan(v)]


def test_a_labelled_parent_refuses_an_observation_as_histogram() -> None:
    _, plain, queued = _pair()
    for h in (plain, queued):
        with pytest.raises(ValueError, match="missing label values"):
            h.observe(1.0)


def test_no_observation_is_lost_to_a_concurrent_scrape() -> None:
    registry, _, queued = _pair()
    child, n, stop = queued.labels("x"), 20_000, threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            registry.get_sample_value("queued_count", {"m": "x"})

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for _ in range(n):
            child.observe(0.02)
    finally:
        stop.set()
        scraper.join()
    assert registry.get_sample_value("queued_count", {"m": "x"}) == n
    assert registry.get_sample_value("queued_bucket", {"m": "x", "le": "0.025"}) == n


def test_the_per_token_series_are_queued() -> None:
    """The series the router observes per token of every stream: ITL and its own token delay (per SSE event)."""
    assert isinstance(metrics.ITL, QueuedHistogram) and isinstance(metrics.ROUTER_TOKEN_DELAY, QueuedHistogram)


def test_a_label_less_histogram_queues_too() -> None:
    registry = CollectorRegistry()
    queued = QueuedHistogram("bare", "h", buckets=BUCKETS, registry=registry)
    queued.observe(0.02)
    assert len(queued._queued) == 1
    assert registry.get_sample_value("bare_bucket", {"le": "0.025"}) == 1
    assert registry.get_sample_value("bare_bucket", {"le": "0.01"}) == 0
