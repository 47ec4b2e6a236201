"""A scenario file's deployment: chips, model, the WAN link, the router policy and the named systems.

What the simulator (pdd.sim, which adds the workload) and the live system's emulated accelerators
(pdd.launch's ``--emulate``, the emulated backend's per-role profile) both read, parsed once. Chips and the
model spec live with the cost model in pdd.shared.cost_model."""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from pdd.shared.cost_model import Chip, CostModel, ModelSpec, from_hardware
from pdd.shared.policy import PolicyConfig

SCENARIO_DIR = Path(__file__).parent  # the packaged scenario files: report.yaml, small.yaml


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A scenario file by path, or by the name of a packaged one (``report``, ``small.yaml``)."""
    p = Path(path)
    if not p.exists() and (SCENARIO_DIR / p).exists():
        p = SCENARIO_DIR / p
    if not p.exists() and (SCENARIO_DIR / f"{p}.yaml").exists():
        p = SCENARIO_DIR / f"{p}.yaml"
    data = yaml.safe_load(p.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{p}: a scenario is a YAML mapping")
    return data


def set_path(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """Copy of `data` with one nested key changed (`wan.bandwidth_gbps`): used by sensitivity runs."""
    out = copy.deepcopy(data)
    node = out
    keys = dotted.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value
    return out


@dataclass(frozen=True)
class WanLink:
    """One leased line between the sites: the line's aggregate rate, one TCP flow's rate, how many flows one
    KV transfer is striped over (the zmq transport's ``streams``), setup cost, jitter.

    A transfer runs at min(streams x per-flow rate, line rate); the line carries as many such transfers at
    once as fit in it (``concurrent_transfers``), later ones queue. On a long fat pipe one flow does not fill
    the line, which is what striping buys. A codec on the link (transports.<link>.codec) sends
    ``codec_wire_ratio`` wire bytes per KV byte and codes at most ``codec_mb_s`` MB of KV per second per
    transfer (its slower end on one core; ``python -m pdd.bench.codec`` measures both on real KV), so a
    transfer moves KV at ``kv_bytes_per_s``."""

    bandwidth_gbps: float = 100.0  # the line
    per_flow_gbps: float = 10.0  # one TCP flow's throughput
    streams: int = 1  # flows one transfer is striped over
    setup_s: float = 0.18  # per-transfer fixed cost (handshake, slow start, registration)
    latency_s: float = 0.015  # one-way latency for small control messages (token ids, "ready")
    jitter_sigma: float = 0.5  # lognormal sigma of the setup-time multiplier (mean kept)
    throughput_sigma: float = 0.0  # lognormal sigma of the payload-time multiplier (median 1)
    codec_wire_ratio: float = 1.0  # wire bytes per KV byte (1: no codec)
    codec_mb_s: float = 0.0  # KV MB/s one transfer's coding keeps up with (0: no codec, or free)

    def __post_init__(self) -> None:
        if self.streams < 1 or self.per_flow_gbps <= 0 or self.bandwidth_gbps <= 0:
            raise ValueError(f"WanLink: streams >= 1 and positive rates needed (got streams={self.streams}, "
                             f"per_flow_gbps={self.per_flow_gbps}, bandwidth_gbps={self.bandwidth_gbps})")
        if not 0 < self.codec_wire_ratio <= 1 or self.codec_mb_s < 0:
            raise ValueError(f"WanLink: codec_wire_ratio in (0, 1] and codec_mb_s >= 0 needed (got "
                             f"{self.codec_wire_ratio}, {self.codec_mb_s})")

    @property
    def transfer_gbps(self) -> float:
        """One transfer's rate: its flows together, at most the line."""
        return min(self.streams * self.per_flow_gbps, self.bandwidth_gbps)

    @property
    def concurrent_transfers(self) -> int:
        """Transfers the line carries at once at full transfer speed (later ones wait for one to end)."""
        return max(1, int(self.bandwidth_gbps / self.transfer_gbps + 1e-9))

    @property
    def transfer_bytes_per_s(self) -> float:
        """Wire bytes one transfer moves per second."""
        return self.transfer_gbps * 1e9 / 8

    @property
    def kv_bytes_per_s(self) -> float:
        """KV bytes one transfer moves per second: its wire rate over the codec's ratio, at most the codec's speed."""
        rate = self.transfer_bytes_per_s / self.codec_wire_ratio
        return min(rate, self.codec_mb_s * 1e6) if self.codec_mb_s > 0 else rate


def build(cls: type, data: dict[str, Any]) -> Any:
    """Dataclass from a dict, with a clear error for unknown keys (typos in scenario files)."""
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return cls(**data)


@dataclass
class Deployment:
    """A parsed scenario file's physical facts plus its named systems (deployments to compare)."""

    raw: dict[str, Any]
    chips: dict[str, Chip]
    model: ModelSpec
    wan: WanLink
    policy: PolicyConfig

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Deployment":
        chips = {k: build(Chip, v) for k, v in data["chips"].items()}
        wan = build(WanLink, data.get("wan", {}))
        # the router is configured for the line the scenario describes, unless its policy says otherwise
        policy = PolicyConfig(**{"wan_flows": wan.concurrent_transfers, **data.get("policy", {})})
        return Deployment(data, chips, build(ModelSpec, data["model"]), wan, policy)

    @property
    def util(self) -> dict[str, float]:
        return self.raw.get("utilisation", {})

    def cost_model(self, chip: str, chips_per_instance: int) -> CostModel:
        u = self.util
        return from_hardware(
            self.chips[chip], chips_per_instance, self.model, u.get("mfu", 0.4), u.get("mbu", 0.7),
            u.get("mem_util", 0.9), u.get("prefill_overhead_s", 0.02), u.get("step_overhead_s", 0.005),
        )

    def system(self, name: str) -> dict[str, Any]:
        try:
            return self.raw["systems"][name]
        except KeyError:
            raise ValueError(f"no system {name!r}; have {sorted(self.raw.get('systems', {}))}") from None

    def hardware_cost(self, name: str) -> float:
        """Chips (including spares the split leaves idle) at their price, plus leased lines."""
        s = self.system(name)
        cost = sum(self.chips[c].price * n for c, n in s["chips"].items())
        return cost + s.get("leased_lines", 0) * self.raw.get("leased_line_cost", 0.0)

    def instance_chips(self, name: str, role: str) -> int:
        """Chips per instance of a role: `chips_per_instance` is one number or a per-role mapping
        (e.g. 8-chip prefill and 16-chip decode instances, sized for compute and KV memory)."""
        s = self.system(name)
        per = s.get("chips_per_instance", 8)
        if isinstance(per, dict):
            unknown = set(per) - set(s["roles"])
            if unknown:
                raise ValueError(f"system {name!r}: chips_per_instance names roles it does not have: "
                                 f"{sorted(unknown)}; roles: {sorted(s['roles'])}")
            return int(per.get(role, 8))
        return int(per)

    def splits(self, name: str) -> list[dict[str, int]]:
        """Role splits to consider: fixed counts, or every split of the instances when 'auto'."""
        s = self.system(name)
        fixed = s.get("split")
        if fixed:
            return [dict(fixed)]
        roles = s["roles"]
        per = {role: self.instance_chips(name, role) for role in roles}
        chips: dict[str, int] = dict(s["chips"])
        out = []
        if roles["prefill"] == roles["decode"] and "relay" not in roles:
            total = chips[roles["prefill"]]
            out = [{"prefill": p, "decode": (total - p * per["prefill"]) // per["decode"]}
                   for p in range(1, total // per["prefill"] + 1)]
        elif "relay" in roles and roles["relay"] == roles["prefill"]:
            total = chips[roles["prefill"]]
            out = [{"prefill": (total - r * per["relay"]) // per["prefill"], "relay": r,
                    "decode": chips[roles["decode"]] // per["decode"]} for r in range(1, total // per["relay"] + 1)]
        else:
            out = [{"prefill": chips[roles["prefill"]] // per["prefill"],
                    "decode": chips[roles["decode"]] // per["decode"]}]
        # every role needs at least one instance
        return [sp for sp in out if all(v >= 1 for v in sp.values())]
