"""Drive one engine from asyncio without blocking the event loop.

All engine calls run on one dedicated worker thread (the engine is not thread-safe and need not
be). A loop task steps the engine while it has work and hands each StepOutput to the callback
registered for its request, and to a request's block watcher the prompt blocks whose KV is final (P streams
its export from them while later chunks compute). Control calls (abort, extend, stop) queue on the same thread, so
they land between two steps, never during one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

from pdd.engine import StepOutput
from pdd.engine.interface import EngineBackend, load_engine
from pdd.shared.config import PDDConfig
from pdd.shared.telemetry import get_logger

log = get_logger("pdd.engine_runner")
T = TypeVar("T")

OutputCallback = Callable[[StepOutput], None]
BlocksCallback = Callable[[list[int]], None]


class EngineRunner:
    def __init__(self, engine: EngineBackend):
        self.engine = engine
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._callbacks: dict[str, OutputCallback] = {}
        self._block_watchers: dict[str, BlocksCallback] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.steps = 0

    @classmethod
    async def load(cls, config: PDDConfig, role: str, cache_finished: bool) -> "EngineRunner":
        """Build the config's engine for ``role`` on a worker thread (seconds for real checkpoints)."""
        engine = await asyncio.to_thread(load_engine, config, role, cache_finished)
        return cls(engine)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="engine-loop")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the engine thread, between steps.

        Once queued, ``fn`` runs even if the caller is cancelled while it waits for the engine thread:
        a cleanup call (``abort``, ``release``) in a cancelled task's ``finally`` must not be dropped,
        or the request's KV blocks stay allocated forever.
        """
        return await asyncio.shield(self.queue(fn, *args, **kwargs))

    def queue(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """``call`` from synchronous code (an output callback): queued now, so it lands before the next step."""
        return asyncio.get_running_loop().run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def watch(self, rid: str, callback: OutputCallback) -> None:
        self._callbacks[rid] = callback
        self.wake()

    def watch_blocks(self, rid: str, callback: BlocksCallback) -> None:
        """After every step, ``callback`` gets ``rid``'s prompt blocks whose KV is final so far
        (``computed_prompt_blocks``), until ``unwatch``."""
        self._block_watchers[rid] = callback

    def unwatch(self, rid: str) -> None:
        self._callbacks.pop(rid, None)
        self._block_watchers.pop(rid, None)

    def wake(self) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            has_work = await self.call(self.engine.has_work)
            if not has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs, blocks = await self.call(self._step)
            except Exception:
                log.exception("engine_step_failed")
                await asyncio.sleep(0.05)
                continue
            self.steps += 1
            for rid, computed in blocks.items():  # before the outputs: a finished prefill's blocks come first
                watcher = self._block_watchers.get(rid)
                if watcher is not None:
                    try:
                        watcher(computed)
                    except Exception:
                        log.exception("blocks_callback_failed", request_id=rid)
            for out in outputs:
                callback = self._callbacks.get(out.rid)
                if callback is None:
                    continue
                try:
                    callback(out)
                except Exception:
                    log.exception("output_callback_failed", request_id=out.rid)
                if out.finished:
                    self._callbacks.pop(out.rid, None)
            await asyncio.sleep(0)  # let bus handlers run between steps

    def _step(self) -> tuple[list[StepOutput], dict[str, list[int]]]:
        """One engine step, then the watched requests' final prompt blocks (on the engine thread, between steps)."""
        outputs = self.engine.step()
        blocks = {rid: self.engine.computed_prompt_blocks(rid) for rid in list(self._block_watchers)
                  if self.engine.has_request(rid)}
        return outputs, blocks
