"""Batches on the bus (shared/protocol.py ``Batch``, ``Bus.publish_batch``), over a real nats-server: the
receiver's handler sees every item, in order, as if each had been published alone; a bad item is rejected
alone; a batch never nests and is never a request. The engine services' outbox publishes an engine step's
token chunks for one router this way (services/engine_service.py)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from pdd.shared import protocol
from pdd.shared.bus import REJECTED, Bus, _metric_subject
from pdd.shared.config import NatsConfig
from pdd.shared.protocol import Batch, Cancel, ProtocolError, TokenChunk
from pdd.shared.roles import Role


def chunk(rid: str, start: int) -> TokenChunk:
    return TokenChunk(rid, "md-0", Role.MAIN_DECODE, start, [100 + start])


def test_batch_round_trip_and_strict_items() -> None:
    messages = [chunk("a", 0), Cancel("b", reason="x"), chunk("a", 1)]
    batch = protocol.decode(protocol.encode_batch(messages))
    assert isinstance(batch, Batch)
    assert [protocol.decode_envelope(item) for item in batch.items] == messages
    with pytest.raises(ProtocolError, match="unexpected_type|expected one of"):
        protocol.decode_envelope(batch.items[1], expect=TokenChunk)
    with pytest.raises(ProtocolError):
        protocol.decode_envelope({"v": protocol.SCHEMA_VERSION, "t": "tokens", "d": {"request_id": 5}})


async def _collect(bus: Bus, subject: str, got: list) -> None:
    async def on(message, _envelope):
        got.append(message)
    await bus.subscribe(subject, on, expect=TokenChunk)


async def test_publish_batch_delivers_each_item_in_order(nats_url) -> None:
    sender, receiver = Bus(NatsConfig(url=nats_url), "sender"), Bus(NatsConfig(url=nats_url), "receiver")
    await sender.connect()
    await receiver.connect()
    try:
        got: list = []
        await _collect(receiver, "pdd.router.test.events", got)
        await receiver.sync()
        sent = [chunk(f"r{i % 3}", i) for i in range(50)]
        await sender.publish_batch("pdd.router.test.events", sent[:1])  # one alone goes as itself
        await sender.publish_batch("pdd.router.test.events", sent[1:])
        for _ in range(200):
            if len(got) == len(sent):
                break
            await asyncio.sleep(0.02)
        assert got == sent

        # a bad item (wrong type for this subscription, or garbage) is rejected alone; the others arrive
        counter = REJECTED.labels(subject=_metric_subject("pdd.router.test.events"), code="unexpected_type")
        rejected = counter._value.get()
        mixed = [protocol._envelope(chunk("m", 0)), protocol._envelope(Cancel("m", reason="x")),
                 protocol._envelope(chunk("m", 1))]
        nested = {"v": protocol.SCHEMA_VERSION, "t": "batch", "d": {"items": [mixed[0]]}}
        data = msgpack.packb({"v": protocol.SCHEMA_VERSION, "t": "batch", "d": {"items": [*mixed, nested]}})
        got.clear()
        await sender.nc.publish("pdd.router.test.events", data)
        for _ in range(200):
            if len(got) == 2:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert got == [chunk("m", 0), chunk("m", 1)]
        assert counter._value.get() == rejected + 2  # the Cancel and the nested batch

        # a batch is never a request: the requester gets a protocol error, the handler nothing
        got.clear()
        reply = await sender.nc.request("pdd.router.test.events", protocol.encode_batch([chunk("q", 0)]), timeout=5)
        assert protocol.decode(reply.data).code == "protocol_error"
        assert got == []
    finally:
        await sender.close()
        await receiver.close()
