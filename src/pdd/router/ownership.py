"""In-order emission with explicit ownership: each output position exactly once, from its owner.

Who owns a position is the pipeline's (``PipelineSpec.owns``): P owns position 0; in a handoff the
relay owns every position up to the boundary it names (``owner_until``) and MD the rest (MD chunks
that arrive before the boundary is named wait here). After a migration the one instance resuming the
request (under its own attempt id) owns every position from where the client's stream stands.
Anything else (a duplicate, a stale owner) is dropped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.shared.pipelines import Pipeline, PipelineSpec, spec
from pdd.shared.protocol import TokenLogprobs
from pdd.shared.roles import Role


@dataclass
class Emission:
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token id when the request asked


@dataclass
class OwnershipTracker:
    pipeline: Pipeline  # the spec (pipelines.py) says who owns which position
    next_position: int = 0
    relay_until: int | None = None  # last relay position, once the relay names it
    finish_at: int | None = None  # total output length when known
    finish_reason: str | None = None
    dropped: int = 0
    relay_tokens: int = 0
    _pending: dict[int, int] = field(default_factory=dict)
    _pending_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # the owner's, beside its token
    _waiting_md: list[tuple[int, list[int], str | None, list[TokenLogprobs]]] = field(default_factory=list)
    _spec: PipelineSpec = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._spec = spec(self.pipeline)

    def owns(self, role: Role, position: int) -> bool | None:
        """True/False, or None when it cannot be decided yet (MD before the relay's boundary)."""
        return self._spec.owns(role, position, self.relay_until)

    def accept(self, role: Role, start: int, token_ids: list[int], finish_reason: str | None = None,
               owner_until: int | None = None, logprobs: list[TokenLogprobs] | None = None) -> Emission:
        """``logprobs``: empty, or one per token id; they travel with their tokens."""
        n = len(token_ids)
        if (start == self.next_position and n and finish_reason is None and owner_until is None
                and self.finish_at is None and not self._pending and not self._waiting_md
                and self._owns_all(role, start, n)):
            # the common case, once per token of every stream: the next positions, from their owner, nothing held
            self.next_position = start + n
            if role == Role.RELAY:
                self.relay_tokens += n
            return Emission(list(token_ids), None, list(logprobs) if logprobs and len(logprobs) == n else [])
        if role == Role.RELAY and owner_until is not None and self.relay_until is None:
            self.relay_until = owner_until
            waiting, self._waiting_md = self._waiting_md, []
            for w_start, w_ids, w_finish, w_logprobs in waiting:
                self._take(Role.MAIN_DECODE, w_start, w_ids, w_finish, w_logprobs)
        self._take(role, start, token_ids, finish_reason, list(logprobs or []))
        return self._flush()

    def _owns_all(self, role: Role, start: int, n: int) -> bool:
        """Whether ``role`` owns every position of [start, start + n): a role's positions are one interval
        (``PipelineSpec.owns``), so its ends decide."""
        own, until = self._spec.owns, self.relay_until
        return own(role, start, until) is True and (n == 1 or own(role, start + n - 1, until) is True)

    def _take(self, role: Role, start: int, token_ids: list[int], finish_reason: str | None,
              logprobs: list[TokenLogprobs]) -> None:
        end = start + len(token_ids)
        decided = self.owns(role, max(start, 1) if role != Role.PREFILL else start)
        if decided is None:
            self._waiting_md.append((start, list(token_ids), finish_reason, logprobs))
            return
        for i, token in enumerate(token_ids):
            pos = start + i
            if self.owns(role, pos) and pos >= self.next_position and pos not in self._pending:
                self._pending[pos] = token
                if logprobs:
                    self._pending_logprobs[pos] = logprobs[i]
                if role == Role.RELAY:
                    self.relay_tokens += 1
            else:
                self.dropped += 1
        if finish_reason is not None and self.finish_at is None:
            last = end - 1
            if last < 0 or self.owns(role, max(last, 0)) or (role == Role.PREFILL and last == 0):
                self.finish_at, self.finish_reason = end, finish_reason

    def _flush(self) -> Emission:
        out: list[int] = []
        logprobs: list[TokenLogprobs] = []
        while self.next_position in self._pending:
            out.append(self._pending.pop(self.next_position))
            lp = self._pending_logprobs.pop(self.next_position, None)
            if lp is not None:
                logprobs.append(lp)
            self.next_position += 1
        finished = self.finish_at is not None and self.next_position >= self.finish_at
        return Emission(out, self.finish_reason if finished else None, logprobs if len(logprobs) == len(out) else [])
