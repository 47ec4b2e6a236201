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
from pdd.shared.roles import Role


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


# The token chunk's fast builder (the router decodes one per token per stream) against the strict builder: the
# same message for what both accept, the same ProtocolError (code and message) for everything else.

def _tokens_body() -> dict:
    return protocol._to_wire(TokenChunk(request_id="r-1", instance_id="md-0", role="main-decode", start=3,
                                        token_ids=[7]))


def _strict(envelope: object) -> object:
    saved = dict(protocol._FAST_BUILDERS)
    protocol._FAST_BUILDERS.clear()
    try:
        return _outcome(envelope)
    finally:
        protocol._FAST_BUILDERS.update(saved)


def _outcome(envelope: object) -> object:
    """The decoded message with its fields' exact types, or the refusal's code and message."""
    try:
        msg = protocol.decode_envelope(envelope)
    except ProtocolError as exc:
        return ("refused", exc.code, exc.message)
    return ("built", msg, [(f.name, type(getattr(msg, f.name))) for f in dataclasses.fields(msg)])


def _assert_same(body: object) -> None:
    envelope = {"v": 1, "t": "tokens", "d": body}
    assert _outcome(envelope) == _strict(envelope)


_ODD_VALUES = [None, True, False, 0, 1, -1, 2**63 - 1, 1.5, float("nan"), "", "x", "md-0", "a.b", "a b", "a*",
               "x" * 129,
               "main-decode", "relay", "prefill", "router", "stop", b"md-0", [], [1], [1, 2], [True], [1, "2"], [1.0],
               (1,), {}, {"a": 1}, {1: 2}, [{"logprob": -0.5}], [{"logprob": -0.5, "top_ids": [1], "top_logprobs": []}],
               [{"logprob": "x"}]]


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(TokenChunk)])
@pytest.mark.parametrize("value", _ODD_VALUES, ids=repr)
def test_fast_token_chunk_decode_matches_the_strict_one_field_by_field(name: str, value: object) -> None:
    body = _tokens_body()
    body[name] = value
    _assert_same(body)
    del body[name]
    _assert_same(body)


@pytest.mark.parametrize("body", [None, [], "tokens", 3, {**_tokens_body(), "evil": 1}, {**_tokens_body(), 1: 1},
                                  {"request_id": "r"}, {}])
def test_fast_token_chunk_decode_matches_the_strict_one_on_malformed_bodies(body: object) -> None:
    _assert_same(body)


_WIRE_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=4),
    st.sampled_from(["md-0", "a.b", "main-decode", "relay", "stop", "length"]), st.binary(max_size=2),
    st.lists(st.one_of(st.integers(-5, 5), st.booleans(), st.text(max_size=1)), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=2),
    st.lists(st.fixed_dictionaries({"logprob": st.floats(-5, 0)}), max_size=2))


@settings(max_examples=1500, deadline=None)
@given(changes=st.dictionaries(st.sampled_from([f.name for f in dataclasses.fields(TokenChunk)] + ["extra"]),
                               _WIRE_VALUES, max_size=4),
       dropped=st.sets(st.sampled_from([f.name for f in dataclasses.fields(TokenChunk)]), max_size=2))
def test_fast_token_chunk_decode_matches_the_strict_one_on_random_bodies(changes: dict, dropped: set) -> None:
    body = {**_tokens_body(), **changes}
    for name in dropped:
        body.pop(name, None)
    _assert_same(body)
    # and as it comes off the wire: the same bytes through decode()
    data = msgpack.packb({"v": 1, "t": "tokens", "d": body}, use_bin_type=True)
    fast = _outcome_bytes(data)
    saved = dict(protocol._FAST_BUILDERS)
    protocol._FAST_BUILDERS.clear()
    try:
        assert fast == _outcome_bytes(data)
    finally:
        protocol._FAST_BUILDERS.update(saved)


def _outcome_bytes(data: bytes) -> object:
    try:
        msg = decode(data)
    except ProtocolError as exc:
        return ("refused", exc.code, exc.message)
    return ("built", msg, [(f.name, type(getattr(msg, f.name))) for f in dataclasses.fields(msg)])


@pytest.mark.parametrize("chunk", [
    TokenChunk(request_id="r", instance_id="md-0", role=Role.MAIN_DECODE, start=0, token_ids=[1]),
    TokenChunk(request_id="r", instance_id="rld-0", role=Role.RELAY, start=5, token_ids=[1, 2, 3], finish_reason="stop",
               owner_until=9, meta={"handoff": "one-shot", "wan_bytes": 10}),
])
def test_what_senders_write_takes_the_fast_path(chunk: TokenChunk) -> None:
    """The fast builder must take every chunk ``encode`` writes without logprobs, or the router pays the strict one."""
    built = protocol._FAST_BUILDERS[TokenChunk](msgpack.unpackb(encode(chunk))["d"])
    assert built == chunk and built.role is chunk.role


def test_a_batch_refuses_a_bad_item_type_by_position() -> None:
    items = [protocol._envelope(protocol.Cancel("r")), 5]
    with pytest.raises(ProtocolError) as err:
        decode(msgpack.packb({"v": 1, "t": "batch", "d": {"items": items}}))
    assert err.value.code == "bad_field" and "batch.items[1]: expected a map" in err.value.message
