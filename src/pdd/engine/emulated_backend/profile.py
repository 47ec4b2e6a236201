"""The emulated backend for one engine role: the config's ``emulation`` section made concrete.

A scenario (pdd/scenarios: the simulator's files, read through the neutral ``Deployment``) states the chips,
the model and the utilisation; its ``system`` says which chip type serves each role and how many chips form
one instance. From those this module builds ``EmulatedEngine`` (engine.py): the role's ``CostModel``, the KV
capacity it implies, and a KV layout whose real bytes per token are the model's divided by ``kv_scale``. The
same figures go into the startup banner (``EmulatedProfile.describe``), so a log states what is emulated, at
which scale and dilation. The scenario is read once per process, at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdd.engine.core.scheduler import DEFAULT_PREFILL_CHUNK_TOKENS
from pdd.engine.emulated_backend.engine import EmulatedEngine
from pdd.engine.emulated_backend.settings import EmulatedModelSettings, EmulationSettings
from pdd.shared.config import ConfigError, PDDConfig
from pdd.shared.cost_model import CostModel, ModelSpec
from pdd.shared.roles import Role

KV_GRANULE_BYTES = 16  # one token's K and V at head_dim 1: 2 tensors x 2 layers x 1 head x 4 bytes (float32)
_LAYERS, _KV_HEADS = 2, 1  # the emulated pool's shape: only its bytes per token matter to the transports
_SCENARIO_ROLE = {Role.PREFILL: "prefill", Role.RELAY: "relay", Role.MAIN_DECODE: "decode"}  # sim's role names


@dataclass(frozen=True)
class EmulatedProfile:
    """What one role's engine emulates: ``chips`` x ``chip`` serving ``model``, moving 1/``scale`` of its KV."""

    role: str
    chip: str
    chips: int
    model: ModelSpec
    cost_model: CostModel
    head_dim: int
    time_dilation: float

    @property
    def real_kv_bytes_per_token(self) -> int:
        return KV_GRANULE_BYTES * self.head_dim

    @property
    def scale(self) -> float:
        """Modeled KV bytes per real byte (``kv_scale`` after rounding to the pool's granule)."""
        return self.model.kv_bytes_per_token / self.real_kv_bytes_per_token

    def describe(self) -> dict[str, Any]:
        """The banner's fields: what is emulated, the scale and dilation, the capacity."""
        return {"chip": self.chip, "chips_per_instance": self.chips, "model": self.model.name,
                "kv_scale": round(self.scale, 2), "time_dilation": self.time_dilation,
                "modeled_kv_bytes_per_token": self.model.kv_bytes_per_token,
                "real_kv_bytes_per_token": self.real_kv_bytes_per_token,
                "kv_capacity_tokens": self.cost_model.kv_capacity_tokens}


def head_dim_for(kv_bytes_per_token: float, kv_scale: float) -> int:
    """The pool's head dim whose real bytes per token come closest to ``kv_bytes_per_token / kv_scale``."""
    return max(1, round(kv_bytes_per_token / kv_scale / KV_GRANULE_BYTES))


def profile(cfg: EmulationSettings, role: str) -> EmulatedProfile:
    """The role's profile from the scenario; a ``ConfigError`` names the field when the scenario, the system or
    its roles do not fit."""
    from pdd.scenarios import Deployment, load_yaml  # one reading of the scenario files

    try:
        scenario = Deployment.from_dict(load_yaml(cfg.scenario))
        system = scenario.system(cfg.system)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"emulation.scenario {cfg.scenario!r} / emulation.system {cfg.system!r}: {exc}") from None
    roles = system.get("roles", {})
    sim_role = _SCENARIO_ROLE[Role(role)]
    if sim_role not in roles:  # a relay in a system without one sits beside prefill, on its chips
        sim_role = "prefill"
    if sim_role not in roles:
        raise ConfigError(f"emulation.system {cfg.system!r}: no chip for role {role} (roles: {sorted(roles)})")
    chip, chips = roles[sim_role], scenario.instance_chips(cfg.system, sim_role)
    try:
        cost_model = scenario.cost_model(chip, chips)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"emulation: {role} on {chips} x {chip}: {exc}") from None
    return EmulatedProfile(role=role, chip=scenario.chips[chip].name, chips=chips, model=scenario.model,
                           cost_model=cost_model, head_dim=head_dim_for(scenario.model.kv_bytes_per_token,
                                                                        cfg.kv_scale),
                           time_dilation=cfg.time_dilation)


def engine_kwargs(cfg: EmulationSettings, prof: EmulatedProfile, tokenizer: Any, *, block_size: int,
                  max_num_seqs: int, max_prefill_tokens: int, prefill_chunk_tokens: int, enable_prefix_cache: bool,
                  cache_finished: bool) -> dict[str, Any]:
    """``EmulatedEngine`` arguments: the profile's cost model and KV shape, the tokenizer's vocabulary and EOS
    (the router detokenizes what the oracle draws), the config's scheduler limits."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return dict(
        cost_model=prof.cost_model, time_dilation=prof.time_dilation, vocab_size=len(tokenizer),
        eos_token_ids=[eos] if isinstance(eos, int) else [], eos_rate=cfg.eos_rate, oracle_seed=cfg.oracle_seed,
        num_layers=_LAYERS, kv_heads=_KV_HEADS, head_dim=prof.head_dim, kv_dtype="float32",
        block_size=block_size, max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill_tokens,
        prefill_chunk_tokens=prefill_chunk_tokens, enable_prefix_cache=enable_prefix_cache,
        cache_finished=cache_finished)


def build_engine(config: PDDConfig, role: str, cache_finished: bool) -> EmulatedEngine:
    """The role's emulated engine (its profile's cost model and KV shape; ``describe`` says what it emulates)."""
    from pdd.shared.model_files import resolve_model_path
    from pdd.shared.tokenizer import load_tokenizer

    m = config.model
    section, model_keys = config.engine_section(), config.engine_settings()
    assert isinstance(section, EmulationSettings) and isinstance(model_keys, EmulatedModelSettings)
    prof = profile(section, role)
    return EmulatedEngine(**engine_kwargs(
        section, prof, load_tokenizer(resolve_model_path(m.path)), block_size=m.block_size,
        max_num_seqs=m.max_num_seqs, max_prefill_tokens=m.max_prefill_tokens,
        prefill_chunk_tokens=model_keys.prefill_chunk_tokens or DEFAULT_PREFILL_CHUNK_TOKENS,
        enable_prefix_cache=m.enable_prefix_cache, cache_finished=cache_finished), profile=prof.describe())


def preflight(config: PDDConfig) -> str:
    """The banner's dtype line: there are no weights."""
    return "no weights: emulated accelerators (KV pages carry a float32 pattern)"
