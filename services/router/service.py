"""Router role process: owns the registry (and, with the API, the request lifecycle)."""

from __future__ import annotations

from typing import Any

from pdd.shared.config import InstanceConfig, PDDConfig
from pdd.shared.registry import Registry
from pdd.shared.service import Service


class RouterService(Service):
    role = "router"

    def __init__(self, config: PDDConfig, instance: InstanceConfig):
        super().__init__(config, instance)
        self.registry = Registry(self.bus, missed_heartbeats=config.service.missed_heartbeats)

    async def on_start(self) -> None:
        await self.registry.start()

    async def on_stop(self) -> None:
        await self.registry.stop()

    def health_details(self) -> dict[str, Any]:
        return {"instances": self.registry.snapshot()}
