"""``Bus.request`` under cancellation (unit test of the class; nats-py's client is replaced by one that waits
for its reply exactly as nats-py does, with ``asyncio.wait_for``).

Found by the HTTP fuzzer: on Python 3.11 ``wait_for`` returns a reply that lands in the same loop turn as a
cancellation and drops the cancellation. P's prepare step, cancelled because its request had just ended,
then returned an import plan; the transfer awaiting it went on waiting for blocks that never came, and P held
the prompt's KV blocks forever."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdd.shared.bus import Bus
from pdd.shared.config import NatsConfig
from pdd.shared.protocol import Cancel


class _ReplyRacesCancel:
    """A NATS client whose reply arrives in the very turn its caller is cancelled."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply

    async def request(self, subject: str, payload: bytes, timeout: float, headers: dict | None = None):
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        asyncio.current_task().cancel()  # the caller gives up ...
        answer.set_result(SimpleNamespace(data=self.reply))  # ... as the reply lands
        return await asyncio.wait_for(answer, timeout)  # how nats-py waits for a reply


def _bus(reply: bytes) -> Bus:
    bus = Bus(NatsConfig(url="nats://127.0.0.1:1"), "unit")
    bus.nc = _ReplyRacesCancel(reply)
    bus._open.set()  # connected
    return bus


async def test_a_cancelled_request_never_returns_its_reply() -> None:
    bus = _bus(Cancel("r1", reason="x").encode())
    call = asyncio.create_task(bus.request("pdd.test", Cancel("r1", reason="x"), timeout=5))
    with pytest.raises(asyncio.CancelledError):
        await call
    assert call.cancelled()


async def test_an_uncancelled_request_returns_its_reply() -> None:
    class _Reply(_ReplyRacesCancel):
        async def request(self, subject: str, payload: bytes, timeout: float, headers: dict | None = None):
            return SimpleNamespace(data=self.reply)

    bus = Bus(NatsConfig(url="nats://127.0.0.1:1"), "unit")
    bus.nc = _Reply(Cancel("r1", reason="ok").encode())
    bus._open.set()
    assert await bus.request("pdd.test", Cancel("r1", reason="x"), timeout=5) == Cancel("r1", reason="ok")
