"""Links to remote KV pools, shared by concurrent transfers: one connected ``Peer`` per (transport, pool).

A transfer holds the link while it sends (``hold`` ... ``release``). A transfer that lost the link
(``PeerLostError``) drops that link (``forget``) so the next transfer opens a fresh one; the dropped link
closes only once no transfer holds it. A pool that comes back with another descriptor (a restarted main
decoder on a new port) gets a fresh link at once, and the old one is dropped the same way: the first transfer
to the new process does not fail on the dead one. Closing a zmq link under a send cancels that send and fails later ones
on closed sockets: transfers that had nothing wrong with them. A failure reported late, after another
transfer already replaced the link, leaves the newer link alone.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pdd.shared.telemetry import get_logger
from pdd.transports import KVTransport, Peer

log = get_logger("pdd.peer_links")


@dataclass
class _Hold:
    """A link some transfers hold; ``retired``: dropped, to close when the last holder lets go."""

    peer: Peer
    users: int = 0
    retired: bool = False


class PeerLinks:
    """``transports``: the service's transports by kind ("fast", "wan"), the dict it keeps filling."""

    def __init__(self, transports: dict[str, KVTransport]) -> None:
        self.transports = transports
        self._peers: dict[tuple[str, str], Peer] = {}
        self._descriptors: dict[tuple[str, str], dict] = {}  # what each current link was opened to
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._holds: dict[int, _Hold] = {}  # by id(peer)

    @staticmethod
    def _key(kind: str, descriptor: dict) -> tuple[str, str]:
        return kind, str(descriptor.get("instance_id"))

    async def get(self, kind: str, descriptor: dict) -> Peer:
        """The link to the pool ``descriptor`` names, connected on first use."""
        key = self._key(kind, descriptor)
        async with self._locks.setdefault(key, asyncio.Lock()):
            if key in self._peers and self._descriptors[key] != descriptor:  # the pool's process was replaced
                await self._drop(kind, key, self._peers[key])
            if key not in self._peers:
                self._peers[key] = await self.transports[kind].connect(descriptor)
                self._descriptors[key] = dict(descriptor)
            return self._peers[key]

    async def hold(self, kind: str, descriptor: dict) -> Peer:
        """``get``, held by one transfer until its ``release``."""
        peer = await self.get(kind, descriptor)
        # no await since get() returned: a forget cannot slip in between
        self._holds.setdefault(id(peer), _Hold(peer)).users += 1
        return peer

    async def release(self, kind: str, peer: Peer) -> None:
        """One transfer is done with ``peer``; the last one out closes it if it was dropped meanwhile."""
        hold = self._holds.get(id(peer))
        if hold is None or hold.peer is not peer:
            return
        hold.users -= 1
        if hold.users <= 0:
            del self._holds[id(peer)]
            if hold.retired:
                await self._close(kind, peer)

    async def forget(self, kind: str, descriptor: dict, peer: Peer | None = None) -> None:
        """Drop the link so the next transfer to that pool opens a fresh one. ``peer``: the link that failed;
        only that one is dropped (a newer link stays). A held link closes when its last holder lets go."""
        key = self._key(kind, descriptor)
        current = self._peers.get(key)
        if current is None or (peer is not None and current is not peer):
            return  # already dropped (closed, or closing when its last holder lets go); a newer link stays
        await self._drop(kind, key, current)

    async def _drop(self, kind: str, key: tuple[str, str], current: Peer) -> None:
        del self._peers[key]
        del self._descriptors[key]
        hold = self._holds.get(id(current))
        holders = hold.users if hold is not None and hold.peer is current else 0
        log.info("peer_dropped", transport=kind, peer=key[1], closes_after_transfers=holders)
        if holders:
            hold.retired = True
        else:
            await self._close(kind, current)

    async def _close(self, kind: str, peer: Peer) -> None:
        try:  # shielded: a holder cancelled while it lets go must not leave the link half closed
            await asyncio.shield(self.transports[kind].disconnect(peer))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("disconnect_failed", error=str(exc))
