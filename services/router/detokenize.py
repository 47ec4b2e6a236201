"""Incremental detokenization with stop strings, as the HTTP layer streams it.

Two things make streaming text harder than ``decode(all_ids)``:

* A character can span several byte-level tokens ("中" is three). Decoding a partial sequence yields
  U+FFFD, so text is held back while the decoded tail ends in U+FFFD and released once it is whole.
* A stop string may arrive split over tokens. Text that could still become a stop string (a suffix
  of the text equal to a prefix of some stop string) is held back until it is ruled out or completed;
  the output ends right before the stop string (OpenAI semantics), which is then never emitted.

Decoding uses the prefix/read offsets of Hugging Face TGI / vLLM, so each step decodes only a few
tokens (the cost stays linear in the output length), and a few prompt tokens seed the window so
tokenizers that strip a leading space on the first token (SentencePiece) still produce it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens that seed the decode window


@dataclass
class DetokStep:
    """What one token added: ``text`` is safe to send now; ``stopped`` means a stop string matched."""

    text: str
    stopped: bool = False


class IncrementalDetokenizer:
    """Turns output token ids into text deltas that are whole UTF-8 characters and stop-string free."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops = [s for s in stop if s]
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._text = ""  # decoded output so far (only whole characters)
        self._sent = 0  # how much of _text has been released
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._text[: self._sent]

    def add(self, token_id: int) -> DetokStep:
        """Feed one output token; returns the text that may be sent now."""
        if self.stopped:
            return DetokStep("", True)
        self._ids.append(token_id)
        self._text += self._decode_delta(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """Generation ended without a stop string: release everything that was held back."""
        if self.stopped:
            return ""
        self._text += self._decode_delta(final=True)
        return self._release(final=True).text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _decode_delta(self, final: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith(_REPLACEMENT)):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""

    def _release(self, final: bool) -> DetokStep:
        if self._stops:
            # A stop string cannot start before _sent (held-back prefixes guarantee it), and may
            # end inside text decoded just now; search from the first byte it could start at.
            hit = -1
            for s in self._stops:
                i = self._text.find(s, self._sent)
                if i != -1 and (hit == -1 or i < hit):
                    hit = i
            if hit != -1:
                out = self._text[self._sent : hit]
                self._sent = hit
                self._text = self._text[:hit]
                self.stopped = True
                return DetokStep(out, True)
        end = len(self._text) if final else len(self._text) - self._held_back()
        out = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return DetokStep(out)

    def _held_back(self) -> int:
        """Length of the longest unsent suffix that is a proper prefix of some stop string."""
        pending = len(self._text) - self._sent
        for k in range(min(self._max_stop - 1, pending), 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
