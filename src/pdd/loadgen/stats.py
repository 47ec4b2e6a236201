"""Small statistics the benchmarks share: percentiles, a mean with its 95 % interval, and the
geometric bisection that finds the edge of a monotone yes/no (a calibrated rate, a sustainable rate)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

# two-sided 95 % Student t quantiles by degrees of freedom (1..30); beyond that the normal 1.96
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042]


def pct(values: list[float | None], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of the values that are not None."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    k = (len(vals) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def mean_ci95(values: list[float | None]) -> dict[str, float | int | None]:
    """Mean and the half-width of its 95 % t interval over repeats (None for fewer than two)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"mean": None, "ci95": None, "n": 0}
    mean = statistics.fmean(vals)
    if len(vals) < 2:
        return {"mean": round(mean, 4), "ci95": None, "n": 1}
    t = _T95[len(vals) - 2] if len(vals) - 1 <= len(_T95) else 1.96
    half = t * statistics.stdev(vals) / math.sqrt(len(vals))
    return {"mean": round(mean, 4), "ci95": round(half, 4), "n": len(vals)}


@dataclass
class Bisection:
    """The search's record: every probe (value, outcome) and where it stopped."""

    value: float
    probes: list[dict] = field(default_factory=list)
    converged: bool = False
    note: str = ""


def bisect_geometric(probe: Callable[[float], float], target: float, tolerance: float, lo: float, hi: float,
                     max_steps: int, decreasing: bool = True) -> Bisection:
    """Find x in [lo, hi] where ``probe(x)`` is within ``tolerance`` of ``target``, halving the log-range.

    ``probe`` must be monotone in x (``decreasing``: a larger x gives a smaller value, as a TTFT ratio
    falls when the link gets faster). Stops at the first probe within tolerance, or after ``max_steps``
    probes with the closest one (``converged`` False, said in ``note``)."""
    probes: list[dict] = []
    for _ in range(max_steps):
        x = math.sqrt(lo * hi)
        y = probe(x)
        probes.append({"x": x, "y": y})
        if abs(y - target) <= tolerance:
            return Bisection(x, probes, True, f"|{y:.3f} - {target}| <= {tolerance}")
        too_high = y > target
        if too_high == decreasing:
            lo = x  # need a larger x to bring the value down (or up, when increasing)
        else:
            hi = x
    best = min(probes, key=lambda p: abs(p["y"] - target))
    return Bisection(best["x"], probes, False, f"no probe within {tolerance} of {target} in {max_steps} "
                                               f"steps; closest {best['y']:.3f}")


def highest_passing(passes: Callable[[float], bool], lo: float, hi: float, steps: int) -> Bisection:
    """The highest x in [lo, hi] for which ``passes(x)`` (true below some edge, false above), by
    geometric bisection over ``steps`` probes starting mid-range (the slowest probe, ``lo``, is tried
    only if every other one failed). If even ``lo`` fails, ``lo`` is returned as an upper bound and
    flagged (never nothing): the answer is "below lo"."""
    probes: list[dict] = []
    best: float | None = None
    top = hi
    for _ in range(steps):
        x = math.sqrt(lo * top)
        ok = passes(x)
        probes.append({"x": x, "passed": ok})
        if ok:
            best, lo = x, x
        else:
            top = x
    if best is None:
        ok = passes(lo)
        probes.append({"x": lo, "passed": ok})
        if not ok:
            return Bisection(lo, probes, False, f"fails at the lowest rate tried ({lo:g}): sustainable rate < {lo:g}")
        best = lo
    note = f"between {best:.3g} (passed) and {top:.3g} (failed)" if top < hi else f"passed up to {best:.3g} " \
        f"(the search's upper end is {hi:g})"
    return Bisection(best, probes, True, note)
