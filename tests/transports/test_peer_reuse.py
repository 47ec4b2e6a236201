"""One shared link per remote pool (services/peer_links.py: PeerLinks.hold / release / forget), over real zmq
sockets: a transfer that loses the link drops only that link, and never closes it under the other
transfers still sending on it; a failure reported late leaves the newer link alone. And a zmq link
closed under a send fails it with PeerLostError, never with a socket error.

Seen in a chaos run (WAN cut): one transfer's PeerLostError closed the link its concurrent transfers to
the same main decoder were sending on (they failed with "Socket operation on non-socket"), and a late
PeerLostError from an old transfer closed the new link a later transfer had just opened.
"""

from __future__ import annotations

import asyncio

import pytest

from pdd.roles.peer_links import PeerLinks
from pdd.transports.errors import PeerLostError
from tests.transports.conftest import Pair, layout_for


def _service(transport) -> PeerLinks:
    return PeerLinks({"wan": transport})


async def _moves(pair: Pair, peer, rid: str, src: list[int], dst: list[int]) -> None:
    handle = pair.receiver.expect(rid, dst, timeout_s=10)
    await asyncio.wait_for(pair.sender.send(peer, rid, src, dst), 10)
    await asyncio.wait_for(handle.wait(), 10)


async def test_a_lost_transfer_drops_only_its_link_and_only_once_free() -> None:
    async with Pair("zmq", layout_for("float32")) as pair:
        svc, desc = _service(pair.sender), pair.receiver.descriptor()
        first = await svc.hold("wan", desc)  # transfer A
        other = await svc.hold("wan", desc)  # transfer B, concurrent, to the same pool
        assert other is first
        # A loses the link: it is dropped, but B still sends on it
        await svc.forget("wan", desc, first)
        await svc.release("wan", first)
        await _moves(pair, other, "b", [1, 2], [3, 4])
        # a later transfer C opens a new link
        newer = await svc.hold("wan", desc)
        assert newer is not first
        # a late failure on the old link (B's, say) must not drop C's link
        await svc.forget("wan", desc, other)
        assert await svc.get("wan", desc) is newer
        # B lets go: the old link closes now, C's keeps serving
        await svc.release("wan", other)
        assert first.state not in pair.sender._links
        with pytest.raises(PeerLostError):
            await pair.sender.send(first, "late", [1], [5])
        await _moves(pair, newer, "c", [5, 6], [7, 8])
        await svc.release("wan", newer)
        # dropped with nobody holding it: closed at once
        await svc.forget("wan", desc, newer)
        assert newer.state not in pair.sender._links
        assert await svc.get("wan", desc) not in (first, newer)


async def test_send_on_a_link_closed_under_it_is_a_lost_peer() -> None:
    layout = layout_for("float32")
    async with Pair("zmq", layout, sender_opts={"max_frame_bytes": 256, "window_bytes": 512}) as pair:
        pair.receiver.expect("mid", list(range(12)), timeout_s=10)
        send = asyncio.create_task(pair.sender.send(pair.peer, "mid", list(range(12)), list(range(12))))
        await asyncio.sleep(0)  # under way (many small frames, a small window)
        await pair.sender.disconnect(pair.peer)
        with pytest.raises(PeerLostError):
            await asyncio.wait_for(send, 10)
        with pytest.raises(PeerLostError):  # and after: "link closed", not ENOTSOCK
            await asyncio.wait_for(pair.sender.send(pair.peer, "after", [1], [1]), 10)


async def test_a_pool_back_with_another_descriptor_gets_a_fresh_link() -> None:
    """A main decoder restarted under the same instance id listens on a new port: the next transfer connects
    there at once instead of failing on the link to the dead process, which is closed (once nobody holds it)."""
    layout = layout_for("float32")
    async with Pair("zmq", layout) as pair, Pair("zmq", layout) as restarted:
        svc, desc = _service(pair.sender), pair.receiver.descriptor()
        old = await svc.hold("wan", desc)
        moved = {**restarted.receiver.descriptor(), "instance_id": desc["instance_id"]}  # same id, new port
        assert moved["address"] != desc["address"]
        fresh = await svc.get("wan", moved)
        assert fresh is not old and await svc.get("wan", moved) is fresh
        assert old.state in pair.sender._links  # still held by a transfer: not closed under it
        await svc.release("wan", old)
        assert old.state not in pair.sender._links
        back = await svc.get("wan", desc)  # and back again: a fresh link, the unused one closed at once
        assert back not in (old, fresh) and fresh.state not in pair.sender._links
        await _moves(pair, back, "r", [1, 2], [3, 4])
