"""Drive a server: open-loop arrivals (Poisson / gamma burstiness, or a replayed trace's recorded times) or
closed-loop concurrency.

Open loop is what a real user population does (arrivals do not wait for the server); closed loop
measures a server at a fixed number of requests in flight. Warm-up requests run first and are
left out of the results (they fill caches and compile kernels).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from .client import RequestResult, send
from .workload import RequestSpec


@dataclass(frozen=True)
class LoadConfig:
    url: str
    model: str
    request_rate: float = math.inf  # requests/s; inf = send all at once (bounded by concurrency)
    burstiness: float = 1.0  # gamma shape: 1 = Poisson, < 1 burstier, > 1 smoother
    max_concurrency: int | None = None  # closed loop when set
    warmup: int = 0
    seed: int = 0
    timeout_s: float = 600.0
    api_key: str | None = None


def intervals(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Gaps between sends, like `vllm bench serve`: gamma(shape=b, scale=1/(rate*b)), then scaled so
    that the n sends span exactly n / rate seconds (vLLM's normalisation: throughput figures do not
    drift with the seed). Burstiness 1 is Poisson, < 1 burstier, > 1 smoother, inf evenly spaced."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0 (got {burstiness})")
    if not math.isfinite(rate) or n == 0:
        return np.zeros(n)
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0 or inf (got {rate})")
    if math.isinf(burstiness):
        return np.full(n, 1.0 / rate)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), n)
    return gaps * (n / rate) / gaps.sum() if gaps.sum() > 0 else gaps


async def list_models(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The model cards of ``GET /v1/models``: ValueError when the server does not answer 200, [] when it lists
    none (vLLM's cards carry ``max_model_len``, as PDD's do)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with aiohttp.ClientSession() as session, \
                session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise ValueError(f"GET {url}: HTTP {resp.status}: {(await resp.text())[:200]}; pass --model")
            data = await resp.json(content_type=None)
    except aiohttp.ClientError as exc:
        raise ValueError(f"GET {url} failed ({exc}); is the server up? Or pass --model") from None
    models = data.get("data") if isinstance(data, dict) else None
    return [m for m in models if isinstance(m, dict)] if isinstance(models, list) else []


async def first_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first model the server lists at ``/v1/models`` (what `vllm bench serve` does without --model)."""
    models = await list_models(base_url, api_key, timeout_s)
    if not models or not models[0].get("id"):
        raise ValueError(f"GET {base_url.rstrip('/')}/v1/models: no model listed; pass --model")
    return str(models[0]["id"])


async def run_load(specs: Sequence[RequestSpec], cfg: LoadConfig,
                   on_done: Callable[[RequestResult], None] | None = None,
                   arrivals: Sequence[float] | None = None) -> tuple[list[RequestResult], float]:
    """Send every spec; returns (results of the measured requests in spec order, measured seconds).
    ``arrivals``: when each measured spec goes out, seconds after the start (a replayed trace's recorded
    times); without them the gaps come from ``cfg``'s rate and burstiness."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        warm, measured = list(specs[: cfg.warmup]), list(specs[cfg.warmup:])
        if warm:  # warm-up: sequential-ish, not timed
            await asyncio.gather(*(send(session, cfg.url, s, cfg.model, time.perf_counter(), cfg.timeout_s,
                                        cfg.api_key) for s in warm))
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        if arrivals is None:
            arrivals = np.cumsum(intervals(len(measured), cfg.request_rate, cfg.burstiness, cfg.seed)).tolist()
        if len(arrivals) != len(measured):
            raise ValueError(f"{len(arrivals)} arrival times for {len(measured)} requests")
        t0 = time.perf_counter()

        async def one(spec: RequestSpec) -> RequestResult:
            if sem is None:
                r = await send(session, cfg.url, spec, cfg.model, t0, cfg.timeout_s, cfg.api_key)
            else:
                async with sem:
                    r = await send(session, cfg.url, spec, cfg.model, t0, cfg.timeout_s, cfg.api_key)
            if on_done:
                on_done(r)
            return r

        tasks = []
        for spec, at in zip(measured, arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0
