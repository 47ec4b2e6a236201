"""Mooncake trace files: every bad line is an error naming the line and the field; good lines round-trip into
the simulator's columns and into token ids whose shared blocks follow the shared hash ids."""

import json
from pathlib import Path

import numpy as np
import pytest

from pdd.loadgen.trace import (
    MaxTokensRule,
    TraceError,
    hit_tokens,
    prompt_token_ids,
    read_trace,
    trace_arrays,
)

EXCERPT = Path(__file__).resolve().parents[1] / "data" / "mooncake" / "conversation_excerpt.jsonl"
GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]}


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("bad, field, words", [
    ("{not json", "<json>", "malformed JSON"),
    ("[1, 2]", "<json>", "one JSON object"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "output_length"}), "output_length", "missing"),
    (json.dumps({**GOOD, "input_length": -5}), "input_length", ">= 1"),
    (json.dumps({**GOOD, "output_length": 0}), "output_length", ">= 1"),
    (json.dumps({**GOOD, "input_length": "1000"}), "input_length", "integer"),
    (json.dumps({**GOOD, "hash_ids": [1]}), "hash_ids", "do not cover input_length 1000"),
    (json.dumps({**GOOD, "hash_ids": [1, 2, 3]}), "hash_ids", "do not cover"),
    (json.dumps({**GOOD, "hash_ids": [1, "x"]}), "hash_ids", "list of integers"),
    (json.dumps({**GOOD, "timestamp": -1}), "timestamp", ">= 0"),
    (json.dumps({**GOOD, "timestamp": 5}).replace("5", "NaN", 1), "timestamp", "finite"),
    (json.dumps({**GOOD, "max_tokens": 0}), "max_tokens", ">= 1"),
])
def test_bad_line_names_line_and_field(tmp_path, bad, field, words):
    path = _write(tmp_path, [json.dumps({**GOOD, "timestamp": 0}), "", bad])
    with pytest.raises(TraceError) as exc:
        read_trace(path)
    assert exc.value.line == 3 and exc.value.field == field
    assert words in str(exc.value) and f"{path}:3:" in str(exc.value)


def test_timestamps_going_backwards_are_an_error(tmp_path):
    path = _write(tmp_path, [json.dumps({**GOOD, "timestamp": 500}), json.dumps({**GOOD, "timestamp": 100})])
    with pytest.raises(TraceError, match=r":2: field 'timestamp': goes backwards: 100 ms after 500 ms on line 1"):
        read_trace(path)


def test_missing_file_and_empty_trace(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        read_trace(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="no requests"):
        read_trace(_write(tmp_path, [""]))


def test_excerpt_reads_with_optional_fields_and_a_slice(tmp_path):
    reqs = read_trace(EXCERPT)
    assert len(reqs) == 300 and reqs[0].session_id is None and reqs[0].max_tokens is None
    assert [r.line for r in read_trace(EXCERPT, limit=5)] == [1, 2, 3, 4, 5]
    path = _write(tmp_path, [json.dumps({**GOOD, "session_id": 7, "max_tokens": 64})])
    (req,) = read_trace(path)
    assert req.session_id == "7" and req.max_tokens == 64


def test_block_scaling_keeps_the_partial_last_block():
    req = read_trace(EXCERPT, limit=1)[0]  # 6758 tokens in 14 blocks: the last holds 102
    assert req.input_tokens() == 6758
    assert req.input_tokens(32) == 13 * 32 + round(102 * 32 / 512)
    assert req.input_tokens(16) == 13 * 16 + max(1, round(102 * 16 / 512))


def test_max_tokens_rules():
    req = read_trace(EXCERPT, limit=1)[0]  # output 500
    assert MaxTokensRule.parse(None).sent(req) is None and MaxTokensRule().output_tokens(req) == 500
    assert MaxTokensRule.parse("output").sent(req) == 500
    cap = MaxTokensRule.parse("64")
    assert cap.sent(req) == 64 and cap.output_tokens(req) == 64 and str(cap) == "64"
    for bad in ("0", "-3", "lots"):
        with pytest.raises(ValueError, match="--max-tokens"):
            MaxTokensRule.parse(bad)


def test_router_sees_the_models_room_unless_max_tokens_is_sent():
    reqs = read_trace(EXCERPT, limit=50)
    none = trace_arrays(reqs, MaxTokensRule(), 131072)
    assert np.array_equal(none.route_max_tokens, 131072 - none.prompt)
    assert np.array_equal(none.output, [r.output_length for r in reqs])
    sent = trace_arrays(reqs, MaxTokensRule.parse("output"), 131072)
    assert np.array_equal(sent.route_max_tokens, sent.output)


def test_too_long_prompts_are_skipped_and_counted():
    reqs = read_trace(EXCERPT, limit=50)
    limit = 8000
    arrays = trace_arrays(reqs, MaxTokensRule(), limit)
    too_long = sum(r.input_length >= limit for r in reqs)
    assert too_long > 0 and arrays.skipped_too_long == too_long and len(arrays) == 50 - too_long
    assert arrays.prompt.max() < limit


def test_equal_hash_ids_give_identical_token_blocks():
    reqs = read_trace(EXCERPT, limit=3)  # all three start with hash id 0, then differ
    pool = list(range(1000, 1400))
    a, b = (prompt_token_ids(r, 24, pool) for r in reqs[:2])
    assert len(a) == reqs[0].input_tokens(24) and set(a) <= set(pool)
    assert a[:24] == b[:24] and a[24:48] != b[24:48]


def test_unbounded_hits_follow_the_shared_prefixes():
    reqs = read_trace(EXCERPT, limit=3)
    arrays = trace_arrays(reqs, MaxTokensRule(), 131072)
    assert hit_tokens(arrays.chains, arrays.prompt, 512).tolist() == [0, 512, 512]
