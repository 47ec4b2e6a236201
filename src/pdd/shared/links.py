"""How a request's KV reaches a decoder, named once: inside a site or across the WAN.

The value is also the key of that link's transport under ``transports:`` in a config (UCX by default inside a
site, ZeroMQ across sites) and of the transport's descriptor in an instance's announced endpoints.
"""

from __future__ import annotations

import enum


class KVLink(enum.StrEnum):
    FAST = "fast"  # sender and receiver in one site (P -> RLD, or P -> MD in a one-site deployment)
    WAN = "wan"  # across sites (P -> MD): the bytes the decode-side cache exists to save


def link_between(sender_site: str, receiver_site: str) -> KVLink:
    return KVLink.FAST if sender_site == receiver_site else KVLink.WAN
