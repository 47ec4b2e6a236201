"""Settings fields more than one backend declares, each written once; a backend's settings model (its
``settings.py``) composes the ones it reads. Imports pydantic only: a config validates without any engine."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

ServingDtype = Literal["auto", "float32", "float16", "bfloat16"]


class BackendSettings(BaseModel):
    """A backend's own keys; an unknown one is refused by the config before it gets here."""

    model_config = {"extra": "forbid"}


class DtypeSettings(BackendSettings):
    dtype: ServingDtype = Field(
        "auto", description="weights and compute; auto: bfloat16 where the CPU has avx512_bf16 or amx_bf16 (the torch "
                            "engine: whichever of the two it measured faster here), else float32")
    kv_dtype: ServingDtype = Field(
        "auto", description="KV pool and every KV transfer; auto: the weights' dtype. Every prefill, relay and "
                            "main decode of a fleet must resolve to the same one (checked at start)")


class PoolSettings(BackendSettings):
    kv_memory_mb: int = Field(512, ge=1, description="KV pool budget per instance")
    threads: int | None = Field(None, ge=1, description="compute threads per instance (default: all cores)")
