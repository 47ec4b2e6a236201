"""The decoder's lease on one request (roles/decoder_service.py ``_lease``), as a unit: its KV lands at the first
transfer check, and the request must then live until its own deadline, counted from when the lease began. A
regression: the rest of the wait was counted from the check instead, so a resumed request still decoding at the
first check (5 s) was dropped (`request_deadline_expired`) and its client got "no decode instance is left"."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from pdd.roles import decoder_service
from pdd.roles.decoder_service import DecoderService


@pytest.mark.asyncio
async def test_a_request_whose_kv_landed_lives_until_its_deadline(monkeypatch) -> None:
    monkeypatch.setattr(decoder_service, "TRANSFER_CHECK_S", 0.05)
    dropped: list[float] = []

    async def drop(rid: str) -> None:
        dropped.append(time.monotonic())

    service = SimpleNamespace(incoming={"r": SimpleNamespace(first_token=7)}, drop=drop)
    start = time.monotonic()
    lease = asyncio.create_task(DecoderService._lease(service, "r", 1.0, 1.0))  # type: ignore[arg-type]
    await asyncio.sleep(0.5)  # well past the first check (0.05 s), well before the deadline (1 s)
    assert not dropped, "dropped before its deadline"
    await lease
    assert len(dropped) == 1 and dropped[0] - start >= 1.0
