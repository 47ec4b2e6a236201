"""The four service roles, named once. The value is what config files, `pdd serve`, bus messages,
metric labels and instance ids use; modules and classes follow it (``main_decode.py``,
``MainDecodeService``). Docs abbreviate them P, RLD and MD."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    ROUTER = "router"
    PREFILL = "prefill"
    RELAY = "relay"  # RLD: the small decoder beside prefill that masks the WAN transfer
    MAIN_DECODE = "main-decode"  # MD: the decode site, with the decode-side radix cache


DECODERS = (Role.RELAY, Role.MAIN_DECODE)
ENGINE_ROLES = (Role.PREFILL, Role.RELAY, Role.MAIN_DECODE)
