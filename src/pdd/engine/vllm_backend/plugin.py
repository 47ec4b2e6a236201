"""The vLLM backend's entry point (``pdd.engines``: ``vllm``): its settings, and where its code is."""

from pdd.engine.vllm_backend.settings import VllmSettings
from pdd.shared.engines import EnginePlugin

PLUGIN = EnginePlugin(name="vllm", model_settings=VllmSettings, build="pdd.engine.vllm_backend.build:build_engine",
                      preflight="pdd.engine.vllm_backend.build:preflight")
