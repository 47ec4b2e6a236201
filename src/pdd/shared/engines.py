"""The engine backends' registry: each backend is an entry point of the ``pdd.engines`` group naming an
``EnginePlugin``, as each transport is one of ``pdd.transports``. A backend (torch, emulated, vllm; a fourth,
SGLang or TensorRT-LLM) is one folder plus one entry point; nothing in PDD names a backend in code.

An ``EnginePlugin`` is light on purpose: its module imports pydantic and its typed settings, never torch or
vLLM, so the router and ``pdd config check`` validate any backend's config without its engine installed. What
builds the engine (``build``) and what the launcher says before the services start (``preflight``) are named
as ``"module:function"`` and imported only when called.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel

ENGINES_GROUP = "pdd.engines"
DEFAULT_ENGINE = "torch"  # model.backend when a config names none: the embedded engine


@dataclass(frozen=True)
class EnginePlugin:
    """One engine backend: its name (``model.backend``), its settings and where its code is."""

    name: str
    model_settings: type[BaseModel]  # its keys among the flat ``model.*`` keys of a config
    build: str  # "module:function": (config, role, cache_finished) -> an EngineBackend
    preflight: str | None = None  # "module:function": (the config's model dict) -> a banner line, or raises
    section: str | None = None  # a top-level config section of its own (the emulated backend's `emulation`)
    section_settings: type[BaseModel] | None = None  # that section's keys

    def call(self, which: str, *args: Any) -> Any:
        """Import and call ``build`` or ``preflight``."""
        target = getattr(self, which)
        if target is None:
            return None
        module, _, function = target.partition(":")
        return getattr(importlib.import_module(module), function)(*args)


@cache
def engine_plugins() -> dict[str, EnginePlugin]:
    """Every installed backend by name (the entry points of ``pdd.engines``); a broken one is an error naming it."""
    found: dict[str, EnginePlugin] = {}
    for entry in importlib.metadata.entry_points(group=ENGINES_GROUP):
        plugin = entry.load()
        if not isinstance(plugin, EnginePlugin) or plugin.name != entry.name:
            raise TypeError(f"entry point {entry.name} = {entry.value} of group {ENGINES_GROUP} is not an "
                            f"EnginePlugin named {entry.name!r}")
        found[entry.name] = plugin
    return found


def engine_plugin(name: str) -> EnginePlugin:
    """The backend ``name``; a ``ValueError`` lists the installed ones."""
    plugins = engine_plugins()
    if name not in plugins:
        raise ValueError(f"unknown engine backend {name!r}; installed: {', '.join(sorted(plugins)) or 'none'} "
                         f"(a backend registers an entry point in the {ENGINES_GROUP!r} group)")
    return plugins[name]
