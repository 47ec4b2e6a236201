"""What the loadgen tests share: an aiohttp app served on a free local port, and `pdd bench` run from a test."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

from aiohttp import web


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """The app's base URL while it serves on 127.0.0.1."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def run_bench(argv: list[str]) -> int:
    """`pdd bench ARGV` (the CLI runs its own event loop, so on a thread)."""
    from pdd.launch.cli import main

    return await asyncio.to_thread(main, ["bench", *argv])
