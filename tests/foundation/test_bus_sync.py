"""``Bus.sync`` (``flush_barrier``) is a barrier: once it returns, the server has processed every command the bus
sent before it, so a subscription made just before is live for a message another connection publishes next.

nats-py 2.16's ``flush()`` alone is not: its PING is written straight to the socket, ahead of a SUB still queued
for the client's flusher task, so the PONG can return before the SUB reaches the server (a message published
right after then reaches nobody: about 1 run in 40 of tests/foundation/test_bus_reconnect.py did that). Read from
the real nats-server's protocol trace (``-V``), which logs each client operation in the order it handles them."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from pdd.launch.natsserver import start_nats_server
from pdd.shared.bus import Bus
from pdd.shared.config import NatsConfig
from pdd.shared.protocol import Ping

OPERATION = re.compile(r"<<- \[(SUB \S+|PING)")


async def _operations(log: Path, pongs: int) -> list[str]:
    """The client operations the server has traced, once it has answered ``pongs`` PINGs."""
    for _ in range(100):
        text = log.read_text()
        if text.count("->> [PONG]") >= pongs:
            return OPERATION.findall(text)
        await asyncio.sleep(0.02)
    raise AssertionError(f"the server traced fewer than {pongs} PONGs:\n{log.read_text()[-2000:]}")


async def test_sync_returns_only_after_the_server_has_the_subscription(tmp_path) -> None:
    log = tmp_path / "nats.log"
    server = start_nats_server(log_file=str(log), extra_args=["-V"])
    bus = Bus(NatsConfig(url=server.url), "sync")
    try:
        await bus.connect()

        async def handler(_message, _envelope) -> None:
            return None

        for n, subject in enumerate(("t.first", "t.second")):
            await bus.subscribe(subject, handler, expect=Ping)
            await bus.sync()
            pongs = log.read_text().count("->> [PONG]")  # the server answered sync's last PING before it returned
            ops = await _operations(log, pongs)
            pings = [i for i, op in enumerate(ops) if op == "PING"]
            assert ops.index(f"SUB {subject}") < pings[-1], (n, ops)  # the last PING followed the SUB
    finally:
        await bus.close()
        server.stop()
