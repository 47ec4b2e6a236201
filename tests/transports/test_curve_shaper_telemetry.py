"""CURVE authentication, the in-process shaper, telemetry and `pdd keys`."""

from __future__ import annotations

import asyncio
import struct
import time

import pytest
import zmq
import zmq.asyncio
import zmq.auth

from pdd.transports import PeerLostError, create_transport
from pdd.transports.base import SendProgress
from pdd.transports.blocks import FramePlan
from pdd.transports.keys_cli import write_keypair

from .conftest import PLUGINS, Pair, layout_for, snapshot, unchanged

LAYOUT = layout_for("float16", layers=2)


async def test_curve_authorized_client_delivers(tmp_path) -> None:
    _, server_secret = write_keypair(tmp_path, "server")
    _, client_secret = write_keypair(tmp_path, "client")
    client_public = zmq.auth.load_certificate(str(client_secret))[0]
    async with Pair("zmq", LAYOUT,
                    sender_opts={"curve": {"secret_key_file": str(client_secret)}},
                    receiver_opts={"curve": {"secret_key_file": str(server_secret),
                                             "authorized_clients": [client_public.decode()]}}) as pair:
        assert "curve_public_key" in pair.receiver.descriptor()
        handle = pair.receiver.expect("enc", [1, 2])
        await pair.sender.send(pair.peer, "enc", [3, 4], [1, 2])
        await handle


async def test_curve_client_without_server_key_cannot_deliver(tmp_path) -> None:
    _, server_secret = write_keypair(tmp_path, "server")
    async with Pair("zmq", LAYOUT, receiver_opts={"curve": {"secret_key_file": str(server_secret)}}) as pair:
        snap = snapshot(pair.dst_pool)
        handle = pair.receiver.expect("r", [1, 2], timeout_s=60)
        desc = pair.receiver.descriptor()
        # 1) a plain client (no CURVE at all), 2) a CURVE client holding the wrong server key
        wrong = {**desc, "curve_public_key": zmq.curve_keypair()[0].decode()}
        for attempt in ({k: v for k, v in desc.items() if k != "curve_public_key"}, wrong):
            intruder = create_transport("zmq", {"connect_timeout_s": 1.0, "streams": 1})
            await intruder.start()
            intruder.register(LAYOUT, *pair.src_pool)
            with pytest.raises(PeerLostError, match="no handshake"):
                await intruder.connect(attempt)
            await intruder.close()
        # 3) a raw socket pushing a well-formed frame without CURVE: never acknowledged, never written
        header, payload = pair.sender._build_frame("r", FramePlan(0, 0, (0, 1), (1, 2)), None)
        raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        raw.linger = 0
        raw.connect(desc["address"])
        await raw.send_multipart([struct.pack(">Q", 1), header, bytes(payload)])
        assert await raw.poll(1000) == 0
        raw.close()
        assert not handle.done() and unchanged(pair.dst_pool, snap)


async def test_curve_unauthorized_client_key_is_refused(tmp_path) -> None:
    _, server_secret = write_keypair(tmp_path, "server")
    _, client_secret = write_keypair(tmp_path, "client")
    pair = Pair("zmq", LAYOUT, sender_opts={"curve": {"secret_key_file": str(client_secret)}, "connect_timeout_s": 1.0},
                receiver_opts={"curve": {"secret_key_file": str(server_secret), "authorized_clients": []}})
    with pytest.raises(PeerLostError, match="no handshake"):
        await pair.__aenter__()
    await pair.__aexit__(None, None, None)


async def test_shaper_delays_then_blackhole_fails_cleanly() -> None:
    async with Pair("inproc", LAYOUT) as pair:
        shaped = create_transport("inproc", {"shape": {"rate": "80mbit", "delay": "30ms", "jitter": "5ms"}})
        await shaped.start()
        shaped.register(LAYOUT, *pair.src_pool)
        peer = await shaped.connect(pair.receiver.descriptor())
        handle = pair.receiver.expect("s", [1, 2, 3])
        stats = await shaped.send(peer, "s", [0, 1, 2], [1, 2, 3])
        await handle
        assert stats.seconds >= 0.025  # at least the one-way delay minus jitter: shaping applied
        shaped.down_timeout_s = 0.3
        shaped.set_down(True)
        handle = pair.receiver.expect("cut", [4], timeout_s=1.0)
        with pytest.raises(PeerLostError, match="down"):
            await shaped.send(peer, "cut", [0], [4])
        with pytest.raises(Exception):
            await handle
        shaped.set_down(False)
        handle = pair.receiver.expect("back", [4])
        await shaped.send(peer, "back", [0], [4])
        await handle
        await shaped.close()


async def test_telemetry_metrics_and_span() -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from prometheus_client import REGISTRY

    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    before = REGISTRY.get_sample_value("pdd:kv_transfer_bytes_total", {"transport": "zmq", "direction": "send"}) or 0
    tracer = trace.get_tracer("test")
    async with Pair("zmq", LAYOUT) as pair:
        with tracer.start_as_current_span("request") as parent:
            carrier: dict[str, str] = {}
            from opentelemetry import propagate

            propagate.inject(carrier)
            handle = pair.receiver.expect("t", [1])
            stats = await pair.sender.send(pair.peer, "t", [0], [1], trace_context=carrier)
            await handle
    after = REGISTRY.get_sample_value("pdd:kv_transfer_bytes_total", {"transport": "zmq", "direction": "send"})
    assert after - before == stats.bytes
    assert REGISTRY.get_sample_value("pdd:kv_transfer_seconds_count", {"transport": "zmq"}) >= 2
    assert REGISTRY.get_sample_value("pdd:kv_transfer_gbps_count", {"transport": "zmq"}) >= 2
    spans = {s.name: s for s in exporter.get_finished_spans()}
    for name in ("kv.transfer.send", "kv.transfer.recv"):
        span = spans[name]
        assert span.attributes["pdd.kv.bytes"] == stats.bytes and "pdd.kv.gbps" in span.attributes
        assert span.context.trace_id == parent.get_span_context().trace_id


def test_keys_cli_writes_loadable_pair(tmp_path) -> None:
    from pdd.launch.cli import main

    assert main(["keys", "--out", str(tmp_path), "--name", "site-a"]) == 0
    public, secret = zmq.auth.load_certificate(str(tmp_path / "site-a.key_secret"))
    assert zmq.curve_public(secret) == public
    assert (tmp_path / "site-a.key_secret").stat().st_mode & 0o077 == 0
    assert main(["keys", "--out", str(tmp_path), "--name", "site-a"]) == 1  # no silent overwrite


@pytest.mark.parametrize("streams, line, flow, expected_s", [
    (1, "10gbit", "1gbit", 8e-3),  # one flow: a flow's rate, however wide the line
    (4, "10gbit", "1gbit", 2e-3),  # striped over 4 flows: 4x
    (4, "2gbit", "1gbit", 4e-3),  # the line caps what striping buys
])
def test_shaper_models_flows_and_the_line(streams, line, flow, expected_s) -> None:
    """With ``flow_rate`` a send is striped over the transport's ``streams`` flows: it crosses at
    min(streams x flow_rate, rate), and sends in a row share the line (``rate``)."""
    shaped = create_transport("inproc", {"streams": streams, "shape": {"rate": line, "flow_rate": flow}})
    nbytes = 1_000_000
    before = time.monotonic()
    _, arrival = shaped._schedule(nbytes, [before])
    after = time.monotonic()
    assert before + expected_s <= arrival <= after + expected_s
    line_s = nbytes * 8 / shaped.rate_bps
    _, second = shaped._schedule(nbytes, [time.monotonic()])  # another send: its own flows, the same line
    assert second >= before + 2 * line_s and second >= arrival


@pytest.mark.parametrize("name", PLUGINS)
async def test_progress_counts_every_acknowledged_byte(name) -> None:
    layout = layout_for(layers=4)
    async with Pair(name, layout) as pair:
        handle = pair.receiver.expect("p", [1, 2, 3])
        progress = SendProgress()
        stats = await pair.sender.send(pair.peer, "p", [0, 1, 2], [1, 2, 3], progress=progress)
        await handle
        assert progress.crossed == stats.bytes == 2 * 4 * 3 * layout.bytes_per_block_per_tensor


async def test_a_cancelled_shaped_send_reports_the_layers_that_crossed() -> None:
    """The relay finished first and P gave up on the transfer: the layers already across were sent all the
    same (P counts them as WAN bytes), the ones still waiting for the emulated line never go."""
    layout = layout_for(layers=8)
    per_layer = 2 * 4 * layout.bytes_per_block_per_tensor  # K and V of 4 blocks
    async with Pair("zmq", layout) as pair:
        # one layer per 50 ms through the emulated line, then 200 ms on the wire: the send would take 600 ms
        shaped = create_transport("zmq", {"shape": {"rate": f"{per_layer * 8 / 0.05:.0f}bit", "delay": "200ms"}})
        await shaped.start()
        shaped.register(layout, *pair.src_pool)
        peer = await shaped.connect(pair.receiver.descriptor())
        pair.receiver.expect("c", [1, 2, 3, 4], timeout_s=5.0)
        progress = SendProgress()
        send = asyncio.create_task(shaped.send(peer, "c", [0, 1, 2, 3], [1, 2, 3, 4], progress=progress))
        await asyncio.sleep(0.18)
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        pair.receiver.cancel("c")
        # the layers through the line by the cancel (3 at 0.18 s: at 0.05, 0.10, 0.15 s) crossed, although none
        # had reached the receiver yet; the rest never go
        assert progress.crossed % per_layer == 0
        assert 2 * per_layer <= progress.crossed < 8 * per_layer
        await shaped.close()


@pytest.mark.parametrize("plugin", [p for p in PLUGINS if getattr(p, "values", [p])[0] in ("zmq", "ucx")])
async def test_a_cancelled_send_hands_no_more_frames_to_the_link(plugin: str) -> None:
    """A cancelled send (the relay finished the request first) stops at the next frame (zmq) or batch (ucx)
    boundary: what was not yet handed to the link never crosses, where before the send ran to its end behind
    its shield."""
    layout = layout_for(layers=8)
    blocks = list(range(20))
    total = 2 * len(blocks) * layout.num_layers * layout.bytes_per_block_per_tensor
    one_frame = layout.bytes_per_block_per_tensor  # a frame each, one unacknowledged at a time: ~320 round trips
    opts = {"max_frame_bytes": one_frame, "window_bytes": one_frame, "batch_bytes": one_frame}
    async with Pair(plugin, layout, sender_opts=opts) as pair:
        pair.receiver.expect("stop", blocks, timeout_s=10.0)
        progress = SendProgress()
        send = asyncio.create_task(pair.sender.send(pair.peer, "stop", blocks, blocks, progress=progress))
        while progress.crossed == 0:
            await asyncio.sleep(0.001)
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        last = -1
        while progress.crossed != last:  # until the acknowledgements still under way are in
            last = progress.crossed
            await asyncio.sleep(0.2)
        assert 0 < progress.crossed < total  # the receiver, still expecting every block, would have taken them
        pair.receiver.cancel("stop")
