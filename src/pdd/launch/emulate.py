"""`pdd up --emulate SCENARIO`: the live system at a scenario's shape, on emulated accelerators.

Every engine runs the emulated backend (``model.backend: emulated``): no weights, step times from the cost
model of its role's chips (engine/emulated_backend/profile.py), oracle tokens, real KV bytes at 1/``kv_scale`` of the
model's. The scenario's ``pdd`` system gives the instance counts (its first role split: one relay, the rest
of site A's chips prefill) and its link figures give the WAN, both scaled the same way as the KV bytes:

- rate: the link's per-flow rate / (effective KV scale x time dilation), so a transfer of 1/scale of the
  bytes takes the modeled time (dilated);
- delay: (one-way latency + per-transfer setup) x dilation. The shaper holds one token bucket per sending
  process (concurrent transfers of one prefill share it) and adds no lognormal jitter: the scenario's
  throughput spread is the simulator's, not the live emulation's;
- a codec on the link (the scenario's ``wan.codec_wire_ratio``): the shaper's ``wire_ratio`` (it charges its line,
  and counts, that many wire bytes per KV byte; the emulated KV itself is not coded: transports/shaper.py).
  Only the benchmark sets one (bench/pipelines_emulated.py ``--wan-codec``); `pdd up --emulate` refuses it.

Why a module of its own: ``up.py`` starts and supervises processes; this only edits the config it writes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from pdd.engine.emulated_backend import profile as emulation
from pdd.engine.emulated_backend.plugin import PLUGIN as EMULATED_PLUGIN
from pdd.engine.emulated_backend.settings import EmulationSettings
from pdd.shared.config import ConfigError
from pdd.shared.cost_model import DATACENTER_PREFILL_CHUNK_TOKENS
from pdd.shared.roles import Role

BACKEND = EMULATED_PLUGIN.name  # the engine backend every role runs
SYSTEM = "pdd"  # the scenario's system `pdd up` emulates: P and RLD on site A's chips, MD on site B's
CHUNK_TOKENS = DATACENTER_PREFILL_CHUNK_TOKENS  # tokens one step prefills, as the simulator's
_SPLIT_ROLE = {Role.PREFILL: "prefill", Role.RELAY: "relay", Role.MAIN_DECODE: "decode"}


@dataclass(frozen=True)
class EmulatedLink:
    """The WAN shaper's figures for a scenario's link at a KV scale and time dilation (module docstring)."""

    rate_bits: float  # bit/s of real bytes: the per-flow rate / (effective KV scale x dilation)
    delay_s: float  # (one-way latency + per-transfer setup) x dilation
    why: str  # how both were derived, for banners and benchmark reports
    wire_ratio: float = 1.0  # wire bytes per KV byte: the link's codec (the shaper's ``wire_ratio``), 1 for none

    @property
    def kv_rate_bits(self) -> float:
        """bit/s of real KV through one transfer: the line's rate over the codec's wire ratio."""
        return self.rate_bits / self.wire_ratio

    def shape(self) -> dict[str, Any]:
        """The shaper options of this link (transports.wan.options.shape)."""
        out: dict[str, Any] = {"rate": f"{self.rate_bits:.0f}bit", "delay": f"{self.delay_s * 1e3:g}ms"}
        if self.wire_ratio != 1.0:
            out["wire_ratio"] = self.wire_ratio
        return out


def wan_link(wan: Any, scale: float, time_dilation: float) -> EmulatedLink:
    """The shaper's rate and delay for ``wan`` (a scenario's ``WanLink``) when the KV bytes are 1/``scale`` of
    the modeled ones and every modeled duration is x ``time_dilation``: `pdd up --emulate` and
    bench/pipelines_emulated.py both shape their WAN with this."""
    ratio = wan.codec_wire_ratio
    return EmulatedLink(
        rate_bits=wan.per_flow_gbps * 1e9 / scale / time_dilation,
        delay_s=(wan.latency_s + wan.setup_s) * time_dilation,
        why=(f"the scenario's {wan.per_flow_gbps:g} Gbit/s per flow / {scale:.0f} (KV scale) / "
             f"{time_dilation:g} (dilation); delay = {wan.latency_s * 1e3:g} ms latency + "
             f"{wan.setup_s * 1e3:g} ms setup per transfer"
             + (f"; codec: {ratio:.4g} wire bytes per KV byte" if ratio != 1.0 else "")),
        wire_ratio=ratio)


def emulated_policy(scenario: Any, link: EmulatedLink, time_dilation: float) -> dict[str, Any]:
    """The router policy of an emulated system: the scenario's (the simulator decides with the same one), its
    masking threshold x dilation, and the link's KV rate as the WAN bandwidth the router assumes until main
    decode has measured one (the config's default, 1 Gbit/s, is ~100x the emulated link's real-byte rate:
    every transfer would look small, and every request would go P->MD). Main decode measures KV bytes per
    second, so with a codec the assumed rate is the line's over the wire ratio too."""
    policy = scenario.policy.model_dump()
    policy["wan_masking_threshold_s"] *= time_dilation
    policy["default_wan_gbps"] = link.kv_rate_bits / 1e9
    policy["wan_flows"] = 1  # the shaper's line is one transfer's rate: a second transfer shares it
    return policy


def apply(base: dict[str, Any], args: argparse.Namespace) -> dict[str, str]:
    """Turn ``base`` (the config `pdd up` writes) into the emulated system of ``args.emulate``; fills the
    instance counts not given on the command line. Returns the banner lines ("emulation", "wan")."""
    from pdd.scenarios import Deployment, load_yaml

    cfg = EmulationSettings(**{**base.get("emulation", {}), "scenario": args.emulate, "system": SYSTEM,
                             **({"time_dilation": args.time_dilation} if args.time_dilation else {})})
    try:
        scenario = Deployment.from_dict(load_yaml(cfg.scenario))
        split = scenario.splits(SYSTEM)[0]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise ConfigError(f"--emulate {args.emulate}: {exc}") from None
    base["model"]["backend"] = BACKEND
    base["model"]["max_prefill_tokens"] = base["model"]["prefill_chunk_tokens"] = CHUNK_TOKENS
    base["emulation"] = cfg.model_dump(mode="json")
    counts = {}
    for role, key in _SPLIT_ROLE.items():
        given = getattr(args, role.replace("-", "_"))
        counts[role] = given if given is not None else split.get(key, 1)
        setattr(args, role.replace("-", "_"), counts[role])
    profiles = {role: emulation.profile(cfg, role) for role in counts}
    scale = profiles[Role.PREFILL].scale
    shape = None
    link = wan_link(scenario.wan, scale, cfg.time_dilation)
    if link.wire_ratio != 1.0:
        raise ConfigError(f"--emulate {args.emulate}: the scenario's link has a codec (wan.codec_wire_ratio "
                          f"{link.wire_ratio:g}), which `pdd up --emulate` does not emulate (the emulated benchmark "
                          "does: python -m pdd.bench.pipelines --backend emulated --wan-codec)")
    base["policy"] = {**base.get("policy", {}), **emulated_policy(scenario, link, cfg.time_dilation)}
    if args.wan is None and "shape" not in base["transports"]["wan"].get("options", {}):
        args.wan = f"rate={link.rate_bits:.0f}bit,delay={link.delay_s * 1e3:g}ms"
        shape = link.why
    roles = ", ".join(f"{role} {counts[role]} x ({p.chips} x {p.chip})" for role, p in profiles.items())
    p = profiles[Role.PREFILL]
    notes = {"emulation": f"emulated accelerators ({cfg.scenario}, system {SYSTEM}): {roles}; model {p.model.name}; "
                          f"KV {p.real_kv_bytes_per_token} real bytes per token for {p.model.kv_bytes_per_token:g} "
                          f"modeled (scale 1/{scale:.0f}); time dilation x{cfg.time_dilation:g} (modeled seconds "
                          f"x{cfg.time_dilation:g} = wall seconds)"}
    if shape:
        notes["wan_why"] = shape
    return notes
