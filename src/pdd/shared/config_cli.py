"""`pdd config check F`: validate a config file (env overrides applied) before deploying it."""

from __future__ import annotations

import argparse
import sys

from pdd.shared.config import ConfigError, dump_config, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="config_command", required=True)
    check = sub.add_parser("check", help="validate a config file; exit 1 with the bad fields named")
    check.add_argument("file")
    check.add_argument("--print", action="store_true", help="print the effective config (defaults filled in)")
    show = sub.add_parser("default", help="print the default config")
    show.set_defaults(file=None, print=True)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    if args.print:
        print(dump_config(config), end="")
    else:
        roles = {}
        for inst in config.instances:
            roles[inst.role] = roles.get(inst.role, 0) + 1
        print(f"{args.file}: OK ({len(config.sites)} site(s), instances {roles or 'none'})")
    return 0
