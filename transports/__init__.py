"""KV transport plugins (inproc, zmq, ucx) behind one interface; see base.py."""

from .base import (KVTransport, Peer, available_transports, create_transport, register_transport,
                   ucx_available)
from .errors import (IncompatiblePeerError, PeerLostError, RemoteRejected, TransferCancelled,
                     TransferError, TransferTimeout)
from .frames import FrameError
from .receiver import TransferHandle, TransferStats

__all__ = ["KVTransport", "Peer", "TransferHandle", "TransferStats", "create_transport",
           "register_transport", "available_transports", "TransferError", "TransferTimeout",
           "PeerLostError", "TransferCancelled", "IncompatiblePeerError", "RemoteRejected", "FrameError", "ucx_available"]
