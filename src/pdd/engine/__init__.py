"""The PDD model engine: a neutral core (engine/core: KV pool and block allocator, block bookkeeping, radix
cache, scheduler, request table, step output types, input validation), one folder per backend (torch_backend,
emulated_backend, vllm_backend), and the interface the roles drive (``interface.py``). See docs/ENGINE.md and
docs/BACKENDS.md.

What the roles need by name is re-exported here from the core: importing it loads no backend.
"""

from pdd.engine.core.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    EngineInputError,
    InvalidSamplingParamsError,
    OutOfBlocks,
    PromptTooLongError,
    UnknownRequestError,
    UnsupportedArchitectureError,
)
from pdd.engine.core.radix_cache import CacheEvent
from pdd.engine.core.request import ImportReservation, StepOutput
from pdd.engine.core.sampling_params import SamplingParams

__all__ = [
    "SamplingParams",
    "StepOutput",
    "ImportReservation",
    "CacheEvent",
    "EngineInputError",
    "EmptyPromptError",
    "PromptTooLongError",
    "InvalidSamplingParamsError",
    "UnsupportedArchitectureError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "OutOfBlocks",
]
