"""Chips, model and WAN link: the physical facts a scenario states (each with its source)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Chip:
    """A chip on the report's four axes plus price (per chip, in any consistent unit)."""

    name: str
    peak_tflops: float  # dense peak at the serving precision
    mem_gb: float
    mem_bw_tbs: float
    interconnect_gbs: float  # scale-up (NVLink-class) bandwidth per chip, GB/s
    price: float = 1.0
    attn_peak_tflops: float = 0.0  # dense peak at the attention precision (0 = peak_tflops)

    @property
    def attn_tflops(self) -> float:
        return self.attn_peak_tflops or self.peak_tflops


@dataclass(frozen=True)
class ModelSpec:
    """What the cost model needs of a model: sizes, not weights."""

    name: str
    layers: int
    kv_bytes_per_token: float
    active_params: float  # parameters touched per token (MoE: shared + routed active)
    weight_bytes: float  # resident weight bytes per instance
    attn_flops_per_pair: float = 0.0  # prefill: FLOPs per (query token, key token) pair, all layers
    decode_attn_flops_per_pair: float = 0.0  # decode: the same per pair, in the decode kernel's form
    experts: int = 0  # routed experts per layer (0 = dense)
    experts_active: int = 0
    expert_weight_fraction: float = 0.0  # share of weight_bytes that is routed experts

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.active_params

    def touched_weight_fraction(self, batch: float) -> float:
        """Expected share of weights read in a decode step of `batch` sequences (MoE routing)."""
        if self.experts <= 0 or batch <= 0:
            return 1.0
        p_untouched = (1.0 - self.experts_active / self.experts) ** batch
        return (1.0 - self.expert_weight_fraction) + self.expert_weight_fraction * (1.0 - p_untouched)


@dataclass(frozen=True)
class WanLink:
    """One leased line between the sites: a shared pipe, per-transfer cap, setup cost, jitter."""

    bandwidth_gbps: float = 100.0
    per_flow_gbps: float = 10.0  # effective throughput of one KV transfer
    setup_s: float = 0.18  # per-transfer fixed cost (handshake, slow start, registration)
    latency_s: float = 0.015  # one-way latency for small control messages (token ids, "ready")
    jitter_sigma: float = 0.5  # lognormal sigma of the setup-time multiplier (mean kept)
    throughput_sigma: float = 0.0  # lognormal sigma of the payload-time multiplier (median 1)

    @property
    def flows(self) -> int:
        """Concurrent transfers the link carries at full per-flow speed."""
        return max(1, int(round(self.bandwidth_gbps / max(self.per_flow_gbps, 1e-9))))

    @property
    def flow_bytes_per_s(self) -> float:
        return min(self.per_flow_gbps, self.bandwidth_gbps) * 1e9 / 8


def build(cls: type, data: dict[str, Any]) -> Any:
    """Dataclass from a dict, with a clear error for unknown keys (typos in scenario files)."""
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return cls(**data)
