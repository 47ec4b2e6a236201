"""Prometheus /metrics for every benchmark: the one parser, fetching, and PDD's own figures
(before/after deltas).

Parsing is prometheus_client's (``text_string_to_metric_families``), kept as flat samples
``{(sample name, sorted labels): value}``. A server that does not expose a metric (vLLM, SGLang, or
ours before it is wired) simply yields no figure for it: absent, not an error.
"""

from __future__ import annotations

import urllib.request
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

WAN_BYTES = "pdd:wan_bytes_total"
PIPELINE = "pdd:pipeline_requests_total"
RLD_TOKENS = "pdd:rld_tokens_total"
GENERATED = "pdd:generation_tokens_total"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Prometheus text exposition -> {(sample name, sorted labels): value}; ValueError if malformed."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def samples_of(samples: Samples, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample named ``name`` (or its underscore spelling, pdd_... for pdd:...)."""
    alt = name.replace(":", "_")
    return [(dict(labels), v) for (n, labels), v in samples.items() if n in (name, alt)]


def scrape_sync(url: str, timeout_s: float = 5.0) -> Samples | None:
    """GET /metrics without an event loop; None when nothing (parsable) answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return parse(resp.read().decode())
    except (OSError, ValueError):
        return None


async def scrape(url: str, timeout_s: float = 5.0) -> Samples | None:
    """GET /metrics; None when the server has none (then PDD figures are reported absent)."""
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status != 200:
                    return None
                return parse(await r.text())
    except Exception:  # noqa: BLE001 - no metrics endpoint is a normal case
        return None


def _total(samples: Samples, name: str) -> float | None:
    vals = [v for _, v in samples_of(samples, name)]
    return sum(vals) if vals else None


def pdd_figures(before: Samples | None, after: Samples | None, completed: int) -> dict[str, Any]:
    """WAN bytes per request, pipeline mix and RLD token share over the run (absent keys omitted)."""
    if after is None:
        return {}
    before = before or {}
    out: dict[str, Any] = {}

    def delta(name: str) -> float | None:
        a = _total(after, name)
        return None if a is None else a - (_total(before, name) or 0.0)

    wan = delta(WAN_BYTES)
    if wan is not None:
        out["wan_bytes_total"] = wan
        out["wan_bytes_per_request"] = wan / completed if completed else None
    mix: dict[str, float] = {}
    for (n, labels), v in after.items():
        if n in (PIPELINE, PIPELINE.replace(":", "_")):
            pipe = dict(labels).get("pipeline", "unknown")
            mix[pipe] = mix.get(pipe, 0.0) + v - before.get((n, labels), 0.0)
    if mix:
        out["pipeline_mix"] = mix
    rld, gen = delta(RLD_TOKENS), delta(GENERATED)
    if rld is not None:
        out["rld_tokens"] = rld
        if gen:
            out["rld_token_share"] = rld / gen
    return out


def histogram_quantile(before: Samples | None, after: Samples, name: str, q: float) -> float | None:
    """The ``q`` quantile (0..1) of histogram ``name`` over the observations made between two scrapes, linear
    within a bucket as Prometheus's histogram_quantile; None without observations. Above the last finite
    bucket: that bucket's bound (the figure is then a lower bound)."""
    before = before or {}
    counts: dict[float, float] = {}
    for labels, v in samples_of(after, name + "_bucket"):
        le = float(labels["le"])
        old = next((b for lb, b in samples_of(before, name + "_bucket") if lb == labels), 0.0)
        counts[le] = counts.get(le, 0.0) + v - old
    bounds = sorted(counts)
    total = counts.get(float("inf"), 0.0)
    if not bounds or total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in bounds:
        if counts[le] >= rank:
            if le == float("inf"):
                return lower
            inside = counts[le] - below
            return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
        lower, below = le, counts[le]
    return lower
