"""Is the system `pdd up` started serving, and is it the one it started?

Why: a launcher that takes any answer on its port for its own router says ``ready`` while another
system serves there. So the port must be free before anything starts, and readiness needs both the
router's instance id in /health and the router process's own log line saying it listens on the port.
"""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path
from urllib.parse import urlparse

from pdd.launch.local_cluster import http_json

PROGRESS_EVENTS = ("model_loading", "model_loaded", "service_ready", "api_listening", "service_draining")


def log_events(log_path: Path, offset: int = 0) -> list[dict]:
    """A service's JSON log lines since ``offset`` (the current process's, when it was restarted)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def progress(log_path: Path, offset: int = 0) -> str:
    """Last lifecycle event of a service, from its JSON log ('starting' before the first)."""
    for event in reversed(log_events(log_path, offset)):
        name = event.get("event", "")
        if name in PROGRESS_EVENTS:
            return name.replace("_", " ")
    return "starting"


def service_ready(log_path: Path, offset: int = 0) -> bool:
    """The service whose log this is (its lines since ``offset``) said ``service_ready``."""
    return any(event.get("event") == "service_ready" for event in log_events(log_path, offset))


def port_taken(host: str, port: int) -> bool:
    """Whether something already holds ``host:port`` (bound as the router's server binds: SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def router_ready(base_url: str, port: int, router_id: str, router_log: Path, log_offset: int = 0) -> bool:
    """Our own router serves on ``port`` and has every role: /health says 200 with ``router_id``, and the
    router process we started logged that it listens on that port (another system's router answers
    with the same id when it runs `pdd up` too, but it cannot write our router's log)."""
    return routers_ready(base_url, port, {router_id: (router_log, log_offset)})


def routers_ready(base_url: str, port: int, routers: dict[str, tuple[Path, int]]) -> bool:
    """Several routers sharing ``port`` (SO_REUSEPORT): the one /health reached is one of ours and says 200,
    and every one of them logged that it listens on the port and then that it is ready (by their logs: id ->
    (path, offset)). A router listens a moment before it has announced itself; `pdd up` says ready only once
    every router has (the kernel may hand the next connection to any of them)."""
    code, body = http_json(base_url + "/health")
    if code != 200 or not isinstance(body, dict) or body.get("router") not in routers:
        return False

    def listens_and_ready(events: list[dict]) -> bool:
        listens = any(e.get("event") == "api_listening" and urlparse(str(e.get("url", ""))).port == port
                      for e in events)
        return listens and any(e.get("event") == "service_ready" for e in events)
    return all(listens_and_ready(log_events(log, offset)) for log, offset in routers.values())
