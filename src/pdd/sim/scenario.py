"""Scenario files for the simulator: a deployment (pdd.scenarios) plus its workload -> `SimInput`s ready to run."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pdd.loadgen.trace import TRACE_BLOCK_TOKENS, MaxTokensRule, TraceArrays, hit_tokens
from pdd.loadgen.workload import AgenticConfig, HitDistribution, Workload, agentic_arrays
from pdd.scenarios import Deployment, load_yaml, set_path
from pdd.shared.cost_model import CostModel
from pdd.shared.pipelines import Pipeline
from pdd.shared.policy import RouteInputs, choose_pipeline

from .event_loop import SimInput

__all__ = ["Scenario", "load_yaml", "set_path", "stage_capacity", "unit_poisson"]


@dataclass
class Scenario(Deployment):
    """A parsed scenario: the deployment's physical facts and systems, and the workload to run on them."""

    workload: AgenticConfig = AgenticConfig()
    max_tokens: MaxTokensRule = MaxTokensRule()  # what the workload's clients send (workload.max_tokens)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Scenario":
        wl = dict(data.get("workload", {}))
        hits = HitDistribution.from_dict(wl.pop("hits", None))
        raw_rule = wl.pop("max_tokens", None)
        rule = MaxTokensRule.parse(None if raw_rule is None else str(raw_rule))
        if "anomalous_output" in wl:
            wl["anomalous_output"] = tuple(wl["anomalous_output"])
        return replace(cls(**vars(Deployment.from_dict(data))), workload=AgenticConfig(hits=hits, **wl),
                       max_tokens=rule)

    def arrays(self, n: int | None = None, seed: int | None = None) -> Workload:
        cfg = self.workload
        if n is not None or seed is not None:
            cfg = replace(cfg, num_requests=n or cfg.num_requests, seed=cfg.seed if seed is None else seed)
        return agentic_arrays(cfg)

    def sim_input(self, name: str, split: dict[str, int], rate: float, wl: Workload,
                  unit_arrivals: np.ndarray, seed: int = 0, record_itl: bool = True,
                  trace: TraceArrays | None = None) -> SimInput:
        """One system with a given role split at an offered rate (arrivals = unit-rate times / rate). With a
        trace, its block chains drive the simulated caches and its max_tokens rule what the router sees."""
        s = self.system(name)
        roles = s["roles"]
        per = {role: self.instance_chips(name, role) for role in roles}
        relay = roles.get("relay")
        rdma = self.raw.get("rdma", {})
        sent, output = self.max_tokens.columns(wl.output)
        if trace is not None:
            sent, output = trace.route_max_tokens, trace.output
        return SimInput(
            arrivals=unit_arrivals / rate, prompt=wl.prompt, cached=wl.cached, output=output,
            route_max_tokens=sent, max_context_tokens=self.model.max_context_tokens,
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
            chains=trace.chains if trace is not None else None,
            block_tokens=trace.block_tokens if trace is not None else TRACE_BLOCK_TOKENS,
            prefill_cache_tokens=self.prefill_cache_tokens(name),
        )

    def prefill_cache_tokens(self, name: str) -> int | None:
        """One P instance's prefix cache: its HBM left after weights (None) plus the host memory the scenario's
        ``cache.prefill_host_gb`` gives each instance (a KV store in DRAM, as Mooncake's)."""
        host_gb = float(self.raw.get("cache", {}).get("prefill_host_gb", 0.0))
        if host_gb <= 0:
            return None
        roles = self.system(name)["roles"]
        cm = self.cost_model(roles["prefill"], self.instance_chips(name, "prefill"))
        return cm.kv_capacity_tokens + int(host_gb * 1e9 / self.model.kv_bytes_per_token)


def unit_poisson(n: int, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """Arrival times at rate 1 (gamma gaps; shape 1 = Poisson). Divide by a rate to scale."""
    rng = np.random.default_rng(seed + 7919)
    gaps = rng.gamma(burstiness, 1.0 / burstiness, n)
    return np.cumsum(gaps)


def stage_capacity(inp: SimInput) -> dict[str, float]:
    """Requests/s each stage could sustain alone (analytic): names the bottleneck. Hits are the input column,
    or with block chains an unbounded cache's (an upper bound); the WAN and the relay count for every system
    that uses them, with the pipelines the router's policy picks from what it can know."""
    prompt, output = inp.prompt.astype(float), inp.output.astype(float)
    cached = (hit_tokens(inp.chains, inp.prompt, inp.block_tokens) if inp.chains else inp.cached).astype(float)
    pre = inp.prefill.prefill_time(prompt - cached, cached).mean()
    cap: dict[str, float] = {"prefill": inp.n_prefill / pre}
    cap["decode"] = _decode_capacity(inp.decode, inp.n_decode, prompt, output)
    if inp.wan is None or inp.kind == "local":
        return cap
    wan, kvb = inp.wan, inp.kv_bytes_per_token
    mean_mult = math.exp(wan.throughput_sigma**2 / 2)  # lognormal mean of the payload-time multiplier
    if inp.kind == "naive":
        crossing, wan_bytes, relay_tokens = np.ones(len(prompt), bool), prompt * kvb, np.zeros(len(prompt))
    else:
        crossing, wan_bytes, relay_tokens = _pdd_routes(inp, cached, mean_mult)
    mean_t = (crossing * wan.setup_s + wan_bytes / wan.transfer_bytes_per_s * mean_mult).mean()
    if mean_t > 0:
        cap["wan"] = min(wan.concurrent_transfers / mean_t, wan.bandwidth_gbps * 1e9 / 8 / max(1.0, float(wan_bytes.mean())))
    if inp.relay is not None and inp.n_relay and relay_tokens.any():
        cap["relay"] = _decode_capacity(inp.relay, inp.n_relay, prompt, output, float(relay_tokens.mean()))
    return cap


def _decode_capacity(cm: CostModel, n: int, prompt: np.ndarray, output: np.ndarray,
                     tokens_per_request: float | None = None) -> float:
    """Requests/s of ``n`` decoders running batches as large as their KV allows."""
    need = float((prompt + output).mean())
    batch = max(1.0, cm.kv_capacity_tokens / need)
    ctx = batch * float((prompt + output / 2).mean())
    tokens = float(output.mean()) if tokens_per_request is None else tokens_per_request
    return n * batch / (cm.step_time(batch, ctx) * max(tokens, 1e-9))


def _pdd_routes(inp: SimInput, cached: np.ndarray, mean_mult: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per request under PDD's policy: crosses the WAN?, its WAN bytes, and the tokens the relay decodes
    (a local finish: all of them; a masked transfer: those decoded while the KV crosses)."""
    wan, pol, kvb = inp.wan, inp.policy, inp.kv_bytes_per_token
    md_cached = (np.zeros_like(cached) if not inp.drc else cached if inp.chains
                 else np.minimum(inp.md_cached, inp.prompt) if inp.md_cached is not None else cached * inp.drc_alignment)
    room = inp.max_context_tokens - inp.prompt
    sent = room if inp.route_max_tokens is None else np.asarray(inp.route_max_tokens)
    rld = inp.n_relay > 0 and inp.relay is not None
    relay_step = inp.relay.step_time(1, 0) if rld else 0.0
    crossing, wan_bytes, relay_tokens = (np.zeros(len(cached), bool), np.zeros(len(cached)),
                                         np.zeros(len(cached)))
    bps = inp.route_bandwidth_bps or wan.transfer_bytes_per_s
    for i, (p, m, mt, out) in enumerate(zip(inp.prompt.tolist(), md_cached.tolist(), sent.tolist(),
                                            inp.output.tolist())):
        dec = choose_pipeline(RouteInputs(prompt_tokens=p, max_tokens=mt, p_cached_tokens=int(cached[i]),
                                          md_cached_tokens=int(m), kv_bytes_per_token=int(kvb),
                                          wan_bandwidth_bps=bps, rld_available=rld), pol)
        if dec.pipeline == Pipeline.P_RLD:
            relay_tokens[i] = out
            continue
        crossing[i], wan_bytes[i] = True, dec.wan_bytes
        if dec.pipeline == Pipeline.P_RLD_MD:
            transfer = wan.setup_s + dec.wan_bytes / wan.transfer_bytes_per_s * mean_mult
            relay_tokens[i] = min(out, transfer / relay_step) if relay_step > 0 else out
    return crossing, wan_bytes, relay_tokens
