"""Typed engine errors. Bad input raises a ValueError subclass whose message names the problem."""

from __future__ import annotations


class EngineInputError(ValueError):
    """A request or model argument the engine cannot accept."""


class EmptyPromptError(EngineInputError):
    pass


class PromptTooLongError(EngineInputError):
    pass


class InvalidSamplingParamsError(EngineInputError):
    pass


class UnsupportedArchitectureError(EngineInputError):
    pass


class UnknownRequestError(EngineInputError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown request"


class DuplicateRequestError(EngineInputError):
    pass


class OutOfBlocks(RuntimeError):
    """The KV pool has no room (even after evicting unlocked cache entries)."""
