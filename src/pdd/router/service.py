"""Router role process: registry + orchestrator behind the OpenAI-compatible HTTP API."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from pdd.router import detokenize
from pdd.router.orchestrator import Orchestrator
from pdd.router.registry import Registry
from pdd.router.types import Generation, GenerationRequest
from pdd.shared.config import InstanceConfig, PDDConfig
from pdd.shared.roles import ENGINE_ROLES, Role
from pdd.shared.service import Service
from pdd.shared.telemetry import get_logger

log = get_logger("pdd.router")
REQUIRED_ROLES = ENGINE_ROLES


def model_display_name(config: PDDConfig) -> str:
    return config.model.served_name


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` that other routers on this host bind too (SO_REUSEPORT: the kernel
    spreads new connections over them). An OSError (port held without SO_REUSEPORT) stops the router."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class RouterService(Service):
    """Also the HTTP layer's backend: model facts, readiness and ``generate``."""

    role = Role.ROUTER

    def __init__(self, config: PDDConfig, instance: InstanceConfig, serve_http: bool = True):
        super().__init__(config, instance)
        self.registry = Registry(self.bus, missed_heartbeats=config.service.missed_heartbeats,
                                 suspect_timeout_s=config.service.suspect_timeout_s)
        self.orchestrator = Orchestrator(config, self.bus, self.registry, instance.id)
        self.serve_http = serve_http
        self.model_name = model_display_name(config)
        self.tokenizer: Any = None
        self.max_body_bytes = config.router.max_body_bytes
        self.api_keys = list(config.router.api_keys)
        self.request_timeout_s = config.router.request_timeout_s
        self._uvicorn = None

    @property
    def max_context(self) -> int:
        return self.orchestrator.max_context()

    async def on_start(self) -> None:
        await self.registry.start()
        await self.orchestrator.start()
        if not self.serve_http:
            return
        from pdd.shared.model_files import resolve_model_path
        from pdd.shared.tokenizer import load_tokenizer

        self.tokenizer = await asyncio.to_thread(load_tokenizer, resolve_model_path(self.config.model.path))
        await asyncio.to_thread(detokenize.prepare, self.tokenizer)  # its byte tables: not in the first request
        await self._start_api()

    async def _start_api(self) -> None:
        import uvicorn

        from pdd.router.api import create_app

        app = create_app(self)
        rc = self.config.router
        cfg = uvicorn.Config(app, host=rc.host, port=rc.port, log_level="warning", access_log=False, lifespan="off",
                             http="httptools")
        self._uvicorn = uvicorn.Server(cfg)
        self._uvicorn.install_signal_handlers = lambda: None  # the service owns SIGTERM (drain)
        sockets = [shared_port_socket(rc.host, rc.port)] if rc.reuse_port else None
        self._tasks.append(asyncio.create_task(self._uvicorn.serve(sockets=sockets), name="http-api"))
        while not self._uvicorn.started:
            await asyncio.sleep(0.02)
        port = self._uvicorn.servers[0].sockets[0].getsockname()[1]
        log.info("api_listening", url=f"http://{self.config.router.host}:{port}/v1", model=self.model_name)

    async def on_stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        await self.orchestrator.stop()
        await self.registry.stop()

    def in_flight(self) -> int:
        return len(self.orchestrator.inflight)

    # -- backend interface for the HTTP layer ------------------------------------------------------
    def ready(self) -> bool:
        return self.state == "ready" and all(self.registry.instances(role) for role in REQUIRED_ROLES)

    def health(self) -> dict[str, Any]:
        return {"router": self.instance_id, "instances": self.registry.snapshot(),
                "missing_roles": [r for r in REQUIRED_ROLES if not self.registry.instances(r)]}

    def health_details(self) -> dict[str, Any]:
        return {"instances": self.registry.snapshot()}

    def generate(self, req: GenerationRequest) -> Generation:
        return self.orchestrator.generate(req)
