"""`pdd serve ROLE --config F`: run one service role as its own process."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys

import uvloop

from pdd.launch.children import watch_parent
from pdd.shared.bus import BusConnectError
from pdd.shared.config import ConfigError, load_config
from pdd.shared.roles import Role
from pdd.shared.service import prepare_process
from pdd.shared.telemetry import get_logger

ROLES = {
    Role.ROUTER: "pdd.router.service:RouterService",
    Role.PREFILL: "pdd.roles.prefill:PrefillService",
    Role.RELAY: "pdd.roles.relay:RelayService",
    Role.MAIN_DECODE: "pdd.roles.main_decode:MainDecodeService",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("role", choices=sorted(ROLES))
    parser.add_argument("--config", "-c", help="deployment config (YAML); defaults apply without one")
    parser.add_argument("--instance-id", help="which instance of the config this process is (default: first of ROLE)")


def run(args: argparse.Namespace) -> int:
    log = get_logger("pdd.serve")
    watch_parent(lambda pid: log.warning("launcher_gone", launcher_pid=pid, action="draining, then exiting"))
    try:
        config = load_config(args.config)
        instance = config.instance(args.instance_id) if args.instance_id else config.first_of_role(args.role)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    if instance.role != args.role:
        print(f"instances[{instance.id}].role is {instance.role!r}, not {args.role!r}", file=sys.stderr)
        return 1
    module_name, class_name = ROLES[args.role].split(":")
    service_cls = getattr(importlib.import_module(module_name), class_name)
    prepare_process(config, instance, args.role)
    service = service_cls(config, instance)
    # The router's work is per token of every stream (bus in, SSE out): uvloop's loop and transports cut its CPU.
    # Engines keep asyncio's loop: their time is in the step, and their libraries (ucxx) are tested on it.
    loop_factory = uvloop.new_event_loop if args.role == Role.ROUTER else None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(service.run())
    except (ConfigError, BusConnectError) as exc:  # wrong credentials/TLS: say so once, do not retry forever
        log.error("service_failed", role=args.role, instance=instance.id, error=str(exc))
        return 1
    return 0
