"""Pipeline policy: which path a request takes and how a relay hands it over (the pipelines themselves
are declared in pipelines.py).

One module, pure functions, every threshold a config value. The router calls it per request;
the simulator imports the very same functions, so simulated and live routing cannot drift.

Paper rules encoded here:
- P-MD when the KV that must cross the WAN is small (MD's decode-side cache already holds most of it).
- P-RLD-MD when the WAN transfer would be long: the relay masks it with eager tokens.
- P-RLD (local finish) only for anomalous traffic (very long input, short output) or when the WAN
  is down. Never for plain low-hit traffic: that overloads the relay pool and the system collapses.
Beyond the report: while the WAN is saturated (P's heartbeats report more queued KV than `wan_saturated_s`
of its measured egress), a request that would add to the queue finishes on the relay, as long as the relay is
below `rld_max_load`. On production traces, where hits are low and the WAN is the bottleneck, this is what
keeps PDD's goodput above naive cross-DC PD's (docs/SIMULATOR.md, "WAN-aware routing").
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field

from pdd.shared.pipelines import HandoffMode, Pipeline


class PolicyConfig(BaseModel):
    """Routing thresholds. Defaults follow the report; every one can be set in the config file."""

    model_config = {"extra": "forbid"}

    wan_masking_threshold_s: float = Field(
        0.25, ge=0, description="Estimated WAN transfer time above which the relay masks it (P-RLD-MD)."
    )
    anomalous_min_prompt_tokens: int = Field(
        16384, ge=1, description="Prompts at least this long with short output are finished on the relay."
    )
    anomalous_max_output_tokens: int = Field(
        500, ge=1, description="max_tokens below this makes a long prompt 'anomalous' (report: < 500)."
    )
    rld_max_load: float = Field(
        0.9, gt=0, le=1, description="Relay load (0..1) above which no new P-RLD-MD requests are sent to it."
    )
    handoff_catch_up_threshold: int = Field(
        64, ge=1, description="Pending relay tokens above which handoff uses catch-up batches."
    )
    handoff_catch_up_max_rld_load: float = Field(
        0.8, gt=0, le=1, description="Above this relay load, hand off one-shot to free the relay at once."
    )
    handoff_final_gap: int = Field(
        8, ge=0, description="Catch-up ends once the relay is at most this many tokens ahead of MD."
    )
    default_wan_gbps: float = Field(
        1.0, gt=0, description="WAN bandwidth assumed until a transfer has been measured."
    )
    wan_saturated_s: float = Field(
        1.0, gt=0, description="WAN queue (seconds before a new transfer could start) above which the relay "
                               "finishes requests locally instead of adding to the queue."
    )
    wan_flows: int = Field(
        1, ge=1, description="KV transfers the WAN line carries side by side, each at one transfer's full rate "
                             "(line rate / one transfer's rate, e.g. 100 / 10 Gbit/s: 10). While fewer are in "
                             "flight a new transfer waits for none: the WAN queue reads 0."
    )


@dataclass(frozen=True)
class RouteInputs:
    prompt_tokens: int
    max_tokens: int
    p_cached_tokens: int
    md_cached_tokens: int
    kv_bytes_per_token: int
    wan_bandwidth_bps: float  # measured bytes/s, or 0 when unknown
    wan_up: bool = True
    rld_available: bool = True
    rld_load: float = 0.0  # 0..1
    wan_queue_s: float = 0.0  # seconds of KV already queued on the WAN ahead of this transfer (P's heartbeats)


@dataclass(frozen=True)
class RouteDecision:
    pipeline: Pipeline
    reason: str
    wan_bytes: int
    est_wan_seconds: float


def estimate_wan_seconds(missing_tokens: int, inputs: RouteInputs, cfg: PolicyConfig) -> tuple[int, float]:
    """Missing KV bytes and their transfer time at the measured (or assumed) WAN bandwidth."""
    wan_bytes = max(0, missing_tokens) * inputs.kv_bytes_per_token
    bandwidth = inputs.wan_bandwidth_bps if inputs.wan_bandwidth_bps > 0 else cfg.default_wan_gbps * 1e9 / 8
    return wan_bytes, wan_bytes / bandwidth


def wan_queue_seconds(queued_bytes: float, egress_bps: float, transfers: float, cfg: PolicyConfig) -> float:
    """How long a new transfer would wait for the KV already on the WAN: none while the line has a free flow
    (fewer than ``wan_flows`` transfers in flight), else P's reported backlog over its measured egress (the
    assumed bandwidth until one is measured). A transfer slow on its own (the per-flow rate) is no queue."""
    if transfers < cfg.wan_flows:
        return 0.0
    rate = egress_bps if egress_bps > 0 else cfg.default_wan_gbps * 1e9 / 8
    return max(0.0, queued_bytes) / rate


def choose_pipeline(inputs: RouteInputs, cfg: PolicyConfig) -> RouteDecision:
    missing = inputs.prompt_tokens - min(inputs.md_cached_tokens, inputs.prompt_tokens)
    wan_bytes, seconds = estimate_wan_seconds(missing, inputs, cfg)
    anomalous = (
        inputs.prompt_tokens >= cfg.anomalous_min_prompt_tokens
        and inputs.max_tokens < cfg.anomalous_max_output_tokens
    )
    if not inputs.wan_up:
        if inputs.rld_available:
            return RouteDecision(Pipeline.P_RLD, "wan down: relay finishes locally", 0, 0.0)
        return RouteDecision(Pipeline.P_MD, "wan down and no relay: direct (may fail over)", wan_bytes, seconds)
    if anomalous and inputs.rld_available:
        return RouteDecision(Pipeline.P_RLD, "anomalous long-input/short-output: transfer blocked", 0, 0.0)
    if (inputs.wan_queue_s > cfg.wan_saturated_s and inputs.rld_available
            and inputs.rld_load < cfg.rld_max_load and wan_bytes > 0):
        return RouteDecision(Pipeline.P_RLD, "WAN saturated: relay finishes locally", 0, 0.0)
    if seconds <= cfg.wan_masking_threshold_s:
        return RouteDecision(Pipeline.P_MD, "small WAN transfer (high MD hit)", wan_bytes, seconds)
    if not inputs.rld_available:
        return RouteDecision(Pipeline.P_MD, "large transfer but no relay available", wan_bytes, seconds)
    if inputs.rld_load >= cfg.rld_max_load:
        return RouteDecision(Pipeline.P_MD, "large transfer but relay overloaded", wan_bytes, seconds)
    return RouteDecision(Pipeline.P_RLD_MD, "large WAN transfer: relay masks it", wan_bytes, seconds)


def choose_handoff_mode(pending_tokens: int, rld_load: float, cfg: PolicyConfig) -> HandoffMode:
    """Catch-up spreads a big backlog over small extends; one-shot frees a loaded relay at once."""
    if pending_tokens > cfg.handoff_catch_up_threshold and rld_load < cfg.handoff_catch_up_max_rld_load:
        return HandoffMode.CATCH_UP
    return HandoffMode.ONE_SHOT


def instance_cost(overlap_tokens: int, prompt_tokens: int, load: float, overlap_weight: float = 1.0) -> float:
    """Lower is better: tokens still to prefill (weighted) plus load, like Dynamo's KV-router cost."""
    new_tokens = max(0, prompt_tokens - overlap_tokens)
    return overlap_weight * new_tokens / max(1, prompt_tokens) + load
