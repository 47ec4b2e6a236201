"""KV wire codecs (transports/codec.py): round trips, the adaptive rule, the receiver's refusals on the real wire."""

from __future__ import annotations

import math
import typing

import pytest
import torch
import zstandard

from pdd.shared.config import TransportConfig
from pdd.shared.kv_layout import KVLayout
from pdd.transports import IncompatiblePeerError, RemoteRejected, create_link_transport, create_transport
from pdd.transports.blocks import FramePlan
from pdd.transports.codec import (
    CODEC_NAMES,
    AdaptiveLossless,
    CodecSpec,
    decode,
    encode,
    fp8_size,
    summarize,
)
from pdd.transports.frames import (
    VERSION,
    VERSION_CODED,
    ChecksumMismatch,
    CodecError,
    FrameHeader,
    MalformedHeader,
    checksum,
    decode_header,
)

from .conftest import PLUGINS, Pair, snapshot, unchanged
from .test_bad_frames import flip, inject

# big enough blocks that zstd's frame overhead is small against what the shuffle buys
LAYOUT_BF16 = KVLayout(num_layers=2, block_size=16, kv_heads=2, head_dim=64, dtype="bfloat16")


def kv_like(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Looks like attention KV: per-channel magnitudes spread over decades (a few outlier channels), rotary-like
    oscillation along positions, noise; [n, block_size, heads, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    n, bs, heads, hd = shape
    mag = torch.exp(torch.randn(heads, hd, generator=g) * 1.2) * 0.3
    freq = torch.rand(heads, hd, generator=g) * 0.5
    pos = torch.arange(n * bs, dtype=torch.float32).view(n, bs, 1, 1)
    x = mag * (torch.sin(pos * freq) + 0.3 * torch.randn(n, bs, heads, hd, generator=g))
    return x.to(dtype)


def kv_pool(layout: KVLayout, blocks: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (blocks, *layout.block_shape)
    return ([kv_like(shape, layout.torch_dtype, seed + i) for i in range(layout.num_layers)],
            [kv_like(shape, layout.torch_dtype, seed + 100 + i) for i in range(layout.num_layers)])


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def as_tensor(data: typing.Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(bytes(data)), dtype=torch.uint8).view(dtype).view(shape)


def fp8_bound_holds(x: torch.Tensor, y: torch.Tensor) -> bool:
    """The fp8 error bound, per element: |y - x| <= (2^-4 + 2^-7) |x| + 2^-9 s, s = absmax / 448 of the element's
    (block, head). e4m3 keeps 3 mantissa bits (round to nearest: 2^-4 relative, 2^-10 s in the subnormal range),
    the cast back to bf16 adds 2^-8 relative. So no element is off by more than absmax / 14 of its (block, head)."""
    x, y = x.float(), y.float()
    absmax = x.abs().amax(dim=(1, 3), keepdim=True)
    err = (y - x).abs()
    return bool((err <= (2**-4 + 2**-7) * x.abs() + 2**-9 * absmax / 448).all() and (err <= absmax / 14).all())


# ---- the codec itself --------------------------------------------------------------------------------------
def test_codec_names_parse_and_config_agrees() -> None:
    assert [CodecSpec.parse(n).name for n in CODEC_NAMES] == list(CODEC_NAMES)
    assert CodecSpec.parse(None) == CodecSpec.parse("none") and not CodecSpec.parse("none").active
    assert CodecSpec.parse(" FP8+Lossless ").name == "fp8+lossless"
    with pytest.raises(ValueError, match="unknown KV codec 'lossless\\+fp8'"):
        CodecSpec.parse("lossless+fp8")  # stages stack in one order only: fp8 first
    # the config's typed field (pdd.shared may not import transports) names exactly the codecs the wire knows
    assert typing.get_args(TransportConfig.model_fields["codec"].annotation) == CODEC_NAMES
    assert CodecSpec.parse("fp8+lossless").frame_codecs() == {"fp8+lossless", "fp8"}
    assert summarize(["lossless", "lossless"]) == "lossless"
    assert summarize(["lossless", "none"]) == "lossless(partial)"
    assert summarize(["fp8", "fp8+lossless(partial)"]) == "fp8+lossless(partial)"
    assert summarize([]) == "none"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lossless_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    shape = (12, 16, 3, 64)
    x = kv_like(shape, dtype, seed=5)
    flat = x.view(-1)
    flat[:4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")], dtype=dtype)  # bits, not values, must survive
    flat[4] = torch.finfo(dtype).tiny / 4  # a subnormal
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    wire = encode(x, "lossless", name, shape)
    assert len(wire) < x.numel() * x.element_size()  # real-looking KV compresses (the exponent byte plane)
    assert bytes(decode(wire, "lossless", name, shape, x.numel() * x.element_size())) == raw_bytes(x)
    assert encode(raw_bytes(x), "lossless", name, shape) == wire  # bytes in: the same frame


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("spec", ["fp8", "fp8+lossless"])
def test_fp8_round_trip_error_is_bounded_per_block_and_head(dtype: str, spec: str) -> None:
    shape = (6, 16, 4, 32)
    x = kv_like(shape, getattr(torch, dtype), seed=7)
    x[2] = 0  # an all-zero block decodes to zeros
    x[3, :, 1] *= 1e-30 if dtype == "float32" else 1.0  # a head of tiny values: the scale adapts
    wire = encode(x, spec, dtype, shape)
    assert len(wire) <= fp8_size(shape) < x.numel() * x.element_size()
    y = as_tensor(decode(wire, spec, dtype, shape, x.numel() * x.element_size()), x.dtype, shape)
    assert fp8_bound_holds(x, y)
    assert torch.equal(y[2], torch.zeros_like(y[2]))


def test_fp8_refuses_non_finite_kv() -> None:
    x = kv_like((1, 16, 2, 8), torch.bfloat16)
    x[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="inf or NaN"):
        encode(x, "fp8", "bfloat16", tuple(x.shape))


def bomb_cases(shape: tuple[int, ...], itemsize: int) -> dict[str, bytes]:
    """zstd frames a sender could craft for a lossless frame of ``shape``: each must be refused."""
    size = math.prod(shape) * itemsize
    good = zstandard.ZstdCompressor(level=1).compress(bytes(size))
    claims_more = zstandard.ZstdCompressor(level=1).compress(bytes(64 * size))  # declares 64x its blocks
    no_size = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(64 * size))
    # declares exactly the right size, then expands past it: the content-size field patched down
    params = zstandard.get_frame_parameters(claims_more)
    assert params.content_size == 64 * size
    at = claims_more.index((64 * size).to_bytes(4, "little"))
    lies = claims_more[:at] + size.to_bytes(4, "little") + claims_more[at + 4:]
    return {"claims more": claims_more, "no declared size": no_size, "declares right, expands past": lies,
            "truncated": good[:-3], "trailing bytes": good + good, "not zstd": b"\x00" * 32}


def test_decode_refuses_malformed_frames_without_allocating_past_the_cap() -> None:
    shape = (2, 16, 2, 64)
    for data in bomb_cases(shape, 2).values():
        with pytest.raises(CodecError):
            decode(data, "lossless", "bfloat16", shape, math.prod(shape) * 2)
    x = kv_like(shape, torch.bfloat16)
    wire = encode(x, "fp8", "bfloat16", shape)
    with pytest.raises(CodecError, match="fp8 payload"):
        decode(wire[:-1], "fp8", "bfloat16", shape, 1 << 20)
    bad_scale = bytes(4 * 2 * 2) + wire[16:]  # zero scales
    with pytest.raises(CodecError, match="scale"):
        decode(bad_scale, "fp8", "bfloat16", shape, 1 << 20)
    with pytest.raises(CodecError, match="cap"):  # blocks that hold more than the caller allows
        decode(encode(x, "lossless", "bfloat16", shape), "lossless", "bfloat16", shape, 100)


def test_adaptive_rule_compresses_only_where_it_pays() -> None:
    a = AdaptiveLossless()
    assert a.pays()  # nothing measured yet: compress (the operator configured lossless for a slow link)
    a.observe_compress(400_000_000, 300_000_000, 1.0)  # 400 MB/s per core, ratio 1.33: saves 100 MB/s of link
    a.link_hint_bps = 1e9 / 8  # 1 Gbit/s = 125 MB/s: compressing costs more than it saves
    assert not a.pays()
    a.link_hint_bps = 50e6  # 400 Mbit/s: it pays
    assert a.pays()
    a.observe_compress(100, 100, 1e-6)
    a.observe_compress(100, 101, 1e-6)  # incompressible lately: ratio below 1 never pays
    a.ratio = 0.99
    assert not a.pays()
    # a probe every PROBE_EVERY frames keeps the measurements fresh while the stage is off
    a.link_hint_bps = 1e15
    wants = [a.want() for _ in range(3 * a.PROBE_EVERY)]
    assert sum(wants) == 3


def test_measured_link_rate_excludes_encode_time() -> None:
    a = AdaptiveLossless()
    assert a.link_bps is None
    a.send_began()
    a.add_encode_time(0.0)
    a.send_ended(1000, ok=True)
    assert a.link_bps and a.link_bps > 0
    before = a.link_bps
    a.send_began()
    a.send_ended(0, ok=False)  # a failed send says nothing about the link
    assert a.link_bps == before


# ---- headers and the receive side -----------------------------------------------------------------------------
def test_coded_header_round_trip_and_uncoded_frames_stay_version_1() -> None:
    plain = FrameHeader("r", 0, 1, (3,), "bfloat16", (1, 16, 2, 64), 4096, 7)
    assert plain.encode()[4] == VERSION and decode_header(plain.encode()) == plain
    coded = FrameHeader("r", 0, 1, (3,), "bfloat16", (1, 16, 2, 64), 4096, 7, None, "fp8+lossless", 1500)
    assert coded.encode()[4] == VERSION_CODED
    back = decode_header(coded.encode())
    assert back == coded and back.codec == "fp8+lossless" and back.wire_nbytes == 1500
    for bad in [{"codec": "zip"}, {"wire_nbytes": 0}, {"wire_nbytes": 4097}, {"wire_nbytes": "1"}]:
        fields = {**coded.__dict__, **bad}
        with pytest.raises(MalformedHeader):
            decode_header(FrameHeader(**fields).encode())


def coded_frame(pair: Pair, rid: str, wire: bytes, codec: str = "lossless", dst=(4, 5)) -> tuple[bytes, bytes]:
    """A header for ``wire`` as the payload of blocks ``dst`` of layer 1, K, with a correct checksum."""
    lay = pair.layout
    header = FrameHeader(rid, 1, 0, tuple(dst), lay.dtype, (len(dst), *lay.block_shape),
                         len(dst) * lay.bytes_per_block_per_tensor, checksum(wire), None, codec, len(wire))
    return header.encode(), wire


@pytest.mark.parametrize("plugin", PLUGINS)
async def test_corrupt_and_bomb_frames_are_refused_and_write_nothing(plugin: str) -> None:
    opts = {"codec": "lossless"}
    async with Pair(plugin, LAYOUT_BF16, sender_opts=opts, receiver_opts=opts) as pair:
        pair.sender.set_link_rate_hint(1.0)  # a slow link: the sender compresses every frame
        shape = (2, *LAYOUT_BF16.block_shape)
        header, payload = pair.sender._build_frame("x", FramePlan(1, 0, (0, 1), (4, 5)), None)
        sent = decode_header(header)
        assert sent.codec == "lossless" and sent.wire_nbytes < sent.nbytes

        def flipped(rid: str) -> tuple[bytes, bytes]:  # the sender's header (its checksum), a byte flipped in transit
            return FrameHeader(**{**sent.__dict__, "request_id": rid}).encode(), flip(bytes(payload), len(payload) // 2)

        fp8_wire = encode(pair.src_pool[0][1][:2], "fp8", "bfloat16", shape)
        cases: dict[str, tuple[typing.Callable[[str], tuple[bytes, bytes]], str]] = {
            "compressed byte flipped": (flipped, "ChecksumMismatch"),
            "a codec the link did not agree on": (lambda rid: coded_frame(pair, rid, fp8_wire, "fp8"), "CodecError")}
        for name, wire in bomb_cases(shape, 2).items():
            cases[name] = (lambda rid, w=wire: coded_frame(pair, rid, w), "CodecError")
        snap = snapshot(pair.dst_pool)
        for i, (name, (make, verdict)) in enumerate(cases.items()):
            rid = f"r{i}"
            handle = pair.receiver.expect(rid, [4, 5], timeout_s=30)
            assert await inject(pair, *make(rid)) == verdict, name
            assert unchanged(pair.dst_pool, snap), f"{name} modified the pool"
            with pytest.raises({"ChecksumMismatch": ChecksumMismatch, "CodecError": CodecError}[verdict]):
                # the request failed: its data cannot arrive intact any more
                await handle
        # the receiver keeps serving: a valid compressed frame is accepted
        pair.receiver.expect("good", [4, 5], timeout_s=30)
        assert await inject(pair, *coded_frame(pair, "good", bytes(payload))) == "ok"
        assert torch.equal(pair.dst_pool[0][1][4:6], pair.src_pool[0][1][0:2])


# ---- links: agreement, end to end ------------------------------------------------------------------------------
@pytest.mark.parametrize("plugin", ["inproc", "zmq"])
async def test_mismatched_codecs_are_refused_naming_both(plugin: str) -> None:
    a, b = create_transport(plugin, {"codec": "lossless"}), create_transport(plugin, {"codec": "fp8"})
    await a.start()
    await b.start()
    try:
        for t in (a, b):
            t.register(LAYOUT_BF16, *kv_pool(LAYOUT_BF16, 4, 0))
        assert b.descriptor()["codec"] == "fp8"
        with pytest.raises(IncompatiblePeerError, match="ours 'lossless', the peer's 'fp8'"):
            a.check_codec(b.descriptor())
        with pytest.raises(IncompatiblePeerError, match="ours 'fp8', the peer's 'lossless'"):
            await b.connect(a.descriptor())
        legacy = {k: v for k, v in a.descriptor().items() if k != "codec"}  # a peer from before codecs: none
        with pytest.raises(IncompatiblePeerError, match="the peer's 'none'"):
            a.check_codec(legacy)
        with pytest.raises(IncompatiblePeerError, match="unknown here"):
            a.check_codec({"codec": "zip"})
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("plugin", PLUGINS)
@pytest.mark.parametrize("codec", ["lossless", "fp8", "fp8+lossless"])
async def test_end_to_end_send_with_a_codec(plugin: str, codec: str) -> None:
    opts = {"codec": codec, "max_frame_bytes": 8 * LAYOUT_BF16.bytes_per_block_per_tensor}
    async with Pair(plugin, LAYOUT_BF16, sender_opts=opts, receiver_opts=opts) as pair:
        for t in (pair.sender, pair.receiver):
            pool = kv_pool(LAYOUT_BF16, t.num_blocks, seed=3 if t is pair.sender else 4)
            for mine, new in zip(t._k + t._v, pool[0] + pool[1]):
                mine.copy_(new)
        pair.sender.set_link_rate_hint(1.0)  # a slow link: the lossless stage runs on every frame
        src, dst = list(range(20)), [31 - i for i in range(20)]
        before = snapshot(pair.dst_pool)
        handle = pair.receiver.expect("c", dst)
        stats = await pair.sender.send(pair.peer, "c", src, dst)
        got = await handle
        raw = 2 * LAYOUT_BF16.num_layers * len(src) * LAYOUT_BF16.bytes_per_block_per_tensor
        assert stats.codec == got.codec == codec
        assert stats.raw_bytes == got.raw_bytes == raw and stats.bytes == got.bytes < raw
        for i, (s_t, d_t) in enumerate(zip(pair.src_pool[0] + pair.src_pool[1], pair.dst_pool[0] + pair.dst_pool[1])):
            if codec == "lossless":
                assert torch.equal(d_t[dst].view(torch.uint8), s_t[src].view(torch.uint8))
            else:
                assert fp8_bound_holds(s_t[src], d_t[dst])
            untouched = [b for b in range(d_t.shape[0]) if b not in dst]
            assert torch.equal(d_t[untouched], before[i][untouched])
        # a fast link: the lossless stage is skipped but for its probes, and the stats say so
        pair.sender.set_link_rate_hint(1e15)
        handle = pair.receiver.expect("d", dst)
        stats = await pair.sender.send(pair.peer, "d", src, dst)
        assert (await handle).codec == stats.codec == {"lossless": "lossless(partial)", "fp8": "fp8",
                                                       "fp8+lossless": "fp8+lossless(partial)"}[codec]


async def test_shaper_charges_the_line_with_the_coded_bytes_and_hints_its_rate() -> None:
    opts = {"codec": "fp8", "shape": {"rate": "1gbit"}}
    sender, receiver = create_transport("inproc", opts), create_transport("inproc", {"codec": "fp8"})
    await sender.start()
    await receiver.start()
    try:
        sender.register(LAYOUT_BF16, *kv_pool(LAYOUT_BF16, 8, 1))
        receiver.register(LAYOUT_BF16, *kv_pool(LAYOUT_BF16, 8, 2))
        assert sender.inner._encoder.adaptive.link_hint_bps == 1e9 / 8
        ratio = fp8_size((1, *LAYOUT_BF16.block_shape)) / LAYOUT_BF16.bytes_per_block_per_tensor
        assert sender.inner.expected_wire_ratio() == pytest.approx(ratio)
        peer = await sender.connect(receiver.descriptor())
        handle = receiver.expect("s", [0, 1])
        stats = await sender.send(peer, "s", [2, 3], [0, 1])
        await handle
        assert stats.codec == "fp8" and stats.bytes == round(stats.raw_bytes * ratio)
    finally:
        await sender.close()
        await receiver.close()


async def test_shaper_wire_ratio_emulates_a_codec_in_the_bytes_it_charges_and_counts() -> None:
    """The emulated benchmark's codec: the link sends the KV uncoded, the shaper charges its line and reports wire_ratio
    x the KV bytes (stats and SendProgress: the WAN byte counters), and refuses a link with a codec of its own."""
    from pdd.transports.receive_side import SendProgress

    sender = create_transport("inproc", {"shape": {"rate": "1gbit", "wire_ratio": 0.25}})
    receiver = create_transport("inproc", {})
    await sender.start()
    await receiver.start()
    try:
        sender.register(LAYOUT_BF16, *kv_pool(LAYOUT_BF16, 8, 1))
        receiver.register(LAYOUT_BF16, *kv_pool(LAYOUT_BF16, 8, 2))
        peer = await sender.connect(receiver.descriptor())
        handle = receiver.expect("w", [0, 1])
        progress = SendProgress()
        stats = await sender.send(peer, "w", [2, 3], [0, 1], progress=progress)
        got = await handle
        raw = 2 * LAYOUT_BF16.num_layers * 2 * LAYOUT_BF16.bytes_per_block_per_tensor
        assert stats.raw_bytes == got.raw_bytes == got.bytes == raw and stats.codec == got.codec == "none"
        assert stats.bytes == progress.crossed == raw // 4
    finally:
        await sender.close()
        await receiver.close()
    with pytest.raises(ValueError, match="wire_ratio emulates a codec"):
        create_transport("inproc", {"codec": "fp8", "shape": {"wire_ratio": 0.5}})
    for bad in (0, -0.5, 2.0):  # a ratio the simulator's link refuses too
        with pytest.raises(ValueError, match=r"wire_ratio is wire bytes per KV byte, in \(0, 1\]"):
            create_transport("inproc", {"shape": {"rate": "1gbit", "wire_ratio": bad}})


async def test_config_codec_reaches_the_transport() -> None:
    cfg = TransportConfig(name="inproc", codec="fp8+lossless", options={"max_frame_bytes": 4096})
    t = create_link_transport(cfg, {"bind_host": "127.0.0.1"})
    assert t.codec.name == "fp8+lossless" and t.max_frame_bytes == 4096
    with pytest.raises(ValueError, match="Input should be 'none', 'lossless', 'fp8' or 'fp8\\+lossless'"):
        TransportConfig(name="zmq", codec="zip")
    with pytest.raises(ValueError, match="transports.<link>.codec"):
        TransportConfig(name="zmq", options={"codec": "fp8"})
    with pytest.raises(ValueError, match="unknown KV codec"):
        create_transport("inproc", {"codec": "zip"})


async def test_rejected_coded_frame_fails_the_send_typed() -> None:
    """A receiver configured without the codec refuses the sender's coded frames (were connect's check skipped)."""
    sender, receiver = create_transport("inproc", {"codec": "fp8"}), create_transport("inproc")
    await sender.start()
    await receiver.start()
    try:
        sender.register(LAYOUT_BF16, *kv_pool(LAYOUT_BF16, 4, 1))
        receiver.register(LAYOUT_BF16, *kv_pool(LAYOUT_BF16, 4, 2))
        snap = snapshot((receiver._k, receiver._v))
        desc = {**receiver.descriptor(), "codec": "fp8"}  # a peer that lied about its codec
        peer = await sender.connect(desc)
        handle = receiver.expect("r", [0])
        with pytest.raises(RemoteRejected) as info:
            await sender.send(peer, "r", [1], [0])
        assert info.value.remote_kind == "CodecError"
        assert unchanged((receiver._k, receiver._v), snap)
        with pytest.raises(CodecError):
            await handle
    finally:
        await sender.close()
        await receiver.close()
