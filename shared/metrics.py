"""Prometheus metrics of the serving path, defined once.

Names mirror vLLM's ``vllm:`` metrics under a ``pdd:`` prefix where the meaning matches
(time_to_first_token_seconds, inter_token_latency_seconds, e2e_request_latency_seconds,
prompt/generation token counters), so vLLM dashboards port with a prefix swap; PDD's own
figures (pipeline mix, WAN bytes, handoff, relay share, hit rates) sit beside them.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)

# Router (per request)
TTFT = Histogram("pdd:time_to_first_token_seconds", "Time to first token", ["pipeline"], buckets=_LATENCY)
ITL = Histogram("pdd:inter_token_latency_seconds", "Time between consecutive streamed tokens", ["pipeline"],
                buckets=_LATENCY)
E2E = Histogram("pdd:e2e_request_latency_seconds", "Request latency, arrival to last token", ["pipeline"],
                buckets=_LATENCY)
REQUESTS = Counter("pdd:request_success_total", "Finished requests", ["finish_reason"])
REQUEST_ERRORS = Counter("pdd:request_errors_total", "Requests ended with an error", ["code"])
PROMPT_TOKENS = Counter("pdd:prompt_tokens_total", "Prompt tokens processed")
GENERATED_TOKENS = Counter("pdd:generated_tokens_total", "Output tokens emitted to clients")
RLD_TOKENS = Counter("pdd:rld_tokens_total", "Output tokens emitted by relay decoders (eager tokens)")
PIPELINE = Counter("pdd:pipeline_requests_total", "Pipeline chosen per request", ["pipeline", "reason"])
HANDOFF = Counter("pdd:handoff_total", "Relay to main-decode handoffs", ["mode"])
HANDOFF_STALL = Histogram("pdd:handoff_stall_seconds",
                          "Longest gap between tokens around the ownership switch relay -> MD", buckets=_LATENCY)
REQUEST_HIT_RATIO = Histogram("pdd:request_prefix_hit_ratio", "Per-request share of the prompt already cached",
                              ["side"], buckets=(0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 1.0))
REQUEST_WAN_BYTES = Histogram("pdd:request_wan_bytes", "KV bytes one request moved across the WAN",
                              buckets=(0, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28, 2**30))
MIGRATIONS = Counter("pdd:request_migrations_total",
                     "Requests moved to another instance after a failure (resume from emitted tokens or retry)",
                     ["kind"])
WAN_UP = Gauge("pdd:wan_link_up", "1 while the router routes KV over the WAN to this main-decode instance", ["main_decode"])
WAN_FALLBACKS = Counter("pdd:wan_fallback_total", "WAN KV transfers that failed and fell back", ["action"])
RUNNING = Gauge("pdd:num_requests_running", "Requests in flight at this router")

# Engines (P, RLD, MD)
KV_BLOCKS_FREE = Gauge("pdd:kv_blocks_free", "Free KV blocks", ["instance", "role"])
KV_BLOCKS_TOTAL = Gauge("pdd:kv_blocks_total", "KV blocks in the pool", ["instance", "role"])
PREFIX_HIT_RATE = Gauge("pdd:prefix_cache_hit_rate", "Radix cache token hit rate", ["instance", "role"])
CACHED_PROMPT_TOKENS = Counter("pdd:cached_prompt_tokens_total", "Prompt tokens served from the prefix cache",
                               ["instance", "role"])
WAN_BYTES = Counter("pdd:wan_bytes_total", "KV bytes sent across the WAN (P -> MD)", ["instance"])
FAST_BYTES = Counter("pdd:fast_path_bytes_total", "KV bytes sent in-site (P -> RLD)", ["instance"])
WAN_TRANSFER = Histogram("pdd:wan_transfer_seconds", "P -> MD KV transfer time per request", buckets=_LATENCY)
EXTEND_TOKENS = Histogram("pdd:extend_tokens", "Known tokens extended in one pass at handoff",
                          buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
