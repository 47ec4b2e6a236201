"""PDD's own figures from a server's Prometheus /metrics (before/after deltas).

A server that does not expose a metric (vLLM, SGLang, or ours before it is wired) simply yields
no figure for it: absent, not an error.
"""

from __future__ import annotations

import re
from typing import Any

import aiohttp

WAN_BYTES = "pdd:wan_bytes_total"
PIPELINE = "pdd:pipeline_requests_total"
RLD_TOKENS = "pdd:rld_tokens_total"
GENERATED = "pdd:generated_tokens_total"
_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfaINFA]+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Prometheus text exposition -> {(name, sorted labels): value}. Unparseable lines are skipped."""
    out: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line.strip())
        if not m:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


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
    alt = name.replace(":", "_")
    vals = [v for (n, _), v in samples.items() if n in (name, alt)]
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
