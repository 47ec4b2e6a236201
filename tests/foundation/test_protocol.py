import dataclasses
import enum

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.shared import protocol
from pdd.shared.protocol import (
    Announce, HandoffTokens, ProtocolError, SamplingSpec, SubmitRequest, TokenChunk, decode, encode,
)


def sample_submit() -> SubmitRequest:
    return SubmitRequest(
        request_id="r1", prompt_ids=[1, 2, 3], sampling=SamplingSpec(max_tokens=8, temperature=0.7, seed=3),
        pipeline="P-RLD-MD", events_subject="pdd.router.r.events", deadline_unix=123.5, rld_instance="rld-0",
    )


def test_every_message_type_round_trips():
    samples = {
        "submit": sample_submit(),
        "tokens": TokenChunk(request_id="r", instance_id="md-0", role="main-decode", start=4, token_ids=[9, 8],
                             finish_reason="length"),
        "handoff_tokens": HandoffTokens(request_id="r", rld_instance="rld-0", start=1, token_ids=[5], mode="catch-up",
                                        final=False),
        "announce": Announce(instance_id="p-0", role="prefill", site="site-a", state="ready", load=0.5,
                             running_requests=2, free_kv_blocks=10, total_kv_blocks=20, heartbeat_ms=500,
                             cache_summary={"hit_rate": 0.9}),
        "batch": protocol.Batch(items=[protocol._envelope(protocol.Cancel("r", reason="x"))]),
    }
    for cls in protocol.message_types().values():
        if cls.TYPE in samples:
            continue
        # build a minimal instance from field types
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name == "TYPE" or f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            hint = protocol._hints(cls)[f.name]
            if isinstance(hint, type) and issubclass(hint, enum.Enum):
                kwargs[f.name] = list(hint)[-1]
                continue
            kwargs[f.name] = {int: 1, float: 1.5, str: "x", bool: True, dict: {"a": 1},
                              list[int]: [1, 2], SamplingSpec: SamplingSpec(max_tokens=4)}.get(hint, "x")
        samples[cls.TYPE] = cls(**kwargs)
    for msg in samples.values():
        assert decode(encode(msg)) == msg


@pytest.mark.parametrize("field, value", [("pipeline", "P-XYZ"), ("pipeline", 3), ("handoff_mode", "sideways")])
def test_enum_fields_reject_unknown_values_by_name(field: str, value: object) -> None:
    body = protocol._to_wire(sample_submit())
    body[field] = value
    with pytest.raises(ProtocolError) as err:
        decode(msgpack.packb({"v": 1, "t": "submit", "d": body}))
    choices = "'P-MD'" if field == "pipeline" else "'one-shot'"
    assert err.value.code == "bad_field"
    assert f"submit.{field}" in err.value.message and choices in err.value.message

@pytest.mark.parametrize(
    "data, code",
    [
        (b"\xc1garbage", "bad_frame"),
        (encode(sample_submit())[:-3], "bad_frame"),
        (msgpack.packb({"v": 99, "t": "submit", "d": {}}), "wrong_version"),
        (msgpack.packb({"v": 1, "t": "nope", "d": {}}), "unknown_type"),
        (msgpack.packb({"v": 1, "t": "cancel", "d": {}}), "missing_field"),
        (msgpack.packb({"v": 1, "t": "cancel", "d": {"request_id": 5}}), "bad_field"),
        (msgpack.packb({"v": 1, "t": "cancel", "d": {"request_id": "a", "evil": 1}}), "unknown_field"),
        (msgpack.packb([1, 2, 3]), "bad_frame"),
        (msgpack.packb({"v": 1, "t": "tokens", "d": {"request_id": "a", "instance_id": "b", "role": "x", "start": 0,
                                                     "token_ids": [1, "2"]}}), "bad_field"),
    ],
)
def test_bad_messages_raise_typed_errors(data, code):
    with pytest.raises(ProtocolError) as info:
        decode(data)
    assert info.value.code == code


def test_oversize_is_rejected_before_parsing():
    msg = TokenChunk(request_id="r", instance_id="i", role="main-decode", start=0, token_ids=list(range(1000)))
    with pytest.raises(ProtocolError) as info:
        decode(encode(msg), max_bytes=100)
    assert info.value.code == "oversize"


def test_expected_type_is_enforced():
    with pytest.raises(ProtocolError) as info:
        decode(encode(sample_submit()), expect=TokenChunk)
    assert info.value.code == "unexpected_type"


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_only_ever_raise_protocol_error(data):
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["request_id", "start", "token_ids", "role", "instance_id", "x"]),
                       st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=5), st.lists(st.integers(0, 2**32), max_size=3), st.none())))
def test_random_fields_only_ever_raise_protocol_error(fields):
    data = msgpack.packb({"v": 1, "t": "tokens", "d": fields})
    try:
        msg = decode(data)
    except ProtocolError:
        return
    assert isinstance(msg, TokenChunk) and isinstance(msg.start, int)
