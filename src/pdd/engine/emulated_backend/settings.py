"""The emulated backend's keys: its model.* key and its own emulation section (imports pydantic only)."""

from __future__ import annotations

from pydantic import Field

from pdd.engine.core.settings import BackendSettings


class EmulatedModelSettings(BackendSettings):
    prefill_chunk_tokens: int | None = Field(
        None, ge=1, description="the most tokens one request prefills per step; default: the engine's (512)")


class EmulationSettings(BackendSettings):
    """The emulated backend's accelerators (read when ``model.backend`` is emulated): each engine is timed as the
    scenario's chips for its role, and moves 1/``kv_scale`` of the modeled KV bytes for real."""

    scenario: str = Field("report", description="a simulator scenario (a packaged one, pdd/scenarios, or "
                                                "a YAML path): its chips, model spec and utilisation")
    system: str = Field("pdd", description="the scenario's system whose chip type and chips per instance each role "
                                           "emulates (a relay without its own entry runs on the prefill chip)")
    kv_scale: float = Field(1000.0, ge=1, description="real KV bytes per token = the model's / kv_scale (rounded to "
                                                      "the pool's 16-byte granule; the banner states the effective "
                                                      "scale). A WAN emulation sized for the report divides its "
                                                      "rates by the same scale")
    time_dilation: float = Field(1.0, gt=0, description="every modeled duration x this (and every emulated WAN "
                                                        "rate / this): > 1 when the box cannot keep up")
    oracle_seed: int = Field(0, description="seed of the token oracle (the same on every engine of a fleet)")
    eos_rate: float = Field(0.0, ge=0, le=1, description="chance of EOS per output token (0: requests run to "
                                                         "max_tokens, as a benchmark with ignore_eos)")
