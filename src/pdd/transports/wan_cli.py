"""`pdd wan up|down|status`: kernel WAN emulation between two network namespaces (root)."""

from __future__ import annotations

import argparse
import json

from .wan_emulation import WanConfig, WanEmulation, WanError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--rate", default="1gbit", help="link rate per direction (tbf), e.g. 1gbit")
    parser.add_argument("--delay", default="20ms", help="one-way delay; RTT is twice this")
    parser.add_argument("--jitter", default="0ms", help="uniform ± jitter on the delay (no reordering)")
    parser.add_argument("--loss", default="0%", help="packet loss, e.g. 0.1%%")
    parser.add_argument("--mtu", type=int, default=65000)
    parser.add_argument("--ns-a", default="site-a")
    parser.add_argument("--ns-b", default="site-b")
    parser.add_argument("--subnet", default="10.77.0", help="first three octets; site A .1, site B .2")


def run(args: argparse.Namespace) -> int:
    wan = WanEmulation(WanConfig(rate=args.rate, delay=args.delay, jitter=args.jitter, loss=args.loss,
                                 ns_a=args.ns_a, ns_b=args.ns_b, subnet=args.subnet, mtu=args.mtu))
    try:
        if args.action == "up":
            state = wan.up()
            print(f"WAN up: {state['ns_a']} ({state['addr_a']}) <-> {state['ns_b']} ({state['addr_b']}), "
                  f"rate {args.rate}, delay {args.delay} ± {args.jitter}, loss {args.loss}\n"
                  f"run in a site: ip netns exec {state['ns_a']} COMMAND")
        elif args.action == "down":
            print("WAN down" if wan.down() else "WAN was not up")
        else:
            print(json.dumps(wan.status(), indent=2))
    except WanError as exc:
        print(f"pdd wan: {exc}")
        return 1
    return 0
