"""Fuzz the bus: the strict message decoder, and every NATS subject the live services listen on.

Unit level: hypothesis over ``protocol.decode`` with random bytes, random msgpack structures and
mutated encodings of every message type (field types, huge ints, NaN/inf, unknown/missing fields,
swapped types and versions, bit flips, truncations): only ``ProtocolError`` may escape, and whatever
decodes re-encodes to the same bytes.

Live level: the same kinds of payloads, plus well-formed messages with hostile values (unknown and
overlong request/instance ids, odd subjects, extreme numbers), published with nats-py onto every
subject of a live system (announce, cancel, cache events, the router's events, and each instance verb
the services subscribe to), some as requests with a reply subject. Checked: every reply and every
message a service emits decodes; no handler raised; afterwards every process is alive and on the bus,
no engine holds KV once idle, and a normal request works on each pipeline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import msgpack
import nats
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdd.shared import protocol
from pdd.shared.bus import flush_barrier
from pdd.shared.links import KVLink
from pdd.shared.protocol import (
    WAN_EGRESS_KEY,
    WAN_QUEUED_KEY,
    WAN_RATE_KEY,
    Announce,
    Cancel,
    Message,
    Ping,
    PrepareImport,
    ProtocolError,
    SamplingSpec,
    Subjects,
)
from pdd.shared.roles import Role

from .common import Tally, collect, examples, fuzz_settings
from .conftest import ENGINES, ROUTER, assert_system_healthy, log_events, wait_router_view

VOCAB = 384
REAL_IDS = (ROUTER, *ENGINES)
FAKE_IDS = ("fz-p", "fz-rld", "fz-md", "fz-router")
RIDS = tuple(f"fz-r{i}" for i in range(8))
EVENTS = "fuzz.events"  # where messages built by the fuzzer ask services to send their results
REPLY_PREFIX = "fuzz.reply"
TYPES = protocol.message_types()

# Who listens where, and what each subject accepts (services/*.py, shared/service.py, router/).
LISTENERS: dict[str, tuple[str, ...]] = {
    Subjects.ANNOUNCE: ("announce",),
    Subjects.CANCEL: ("cancel",),
    Subjects.router_events(ROUTER): ("prefill_result", "tokens", "error"),
    **{Subjects.cache_events(i): ("cache_events",) for i in (*ENGINES, "fz-p")},
    **{Subjects.instance(i, "ping"): ("ping",) for i in REAL_IDS},
    **{Subjects.instance(i, "cache_query"): ("cache_query",) for i in ENGINES},
    Subjects.instance("p-0", "submit"): ("submit",),
    **{Subjects.instance(i, verb): (t,) for i in ("rld-0", "md-0")
       for verb, t in (("prepare_import", "prepare_import"), ("kv_ready", "kv_ready"))},
    Subjects.instance("rld-0", "handoff_ready"): ("handoff_ready",),
    Subjects.instance("rld-0", "handoff_ack"): ("handoff_ack",),
    Subjects.instance("md-0", "handoff_tokens"): ("handoff_tokens",),
}
# Subjects weighted toward the request path (submit, import, handoff), where most state lives.
SUBJECTS = tuple(LISTENERS) + (Subjects.instance("p-0", "submit"),) * 5 + tuple(
    Subjects.instance(i, v) for i in ("rld-0", "md-0") for v in ("prepare_import", "kv_ready")) + (
    Subjects.instance("md-0", "handoff_tokens"), Subjects.instance("rld-0", "handoff_ready"), Subjects.CANCEL)


# ---- values ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rel:
    """A deadline relative to the moment the message is sent (inputs are drawn before sending)."""

    seconds: float


LONG = st.sampled_from(["x" * 300, "a." * 2500, "y" * 5000, "é" * 3000])
ODD_TEXT = st.one_of(st.text(max_size=20), LONG, st.sampled_from(
    ["", " ", "a b", "a\tb", "a\r\nb", "pdd.>", "*", ">", "a..b", ".", "a.", "\x00", "\u202e", "fz-r0 "]))


def token_run(n_min: int, n_max: int) -> st.SearchStrategy:
    """Token id lists built from two draws (hypothesis draws are the cost of generation)."""
    return st.builds(lambda n, k: [(k + 7 * i) % VOCAB for i in range(n)], st.integers(n_min, n_max),
                     st.integers(0, VOCAB - 1))


TOKEN_IDS = st.one_of(token_run(1, 24), token_run(1, 24), token_run(1, 24), st.just([]),
                      st.lists(st.integers(-(2**63), 2**64 - 1), min_size=1, max_size=3), token_run(900, 1100))
INTS = st.one_of(st.integers(0, 12), st.integers(0, 12), st.integers(-(2**63), 2**64 - 1),
                 st.sampled_from([-1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1]))
FLOATS = st.one_of(st.floats(0, 1), st.floats(), st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0]))
MSGPACK_KEYS = st.one_of(st.text(max_size=8), st.integers(-(2**63), 2**64 - 1), st.binary(max_size=4))
MSGPACK_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                            st.text(max_size=20), st.binary(max_size=20),
                            st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)))
MSGPACK = st.recursive(MSGPACK_SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(MSGPACK_KEYS, c,
                                                                                              max_size=4),
                       max_leaves=5)
SAMPLING = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 6)},
    optional={"temperature": st.sampled_from([0.0, 0.7]), "top_p": st.sampled_from([1.0, 0.9]),
              "top_k": st.sampled_from([0, 5]), "seed": st.integers(0, 2**63 - 1),
              "stop_token_ids": st.sampled_from([[], [2]]), "ignore_eos": st.booleans()})
HOSTILE_SAMPLING = st.fixed_dictionaries(
    {"max_tokens": st.one_of(st.integers(1, 6), INTS)},
    optional={"temperature": FLOATS, "top_p": FLOATS, "top_k": INTS, "seed": INTS, "stop_token_ids": TOKEN_IDS,
              "ignore_eos": st.booleans()})
ANY_DICT = st.dictionaries(st.text(max_size=6), MSGPACK, max_size=3)
# Request ids: mostly fresh (receivers remember cancelled ids for a while), sometimes shared, so that
# fuzzed handoff/kv_ready/cancel messages meet requests the fuzzer's own submits put in flight.
RID = st.one_of(st.integers(0, 10**9).map(lambda i: f"fz-{i}"), st.sampled_from(RIDS))

# Plausible values by field name: what a correct sender would send (so messages reach deep into handlers).
PLAUSIBLE: dict[str, st.SearchStrategy] = {
    "request_id": RID, "instance_id": st.sampled_from(REAL_IDS + FAKE_IDS),
    "rld_instance": st.sampled_from(["rld-0", "rld-0", "fz-rld"]), "md_instance": st.sampled_from(["md-0", "md-0",
                                                                                                    "fz-md"]),
    "role": st.sampled_from(list(Role)),
    "pipeline": st.sampled_from(["P-MD", "P-RLD-MD", "P-RLD"]),
    "events_subject": st.sampled_from([EVENTS, EVENTS, EVENTS, Subjects.router_events(ROUTER)]),
    "deadline_unix": st.floats(1, 4).map(Rel), "prompt_ids": token_run(1, 40), "output_ids": st.just([]),
    "token_ids": token_run(1, 6), "first_token": st.integers(0, VOCAB - 1), "sampling": SAMPLING,
    "handoff_mode": st.sampled_from([None, "one-shot", "catch-up"]), "mode": st.sampled_from(["one-shot", "catch-up"]),
    "finish_reason": st.sampled_from([None, None, "stop", "length"]),
    "state": st.sampled_from(["ready", "draining", "stopped"]), "heartbeat_ms": st.just(500),
    "site": st.sampled_from(["site-a", "site-b"]), "load": st.floats(0, 1), "seconds": st.floats(0, 1),
    "sent_unix": st.floats(0, 2e9),
    "cache_summary": st.sampled_from([{}, {"block_size": 16, "kv_bytes_per_token": 256, WAN_RATE_KEY: 1e6},
                                      {WAN_QUEUED_KEY: 1e9, WAN_EGRESS_KEY: 1e8}]),
    "endpoints": st.just({}), "meta": st.sampled_from([{}, {"rld_tokens": 1}]), "source_descriptor": st.just({}),
    "descriptor": st.just({}), "stored": st.lists(st.integers(0, 2**63), max_size=3),
    "removed": st.lists(st.integers(0, 2**63), max_size=3), "dst_blocks": st.lists(st.integers(0, 1023), max_size=3),
    "payload": st.text(max_size=10), "code": st.sampled_from(["internal_x", "invalid_request", "draining"]),
    "message": st.text(max_size=20), "trace_id": st.none(), "owner_until": st.one_of(st.none(), st.integers(0, 8)),
    "start": st.integers(0, 8), "next_position": st.integers(0, 8), "through_position": st.integers(0, 8),
    "cached_tokens": st.integers(0, 64), "prompt_tokens": st.integers(1, 64), "bytes_sent": st.integers(0, 10**6),
    "running_requests": st.integers(0, 4), "free_kv_blocks": st.integers(0, 1024),
    "total_kv_blocks": st.just(1024), "max_context": st.just(1024), "use_cache": st.booleans(),
    "final": st.booleans(), "cleared": st.booleans(), "retryable": st.booleans(), "model": st.just("model"),
}
# Hostile values of the right type: overlong/odd ids and subjects, extreme numbers, out-of-vocabulary
# tokens, deadlines in the past or at infinity, junk maps (decoding must let most of these through).
HOSTILE: dict[str, st.SearchStrategy] = {
    "request_id": ODD_TEXT, "instance_id": ODD_TEXT, "rld_instance": ODD_TEXT, "md_instance": ODD_TEXT,
    "role": ODD_TEXT, "pipeline": ODD_TEXT, "events_subject": ODD_TEXT, "site": ODD_TEXT, "state": ODD_TEXT,
    "mode": ODD_TEXT, "handoff_mode": ODD_TEXT, "finish_reason": ODD_TEXT, "code": ODD_TEXT, "message": LONG,
    "payload": LONG, "trace_id": ODD_TEXT, "model": ODD_TEXT,
    "deadline_unix": st.one_of(st.floats(-100, 0).map(Rel), st.sampled_from(
        [0.0, -1.0, 1e300, float("inf"), float("-inf"), float("nan")])),
    "prompt_ids": TOKEN_IDS, "output_ids": TOKEN_IDS, "token_ids": TOKEN_IDS, "stored": st.lists(INTS, max_size=4),
    "removed": st.lists(INTS, max_size=4), "dst_blocks": st.lists(INTS, max_size=4), "sampling": HOSTILE_SAMPLING,
    "heartbeat_ms": st.sampled_from([0, -1, 1, 2**62]), "cache_summary": st.one_of(st.sampled_from([
        {"block_size": 0}, {"block_size": "x"}, {"kv_bytes_per_token": -1}, {WAN_RATE_KEY: float("nan")},
        {WAN_QUEUED_KEY: "x", WAN_EGRESS_KEY: float("inf")}, {WAN_QUEUED_KEY: -1e300}, {"hit_rate": None}]), ANY_DICT),
    "endpoints": ANY_DICT, "meta": ANY_DICT, "source_descriptor": ANY_DICT, "descriptor": ANY_DICT,
}


def field_value(name: str, hint: Any, hostile: bool) -> st.SearchStrategy:
    if hostile and name in HOSTILE:
        return HOSTILE[name]
    if not hostile and name in PLAUSIBLE:
        return PLAUSIBLE[name]
    return INTS if hint is int else FLOATS if hint is float else st.booleans() if hint is bool else ODD_TEXT


@st.composite
def message_dict(draw, type_name: str, hostile: bool = False) -> dict:
    """A message of this type as its wire map: plausible values, or (``hostile``) 1-3 fields of the right
    type with extreme values."""
    cls = TYPES[type_name]
    hints = protocol._hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "TYPE"]
    bad = set(draw(st.lists(st.sampled_from(names), min_size=1, max_size=3))) if hostile and names else set()
    out = {}
    for f in dataclasses.fields(cls):
        if f.name == "TYPE":
            continue
        optional = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if optional and f.name not in bad and draw(st.booleans()):
            continue
        out[f.name] = draw(field_value(f.name, hints[f.name], f.name in bad))
    return out


@st.composite
def mutate_fields(draw, d: dict) -> dict:
    d = dict(d)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["set", "set", "drop", "add", "nest"]))
        if op == "set" and d:
            d[draw(st.sampled_from(sorted(d, key=repr)))] = draw(MSGPACK)
        elif op == "drop" and d:
            d.pop(draw(st.sampled_from(sorted(d, key=repr))))
        elif op == "add":
            d[draw(MSGPACK_KEYS)] = draw(MSGPACK)
        elif op == "nest" and "sampling" in d and isinstance(d["sampling"], dict):
            d["sampling"] = draw(mutate_fields(d["sampling"]))
    return d


@st.composite
def byte_mutation(draw, data: bytes) -> bytes:
    op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "duplicate"]))
    if not data:
        return draw(st.binary(max_size=8))
    at = draw(st.integers(0, len(data) - 1))
    if op == "flip":
        return data[:at] + bytes([data[at] ^ (1 << draw(st.integers(0, 7)))]) + data[at + 1:]
    if op == "truncate":
        return data[:at]
    if op == "insert":
        return data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
    if op == "delete":
        return data[:at] + data[at + draw(st.integers(1, 8)):]
    return data + data


@dataclass
class BusInput:
    """One payload: ``envelope`` (a map with Rel deadlines, packed at send time) or raw ``data``."""

    kind: str
    envelope: Any = None
    data: bytes | None = None
    subject: str = ""
    reply: bool = False
    headers: dict | None = None

    def payload(self, now: float) -> bytes:
        if self.kind == "oversize":  # built when sent: a megabyte each
            return msgpack.packb({"v": 1, "t": "ping", "d": {"payload": "x" * protocol.MAX_MESSAGE_BYTES}})
        if self.data is not None:
            return self.data
        return msgpack.packb(_resolve(self.envelope, now), use_bin_type=True)


def _resolve(value: Any, now: float) -> Any:
    if isinstance(value, Rel):
        return now + value.seconds
    if isinstance(value, dict):
        return {k: _resolve(v, now) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, now) for v in value]
    return value


@st.composite
def bus_payload(draw, type_name: str | None = None) -> BusInput:
    """Every kind of payload, for one (or a random) message type."""
    type_name = type_name or draw(st.sampled_from(sorted(TYPES)))
    kind = draw(st.sampled_from(["valid"] * 10 + ["hostile"] * 8 + ["fields"] * 5 + ["swap"] * 2 + ["envelope"] * 2
                                + ["bytes"] * 2 + ["msgpack"] * 2 + ["mutate"] * 4 + ["oversize"]))
    d = draw(message_dict(type_name, hostile=kind == "hostile"))
    env: Any = {"v": protocol.SCHEMA_VERSION, "t": type_name, "d": d}
    if kind == "fields":
        env["d"] = draw(mutate_fields(d))
    elif kind == "swap":
        env["t"] = draw(st.sampled_from(sorted(TYPES)))
    elif kind == "envelope":
        env = draw(st.sampled_from([
            {"v": draw(MSGPACK), "t": type_name, "d": d}, {"v": 1, "t": draw(MSGPACK), "d": d},
            {"v": 1, "t": type_name, "d": draw(MSGPACK)}, {"v": 1, "t": type_name}, {**env, "x": 1},
            [1, type_name, d], {"v": 1.0, "t": type_name, "d": d}, {"v": True, "t": type_name, "d": d},
            {b"v": 1, b"t": type_name.encode(), b"d": d}]))
    elif kind == "bytes":
        return BusInput(kind, data=draw(st.binary(max_size=300)))
    elif kind == "msgpack":
        return BusInput(kind, data=msgpack.packb(draw(MSGPACK), use_bin_type=draw(st.booleans())))
    elif kind == "mutate":
        base = msgpack.packb(_resolve(env, time.time() + 2), use_bin_type=True)
        return BusInput(kind, data=draw(byte_mutation(base)))
    elif kind == "oversize":
        return BusInput(kind)
    return BusInput(kind, envelope=env)


HEADERS = st.one_of(st.none(), st.none(), st.sampled_from([
    {"traceparent": "garbage"}, {"traceparent": "00-" + "0" * 32 + "-" + "0" * 16 + "-01"},
    {"traceparent": "ff-" + "a" * 32 + "-" + "b" * 16 + "-zz", "tracestate": "=,=,"}, {"tracestate": "x" * 600},
    {"X-Odd": "\u00e9"}, {"traceparent": ""}]))


@st.composite
def live_input(draw) -> BusInput:
    subject = draw(st.sampled_from(SUBJECTS))
    accepted = LISTENERS[subject]
    type_name = draw(st.sampled_from(accepted)) if draw(st.integers(0, 4)) else None
    inp = draw(bus_payload(type_name))
    inp.subject = subject
    inp.reply = draw(st.integers(0, 3)) == 0
    inp.headers = draw(HEADERS)
    return inp


# ---- unit: the decoder ------------------------------------------------------------------------------

EXPECTS = st.one_of(st.none(), st.sampled_from(sorted(TYPES)).map(lambda t: TYPES[t]),
                    st.lists(st.sampled_from(sorted(TYPES)), min_size=1, max_size=3).map(
                        lambda ts: tuple(TYPES[t] for t in ts)))


def check_decode(data: bytes, expect: Any, tally: Tally) -> None:
    tally.add("inputs")
    try:
        msg = protocol.decode(data, expect=expect)
    except ProtocolError as exc:
        tally.add(f"rejected_{exc.code}")
        return
    tally.add("decoded")
    assert isinstance(msg, Message) and type(msg) in TYPES.values()
    again = protocol.encode(msg)
    assert protocol.encode(protocol.decode(again)) == again  # whatever decodes is a fixed point


def decoder_fuzz(n: int) -> None:
    tally = Tally("bus-decode")
    t0 = time.monotonic()

    @fuzz_settings(n)
    @given(bus_payload(), EXPECTS)
    def run(inp: BusInput, expect: Any) -> None:
        check_decode(inp.payload(time.time()), expect, tally)

    run()
    tally.report(seconds=round(time.monotonic() - t0, 1))
    assert tally.counts["inputs"] >= n


def test_fuzz_decoder() -> None:
    decoder_fuzz(examples(slow=False, fast_default=300))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzz_decoder_10k() -> None:
    decoder_fuzz(examples(slow=True))


# ---- live: every subject of a running system ------------------------------------------------------------

def _scrape(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def handler_errors(cluster) -> dict[str, float]:
    return {m.instance_id: _scrape(m.metrics_url, "pdd:bus_handler_errors_total") for m in cluster.members.values()}


async def publish_all(nats_url: str, inputs: list[BusInput], tally: Tally) -> tuple[set[str], set[str]]:
    """Send every input; validate every reply and every message the services emit for the fuzzer.
    Returns (request ids, fake instance ids) that decodable inputs introduced (for cleanup)."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(repr(exc))

    nc = await nats.connect(nats_url, name="fuzzer", error_cb=on_error, max_reconnect_attempts=0)
    rids: set[str] = set()
    fakes: set[str] = set()

    async def on_reply(msg) -> None:
        tally.add("replies")
        try:
            reply = protocol.decode(msg.data)
        except ProtocolError as exc:
            tally.bad(f"undecodable reply on {msg.subject}: {exc}")
            return
        tally.add(f"reply_{reply.TYPE}")
        if getattr(reply, "code", None) == "internal":
            tally.bad(f"handler failed: {reply}")

    async def on_event(msg) -> None:
        tally.add("emitted")
        try:
            ev = protocol.decode(msg.data)
        except ProtocolError as exc:
            tally.bad(f"a service emitted an undecodable message: {exc}")
            return
        tally.add(f"emitted_{ev.TYPE}")

    await nc.subscribe(REPLY_PREFIX + ".>", cb=on_reply)
    await nc.subscribe(EVENTS, cb=on_event)
    pings = [Subjects.instance(i, "ping") for i in REAL_IDS]
    worst_ping = 0.0
    for i, inp in enumerate(inputs):
        data = inp.payload(time.time())
        try:
            msg = protocol.decode(data)
            if getattr(msg, "request_id", None):
                rids.add(msg.request_id)
            if isinstance(msg, Announce) and msg.instance_id not in REAL_IDS:
                fakes.add(msg.instance_id)
            tally.add(f"sent_decodable_{inp.kind}")
        except ProtocolError:
            tally.add(f"sent_undecodable_{inp.kind}")
        tally.add("inputs")
        await nc.publish(inp.subject, data, reply=f"{REPLY_PREFIX}.{i}" if inp.reply else "", headers=inp.headers)
        if i % 50 == 49 or i == len(inputs) - 1:  # pace: every instance must still answer promptly
            await flush_barrier(nc)
            t0 = time.monotonic()
            for subject in pings:
                try:
                    pong = protocol.decode((await nc.request(subject, Ping("fz").encode(), timeout=30)).data)
                    assert pong.TYPE == "pong"
                except Exception as exc:  # noqa: BLE001 - recorded, the test fails on it
                    tally.bad(f"{subject} did not answer a ping after input {i}: {exc!r}")
            worst_ping = max(worst_ping, time.monotonic() - t0)
    await asyncio.sleep(2)  # late replies and events
    tally.add("worst_ping_ms", int(worst_ping * 1000))
    if errors:
        tally.bad(f"fuzzer's own NATS connection saw errors: {errors[:3]}")
    await nc.close()
    return rids, fakes


async def cleanup(nats_url: str, rids: set[str], fakes: set[str]) -> None:
    """What the real system would do next: routers cancel the requests, fake instances leave."""
    nc = await nats.connect(nats_url, name="fuzzer-cleanup")
    for rid in sorted(rids):
        await nc.publish(Subjects.CANCEL, Cancel(rid, reason="fuzz done").encode())
    for iid in sorted(fakes):
        await nc.publish(Subjects.ANNOUNCE, Announce(
            instance_id=iid, role="prefill", site="site-a", state="stopped", load=0.0, running_requests=0,
            free_kv_blocks=0, total_kv_blocks=0, heartbeat_ms=500).encode())
    await flush_barrier(nc)
    await nc.close()


def bus_fuzz(cluster, n: int) -> None:
    t0 = time.monotonic()
    errors_before = handler_errors(cluster)
    logged_before = log_events(cluster, "prefill_failed", "unhandled_error", "engine_step_failed",
                               "output_callback_failed")
    inputs = collect(live_input(), n)
    t_gen = time.monotonic() - t0
    assert len(inputs) >= n, f"hypothesis drew only {len(inputs)} of {n} inputs"
    tally = Tally("bus-live")
    rids, fakes = asyncio.run(publish_all(cluster.nats.url, inputs, tally))
    t_send = time.monotonic() - t0 - t_gen
    dead = [m.instance_id for m in cluster.members.values() if not m.alive]
    held_before_cancel = cluster.wait_idle(10) if not dead else None
    asyncio.run(cleanup(cluster.nats.url, rids, fakes))
    handler_failures = {k: v - errors_before.get(k, 0) for k, v in handler_errors(cluster).items()
                        if v > errors_before.get(k, 0)} if not dead else None
    logged = {k: v - logged_before.get(k, 0) for k, v in log_events(
        cluster, "prefill_failed", "unhandled_error", "engine_step_failed", "output_callback_failed").items()
              if v > logged_before.get(k, 0)}
    leaked = None
    try:
        assert not dead, f"processes died: {dead}; logs in {cluster.run_dir}"
        wait_router_view(cluster, set(REAL_IDS))
        leaked = assert_system_healthy(cluster)
    finally:
        tally.report(crashes=dead, held_before_cancel=held_before_cancel, leaked_blocks=leaked,
                     handler_failures=handler_failures, errors_logged=logged, request_ids=len(rids),
                     fake_instances=len(fakes), gen_s=round(t_gen, 1), send_s=round(t_send, 1))
    assert tally.counts["inputs"] >= n
    assert not tally.anomalies, f"{len(tally.anomalies)} anomalies, first: {tally.anomalies[:5]}"
    assert not handler_failures, f"bus handlers raised: {handler_failures} (see {cluster.run_dir})"
    assert not logged, f"services logged unexpected errors: {logged} (see {cluster.run_dir})"


def test_fuzz_live_bus(fuzz_cluster) -> None:
    bus_fuzz(fuzz_cluster, examples(slow=False, fast_default=200))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_live_bus_10k(fuzz_cluster) -> None:
    bus_fuzz(fuzz_cluster, examples(slow=True))


# ---- regressions found by this fuzzer ---------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("events_subject", "y" * 5000), ("events_subject", "pdd.>"), ("events_subject", "a b"), ("events_subject", ""),
    ("events_subject", "a..b"), ("rld_instance", "x" * 300), ("md_instance", "md.0"), ("md_instance", "*"),
])
def test_subject_fields_are_checked_when_decoding(field: str, value: str) -> None:
    """A service publishes to subjects named inside messages; an overlong one exceeds nats-server's
    control line, whose -ERR makes nats-py close that service's connection for good (found live:
    prefill vanished from the bus). Such messages are now rejected when decoded."""
    msg = protocol.SubmitRequest(request_id="r", prompt_ids=[1, 2], sampling=SamplingSpec(max_tokens=2),
                                 pipeline="P-RLD-MD", events_subject="pdd.router.router-0.events",
                                 deadline_unix=time.time() + 5, rld_instance="rld-0", md_instance="md-0")
    assert protocol.decode(msg.encode()) == msg
    with pytest.raises(ProtocolError) as err:
        protocol.decode(dataclasses.replace(msg, **{field: value}).encode())
    assert err.value.code == "bad_field"
    announce = Announce(instance_id="x" * 300, role="prefill", site="a", state="ready", load=0.0,
                        running_requests=0, free_kv_blocks=0, total_kv_blocks=0, heartbeat_ms=500)
    with pytest.raises(ProtocolError):
        protocol.decode(announce.encode())


def test_overlong_events_subject_leaves_prefill_on_the_bus(fuzz_cluster) -> None:
    async def main() -> None:
        nc = await nats.connect(fuzz_cluster.nats.url, name="fuzz-regression")
        try:
            submit = protocol.SubmitRequest(
                request_id="fz-long-subject", prompt_ids=[5, 6, 7], sampling=SamplingSpec(max_tokens=2),
                pipeline="P-MD", events_subject="y" * 5000, deadline_unix=time.time() + 5, md_instance="md-0")
            reply = protocol.decode((await nc.request(Subjects.instance("p-0", "submit"), submit.encode(),
                                                      timeout=10)).data)
            assert reply.TYPE == "error" and reply.code == "protocol_error"
            await asyncio.sleep(1.0)
            pong = protocol.decode((await nc.request(Subjects.instance("p-0", "ping"), Ping().encode(),
                                                     timeout=10)).data)
            assert pong.TYPE == "pong"
        finally:
            await nc.close()

    asyncio.run(main())
    assert fuzz_cluster.members["p-0"].health().get("nats_connected") is True


def test_cancel_that_overtakes_prepare_import_reserves_nothing(fuzz_cluster) -> None:
    """A Cancel and its request's prepare_import travel on separate subscriptions, so the Cancel can be
    handled first (found live: blocks stayed reserved at MD until the import lease, up to 120 s).
    The receiver now remembers recent cancellations and refuses such an import."""
    async def main() -> None:
        nc = await nats.connect(fuzz_cluster.nats.url, name="fuzz-regression")
        try:
            for target in ("md-0", "rld-0"):
                rid = f"fz-overtaken-{target}"
                await nc.publish(Subjects.CANCEL, Cancel(rid).encode())
                await flush_barrier(nc)
                await asyncio.sleep(0.5)
                prepare = PrepareImport(request_id=rid, prompt_ids=list(range(40, 80)),
                                        sampling=SamplingSpec(max_tokens=2), events_subject=EVENTS,
                                        deadline_unix=time.time() + 60, pipeline="P-RLD-MD",
                                        use_cache=target == "md-0",
                                        link=KVLink.WAN if target == "md-0" else KVLink.FAST)
                reply = protocol.decode((await nc.request(Subjects.instance(target, "prepare_import"),
                                                          prepare.encode(), timeout=10)).data)
                assert reply.TYPE == "error" and reply.code == "cancelled", reply
        finally:
            await nc.close()

    asyncio.run(main())
    assert fuzz_cluster.leaked_blocks() == {"p-0": 0, "rld-0": 0, "md-0": 0}


def test_prepare_import_over_a_link_the_decoder_lacks_is_refused_and_reserves_nothing(fuzz_cluster) -> None:
    """The relay takes KV only inside its site, and a main decoder in another site than every prefill only over
    the WAN: a PrepareImport naming the other link gets invalid_request, before any block is reserved."""
    async def main() -> None:
        nc = await nats.connect(fuzz_cluster.nats.url, name="fuzz-regression")
        try:
            for target, link in (("rld-0", KVLink.WAN), ("md-0", KVLink.FAST)):
                prepare = PrepareImport(request_id=f"fz-link-{target}", prompt_ids=list(range(40, 120)),
                                        sampling=SamplingSpec(max_tokens=2), events_subject=EVENTS,
                                        deadline_unix=time.time() + 60, pipeline="P-RLD-MD", link=link)
                reply = protocol.decode((await nc.request(Subjects.instance(target, "prepare_import"),
                                                          prepare.encode(), timeout=10)).data)
                assert reply.TYPE == "error" and reply.code == "invalid_request", reply
                assert f"not {link.value}" in reply.message
        finally:
            await nc.close()

    asyncio.run(main())
    assert fuzz_cluster.leaked_blocks() == {"p-0": 0, "rld-0": 0, "md-0": 0}


def test_an_import_its_prefill_no_longer_sends_is_freed_long_before_the_lease(fuzz_cluster) -> None:
    """A Cancel lost while the WAN was cut left an import reserved at MD until the 120 s lease (found by
    `python -m pdd.bench.chaos --scenarios wan_cut_net`: 11 blocks held 30 s after idle). The receiver now asks
    the sending prefill while the KV has not landed; "unknown" frees the blocks. A prefill that does not answer
    (here: none by that name) leaves the reservation in place."""
    from pdd.roles.decoder_service import TRANSFER_CHECK_S

    async def main() -> None:
        nc = await nats.connect(fuzz_cluster.nats.url, name="fuzz-regression")
        try:
            for rid, source in (("fz-orphan", "p-0"), ("fz-silent-source", "p-nowhere")):
                prepare = PrepareImport(request_id=rid, prompt_ids=list(range(40, 120)),
                                        sampling=SamplingSpec(max_tokens=2), events_subject=EVENTS,
                                        deadline_unix=time.time() + 300, pipeline="P-MD", source_instance=source)
                reply = protocol.decode((await nc.request(Subjects.instance("md-0", "prepare_import"),
                                                          prepare.encode(), timeout=10)).data)
                assert reply.TYPE == "import_plan", reply
            assert fuzz_cluster.leaked_blocks()["md-0"] > 0
            deadline = time.monotonic() + 4 * TRANSFER_CHECK_S
            held = {}
            while time.monotonic() < deadline:
                held = (fuzz_cluster.members["md-0"].health().get("engine") or {}).get("held_requests", {})
                if "fz-orphan" not in held:
                    break
                await asyncio.sleep(0.5)
            assert "fz-orphan" not in held and held.get("fz-silent-source") == "IMPORTING", held
            await nc.publish(Subjects.CANCEL, Cancel("fz-silent-source").encode())
            await flush_barrier(nc)
        finally:
            await nc.close()

    asyncio.run(main())
    assert fuzz_cluster.wait_idle(30) == {"p-0": 0, "rld-0": 0, "md-0": 0}


def test_requests_of_a_router_that_came_back_as_a_new_process_are_cancelled(fuzz_cluster) -> None:
    """A router restarted under the same id (another started_unix in its announce) no longer knows the requests
    its old process owned: P, RLD and MD cancel them (roles/router_watch.py) instead of decoding to the end for
    nobody. Here a stand-in router announces itself, submits a long P-MD request, and announces again as a new
    process once the first tokens arrive: the stream stops well before max_tokens and no block stays held."""
    router = "router-fz"
    subject = Subjects.router_events(router)

    def announce(started: float) -> bytes:
        return Announce(instance_id=router, role=Role.ROUTER, site="site-a", state="ready", load=0.0,
                        running_requests=0, free_kv_blocks=0, total_kv_blocks=0, heartbeat_ms=500,
                        started_unix=started).encode()

    async def main() -> int:
        nc = await nats.connect(fuzz_cluster.nats.url, name="fuzz-regression")
        got: list[int] = []
        first = asyncio.Event()

        async def on_event(msg) -> None:
            m = protocol.decode(msg.data)
            items = [protocol.decode_envelope(i) for i in m.items] if m.TYPE == "batch" else [m]
            for item in items:
                got.extend(getattr(item, "token_ids", []) or [])
                if got:
                    first.set()

        try:
            await nc.subscribe(subject, cb=on_event)
            await nc.publish(Subjects.ANNOUNCE, announce(1000.0))
            await flush_barrier(nc)
            await asyncio.sleep(0.5)
            await nc.publish(Subjects.instance("p-0", "submit"), protocol.SubmitRequest(
                request_id="fz-orphaned-by-router", prompt_ids=list(range(40, 80)),
                sampling=SamplingSpec(max_tokens=900, ignore_eos=True), pipeline="P-MD", events_subject=subject,
                deadline_unix=time.time() + 120, md_instance="md-0").encode())
            await asyncio.wait_for(first.wait(), 30)
            await nc.publish(Subjects.ANNOUNCE, announce(2000.0))  # the same id, a new process
            await flush_barrier(nc)
            await asyncio.sleep(3.0)
            return len(got)
        finally:
            await nc.close()

    tokens = asyncio.run(main())
    assert 0 < tokens < 900
    assert fuzz_cluster.wait_idle(30) == {"p-0": 0, "rld-0": 0, "md-0": 0}
    assert log_events(fuzz_cluster, "router_requests_cancelled").get("md-0", 0) >= 1
