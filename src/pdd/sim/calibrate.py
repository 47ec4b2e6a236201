"""`pdd sim calibrate`: fit cost-model coefficients to `pdd bench` JSON, then predict another run.

Prefill: TTFT of requests that found the prefill engine idle = p0 + p_tok*new + p_attn*new*ctx.
Decode: each request's mean inter-token time = d0 + d_seq*batch + d_ctx*kv_tokens, with batch and
KV tokens averaged over its own decode window (reconstructed from every request's timestamps).
Both are linear least squares: no search, no dependence on the figures being predicted.
Optional (`service_noise`): the idle requests' TTFT relative to the fitted line, kept as a sample
(`p_noise`, mean 1) that the simulator resamples as prefill service-time multipliers, so that a
noisy live system's TTFT tail can be predicted without assuming a shape for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from pdd.shared.cost_model import CostModel

from .event_loop import SimInput, SimResult, simulate


@dataclass
class BenchRun:
    """The per-request columns calibration needs, read from a `pdd bench` JSON file."""

    start: np.ndarray
    ttft: np.ndarray
    e2el: np.ndarray
    prompt: np.ndarray
    cached: np.ndarray
    output: np.ndarray

    @classmethod
    def from_json(cls, data: dict[str, Any], ttft_field: str = "ttft") -> "BenchRun":
        """``ttft_field="ttfe"``: time to the first stream event instead of the first visible text
        (the same unless the first tokens decode to no text yet, as with a random tiny model)."""
        reqs = [r for r in data.get("requests", []) if r.get("success")]
        if not reqs:
            raise ValueError("bench JSON has no successful per-request records ('requests')")
        if ttft_field != "ttft" and any(r.get(ttft_field) is None for r in reqs):
            raise ValueError(f"bench JSON lacks '{ttft_field}' on some requests (older `pdd bench`?)")
        col = lambda k, d=0: np.array([float(r.get(k) or d) for r in reqs])  # noqa: E731
        return cls(col("start"), col(ttft_field), col("e2el"), col("prompt_tokens"), col("cached_tokens"),
                   col("output_tokens"))

    @classmethod
    def load(cls, path: str | Path, ttft_field: str = "ttft") -> "BenchRun":
        return cls.from_json(json.loads(Path(path).read_text()), ttft_field)


def to_bench_json(inp: SimInput, res: SimResult) -> dict[str, Any]:
    """A simulated run in `pdd bench`'s JSON schema (lets calibration be tested end to end)."""
    reqs = []
    for i in range(len(res.ok)):
        ok = bool(res.ok[i])
        reqs.append({
            "success": ok, "start": float(res.arrival[i]),
            "ttft": float(res.ttft[i]) if ok else None, "e2el": float(res.e2e[i]) if ok else None,
            "prompt_tokens": int(inp.prompt[i]), "cached_tokens": int(inp.cached[i]),
            "output_tokens": int(inp.output[i]),
        })
    return {"source": "pdd sim", "completed": res.completed, "failed": res.failed, "requests": reqs}


def _lstsq_nonneg(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares, dropping columns whose coefficient comes out negative (physically impossible)."""
    cols = list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        sol, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
        coef[cols] = sol
        neg = [c for c in cols if coef[c] < 0 and c != 0]
        if not neg:
            return coef
        cols.remove(min(neg, key=lambda c: coef[c]))


def decode_regressors(run: BenchRun) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per request: mean inter-token time, mean co-running batch and mean KV tokens in its window."""
    first = run.start + run.ttft
    end = run.start + run.e2el
    n = len(first)
    tpot = (end - first) / np.maximum(run.output - 1, 1)
    batch = np.ones(n)
    ctx = run.prompt + run.output / 2
    ctx_sum = ctx.copy()
    for i in range(n):
        span = end[i] - first[i]
        if span <= 0:
            continue
        overlap = np.clip(np.minimum(end, end[i]) - np.maximum(first, first[i]), 0, None) / span
        overlap[i] = 1.0
        batch[i] = overlap.sum()
        ctx_sum[i] = (overlap * ctx).sum()
    keep = run.output > 1
    return tpot[keep], batch[keep], ctx_sum[keep]


def fit(runs: Sequence[BenchRun], transfer_s: float = 0.0, first_token_from_prefill: bool = False,
        service_noise: bool = False) -> CostModel:
    """Coefficients from one or more runs. `transfer_s`: fixed KV hand-over time inside TTFT.

    `first_token_from_prefill`: the client gets the first token straight from the prefill instance
    (PDD: P samples it and the router streams it at once), so an idle request's TTFT is the whole
    prefill service time and no decode step is subtracted from p0. Without it (conventional P-D) the
    first token comes from the decoder's first step after the KV hand-over, and both are taken out.

    `service_noise`: the idle requests' TTFT divided by the fitted line, normalised to mean 1, becomes
    `p_noise` (OS scheduling and co-tenant noise; a deterministic service time has no tail). The
    measured ratios are resampled rather than summarised by a lognormal: on a quiet machine they are
    a tight core plus a few stragglers, which a lognormal's one sigma widens on both sides.
    """
    X_p, y_p, X_d, y_d = [], [], [], []
    for run in runs:
        new = run.prompt - run.cached
        busy_until = run.start + run.ttft
        order = np.argsort(run.start)
        idle = np.zeros(len(order), dtype=bool)
        latest = -np.inf
        for i in order:  # a request found the prefill engine idle if no earlier request was still in prefill
            idle[i] = run.start[i] >= latest
            latest = max(latest, busy_until[i])
        X_p.append(np.column_stack([np.ones(idle.sum()), new[idle], (new * (run.cached + new / 2))[idle]]))
        y_p.append(run.ttft[idle])
        tpot, batch, ctx = decode_regressors(run)
        X_d.append(np.column_stack([np.ones(len(tpot)), batch, ctx]))
        y_d.append(tpot)
    d = _lstsq_nonneg(np.vstack(X_d), np.concatenate(y_d))
    Xp, yp = np.vstack(X_p), np.concatenate(y_p)
    p = _lstsq_nonneg(Xp, yp)
    noise: tuple[float, ...] = ()
    if service_noise:
        yhat = Xp @ p
        ok = (yhat > 0) & (yp > 0)
        if ok.sum() > 2:
            ratio = yp[ok] / yhat[ok]
            noise = tuple((ratio / ratio.mean()).tolist())
    first_step = 0.0 if first_token_from_prefill else (
        d[0] + d[1] + d[2] * float(np.mean(np.concatenate([r.prompt for r in runs]))))
    return CostModel(p0=max(0.0, p[0] - transfer_s - first_step), p_tok=p[1], p_attn=p[2],
                     p_noise=noise,
                     d0=d[0], d_w=0.0, d_seq=d[1], d_ctx=d[2])


def predict(cm: CostModel, run: BenchRun, n_prefill: int = 1, n_decode: int = 1,
            rdma_setup_s: float = 0.0, first_token_from_prefill: bool = False) -> SimResult:
    """Replay a run's arrivals and token counts through the simulator with fitted coefficients."""
    inp = SimInput(
        arrivals=run.start - run.start.min(), prompt=run.prompt.astype(np.int64),
        cached=run.cached.astype(np.int64), output=run.output.astype(np.int64),
        prefill=cm, decode=cm, n_prefill=n_prefill, n_decode=n_decode, kv_bytes_per_token=1.0,
        kind="local", rdma_setup_s=rdma_setup_s, record_itl=False,
        first_token_from_prefill=first_token_from_prefill,
    )
    return simulate(inp)


def compare(pred: SimResult, run: BenchRun) -> dict[str, float]:
    out: dict[str, float] = {}
    for q in (50, 90):
        sim_v, obs_v = float(np.nanpercentile(pred.ttft, q)), float(np.percentile(run.ttft, q))
        out[f"ttft_p{q}_sim_s"], out[f"ttft_p{q}_obs_s"] = sim_v, obs_v
        out[f"ttft_p{q}_error"] = sim_v / obs_v - 1 if obs_v > 0 else float("nan")
    return out
