"""Latency CDF plots of `pdd bench` and `pdd sim`, one line per setup (matplotlib imported lazily, Agg)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf_step(ax: Any, values: Sequence[float | None], label: str, scale: float = 1.0) -> int:
    """Draw one empirical CDF (finite values only); ``{n}`` in ``label`` becomes the count drawn."""
    x = np.sort(np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float))
    if x.size:
        ax.step(x * scale, np.arange(1, x.size + 1) / x.size, where="post", label=label.format(n=x.size))
    return int(x.size)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def plot_ttft_cdf(ttfts: Mapping[str, Sequence[float]], path: str | Path, title: str = "TTFT CDF") -> Path:
    """Empirical CDF of TTFT (seconds) per setup, saved as PNG."""
    fig, ax = _pyplot().subplots(figsize=(7, 4))
    for label, values in ttfts.items():
        _cdf_step(ax, values, label.replace("{", "{{").replace("}", "}}"))
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


LATENCY_PANELS = (("ttft", "TTFT"), ("tpot", "TPOT (excl. first token)"), ("itl", "ITL (per token)"))


def plot_latency_cdfs(runs: Mapping[str, Mapping[str, Sequence[float]]], path: str | Path,
                      title: str = "pdd bench") -> Path:
    """TTFT, TPOT and ITL CDFs side by side, one line per setup; ``runs[label][metric]`` in seconds."""
    fig, axes = _pyplot().subplots(1, len(LATENCY_PANELS), figsize=(15, 4))
    for ax, (key, name) in zip(axes, LATENCY_PANELS):
        for label, metrics in runs.items():
            _cdf_step(ax, metrics.get(key, []), label.replace("{", "{{").replace("}", "}}") + " (n={n})", scale=1000.0)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)
