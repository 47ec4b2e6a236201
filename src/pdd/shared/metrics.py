"""Prometheus metrics of the serving path, defined once.

Naming: the ``pdd:`` namespace, with vLLM's metric names and labels after it wherever the meaning
matches (``pdd:time_to_first_token_seconds`` is ``vllm:time_to_first_token_seconds``,
``pdd:request_success_total{finished_reason}`` is ``vllm:request_success_total{finished_reason}``).
A vLLM dashboard therefore ports by swapping ``vllm:`` for ``pdd:``: every series it filters on
carries the same ``model_name`` label (the served model name), and tests/e2e/test_vllm_metrics.py
runs the reference dashboard's queries against a live system. The namespace stays ``pdd:`` so a
Prometheus scraping vLLM and PDD side by side keeps them apart.

Where the figures come from:
- the router, per request: TTFT, ITL, E2E, the request's prompt / generation tokens and its
  ``max_tokens``, and its phases as the router sees them — queue (arrival until the request is
  handed to a prefill instance: routing and cache queries), prefill (hand-over until the first token
  reaches the router: P's own queue, its prefill and the bus), decode (first token until the last);
- each engine (P, RLD, MD; labels ``instance``, ``role``): its scheduler's running / waiting
  requests, KV cache usage and prefix-cache queries / hits in tokens, updated at every heartbeat.

ITL is per token, not per chunk, by output position as the client gets them: a flush of n tokens
that reaches the client a gap g after the previous one records g for its first token and 0 for the
other n - 1 (they arrive together). So a request records output_tokens - 1 observations whose sum
is its decode time, and the mean ITL equals the mean time per output token. (vLLM's engine records
one observation per engine step, which is the same thing when a step yields one token.)

PDD's own figures (pipeline mix, WAN bytes, handoff, relay share, hit ratios) sit beside them.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import deque
from typing import Any

from prometheus_client import Counter, Gauge, Histogram


class QueuedHistogram(Histogram):
    """A histogram observed at token rate (ITL, the router's token delay): ``observe`` queues the value (a deque
    append) and the queue is folded into the buckets and sum before any read of the series (a scrape, ``collect``)
    and whenever it holds ``FOLD_AT`` values. A scrape shows exactly what ``Histogram`` would, at about a third of
    its cost per value (``Histogram.observe`` takes two locks and walks the buckets in Python). No exemplars."""

    FOLD_AT = 4096  # bounds the queue between scrapes (~150 KB)

    def _metric_init(self) -> None:
        super()._metric_init()
        self._queued: deque[float] = deque()
        self._fold_lock = threading.Lock()

    def observe(self, amount: float, exemplar: Any = None) -> None:
        """Queue ``amount``; a labelled parent (no queue) refuses as ``Histogram`` does."""
        try:
            queued = self._queued
        except AttributeError:
            queued = None
        if queued is None or exemplar is not None:
            super().observe(amount, exemplar)
            return
        queued.append(amount)
        if len(queued) >= self.FOLD_AT:
            self.fold()

    def fold(self) -> None:
        """Move the queued values into the buckets (``Histogram.observe``'s rule: the first bound >= the value)."""
        with self._fold_lock:  # deque append/popleft are atomic: an observe in another thread is never lost
            queued, bounds = self._queued, self._upper_bounds
            counts, total = [0] * len(bounds), 0.0
            for _ in range(len(queued)):
                value = queued.popleft()
                total += value
                if not math.isnan(value):  # NaN: in the sum, in no bucket (as Histogram.observe)
                    counts[bisect.bisect_left(bounds, value)] += 1
            if total or any(counts):
                self._sum.inc(total)
            for bucket, count in zip(self._buckets, counts):
                if count:
                    bucket.inc(count)

    def _child_samples(self) -> Any:
        self.fold()
        return super()._child_samples()


_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)
MODEL = "model_name"  # the served model name, the label every vLLM dashboard query filters on

# Router (per request), vLLM's names
TTFT = Histogram("pdd:time_to_first_token_seconds", "Time to first token (arrival at the router to the first "
                 "token sent to the client)", [MODEL, "pipeline"], buckets=_LATENCY)
ITL = QueuedHistogram("pdd:inter_token_latency_seconds", "Inter-token latency per output token (a chunk of n "
                      "tokens records its gap once, then n - 1 zeros)", [MODEL, "pipeline"], buckets=_LATENCY)
E2E = Histogram("pdd:e2e_request_latency_seconds", "Request latency, arrival to last token", [MODEL, "pipeline"],
                buckets=_LATENCY)
TPOT = Histogram("pdd:request_time_per_output_token_seconds", "Per request: decode time / (output tokens - 1)",
                 [MODEL], buckets=_LATENCY)
QUEUE_TIME = Histogram("pdd:request_queue_time_seconds", "Arrival until handed to a prefill instance (routing)",
                       [MODEL], buckets=_LATENCY)
PREFILL_TIME = Histogram("pdd:request_prefill_time_seconds", "Hand-over to prefill until the first token reached "
                         "the router (P's queue and prefill)", [MODEL], buckets=_LATENCY)
DECODE_TIME = Histogram("pdd:request_decode_time_seconds", "First token to last token", [MODEL], buckets=_LATENCY)
INFERENCE_TIME = Histogram("pdd:request_inference_time_seconds", "Hand-over to prefill until the last token",
                           [MODEL], buckets=_LATENCY)
REQUEST_PROMPT_TOKENS = Histogram("pdd:request_prompt_tokens", "Prompt tokens per finished request", [MODEL],
                                  buckets=_TOKENS)
REQUEST_GENERATION_TOKENS = Histogram("pdd:request_generation_tokens", "Output tokens per finished request",
                                      [MODEL], buckets=_TOKENS)
REQUEST_MAX_GENERATION_TOKENS = Histogram("pdd:request_max_num_generation_tokens",
                                          "Requested output tokens (max_tokens) per finished request (n = 1)",
                                          [MODEL], buckets=_TOKENS)
REQUEST_PARAMS_MAX_TOKENS = Histogram("pdd:request_params_max_tokens", "The max_tokens parameter per finished request",
                                      [MODEL], buckets=_TOKENS)
REQUESTS = Counter("pdd:request_success_total", "Finished requests", [MODEL, "finished_reason"])
PROMPT_TOKENS = Counter("pdd:prompt_tokens_total", "Prompt tokens of admitted requests", [MODEL])
GENERATION_TOKENS = Counter("pdd:generation_tokens_total", "Output tokens emitted to clients", [MODEL])
REQUEST_ERRORS = Counter("pdd:request_errors_total", "Requests ended with an error", ["code"])
IN_FLIGHT = Gauge("pdd:router_requests_in_flight", "Requests in flight at this router (engines report "
                  "pdd:num_requests_running / _waiting)", [MODEL])

# Router, PDD's own
RLD_TOKENS = Counter("pdd:rld_tokens_total", "Output tokens emitted by relay decoders (eager tokens)")
PIPELINE = Counter("pdd:pipeline_requests_total", "Pipeline chosen per request", ["pipeline", "reason"])
HANDOFF = Counter("pdd:handoff_total", "Relay to main-decode handoffs", ["mode"])
ROUTER_TOKEN_DELAY = QueuedHistogram(
    "pdd:router_token_delay_seconds", "Time a streamed token spends in the router: from when the router began taking "
    "the bus message that carried it until its SSE event is written (per event, its oldest token)",
    buckets=(0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 1.0))
HANDOFF_STALL = Histogram("pdd:handoff_stall_seconds",
                          "Longest gap between tokens around the ownership switch relay -> MD", buckets=_LATENCY)
REQUEST_HIT_RATIO = Histogram("pdd:request_prefix_hit_ratio", "Per-request share of the prompt already cached",
                              ["side"], buckets=(0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 1.0))
REQUEST_WAN_BYTES = Histogram("pdd:request_wan_bytes", "KV bytes one request moved across the WAN",
                              buckets=(0, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28, 2**30))
MIGRATIONS = Counter("pdd:request_migrations_total",
                     "Requests moved to another instance after a failure (resume from emitted tokens or retry), "
                     "by why (decoder_lost, prefill_lost, stalled, an error code) and the role that took them over",
                     ["kind", "reason", "role"])
WAN_UP = Gauge("pdd:wan_link_up", "1 while the router routes KV over the WAN to this main-decode instance", ["main_decode"])
WAN_FALLBACKS = Counter("pdd:wan_fallback_total", "WAN KV transfers that failed and fell back", ["action"])

# Engines (P, RLD, MD), vLLM's names
_ENGINE = [MODEL, "instance", "role"]
NUM_RUNNING = Gauge("pdd:num_requests_running", "Requests in this engine's running batch", _ENGINE)
NUM_WAITING = Gauge("pdd:num_requests_waiting", "Requests waiting in this engine's scheduler queue", _ENGINE)
KV_CACHE_USAGE = Gauge("pdd:kv_cache_usage_perc", "Fraction of this engine's KV blocks in use (0 to 1)", _ENGINE)
PREFIX_CACHE_QUERIES = Counter("pdd:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up",
                               _ENGINE)
PREFIX_CACHE_HITS = Counter("pdd:prefix_cache_hits", "Prefix cache hits, in tokens found cached", _ENGINE)

# Engines, PDD's own
KV_BLOCKS_FREE = Gauge("pdd:kv_blocks_free", "Free KV blocks", ["instance", "role"])
KV_BLOCKS_TOTAL = Gauge("pdd:kv_blocks_total", "KV blocks in the pool", ["instance", "role"])
PREFIX_HIT_RATE = Gauge("pdd:prefix_cache_hit_rate", "Radix cache token hit rate since start", ["instance", "role"])
WAN_BYTES = Counter("pdd:wan_bytes_total", "KV bytes sent across the WAN (P -> MD)", ["instance"])
FAST_BYTES = Counter("pdd:fast_path_bytes_total", "KV bytes sent in-site (P -> RLD, P -> MD in one site)",
                     ["instance"])
WAN_TRANSFER = Histogram("pdd:wan_transfer_seconds", "P -> MD KV transfer time per request", buckets=_LATENCY)
EXTEND_TOKENS = Histogram("pdd:extend_tokens", "Known tokens extended in one pass at handoff",
                          buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))


def itl_observations(gap: float, count: int) -> list[float]:
    """The per-token ITL values of one flush of ``count`` tokens arriving ``gap`` after the previous one."""
    return [gap] + [0.0] * (count - 1) if count > 0 else []
