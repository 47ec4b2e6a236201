"""The torch engine from a deployment config, and what `pdd up` says about it before the services start."""

from __future__ import annotations

from pdd.engine.core.dtypes import resolve_dtypes
from pdd.engine.core.scheduler import DEFAULT_PREFILL_CHUNK_TOKENS
from pdd.engine.torch_backend.dtype_probe import probe_dtype
from pdd.engine.torch_backend.engine import TorchEngine
from pdd.engine.torch_backend.loader import load_model_config
from pdd.engine.torch_backend.settings import TorchSettings
from pdd.shared.config import PDDConfig
from pdd.shared.model_files import resolve_model_path


def build_engine(config: PDDConfig, role: str, cache_finished: bool) -> TorchEngine:
    """Load the model of ``config.model`` with the torch backend's settings (the role does not matter)."""
    m = config.model
    s = config.engine_settings()
    assert isinstance(s, TorchSettings)
    return TorchEngine.from_model(
        m.path, s.dtype, kv_dtype=s.kv_dtype, num_threads=s.threads, kv_memory_bytes=s.kv_memory_mb << 20,
        block_size=m.block_size, max_num_seqs=m.max_num_seqs, max_prefill_tokens=m.max_prefill_tokens,
        cache_finished=cache_finished, enable_prefix_cache=m.enable_prefix_cache, batch_invariant=s.batch_invariant,
        prefill_chunk_tokens=s.prefill_chunk_tokens or DEFAULT_PREFILL_CHUNK_TOKENS)


def preflight(config: PDDConfig) -> str:
    """``dtype: auto`` measured once, before the services start loading (a quiet probe, cached for all of them)."""
    s = config.engine_settings()
    assert isinstance(s, TorchSettings)
    path = resolve_model_path(config.model.path)
    return resolve_dtypes(s.dtype, s.kv_dtype, probe=lambda: probe_dtype(load_model_config(path))).reason
