"""The vLLM backend's ``model.*`` keys (imports pydantic only: a vLLM config validates in an environment without
vLLM, the router's)."""

from __future__ import annotations

from pdd.engine.core.settings import DtypeSettings, PoolSettings


class VllmSettings(DtypeSettings, PoolSettings):
    """``kv_memory_mb`` sizes the staging pool and vLLM's own cache alike; ``kv_dtype`` must resolve to the
    weights' dtype (vLLM keeps KV in it)."""
