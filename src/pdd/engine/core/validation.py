"""The checks every backend runs on what a client or a peer asks of it, in one implementation: a backend
cannot drift from another in what it refuses (a bool ``max_new_tokens``, an unseeded random request).

Each raises ``EngineInputError`` or a subclass (engine/core/errors.py) naming what is wrong; nothing is
queued or reserved when one does.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from pdd.engine.core.errors import DuplicateRequestError, EmptyPromptError, EngineInputError, PromptTooLongError
from pdd.engine.core.request import Request, Status
from pdd.engine.core.sampling_params import SamplingParams


def check_token_ids(token_ids: Sequence[object], vocab_size: int, what: str = "token ids") -> None:
    """Every id an int in ``[0, vocab_size)``."""
    if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab_size for t in token_ids):
        raise EngineInputError(f"{what}: token ids outside the vocabulary [0, {vocab_size})")


def check_max_new_tokens(value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise EngineInputError(f"max_new_tokens must be an integer >= 1, got {value!r}")


def check_new_request(rid: str, prompt_ids: Sequence[object], in_use: Container[str], vocab_size: int,
                      max_context: int, max_new_tokens: object) -> None:
    """A new request (``add_request``, ``prepare_import``): a free id, a prompt of valid ids that leaves room
    for one output, a valid ``max_new_tokens``."""
    if rid in in_use:
        raise DuplicateRequestError(f"request id {rid!r} is already in use")
    if not prompt_ids:
        raise EmptyPromptError("prompt is empty: at least one token is required")
    check_token_ids(prompt_ids, vocab_size, "prompt")
    if len(prompt_ids) >= max_context:
        raise PromptTooLongError(f"prompt has {len(prompt_ids)} tokens; the context limit is {max_context} "
                                 "(prompt plus at least one generated token)")
    check_max_new_tokens(max_new_tokens)


def check_commit(req: Request, prompt_ids: Sequence[object], output_ids_so_far: Sequence[object],
                 max_new_tokens: object, vocab_size: int) -> None:
    """``commit_import``: ``req`` awaits an import of this very prompt, and the outputs so far (at least P's
    first token) and ``max_new_tokens`` are valid."""
    if req.status is not Status.IMPORTING:
        raise EngineInputError(f"request {req.rid!r} is not awaiting an import")
    if list(prompt_ids) != req.prompt_ids:
        raise EngineInputError(f"commit_import for {req.rid!r}: prompt differs from prepare_import")
    if not output_ids_so_far:
        raise EngineInputError("output_ids_so_far must hold at least the first generated token")
    check_max_new_tokens(max_new_tokens)
    check_token_ids(output_ids_so_far, vocab_size, "outputs so far")


def checked_params(params: SamplingParams | None) -> SamplingParams:
    """The request's sampling parameters, validated, with a concrete seed (so a continuation elsewhere draws
    the same tokens)."""
    params = params or SamplingParams()
    params.validate()
    return params.with_seed()
