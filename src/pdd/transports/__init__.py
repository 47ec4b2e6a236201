"""KV transport plugins (inproc, zmq, ucx) behind one interface; see base.py (interface) and plugins.py (registry).

The names below load their module on first use (PEP 562): ``pdd.transports.units`` (the WAN shaper's unit
parser, which compose/wan/shape.sh imports) loads without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "KVTransport": "base", "Peer": "base", "IncompatiblePeerError": "errors", "PeerLostError": "errors",
    "RemoteRejected": "errors", "TransferCancelled": "errors", "TransferError": "errors",
    "TransferTimeout": "errors", "FrameError": "frames", "available_transports": "plugins",
    "create_transport": "plugins", "create_link_transport": "plugins", "register_transport": "plugins",
    "ucx_available": "plugins",
    "TransferHandle": "receive_side", "TransferStats": "receive_side",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pdd.transports' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pdd.transports.{_EXPORTS[name]}"), name)
