"""The vLLM engine from a deployment config, and what `pdd up` says about it before the services start."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from pdd.engine.core.dtypes import resolve_dtypes
from pdd.engine.vllm_backend.settings import VllmSettings
from pdd.shared.config import ConfigError, PDDConfig

if TYPE_CHECKING:
    from pdd.engine.vllm_backend.engine import VllmEngine

MISSING_VLLM = ("model.backend vllm needs vLLM, which this Python lacks: bash scripts/install_vllm.sh, then run PDD "
                "from .venv-vllm (.venv-vllm/bin/pdd up --backend vllm; docs/BACKENDS.md)")


def build_engine(config: PDDConfig, role: str, cache_finished: bool) -> VllmEngine:
    """vLLM embedded in this role's process, beside its staging pool (the role does not matter)."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(MISSING_VLLM)
    from pdd.engine.vllm_backend.engine import VllmEngine

    m = config.model
    s = config.engine_settings()
    assert isinstance(s, VllmSettings)
    return VllmEngine(m.path, s.dtype, kv_dtype=s.kv_dtype, num_threads=s.threads,
                      kv_memory_bytes=s.kv_memory_mb << 20, block_size=m.block_size, max_num_seqs=m.max_num_seqs,
                      max_prefill_tokens=m.max_prefill_tokens, cache_finished=cache_finished,
                      enable_prefix_cache=m.enable_prefix_cache)


def preflight(config: PDDConfig) -> str:
    """Refuse to start without vLLM; the dtype ``auto`` resolves to (by the CPU's flags)."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(MISSING_VLLM)
    s = config.engine_settings()
    assert isinstance(s, VllmSettings)
    return resolve_dtypes(s.dtype, s.kv_dtype).reason + " (vLLM)"
