"""How the router learns each instance's prefix hit (services/router/routing.py, prefix_index.py).

A cold instance (no cache events seen yet) is asked over the bus with the whole prompt: for a 64K-token
prompt that costs tens of milliseconds on the TTFT path, once per cold instance. An instance whose announce
says it holds no block cannot hold any of the prompt, so it is not asked. A restarted instance's first cache
events say ``cleared``, so the index drops what the earlier process under that id held.
"""

from __future__ import annotations

from pdd.router.prefix_index import PrefixIndex
from pdd.router.registry import Registry
from pdd.router.routing import Routing
from pdd.router.wan_health import WanHealth
from pdd.shared.block_hash import prefix_block_hashes
from pdd.shared.config import PDDConfig
from pdd.shared.protocol import Announce, CacheEvents, CacheQuery, CacheQueryReply
from pdd.shared.roles import Role

BS = 16
PROMPT = list(range(100, 100 + 8 * BS))


def _announce(iid: str, role: Role, cached_blocks: int) -> Announce:
    return Announce(instance_id=iid, role=role, site="site-a", state="ready", load=0.0, running_requests=0,
                    free_kv_blocks=10, total_kv_blocks=10, heartbeat_ms=500,
                    cache_summary={"block_size": BS, "cached_blocks": cached_blocks})


class _Bus:
    """Answers cache queries: each instance holds ``holds[instance]`` tokens of any prompt."""

    def __init__(self, holds: dict[str, int]) -> None:
        self.holds = holds
        self.asked: list[str] = []

    async def request(self, subject: str, message, timeout: float, expect) -> CacheQueryReply:
        assert isinstance(message, CacheQuery)
        iid = subject.split(".")[-2]
        self.asked.append(iid)
        return CacheQueryReply(instance_id=iid, cached_tokens=self.holds[iid])


def _routing(bus: _Bus, *announces: Announce) -> tuple[Routing, PrefixIndex]:
    registry = Registry(bus=None)
    for a in announces:
        registry.observe(a)
    index = PrefixIndex()
    return Routing(PDDConfig(), bus, registry, index, WanHealth(probe=None, interval_s=1.0)), index


async def test_a_cold_instance_that_holds_nothing_is_not_asked() -> None:
    bus = _Bus({"p-0": 0, "p-1": 3 * BS})
    routing, _ = _routing(bus, _announce("p-0", Role.PREFILL, cached_blocks=0),
                          _announce("p-1", Role.PREFILL, cached_blocks=5))
    hashes = prefix_block_hashes(PROMPT, BS)
    empty, holding = (routing.registry.get(i) for i in ("p-0", "p-1"))
    assert await routing.cached_tokens(empty, PROMPT, hashes, BS) == 0
    assert await routing.cached_tokens(holding, PROMPT, hashes, BS) == 3 * BS
    assert bus.asked == ["p-1"]


async def test_an_indexed_instance_is_answered_from_the_index() -> None:
    bus = _Bus({})
    routing, index = _routing(bus, _announce("md-0", Role.MAIN_DECODE, cached_blocks=5))
    hashes = prefix_block_hashes(PROMPT, BS)
    index.apply(CacheEvents("md-0", stored=hashes[:5]))
    assert await routing.cached_tokens(routing.registry.get("md-0"), PROMPT, hashes, BS) == 5 * BS
    assert bus.asked == []


def test_cleared_events_drop_an_earlier_process_blocks() -> None:
    index = PrefixIndex()
    hashes = prefix_block_hashes(PROMPT, BS)
    index.apply(CacheEvents("md-0", stored=hashes))
    index.apply(CacheEvents("md-0", stored=hashes[:2], cleared=True))  # the restarted process's first events
    assert index.overlap_tokens("md-0", hashes, BS) == 2 * BS
