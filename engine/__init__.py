"""The PDD model engine: Llama-family model over a paged KV pool, radix prefix cache,
continuous batching with chunked prefill and extend, and KV export/import for disaggregation.
See docs/ENGINE.md."""

from pdd.engine.engine import Engine
from pdd.engine.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    EngineInputError,
    InvalidSamplingParamsError,
    OutOfBlocks,
    PromptTooLongError,
    UnknownRequestError,
    UnsupportedArchitectureError,
)
from pdd.engine.radix_cache import CacheEvent, RadixCache
from pdd.engine.request import ImportReservation, StepOutput
from pdd.engine.sampling import SamplingParams

__all__ = [
    "Engine",
    "SamplingParams",
    "StepOutput",
    "ImportReservation",
    "RadixCache",
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
