"""Shared by the fuzz tests: input counts, deterministic hypothesis settings, example collection."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

SLOW_EXAMPLES = 10_000
FAST_EXAMPLES = 300


def examples(slow: bool, fast_default: int = FAST_EXAMPLES) -> int:
    """Inputs per surface: PDD_FUZZ_EXAMPLES overrides; else 10,000 in the slow run, a few hundred in CI."""
    env = os.environ.get("PDD_FUZZ_EXAMPLES")
    if env:
        return max(1, int(env))
    return SLOW_EXAMPLES if slow else fast_default


def fuzz_settings(n: int, shrink: bool = True) -> settings:
    """Deterministic (derandomized, no example database): CI runs the same inputs every time."""
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, phases=phases,
                    suppress_health_check=list(HealthCheck), print_blob=True)


def collect(strategy: st.SearchStrategy, n: int) -> list[Any]:
    """Draw ``n`` inputs from ``strategy`` with hypothesis, deterministically, for live-system fuzzing
    (they are sent afterwards, concurrently; a live system is not a pure function to shrink against)."""
    out: list[Any] = []

    @fuzz_settings(n, shrink=False)
    @given(strategy)
    def draw(x: Any) -> None:
        out.append(x)

    draw()
    return out


class Tally:
    """Counts for the report printed under ``pytest -s``, and the anomalies that fail the test."""

    def __init__(self, surface: str):
        self.surface = surface
        self.counts: Counter[str] = Counter()
        self.anomalies: list[str] = []

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] += n

    def bad(self, what: str) -> None:
        self.anomalies.append(what)

    def report(self, **extra: Any) -> str:
        parts = [f"{k}={v}" for k, v in sorted(self.counts.items())]
        parts += [f"{k}={v}" for k, v in extra.items()]
        text = f"[fuzz {self.surface}] " + " ".join(parts) + f" anomalies={len(self.anomalies)}"
        print("\n" + text)
        for a in self.anomalies[:20]:
            print(f"[fuzz {self.surface}]   anomaly: {a}")
        return text
