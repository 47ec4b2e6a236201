"""A request that finds no live instance of a role it needs waits for one (router.instance_wait_s, inside its
deadline), then gets 503 with Retry-After; past router.max_waiting_requests it gets 429 with Retry-After."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdd.router.errors import APIError
from pdd.router.orchestrator import Orchestrator
from pdd.router.registry import Registry
from pdd.router.routing import NO_PREFILL
from pdd.router.types import GenerationError, GenerationRequest
from pdd.shared.config import PDDConfig
from pdd.shared.protocol import SamplingSpec


class _Routing:
    """Refuses (no prefill) until ``ready`` is set, then routes."""

    def __init__(self) -> None:
        self.ready = False
        self.calls = 0

    async def route(self, req, exclude=frozenset()):
        self.calls += 1
        if not self.ready:
            raise GenerationError(503, NO_PREFILL, "no prefill instance is available; retry later")
        return "route"


def _orchestrator(wait_s: float, max_waiting: int = 256) -> tuple[Orchestrator, _Routing]:
    config = PDDConfig()
    config.router.instance_wait_s = wait_s
    config.router.max_waiting_requests = max_waiting
    orch = Orchestrator(config, bus=None, registry=Registry(bus=None), router_id="r-test")  # type: ignore[arg-type]
    orch.routing = _Routing()  # type: ignore[assignment]
    return orch, orch.routing  # type: ignore[return-value]


def _request(deadline_s: float = 60.0) -> GenerationRequest:
    return GenerationRequest("req-1", [1, 2, 3], SamplingSpec(max_tokens=4), time.time() + deadline_s)


async def test_waits_for_an_instance_to_come_back() -> None:
    orch, routing = _orchestrator(wait_s=10.0)
    task = asyncio.create_task(orch.route(_request()))
    await asyncio.sleep(0.2)
    assert not task.done() and orch.waiting == 1
    routing.ready = True
    orch.registry._changed()  # an instance (re)joined
    assert await asyncio.wait_for(task, 2.0) == "route" and orch.waiting == 0


async def test_gives_up_with_503_and_retry_after_inside_the_deadline() -> None:
    orch, routing = _orchestrator(wait_s=10.0)
    t0 = time.monotonic()
    with pytest.raises(GenerationError) as exc:
        await orch.route(_request(deadline_s=0.6))  # the deadline comes before instance_wait_s
    assert time.monotonic() - t0 < 3.0 and routing.calls >= 2
    assert exc.value.http_status == 503 and exc.value.code == NO_PREFILL and exc.value.retry_after_s == 10.0
    response = APIError.from_generation_error(exc.value).response()
    assert response.status_code == 503 and response.headers["Retry-After"] == "10"


async def test_too_many_waiting_get_429_with_retry_after() -> None:
    orch, _ = _orchestrator(wait_s=5.0, max_waiting=1)
    first = asyncio.create_task(orch.route(_request()))
    await asyncio.sleep(0.1)
    with pytest.raises(GenerationError) as exc:
        await orch.route(_request())
    assert exc.value.http_status == 429 and exc.value.code == "too_many_waiting"
    response = APIError.from_generation_error(exc.value).response()
    assert response.status_code == 429 and response.headers["Retry-After"] == "5"
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert orch.waiting == 0


async def test_other_refusals_do_not_wait() -> None:
    orch, routing = _orchestrator(wait_s=10.0)

    async def refuse(req, exclude=frozenset()):
        raise GenerationError(400, "invalid_request", "bad")

    routing.route = refuse  # type: ignore[method-assign]
    with pytest.raises(GenerationError) as exc:
        await asyncio.wait_for(orch.route(_request()), 1.0)
    assert exc.value.http_status == 400 and orch.waiting == 0
