"""The transport plugin registry: names -> KVTransport classes (built-ins plus the ``pdd.transports``
entry-point group), and ``create_transport``, which may wrap a plugin in the in-process WAN shaper.
Its own module so the ABC (base.py) and the shaper (which subclasses it) import no circle."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Mapping

from .base import KVTransport
from .shaper import ShapedTransport

if TYPE_CHECKING:
    from pdd.shared.config import TransportConfig

_REGISTRY: dict[str, type[KVTransport] | str] = {
    "inproc": "pdd.transports.inproc:InprocTransport",
    "zmq": "pdd.transports.zmq_transport:ZmqTransport",
    "ucx": "pdd.transports.ucx_transport:UcxTransport",
}
_discovered = False


def register_transport(name: str, cls: type[KVTransport] | str) -> None:
    """Add a plugin by class or by "module:Class" path (loaded on first use)."""
    _REGISTRY[name] = cls


def _discover() -> None:
    global _discovered
    if not _discovered:
        _discovered = True
        for ep in entry_points(group="pdd.transports"):
            _REGISTRY.setdefault(ep.name, ep.value)


def ucx_available() -> bool:
    """Whether the ucx plugin can run here (ucxx imports); callers fall back to zmq in-site."""
    try:
        import ucxx  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure (missing package, missing libucx) means no
        return False
    return True


def available_transports() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def _load(name: str) -> type[KVTransport]:
    _discover()
    if name not in _REGISTRY:
        raise KeyError(f"unknown KV transport {name!r}; available: {', '.join(available_transports())}")
    target = _REGISTRY[name]
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
        _REGISTRY[name] = target
    return target


def create_transport(name: str, options: Mapping[str, Any] | None = None) -> KVTransport:
    """Instantiate a plugin by name. ``options["shape"]`` wraps it in the in-process WAN shaper."""
    opts = dict(options or {})
    shape = opts.pop("shape", None)
    transport = _load(name)(opts)
    if shape:
        transport = ShapedTransport(transport, **shape)
    return transport


def create_link_transport(cfg: TransportConfig, defaults: Mapping[str, Any] | None = None) -> KVTransport:
    """The transport of one configured link (``transports.<link>``): its plugin and options, over ``defaults``
    (say, the instance's ``bind_host``), and its typed ``codec``."""
    return create_transport(cfg.name, {**(defaults or {}), **cfg.plugin_options()})
