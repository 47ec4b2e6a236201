"""EngineRunner, the engine's thread: calls made by a task that gets cancelled still run."""

from __future__ import annotations

import asyncio
import threading

from pdd.roles.engine_runner import EngineRunner


async def test_queued_call_runs_although_its_caller_is_cancelled() -> None:
    """Regression (found by tests/fuzz/test_fuzz_http.py): prefill's request task, cancelled by a
    Cancel while its ``finally`` waited to release the request on the busy engine thread, dropped the
    release, and the prompt's KV blocks stayed allocated for good."""
    runner = EngineRunner(engine=None)  # call() never touches the engine
    gate = threading.Event()
    released: list[str] = []
    busy = asyncio.create_task(runner.call(gate.wait, 10))  # the engine thread is in a step
    await asyncio.sleep(0.05)

    async def request_task() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await runner.call(released.append, "r1")  # cleanup, queued behind the step

    task = asyncio.create_task(request_task())
    await asyncio.sleep(0.05)
    task.cancel()  # the request is cancelled: its finally queues the release...
    await asyncio.sleep(0.05)
    task.cancel()  # ...and a second cancel (the Cancel message) lands while the release waits
    await asyncio.gather(task, return_exceptions=True)
    gate.set()
    await busy
    await runner.call(lambda: None)  # one thread, FIFO: everything queued before has run
    assert released == ["r1"]
    runner._executor.shutdown(wait=True)
