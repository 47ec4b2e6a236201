"""The router's playout buffer (router/playout.py): unit tests of the class on a real event loop."""

from __future__ import annotations

import asyncio
import time

from pdd.router.playout import MAX_STRETCH, HandoverCosts, Playout


class Client:
    """What the buffer released, with when."""

    def __init__(self) -> None:
        self.got: list[tuple[float, list[int]]] = []

    def release(self, tokens: list[int], logprobs: list) -> None:
        self.got.append((time.monotonic(), tokens))


def warmed(client: Client, gap: float = 0.02, positions: int = 6) -> Playout:
    """A buffer that saw the relay emit ``positions`` tokens ``gap`` apart."""
    playout = Playout(client.release, HandoverCosts())
    t = time.monotonic() - gap * positions
    for position in range(positions):
        playout.emitted(t + position * gap, position, 1)
    return playout


async def test_the_relays_last_tokens_are_released_paced() -> None:
    client = Client()
    playout = warmed(client)
    assert abs(playout.gap - 0.02) < 1e-6
    assert playout.hold([7], [], start=6, boundary=7) and playout.hold([8], [], start=7, boundary=7)
    assert playout.held == 2 and not client.got
    await asyncio.sleep(0.2)
    assert [tokens for _, tokens in client.got] == [[7], [8]]
    spacing = client.got[1][0] - client.got[0][0]
    assert spacing >= MAX_STRETCH * 0.02 * 0.9  # paced, not back to back (a timer never fires early: no flake)


async def test_main_decodes_first_token_releases_everything_at_once() -> None:
    client = Client()
    playout = warmed(client, gap=0.5)
    assert playout.hold([7, 8], [], start=6, boundary=8)
    assert not playout.hold([9], [], start=9, boundary=8)  # main decode's: past the boundary, never held
    playout.flush()
    assert [tokens for _, tokens in client.got] == [[7, 8]]
    await asyncio.sleep(0.05)
    assert len(client.got) == 1  # the cancelled timer released nothing twice


async def test_nothing_is_held_without_a_boundary_a_gap_or_before_position_two() -> None:
    client = Client()
    playout = warmed(client)
    assert not playout.hold([7], [], start=6, boundary=None)
    assert not playout.hold([1], [], start=1, boundary=5)  # TT2 is never held
    cold = Playout(client.release, HandoverCosts())
    assert not cold.hold([7], [], start=6, boundary=7)  # no gap known yet


async def test_close_drops_what_is_held() -> None:
    client = Client()
    playout = warmed(client)
    assert playout.hold([7], [], start=6, boundary=7)
    playout.close()
    await asyncio.sleep(0.1)
    assert not client.got and playout.held == 0


def test_the_stretch_follows_the_handovers_seen() -> None:
    """No handover seen: the busy case's stretch. Handovers that cost one gap and a bit (main decode idle, so
    no running step to wait for): held tokens go out closer to the relay's own pace; never faster than it, never
    slower than the busy case."""
    costs = HandoverCosts()
    assert costs.stretch() == MAX_STRETCH
    for _ in range(10):
        costs.record(1.2)
    assert abs(costs.stretch() - (2 + 1.2) / 3) < 1e-9  # the 90th percentile of equal costs
    costs.record(0.1)
    assert costs.stretch() >= 1.0
    for _ in range(40):
        costs.record(9.0)  # main decode queued: not the step clocks' phase, holding longer would not help
    assert costs.stretch() == MAX_STRETCH


async def test_main_decodes_arrival_records_the_handover_cost_once() -> None:
    client, costs = Client(), HandoverCosts()
    playout = Playout(client.release, costs)
    t = time.monotonic() - 0.12
    for position in range(6):
        playout.emitted(t + position * 0.02, position, 1)
    assert playout.hold([7], [], start=6, boundary=7)
    await asyncio.sleep(0.03)
    playout.flush(took_over=True)  # ~1.5 gaps after the relay's last (more on a slow machine)
    once = costs.stretch()
    assert 1.0 < once
    playout.flush(took_over=True)  # main decode's next tokens: nothing more to record (a second cost would move it)
    assert costs.stretch() == once
