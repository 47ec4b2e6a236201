"""The torch engine's ``model.*`` keys (imports pydantic only)."""

from __future__ import annotations

from pydantic import Field

from pdd.engine.core.settings import DtypeSettings, PoolSettings


class TorchSettings(DtypeSettings, PoolSettings):
    batch_invariant: bool = Field(
        True, description="decode-phase attention accumulates in float64, so a request's tokens do not depend on "
                          "its batch or on decode vs extend: a handoff's output equals an undisturbed run. false: "
                          "fp32, faster at large batch x long context; tokens after a handoff may then differ")
    prefill_chunk_tokens: int | None = Field(
        None, ge=1, description="the most tokens one request prefills per step, so a long prompt shares every step "
                                "with the requests queued behind it; default: the engine's (512)")
