"""The byte-level detokenizer stream (router/detokenize.py ``_ByteLevelStream``) releases exactly what
``tokenizers``' DecodeStream releases, token by token: for ordinary text, characters split over several byte
tokens, stray bytes that never make a character, special tokens (kept or skipped), and ids outside the
vocabulary; a tokenizer whose decoder is not byte-level keeps DecodeStream. With the tiny model's real tokenizer
and, when present, SmolLM2's."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models
from tokenizers.decoders import DecodeStream

from pdd.router import detokenize
from pdd.router.detokenize import IncrementalDetokenizer, _ByteLevelStream

TEXT = "Hello world! naïve café, 中文 测试, emoji 😀🚀 and ∑ math. "


def _tokenizers(tiny_model: str) -> list:
    from pdd.shared.model_files import resolve_model_path
    from pdd.shared.tokenizer import load_tokenizer

    found = [load_tokenizer(tiny_model)]
    with contextlib.suppress(Exception):  # SmolLM2's files are optional here
        found.append(load_tokenizer(resolve_model_path("default")))
    return found


@pytest.fixture(scope="module")
def tokenizers(tiny_model) -> list:
    return _tokenizers(tiny_model)


def _ids(tok) -> st.SearchStrategy[list[int]]:
    text_ids = tok.encode(TEXT, add_special_tokens=False)
    size = len(tok)
    special = list(tok.all_special_ids)
    one = st.one_of(st.sampled_from(text_ids), st.integers(0, size - 1), st.sampled_from(special or [0]),
                    st.integers(size, size + 5))
    return st.lists(one, min_size=1, max_size=40)


def _both(tok, ids: list[int], skip: bool) -> tuple[list, list]:
    backend = tok.backend_tokenizer
    table = detokenize.byte_table(backend, skip)
    assert table is not None
    ours, theirs = _ByteLevelStream(table), DecodeStream(ids=[], skip_special_tokens=skip)
    mine, ref = [], []
    for i in ids:
        mine.append(ours.step(backend, i))
        try:
            ref.append(theirs.step(backend, i))
        except Exception:  # noqa: BLE001 - DecodeStream refuses some sequences; stop comparing there
            break
    return mine[:len(ref)], ref


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_byte_stream_releases_what_decode_stream_releases(tokenizers, data, skip) -> None:
    for tok in tokenizers:
        ids = data.draw(_ids(tok))
        mine, ref = _both(tok, ids, skip)
        assert mine == ref, (ids, skip)


def test_text_split_over_byte_tokens_streams_as_the_full_decode(tokenizers) -> None:
    for tok in tokenizers:
        ids = tok.encode(TEXT * 3, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, tok.encode("Say it: ", add_special_tokens=False))
        assert isinstance(detok._stream, _ByteLevelStream)
        out = "".join(detok.add(i).text for i in ids) + detok.finish()
        assert out == tok.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_is_not_byte_level_keeps_decode_stream() -> None:
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    assert detokenize.byte_table(tok, True) is None
