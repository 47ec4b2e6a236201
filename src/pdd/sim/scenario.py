"""Scenario files for the simulator: a deployment (pdd.scenarios) plus its workload -> `SimInput`s ready to run."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pdd.loadgen.workload import AgenticConfig, HitDistribution, Workload, agentic_arrays
from pdd.scenarios import Deployment, load_yaml, set_path

from .event_loop import SimInput

__all__ = ["Scenario", "load_yaml", "set_path", "stage_capacity", "unit_poisson"]


@dataclass
class Scenario(Deployment):
    """A parsed scenario: the deployment's physical facts and systems, and the workload to run on them."""

    workload: AgenticConfig = AgenticConfig()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Scenario":
        wl = dict(data.get("workload", {}))
        hits = HitDistribution.from_dict(wl.pop("hits", None))
        if "anomalous_output" in wl:
            wl["anomalous_output"] = tuple(wl["anomalous_output"])
        return replace(cls(**vars(Deployment.from_dict(data))), workload=AgenticConfig(hits=hits, **wl))

    def arrays(self, n: int | None = None, seed: int | None = None) -> Workload:
        cfg = self.workload
        if n is not None or seed is not None:
            cfg = replace(cfg, num_requests=n or cfg.num_requests, seed=cfg.seed if seed is None else seed)
        return agentic_arrays(cfg)

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
