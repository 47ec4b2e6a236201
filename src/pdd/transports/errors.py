"""Typed transfer failures.

Callers (prefill, relay, decode services) branch on the *kind* of failure — retry on a lost peer,
fall back to recompute on a timeout, log and drop on a bad frame — so every failure a transport
reports is one of these classes, never a bare socket exception.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base class: a KV transfer did not complete."""

    code = 1  # wire code used in negative acknowledgements

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class TransferTimeout(TransferError):
    """The expected blocks did not all arrive before the deadline."""

    code = 2


class PeerLostError(TransferError):
    """The other side disconnected, died, or stopped acknowledging frames."""

    code = 3


class TransferCancelled(TransferError):
    """cancel(request_id) was called, or the transport closed, before completion."""

    code = 4


class IncompatiblePeerError(TransferError):
    """The peer's descriptor names another transport or a different KV page layout."""

    code = 5


class RemoteRejected(TransferError):
    """The receiver rejected one of our frames; ``remote_kind`` names its error class."""

    code = 6

    def __init__(self, message: str, request_id: str | None = None, remote_kind: str = "") -> None:
        super().__init__(message, request_id)
        self.remote_kind = remote_kind
