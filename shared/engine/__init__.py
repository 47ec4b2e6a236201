"""The PDD model engine: Llama-family model over a paged KV pool, radix prefix cache,
continuous batching with chunked prefill and extend, and KV export/import for disaggregation.
See docs/ENGINE.md."""

from pdd.shared.engine.engine import Engine
from pdd.shared.engine.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    EngineInputError,
    InvalidSamplingParamsError,
    OutOfBlocks,
    PromptTooLongError,
    UnknownRequestError,
    UnsupportedArchitectureError,
)
from pdd.shared.engine.radix_cache import CacheEvent, RadixCache, prefix_block_hashes
from pdd.shared.engine.request import ImportPlan, StepOutput
from pdd.shared.engine.sampling import SamplingParams

__all__ = [
    "Engine",
    "SamplingParams",
    "StepOutput",
    "ImportPlan",
    "RadixCache",
    "CacheEvent",
    "prefix_block_hashes",
    "EngineInputError",
    "EmptyPromptError",
    "PromptTooLongError",
    "InvalidSamplingParamsError",
    "UnsupportedArchitectureError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "OutOfBlocks",
]
