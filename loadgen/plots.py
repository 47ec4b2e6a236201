"""Latency CDF plots of `pdd bench` and `pdd sim`, one line per setup (matplotlib imported lazily, Agg)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

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


LATENCY_PANELS = (("ttft", "TTFT"), ("tpot", "TPOT (excl. first token)"), ("itl", "ITL (per token)"))


def plot_latency_cdfs(runs: Mapping[str, Mapping[str, Sequence[float]]], path: str | Path,
                      title: str = "pdd bench") -> Path:
    """TTFT, TPOT and ITL CDFs side by side, one line per setup; ``runs[label][metric]`` in seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LATENCY_PANELS), figsize=(15, 4))
    for ax, (key, name) in zip(axes, LATENCY_PANELS):
        for label, metrics in runs.items():
            x = np.sort(np.asarray([v for v in metrics.get(key, []) if v is not None and np.isfinite(v)], dtype=float))
            if x.size:
                ax.step(x * 1000.0, np.arange(1, x.size + 1) / x.size, where="post", label=f"{label} (n={x.size})")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
