"""Every message between PDD services: typed dataclasses with one msgpack encoding.

Wire form: a msgpack map ``{"v": SCHEMA_VERSION, "t": <type name>, "d": {<fields>}}``.
Decoding is strict: unknown type, wrong version, missing/unknown/ill-typed field or an oversize
payload raises ``ProtocolError`` (never anything else), so a service loop can reject a bad
message with one ``except`` and keep serving. Subjects are documented in docs/PROTOCOL.md and
built by the helpers in ``Subjects``.

Why one module: it is the wire contract, one job: every message schema with the one codec that
checks messages against those schemas' type hints; a reviewer of a protocol change reads one file,
and the codec's registry of types is built from the classes defined beside it.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from pdd.shared.links import KVLink
from pdd.shared.pipelines import HandoffMode, Pipeline
from pdd.shared.roles import Role

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 1_000_000  # below NATS's default 1 MiB max_payload; ~200K token ids fit


class ProtocolError(ValueError):
    """A message could not be decoded or validated. ``code`` is stable and machine-readable."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


_REGISTRY: dict[str, type["Message"]] = {}


@dataclass
class Message:
    """Base of all bus messages. Subclasses set TYPE and are registered automatically."""

    TYPE: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.TYPE:
            if cls.TYPE in _REGISTRY:
                raise TypeError(f"duplicate message type {cls.TYPE}")
            _REGISTRY[cls.TYPE] = cls

    def encode(self) -> bytes:
        return encode(self)


# ---------------------------------------------------------------------------------------------
# Requests and results
# ---------------------------------------------------------------------------------------------


MAX_LOGPROBS = 20  # most top alternatives per token a request may ask for (vLLM's default max_logprobs)


@dataclass
class SamplingSpec:
    """Sampling parameters as they travel (the engine's SamplingParams is built from this)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output tokens (vLLM)
    presence_penalty: float = 0.0  # over output tokens
    frequency_penalty: float = 0.0  # over output tokens
    min_tokens: int = 0  # EOS and stop token ids are masked until this many outputs
    logprobs: int | None = None  # None: no logprobs; n: the chosen token's and the top n alternatives'


@dataclass
class TokenLogprobs:
    """One output token's log-probabilities: raw (log-softmax of the model's logits, before penalties,
    temperature and filters: vLLM's default ``raw_logprobs``), the chosen token's and the top alternatives'
    (most likely first; as many as the request asked for)."""

    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.top_ids) != len(self.top_logprobs):
            raise ValueError("top_ids and top_logprobs differ in length")


@dataclass
class SubmitRequest(Message):
    """Router -> prefill: run the prompt, stream the first token, ship KV along the chosen pipeline."""

    TYPE: ClassVar[str] = "submit"
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    pipeline: Pipeline
    events_subject: str  # where token chunks / errors for this request go (the router's inbox)
    deadline_unix: float
    rld_instance: str | None = None
    md_instance: str | None = None
    handoff_mode: HandoffMode | None = None  # forced, else chosen by the relay
    output_ids: list[int] = field(default_factory=list)  # already emitted tokens (migration/resume)
    md_link: KVLink = KVLink.WAN  # how main decode's KV goes: FAST where it shares prefill's site


@dataclass
class PrefillResult(Message):
    """Prefill -> router: the first token, with what the prefix cache saved."""

    TYPE: ClassVar[str] = "prefill_result"
    request_id: str
    instance_id: str
    first_token: int
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str | None = None
    first_logprobs: TokenLogprobs | None = None  # when the request asked for logprobs


@dataclass
class PrepareImport(Message):
    """Prefill -> decode instance (request/reply): reserve blocks for a request's incoming KV."""

    TYPE: ClassVar[str] = "prepare_import"
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    events_subject: str
    deadline_unix: float
    pipeline: Pipeline
    use_cache: bool = True  # the relay takes the full KV; main decode reuses its radix cache
    link: KVLink = KVLink.WAN  # which of the receiver's transports the KV comes over
    source_descriptor: dict = field(default_factory=dict)  # sender's transport descriptor (of ``link``)
    handoff_mode: HandoffMode | None = None
    md_instance: str | None = None
    rld_instance: str | None = None
    trace_id: str | None = None
    source_instance: str | None = None  # the prefill instance sending the KV: asked while it has not landed


@dataclass
class TransferCheck(Message):
    """Decode instance -> the prefill sending it KV (request/reply), while the KV has not landed: is it still on
    its way? A Cancel lost on a cut WAN would otherwise strand the reserved blocks until the import lease ends."""

    TYPE: ClassVar[str] = "transfer_check"
    request_id: str
    instance_id: str  # the receiver asking


class TransferState(str, enum.Enum):
    SENDING = "sending"  # prefill or transfer still running
    SENT = "sent"  # done: its kv_ready is on the way
    UNKNOWN = "unknown"  # failed, cancelled, never seen, or a restarted prefill: the reservation can go


@dataclass
class TransferCheckReply(Message):
    TYPE: ClassVar[str] = "transfer_check_reply"
    request_id: str
    state: TransferState


@dataclass
class ImportPlan(Message):
    """Decode instance -> prefill (reply): what it already holds and where the rest must land."""

    TYPE: ClassVar[str] = "import_plan"
    request_id: str
    instance_id: str
    cached_tokens: int
    dst_blocks: list[int]
    descriptor: dict  # receiver's transport descriptor (address, layout, keys)


@dataclass
class KVReady(Message):
    """Sender -> receiver: all blocks for the request were sent (receiver still verifies arrival)."""

    TYPE: ClassVar[str] = "kv_ready"
    request_id: str
    instance_id: str
    first_token: int  # output position 0, sampled by P: the receiver extends it before decoding
    bytes_sent: int  # on the wire (coded, when the link has a codec)
    seconds: float  # the transfer's link time: seconds with a send in flight
    codec: str = "none"  # what the KV crossed with (transports/codec.py; "<codec>(partial)": some frames only)
    kv_bytes: int = 0  # the KV those bytes decode to (0 from a sender before codecs: bytes_sent)


@dataclass
class TokenChunk(Message):
    """Any decoding instance -> router: output tokens at positions [start, start+len)."""

    TYPE: ClassVar[str] = "tokens"
    request_id: str
    instance_id: str
    role: Role
    start: int
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | None (more to come)
    owner_until: int | None = None  # relay: last position it will emit (handoff boundary), if known
    meta: dict = field(default_factory=dict)  # per-request facts for metrics (handoff mode, WAN bytes, hits)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token id when the request asked

    def __post_init__(self) -> None:
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise ValueError("logprobs must be empty or one per token id")


@dataclass
class HandoffReady(Message):
    """Main decode -> relay: my KV has landed; hand the request over from position ``next_position``."""

    TYPE: ClassVar[str] = "handoff_ready"
    request_id: str
    md_instance: str
    next_position: int  # first output position MD does not hold yet


@dataclass
class HandoffTokens(Message):
    """Relay -> main decode: token ids at output positions [start, start+len).

    ``final`` names the end of the relay's ownership: MD owns every position from ``start+len``.
    """

    TYPE: ClassVar[str] = "handoff_tokens"
    request_id: str
    rld_instance: str
    start: int
    token_ids: list[int]
    mode: HandoffMode
    final: bool
    finish_reason: str | None = None  # the relay already finished the request (nothing left for MD)


@dataclass
class HandoffAck(Message):
    """Main decode -> relay: extended through ``through_position``; send the next batch."""

    TYPE: ClassVar[str] = "handoff_ack"
    request_id: str
    md_instance: str
    through_position: int


@dataclass
class Cancel(Message):
    TYPE: ClassVar[str] = "cancel"
    request_id: str
    reason: str = "cancelled"


@dataclass
class Batch(Message):
    """Messages for one subject sent as one NATS message: an engine step's token chunks for one router go
    together instead of one message per request. The receiver decodes and handles the items in order, each
    as if it had come alone (a bad item is rejected alone); a batch never nests and is never a request."""

    TYPE: ClassVar[str] = "batch"
    items: list[dict]  # envelopes {v, t, d}, as ``encode`` writes them


@dataclass
class ErrorReply(Message):
    """A request failed somewhere (or a bus message was rejected). ``code`` is machine-readable."""

    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    request_id: str | None = None
    instance_id: str | None = None
    retryable: bool = False


# Keys of an announce's cache_summary that routing reads (main decode's measured WAN rate, P's WAN backlog).
WAN_RATE_KEY = "wan_bytes_per_s"  # MD: EWMA of one KV transfer's arrival rate over the WAN
WAN_QUEUED_KEY = "wan_queued_bytes"  # P: KV bytes its WAN transfers in flight have still to send (estimated)
WAN_EGRESS_KEY = "wan_egress_bytes_per_s"  # P: its WAN egress while it had transfers in flight (EWMA)
WAN_TRANSFERS_KEY = "wan_transfers"  # P: its WAN transfers in flight


@dataclass
class Announce(Message):
    """Every instance, every heartbeat period: who I am, where, how loaded, what I cache."""

    TYPE: ClassVar[str] = "announce"
    instance_id: str
    role: Role
    site: str
    state: str  # "ready" | "draining" | "stopped"
    load: float  # 0..1
    running_requests: int
    free_kv_blocks: int
    total_kv_blocks: int
    heartbeat_ms: int
    cache_summary: dict = field(default_factory=dict)  # e.g. {"hit_rate": .., WAN_RATE_KEY: ..}
    max_context: int = 0
    model: str = ""
    dtype: str = ""  # engine roles: weights/compute dtype ("float32", "bfloat16", ...)
    kv_layout: dict = field(default_factory=dict)  # engine roles: KVLayout.to_dict(); one per fleet (dtype incl.)
    endpoints: dict = field(default_factory=dict)  # e.g. {"metrics": "http://..", "kv": {...}}
    sent_unix: float = 0.0
    started_unix: float = 0.0  # when this process started: another value under the same id is a new process


@dataclass
class CacheEvents(Message):
    """Engine radix cache -> router prefix index: block hashes stored or removed."""

    TYPE: ClassVar[str] = "cache_events"
    instance_id: str
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False


@dataclass
class CacheQuery(Message):
    """Router -> instance (request/reply): how many leading tokens of this prompt do you hold?"""

    TYPE: ClassVar[str] = "cache_query"
    prompt_ids: list[int]


@dataclass
class CacheQueryReply(Message):
    TYPE: ClassVar[str] = "cache_query_reply"
    instance_id: str
    cached_tokens: int


@dataclass
class Ping(Message):
    TYPE: ClassVar[str] = "ping"
    payload: str = ""


@dataclass
class Pong(Message):
    TYPE: ClassVar[str] = "pong"
    instance_id: str
    role: Role
    payload: str = ""


# ---------------------------------------------------------------------------------------------
# Subjects
# ---------------------------------------------------------------------------------------------


class Subjects:
    """The one NATS subject scheme (docs/PROTOCOL.md)."""

    PREFIX = "pdd"
    ANNOUNCE = "pdd.announce"
    CANCEL = "pdd.cancel"

    @staticmethod
    def instance(instance_id: str, verb: str) -> str:
        """Instance-addressed control: submit, prepare_import, handoff, cache_query, ping, ..."""
        return f"pdd.inst.{instance_id}.{verb}"

    @staticmethod
    def cache_events(instance_id: str) -> str:
        return f"pdd.cache.{instance_id}"

    @staticmethod
    def router_events(router_id: str) -> str:
        return f"pdd.router.{router_id}.events"


def check_token(name: str) -> str:
    """Instance ids become subject tokens: keep them to a safe alphabet."""
    if not name or any(c in name for c in ". *>\t\r\n") or len(name) > 128:
        raise ValueError(f"invalid id {name!r}: use letters, digits, '-' or '_' (no dots, spaces or wildcards)")
    return name


MAX_SUBJECT_CHARS = 256


def check_subject(subject: str) -> str:
    """A subject carried inside a message (``events_subject``) is one a service will publish to: it must be
    literal (no wildcard or empty token), printable, without spaces, and short. A long one would exceed
    the server's control line, and the server's -ERR makes nats-py close that service's connection."""
    if (not subject or len(subject) > MAX_SUBJECT_CHARS or any(c.isspace() or not c.isprintable() for c in subject)
            or any(t in ("", "*", ">") for t in subject.split("."))):
        raise ValueError(f"invalid subject {subject[:40]!r}: literal dot-separated tokens, at most "
                         f"{MAX_SUBJECT_CHARS} printable characters")
    return subject


# Fields whose values become NATS subjects (or subject tokens) where they are received.
_FIELD_CHECKS = {"events_subject": check_subject, "instance_id": check_token, "md_instance": check_token,
                 "rld_instance": check_token}


# ---------------------------------------------------------------------------------------------
# Encoding and strict decoding
# ---------------------------------------------------------------------------------------------


def _to_wire(value: Any) -> Any:
    """Dataclasses -> dicts (TYPE left out), tuples -> lists, enums -> their values, recursively; dict values
    pass as they are. The per-class encoders below compute the same for messages, faster."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encoder(type(value))(value)
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


# Codecs compiled once per class: the type hints are read and dispatched when a class is first seen, not per
# message (a token stream is thousands of messages per second through the router).
_ENCODERS: dict[type, Callable[[Any], dict]] = {}
_BUILDERS: dict[type, Callable[[Any, str], Any]] = {}
_PLAIN = (str, bool, bytes, int, float, dict)


def _encoder(cls: type) -> Callable[[Any], dict]:
    enc = _ENCODERS.get(cls)
    if enc is None:
        hints = _hints(cls)
        # (name, passes as is): scalars, maps and token id lists need no conversion
        fields_ = [(f.name, hints.get(f.name) in _PLAIN or hints.get(f.name) == list[int])
                   for f in dataclasses.fields(cls) if f.name != "TYPE"]

        def enc(value: Any) -> dict:
            return {n: getattr(value, n) if as_is else _to_wire(getattr(value, n)) for n, as_is in fields_}
        _ENCODERS[cls] = enc
    return enc


def _envelope(message: Message) -> dict:
    if not message.TYPE:
        raise TypeError(f"{type(message).__name__} is not a registered message type")
    return {"v": SCHEMA_VERSION, "t": message.TYPE, "d": _encoder(type(message))(message)}


def encode(message: Message) -> bytes:
    return msgpack.packb(_envelope(message), use_bin_type=True)


def encode_batch(messages: list[Message]) -> bytes:
    """Several messages as one ``Batch`` (each inside in its own envelope, in order)."""
    return msgpack.packb({"v": SCHEMA_VERSION, "t": Batch.TYPE, "d": {"items": [_envelope(m) for m in messages]}},
                         use_bin_type=True)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


Checker = Callable[[Any, str], Any]
_CHECKERS: dict[Any, Checker] = {}


def _checker(hint: Any) -> Checker:
    """A function (value, where) -> the checked value, or ProtocolError naming ``where``; one per type hint."""
    try:
        found = _CHECKERS.get(hint)
    except TypeError:  # an unhashable hint
        found = None
    if found is None:
        found = _make_checker(hint)
        try:
            _CHECKERS[hint] = found
        except TypeError:
            pass
    return found


_INT_ONLY = frozenset((int,))  # not bool: msgpack's true/false decode to bool, a subclass of int
# Item hints whose checker passes a value of exactly these types through unchanged (a list of them needs no copy)
_AS_IS = {int: _INT_ONLY, str: frozenset((str,)), bool: frozenset((bool,)), bytes: frozenset((bytes,)),
          dict: frozenset((dict,))}


def _make_checker(hint: Any) -> Checker:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        allow_none = type(None) in args
        options = [_checker(o) for o in args if o is not type(None)]

        def check_union(value: Any, where: str) -> Any:
            if value is None and allow_none:
                return None
            errors = []
            for option in options:
                try:
                    return option(value, where)
                except ProtocolError as exc:
                    errors.append(exc.message)
            raise ProtocolError("bad_field", f"{where}: {'; '.join(errors)}")
        return check_union
    if origin is list:
        (item_hint,) = typing.get_args(hint)
        if item_hint is int:  # fast path for token id lists
            def check_ints(value: Any, where: str) -> Any:
                if not isinstance(value, list):
                    raise ProtocolError("bad_field", f"{where}: expected a list, got {type(value).__name__}")
                if not set(map(type, value)) <= _INT_ONLY:  # C loops: 64K ids in ~1.4 ms (a generator: ~2.3)
                    raise ProtocolError("bad_field", f"{where}: expected a list of ints")
                return value
            return check_ints
        item = _checker(item_hint)
        as_is = _AS_IS.get(item_hint)

        def check_list(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise ProtocolError("bad_field", f"{where}: expected a list, got {type(value).__name__}")
            if as_is is not None and set(map(type, value)) <= as_is:  # a batch's items: no per-item call
                return value
            return [item(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return check_list
    if hint is dict or origin is dict:
        def check_dict(value: Any, where: str) -> Any:
            if not isinstance(value, dict):
                raise ProtocolError("bad_field", f"{where}: expected a map, got {type(value).__name__}")
            return value
        return check_dict
    if dataclasses.is_dataclass(hint):
        return lambda value, where: _builder(hint)(value, where)
    if hint is float:
        def check_float(value: Any, where: str) -> Any:
            if type(value) not in (int, float):
                raise ProtocolError("bad_field", f"{where}: expected a number, got {type(value).__name__}")
            return float(value)
        return check_float
    if hint is int:
        def check_int(value: Any, where: str) -> Any:
            if type(value) is not int:
                raise ProtocolError("bad_field", f"{where}: expected an int, got {type(value).__name__}")
            return value
        return check_int
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        members = {m.value: m for m in hint}
        choices = ", ".join(repr(m.value) for m in hint)

        def check_enum(value: Any, where: str) -> Any:
            member = members.get(value) if type(value) is str else None
            if member is None:
                raise ProtocolError("bad_field", f"{where}: {str(value)[:40]!r} is not one of {choices}")
            return member
        return check_enum
    if hint in (str, bool, bytes):
        def check_exact(value: Any, where: str) -> Any:
            if type(value) is not hint:
                raise ProtocolError("bad_field", f"{where}: expected {hint.__name__}, got {type(value).__name__}")
            return value
        return check_exact

    def unsupported(value: Any, where: str) -> Any:
        raise ProtocolError("bad_field", f"{where}: unsupported field type {hint}")
    return unsupported


def _check(value: Any, hint: Any, where: str) -> Any:
    return _checker(hint)(value, where)


def _builder(cls: type) -> Callable[[Any, str], Any]:
    build = _BUILDERS.get(cls)
    if build is None:
        hints = _hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != "TYPE"}
        known_names = frozenset(known)
        required = [n for n, f in known.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        fields_ = [(n, _checker(hints[n]), _FIELD_CHECKS.get(n)) for n in known]

        def build(data: Any, where: str) -> Any:
            if not isinstance(data, dict):
                raise ProtocolError("bad_field", f"{where}: expected a map")
            if not data.keys() <= known_names:
                unknown = set(data) - known_names
                raise ProtocolError("unknown_field", f"{where}: unknown field(s) {sorted(map(str, unknown))}")
            for name in required:
                if name not in data:
                    raise ProtocolError("missing_field", f"{where}.{name} is required")
            kwargs = {}
            for name, check, extra in fields_:
                if name not in data:
                    continue
                value = kwargs[name] = check(data[name], f"{where}.{name}")
                if extra is not None and value is not None:
                    try:
                        extra(value)
                    except ValueError as exc:
                        raise ProtocolError("bad_field", f"{where}.{name}: {str(exc)[:200]}") from None
            return cls(**kwargs)
        _BUILDERS[cls] = build
    return build


def _build(cls: type, data: Any, where: str) -> Any:
    return _builder(cls)(data, where)


# A fast builder for the messages that come at token rate, generated from the class's type hints (as dataclasses
# generates __init__) and run before the strict builder above. It takes only the form senders write (every field
# present, each value of exactly the type ``encode`` writes) and returns None for anything else, which then goes
# to the strict builder. So it refuses nothing itself: every refusal, its code and message, is the strict
# builder's, and what it accepts the strict builder accepts too, as the same message.
_FAST_MEMO_MAX = 1024  # values a field check (``_FIELD_CHECKS``) has passed, remembered per field


def _remember_valid(check: Callable[[str], str], seen: set[str], value: str) -> bool:
    """Run a field's extra check once per distinct value: a stream's instance ids repeat in every message."""
    try:
        check(value)
    except ValueError:
        return False
    if len(seen) >= _FAST_MEMO_MAX:
        seen.clear()
    seen.add(value)
    return True


def _fast_field(hint: Any, var: str, env: dict[str, Any]) -> list[str] | None:
    """Source lines that leave ``var`` holding what the strict checker would return for it, or return None from
    the fast builder; None here where the hint is not one the fast builder takes."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        inner = [a for a in args if a is not type(None)]
        if len(args) != 2 or len(inner) != 1:
            return None
        lines = _fast_field(inner[0], var, env)
        return None if lines is None else [f"if {var} is not None:", *("    " + line for line in lines)]
    if hint in (str, bool, bytes, int, float, dict) or origin is dict:  # float: an int goes the strict way
        return [f"if type({var}) is not {'dict' if origin is dict else hint.__name__}:", "    return None"]
    if origin is list:
        (item_hint,) = typing.get_args(hint)
        if item_hint is int:
            return [f"if type({var}) is not list or not set(map(type, {var})) <= _INT_ONLY:", "    return None"]
        return [f"if type({var}) is not list or {var}:", "    return None"]  # other items: only an empty list
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        env[f"{var}_members"] = {m.value: m for m in hint if type(m.value) is str}  # as the strict checker's
        return [f"if type({var}) is not str:", "    return None",
                f"{var} = {var}_members.get({var})", f"if {var} is None:", "    return None"]
    return None


def _fast_builder(cls: type) -> Callable[[Any], Any] | None:
    """``cls``'s fast builder (above), or None where one of its fields' hints is not one it takes."""
    hints = _hints(cls)
    fields_ = [f for f in dataclasses.fields(cls) if f.name != "TYPE"]
    if not all(f.init for f in fields_):
        return None
    env: dict[str, Any] = {"cls": cls, "_KEYS": frozenset(f.name for f in fields_), "_INT_ONLY": _INT_ONLY,
                           "_remember_valid": _remember_valid}
    body = ["if type(data) is not dict or data.keys() != _KEYS:", "    return None"]
    for i, f in enumerate(fields_):
        var = f"v{i}"
        lines = _fast_field(hints[f.name], var, env)
        if lines is None:
            return None
        body += [f"{var} = data[{f.name!r}]", *lines]
        extra = _FIELD_CHECKS.get(f.name)
        if extra is not None:
            if hints[f.name] not in (str, str | None):
                return None
            env[f"{var}_check"], env[f"{var}_seen"] = extra, set()
            body += [(f"if {var} is not None and {var} not in {var}_seen "
                      f"and not _remember_valid({var}_check, {var}_seen, {var}):"), "    return None"]
    args = ", ".join(f"v{i}" for i in range(len(fields_)))
    body += ["try:", f"    return cls({args})", "except Exception:", "    return None  # the strict builder says why"]
    source = "def fast(data):\n" + "".join(f"    {line}\n" for line in body)
    exec(compile(source, f"<fast builder of {cls.__name__}>", "exec"), env)  # noqa: S102 (generated above)
    return env["fast"]


def _fast_builders(classes: tuple[type, ...]) -> dict[type, Callable[[Any], Any]]:
    """The hot messages' fast builders; a hot message with a field the generator does not take fails the import."""
    built = {cls: _fast_builder(cls) for cls in classes}
    missing = [cls.__name__ for cls, fast in built.items() if fast is None]
    if missing:
        raise TypeError(f"no fast builder for {missing}: a field's type hint is not one _fast_field takes")
    return typing.cast(dict[type, Callable[[Any], Any]], built)


_FAST_BUILDERS = _fast_builders((TokenChunk,))  # the messages at token rate: one per token per stream
_ENVELOPE_KEYS = frozenset(("v", "t", "d"))


def decode(data: bytes, expect: type[Message] | tuple[type[Message], ...] | None = None,
           max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Bytes -> message, or ProtocolError naming what is wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("bad_frame", "message must be bytes")
    if len(data) > max_bytes:
        raise ProtocolError("oversize", f"message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        envelope = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise ProtocolError("bad_frame", f"not a msgpack message ({type(exc).__name__})") from None
    return decode_envelope(envelope, expect)


def decode_envelope(envelope: Any, expect: type[Message] | tuple[type[Message], ...] | None = None) -> Message:
    """An unpacked envelope {v, t, d} -> message (``decode`` without the msgpack step; a ``Batch``'s items)."""
    if not isinstance(envelope, dict) or envelope.keys() != _ENVELOPE_KEYS:
        raise ProtocolError("bad_frame", "expected an envelope {v, t, d}")
    if envelope["v"] != SCHEMA_VERSION:
        raise ProtocolError(
            "wrong_version", f"schema version {envelope['v']!r} is not supported (this side speaks {SCHEMA_VERSION})"
        )
    cls = _REGISTRY.get(envelope["t"]) if isinstance(envelope["t"], str) else None
    if cls is None:
        raise ProtocolError("unknown_type", f"unknown message type {envelope['t']!r}")
    if expect is not None and not issubclass(cls, expect):
        names = [c.TYPE for c in (expect if isinstance(expect, tuple) else (expect,))]
        raise ProtocolError("unexpected_type", f"got {cls.TYPE!r}, expected one of {names}")
    try:
        fast = _FAST_BUILDERS.get(cls)
        if fast is not None and (message := fast(envelope["d"])) is not None:
            return message
        return _build(cls, envelope["d"], cls.TYPE)
    except ProtocolError:
        raise
    except Exception as exc:  # e.g. a dataclass __post_init__ rejecting a value
        raise ProtocolError("bad_field", f"{cls.TYPE}: {exc}") from None


def message_types() -> dict[str, type[Message]]:
    return dict(_REGISTRY)
