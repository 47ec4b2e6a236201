"""Parse the tc-style units used by the shaper and `pdd wan`: 1gbit, 500mbit, 20ms, 0.1%."""

from __future__ import annotations

import re

_RATE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bps": 8, "kbps": 8e3,
         "mbps": 8e6, "gbps": 8e9}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def _split(text: str) -> tuple[float, str]:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z%]*)\s*", str(text))
    if not m:
        raise ValueError(f"cannot parse {text!r}")
    return float(m.group(1)), m.group(2).lower()


def rate_bits(value: str | float | int) -> float:
    """'1gbit' -> 1e9 bits/s (numbers pass through as bits/s)."""
    if isinstance(value, (int, float)):
        return float(value)
    num, unit = _split(value)
    if unit not in _RATE:
        raise ValueError(f"unknown rate unit in {value!r}; use bit/kbit/mbit/gbit")
    return num * _RATE[unit]


def seconds(value: str | float | int) -> float:
    """'20ms' -> 0.02 (numbers pass through as seconds)."""
    if isinstance(value, (int, float)):
        return float(value)
    num, unit = _split(value)
    if unit not in _TIME:
        raise ValueError(f"unknown time unit in {value!r}; use s/ms/us")
    return num * _TIME[unit]


def fraction(value: str | float | int) -> float:
    """'0.1%' -> 0.001 (numbers pass through as a fraction)."""
    if isinstance(value, (int, float)):
        return float(value)
    num, unit = _split(value)
    if unit not in ("%", ""):
        raise ValueError(f"cannot parse loss {value!r}; use e.g. 0.1%")
    return num / 100 if unit == "%" else num
