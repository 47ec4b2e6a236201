"""Bathtub curve: benefit (billed revenue per unit of hardware cost) versus prefix-hit rate.

Cached input is billed at a discount (report: 10-25% of the uncached price), so a hit saves
prefill work but also revenue; where the saving is smaller than the discount, benefit dips.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdd.shared.cost_model import CostModel

# Public list prices of a 1T-class model API (Moonshot Kimi K2, USD per 1M tokens): input on a cache
# miss, input on a cache hit (25% = the report's upper discount bound), output.
DEFAULT_PRICES = {"input": 0.60, "cached_input": 0.15, "output": 2.50}


@dataclass(frozen=True)
class BathtubInputs:
    prefill: CostModel
    decode: CostModel
    prefill_cost_per_s: float  # hardware price units per second of one prefill instance
    decode_cost_per_s: float
    prompt_tokens: int
    output_tokens: int
    decode_batch: float  # typical running batch on a decode instance (shares a step's cost)


def bathtub(inp: BathtubInputs, hits: np.ndarray, prices: dict[str, float] = DEFAULT_PRICES) -> np.ndarray:
    """Revenue / hardware cost per request at each hit rate (normalised so the mean is 1)."""
    L, out = inp.prompt_tokens, inp.output_tokens
    cached = hits * L
    new = L - cached
    prefill_cost = inp.prefill.prefill_time(new, cached) * inp.prefill_cost_per_s
    b = inp.decode_batch
    step = inp.decode.step_time(b, b * (L + out / 2))
    decode_cost = step / b * out * inp.decode_cost_per_s
    revenue = (prices["input"] * new + prices["cached_input"] * cached + prices["output"] * out) / 1e6
    benefit = revenue / (prefill_cost + decode_cost)
    return benefit / benefit.mean()


def plot_bathtub(hits: np.ndarray, curves: dict[str, np.ndarray], path: str | Path) -> Path:
    """PNG of benefit vs hit rate, one line per billing discount."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, y in curves.items():
        ax.plot(hits * 100, y, marker="o", ms=3, label=label)
    ax.set_xlabel("prefix-cache hit rate (%)")
    ax.set_ylabel("benefit = revenue / hardware cost (normalised)")
    ax.set_title("Bathtub: benefit vs hit rate (cached-token billing discount)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
