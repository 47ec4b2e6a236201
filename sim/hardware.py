"""The WAN link a scenario states, and the dict-to-dataclass builder for scenario files.

Chips and the model spec live with the cost model in pdd.shared.cost_model (shared with the emulated engine)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


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
