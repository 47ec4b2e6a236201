"""Scenario files: chips, model, link, workload, systems -> `SimInput`s ready to run."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from pdd.loadgen.workload import AgenticConfig, HitDistribution, Workload, agentic_arrays
from pdd.shared.cost_model import Chip, CostModel, ModelSpec, from_hardware
from pdd.shared.policy import PolicyConfig

from .event_loop import SimInput
from .hardware import WanLink, build

SCENARIO_DIR = Path(__file__).parent / "scenarios"


def load_yaml(path: str | Path) -> dict[str, Any]:
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


@dataclass
class Scenario:
    """A parsed scenario: physical facts plus named systems (deployments) to compare."""

    raw: dict[str, Any]
    chips: dict[str, Chip]
    model: ModelSpec
    wan: WanLink
    workload: AgenticConfig
    policy: PolicyConfig

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Scenario":
        chips = {k: build(Chip, v) for k, v in data["chips"].items()}
        model = build(ModelSpec, data["model"])
        wan = build(WanLink, data.get("wan", {}))
        wl = dict(data.get("workload", {}))
        hits = HitDistribution.from_dict(wl.pop("hits", None))
        if "anomalous_output" in wl:
            wl["anomalous_output"] = tuple(wl["anomalous_output"])
        workload = AgenticConfig(hits=hits, **wl)
        policy = PolicyConfig(**data.get("policy", {}))
        return cls(data, chips, model, wan, workload, policy)

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

    def arrays(self, n: int | None = None, seed: int | None = None) -> Workload:
        cfg = self.workload
        if n is not None or seed is not None:
            cfg = replace(cfg, num_requests=n or cfg.num_requests, seed=cfg.seed if seed is None else seed)
        return agentic_arrays(cfg)

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

    def sim_input(self, name: str, split: dict[str, int], rate: float, wl: Workload,
                  unit_arrivals: np.ndarray, seed: int = 0, record_itl: bool = True) -> SimInput:
        """One system with a given role split at an offered rate (arrivals = unit-rate times / rate)."""
        s = self.system(name)
        roles = s["roles"]
        per = {role: self.instance_chips(name, role) for role in roles}
        relay = roles.get("relay")
        rdma = self.raw.get("rdma", {})
        return SimInput(
            arrivals=unit_arrivals / rate, prompt=wl.prompt, cached=wl.cached, output=wl.output,
            prefill=self.cost_model(roles["prefill"], per["prefill"]),
            decode=self.cost_model(roles["decode"], per["decode"]),
            n_prefill=split["prefill"], n_decode=split["decode"], kv_bytes_per_token=self.model.kv_bytes_per_token,
            kind=s["kind"], relay=self.cost_model(relay, per["relay"]) if relay else None,
            n_relay=split.get("relay", 0),
            wan=self.wan if s["kind"] != "local" else None,
            rdma_gbps=rdma.get("gbps", 3200.0), rdma_setup_s=rdma.get("setup_s", 0.02),
            drc=bool(s.get("drc", True)), drc_alignment=float(s.get("drc_alignment", 1.0)),
            first_token_from_prefill=bool(s.get("first_token_from_prefill", False)),
            policy=self.policy, seed=seed, record_itl=record_itl,
        )

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


def unit_poisson(n: int, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """Arrival times at rate 1 (gamma gaps; shape 1 = Poisson). Divide by a rate to scale."""
    rng = np.random.default_rng(seed + 7919)
    gaps = rng.gamma(burstiness, 1.0 / burstiness, n)
    return np.cumsum(gaps)


def stage_capacity(inp: SimInput) -> dict[str, float]:
    """Requests/s each stage could sustain alone (analytic): names the bottleneck."""
    new = (inp.prompt - inp.cached).astype(float)
    pre = inp.prefill.prefill_time(new, inp.cached.astype(float)).mean()
    cap: dict[str, float] = {"prefill": inp.n_prefill / pre}
    need = float((inp.prompt + inp.output).mean())
    d = inp.decode
    batch = max(1.0, d.kv_capacity_tokens / need)
    ctx = batch * float((inp.prompt + inp.output / 2).mean())
    cap["decode"] = inp.n_decode * batch / (d.step_time(batch, ctx) * float(inp.output.mean()))
    if inp.wan is not None and inp.kind == "naive":
        payload_s = float(inp.prompt.mean()) * inp.kv_bytes_per_token / inp.wan.flow_bytes_per_s
        mean_t = inp.wan.setup_s + payload_s * math.exp(inp.wan.throughput_sigma**2 / 2)  # lognormal mean
        cap["wan"] = inp.wan.flows / mean_t
    return cap
