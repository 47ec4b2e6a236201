"""In-process transport for unit tests: same API and validation path, real copies, no sockets.

Frames are encoded, checked and written exactly as on the wire; only the socket is missing.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from .base import KVTransport, Peer, SendProgress
from .blocks import FramePlan
from .errors import PeerLostError, RemoteRejected
from .frames import FrameError

_ENDPOINTS: "weakref.WeakValueDictionary[str, InprocTransport]" = weakref.WeakValueDictionary()


class InprocTransport(KVTransport):
    name = "inproc"

    async def _start(self) -> None:
        _ENDPOINTS[self.instance_id] = self

    def _address(self) -> dict:
        return {"address": f"inproc://{self.instance_id}"}

    async def _connect(self, peer: Peer) -> Any:
        if self._target(peer) is None:
            raise PeerLostError(f"no inproc transport at {peer.descriptor.get('address')}")
        return None

    def _target(self, peer: Peer) -> "InprocTransport | None":
        return _ENDPOINTS.get(str(peer.descriptor.get("address", "")).removeprefix("inproc://"))

    async def _send_frames(self, peer: Peer, request_id: str, plans: list[FramePlan],
                           trace_context: dict | None, progress: SendProgress) -> int:
        return await asyncio.to_thread(self._deliver_all, peer, request_id, plans, trace_context, progress)

    def _deliver_all(self, peer: Peer, request_id: str, plans: list[FramePlan], tc: dict | None,
                     progress: SendProgress) -> int:
        total = 0
        for plan in plans:
            target = self._target(peer)
            if target is None or not target._started:
                raise PeerLostError(f"inproc peer {peer.peer_id} is gone", request_id)
            header, payload = self._build_frame(request_id, plan, tc)
            try:
                received = target._receive_frame(header, payload)
            except FrameError as exc:
                raise RemoteRejected(f"receiver rejected frame: {exc}", request_id, type(exc).__name__) from exc
            total += received
            progress.crossed += received
        return total

    async def _close(self) -> None:
        _ENDPOINTS.pop(self.instance_id, None)
