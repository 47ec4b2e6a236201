"""The engine backends, named once. The value is what ``model.backend`` in a config file says; the engine
interface (engine/interface.py) maps each to its class."""

from __future__ import annotations

import enum


class Backend(enum.StrEnum):
    TORCH = "torch"  # pdd.engine.Engine: real weights and math on the CPU (the embedded default)
    EMULATED = "emulated"  # pdd.engine.emulated.EmulatedEngine: no weights, cost-model step times, oracle tokens
    VLLM = "vllm"  # pdd.engine.vllm_backend.engine.VllmEngine: vLLM embedded, KV moved by PDD's connector
