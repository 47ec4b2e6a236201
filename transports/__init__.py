"""KV transport plugins (inproc, zmq, ucx) behind one interface; see base.py (interface) and plugins.py (registry)."""

from .base import KVTransport, Peer
from .errors import (
                     IncompatiblePeerError,
                     PeerLostError,
                     RemoteRejected,
                     TransferCancelled,
                     TransferError,
                     TransferTimeout,
)
from .frames import FrameError
from .plugins import available_transports, create_transport, register_transport, ucx_available
from .receive_side import TransferHandle, TransferStats

__all__ = ["KVTransport", "Peer", "TransferHandle", "TransferStats", "create_transport",
           "register_transport", "available_transports", "TransferError", "TransferTimeout",
           "PeerLostError", "TransferCancelled", "IncompatiblePeerError", "RemoteRejected", "FrameError", "ucx_available"]
