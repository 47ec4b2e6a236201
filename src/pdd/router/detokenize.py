"""Incremental detokenization with stop strings, as the HTTP layer streams it.

Two things make streaming text harder than ``decode(all_ids)``:

* A character can span several byte-level tokens ("中" is three). ``tokenizers``' ``DecodeStream``
  buffers such tokens and releases the character once it is whole, at constant cost per token.
* A stop string may arrive split over tokens. Text that could still become a stop string (a suffix
  of the text equal to a prefix of some stop string) is held back until it is ruled out or completed;
  the output ends right before the stop string (OpenAI semantics) or right after it with
  ``include_stop_str_in_output`` (vLLM). As in vLLM, stop strings count only once ``min_tokens`` outputs exist.

For a byte-level BPE (GPT-2's scheme: SmolLM2, Llama 3, Qwen) the decoder maps each token to bytes and the text
is their UTF-8, so ``_ByteLevelStream`` releases exactly what ``DecodeStream`` would from a table of each token's
bytes (built once per tokenizer, and used only if it decodes every token as the tokenizer does), without
re-decoding a window of ids per token.

The stream is seeded with a few prompt tokens, so tokenizers that strip a leading space on the first
token (SentencePiece) still produce it. Like vLLM, the seed is the shortest prompt suffix (4 to 23
tokens) that decodes without U+FFFD: a seed ending inside a character would otherwise leak that
character's prompt bytes into the output. The streamed text equals
``decode(seed + output)[len(decode(seed)):]``; tokens that never complete a character (a model
emitting stray bytes) are settled at the end by that one full decode.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers.decoders import ByteLevel, DecodeStream

from pdd.shared.telemetry import get_logger

log = get_logger("pdd.router.api")
_REPLACEMENT = "\ufffd"
_SEED_MIN, _SEED_MAX = 4, 24  # prompt suffix lengths tried for the seed (vLLM's)


@dataclass
class DetokStep:
    """What one token added: ``text`` is safe to send now; ``stopped`` means a stop string matched."""

    text: str
    stopped: bool = False


def _seed(tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool) -> list[int]:
    """The shortest prompt suffix that decodes to whole characters, or none."""
    if len(prompt_ids) < _SEED_MIN:
        ids = list(prompt_ids)
        return ids if _REPLACEMENT not in _decode(tokenizer, ids, skip_special_tokens) else []
    for n in range(_SEED_MIN, min(len(prompt_ids) + 1, _SEED_MAX)):
        ids = list(prompt_ids[-n:])
        if _REPLACEMENT not in _decode(tokenizer, ids, skip_special_tokens):
            return ids
    return []


def _gpt2_byte_of_char() -> dict[str, int]:
    """The byte each character of a byte-level token stands for (GPT-2's ``bytes_to_unicode``, inverted)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_OF_CHAR = _gpt2_byte_of_char()
_TABLES: dict[tuple[int, bool], tuple[Any, list[bytes] | None]] = {}  # (id(backend), skip) -> (backend, table)
_TABLES_LOCK = threading.Lock()


def _byte_table(backend: Any, skip_special_tokens: bool) -> list[bytes] | None:
    """Each token id's bytes under a ByteLevel decoder (special tokens empty when skipped), or None when the
    tokenizer does not decode that way: the table must give every token's text exactly as ``decode`` does."""
    if type(backend.decoder) is not ByteLevel:
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special} if skip_special_tokens else set()
    table: list[bytes] = []
    for i in range(size):
        token = backend.id_to_token(i)
        if token is None or i in special:
            table.append(b"")
        elif all(c in _BYTE_OF_CHAR for c in token):
            table.append(bytes(_BYTE_OF_CHAR[c] for c in token))
        else:  # a token outside the byte alphabet (an added token's content) is its own UTF-8
            table.append(token.encode())
    texts = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=skip_special_tokens)
    if any(b.decode("utf-8", "replace") != t for b, t in zip(table, texts)):
        log.warning("detokenizer_byte_table_unused", reason="a token decodes differently")
        return None
    return table


def prepare(tokenizer: Any) -> None:
    """Build the byte tables of ``tokenizer`` now (~0.2 s for a 49K vocabulary; the router does it at start, off
    the event loop) rather than in the first request."""
    for skip in (True, False):
        byte_table(tokenizer.backend_tokenizer, skip)


def byte_table(backend: Any, skip_special_tokens: bool) -> list[bytes] | None:
    """The cached byte table of a tokenizer (see ``_byte_table``)."""
    key = (id(backend), skip_special_tokens)
    found = _TABLES.get(key)
    if found is None or found[0] is not backend:
        with _TABLES_LOCK:
            found = _TABLES.get(key)
            if found is None or found[0] is not backend:
                found = _TABLES[key] = (backend, _byte_table(backend, skip_special_tokens))
    return found[1]


class _ByteLevelStream:
    """``DecodeStream``'s release rule for a byte-level tokenizer: text goes out once the bytes since the last
    release decode to something that does not end in U+FFFD (a character still incomplete)."""

    def __init__(self, table: list[bytes]):
        self._table = table
        self._pending = b""

    def step(self, _backend: Any, token_id: int) -> str | None:
        table = self._table
        buf = self._pending + (table[token_id] if 0 <= token_id < len(table) else b"")  # unknown ids decode to nothing
        text = buf.decode("utf-8", "replace")
        if text and text[-1] != _REPLACEMENT:
            self._pending = b""
            return text
        self._pending = buf
        return None


def _decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


_NOTHING = DetokStep("")  # a token that completed no character yet (shared: DetokStep is never changed)


class IncrementalDetokenizer:
    """Turns output token ids into text deltas that are whole UTF-8 characters and stop-string free.

    ``tokenizer`` is a transformers fast tokenizer (``backend_tokenizer`` is the ``tokenizers`` one).
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop: bool = False, skip_special_tokens: bool = True, stop_token_ids: Sequence[int] = (),
                 min_tokens: int = 0):
        self._tok = tokenizer
        self._min_tokens = min_tokens  # stop strings count only from this many output tokens on (vLLM)
        self._backend = tokenizer.backend_tokenizer
        self._skip = skip_special_tokens
        self._seed_ids = _seed(tokenizer, prompt_ids, skip_special_tokens)
        table = byte_table(self._backend, skip_special_tokens)
        self._stream: Any = _ByteLevelStream(table) if table is not None else DecodeStream(
            ids=self._seed_ids, skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []  # output ids fed so far
        self._pending = 0  # trailing ids that have not produced text yet
        self._stops = [s for s in stop if s]
        self._include_stop = include_stop
        eos = getattr(tokenizer, "eos_token_id", None)
        self._stop_ids = set(stop_token_ids) | ({eos} if isinstance(eos, int) else set())
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._text = ""  # decoded output so far (only whole characters), with stop strings
        self._sent = 0  # how much of _text has been released
        self._pieces: list[str] = []  # without stop strings: every piece, released as it comes (nothing is held)
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._text[: self._sent] if self._stops else "".join(self._pieces)

    def add(self, token_id: int) -> DetokStep:
        """Feed one output token; returns the text that may be sent now."""
        if self.stopped:
            return DetokStep("", True)
        self._ids.append(token_id)
        piece = self._stream.step(self._backend, token_id)
        if not self._stops:  # nothing to hold back: a piece goes out as it is decoded
            if piece is None:
                self._pending += 1
                return _NOTHING
            self._pending = 0
            self._pieces.append(piece)
            return DetokStep(piece)
        if piece is None:
            self._pending += 1
        else:
            self._pending = 0
            self._text += piece
        return self._release(final=False)

    def add_last(self, token_id: int) -> DetokStep:
        """Feed the token that ended generation with finish_reason "stop": when it is a stop token (EOS,
        one of ``stop_token_ids``) its text is output only with ``include_stop_str_in_output``, as in vLLM."""
        if token_id in self._stop_ids and not self._include_stop:
            return DetokStep("", self.stopped)
        return self.add(token_id)

    def finish(self) -> str:
        """Generation ended without a stop string: release everything that was held back."""
        if self.stopped:
            return ""
        if not self._stops:
            text = "".join(self._pieces)
            rest = ""
            if self._pending:  # bytes that never became a character: decode() renders them as U+FFFD
                full = self._full_decode()
                if full.startswith(text):
                    rest = full[len(text):]
                    self._pieces.append(rest)
                self._pending = 0
            return rest
        if self._pending:
            full = self._full_decode()
            if full.startswith(self._text):
                self._text = full
            self._pending = 0
        return self._release(final=True).text

    def _full_decode(self) -> str:
        """The output as one full decode renders it (the seed's text cut off)."""
        seed = _decode(self._tok, self._seed_ids, self._skip)
        return _decode(self._tok, self._seed_ids + self._ids, self._skip)[len(seed):]

    def _release(self, final: bool) -> DetokStep:
        if self._stops and len(self._ids) >= self._min_tokens:
            # A stop string cannot start before _sent (held-back prefixes guarantee it), and may
            # end inside text decoded just now; search from the first character it could start at.
            hit, end = -1, -1
            for s in self._stops:
                i = self._text.find(s, self._sent)
                if i != -1 and (hit == -1 or i < hit):
                    hit, end = i, i + len(s)
            if hit != -1:
                cut = end if self._include_stop else hit
                out = self._text[self._sent : cut]
                self._sent = cut
                self._text = self._text[:cut]
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
