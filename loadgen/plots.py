"""TTFT CDF plot, one line per setup (matplotlib imported lazily, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np


def plot_ttft_cdf(ttfts: Mapping[str, Sequence[float]], path: str | Path, title: str = "TTFT CDF") -> Path:
    """Empirical CDF of TTFT (seconds) per setup, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in ttfts.items():
        x = np.sort(np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float))
        if x.size:
            ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=label)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
