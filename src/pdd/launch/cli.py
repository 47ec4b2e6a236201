"""The `pdd` command: one entry point, one module per subcommand.

Subcommand modules are imported lazily so `pdd config check` stays fast and never loads torch.
Each module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pdd.launch.serve", "run one service role (router|prefill|relay|main-decode)"),
    "up": ("pdd.launch.up", "start the whole multi-site system on this machine"),
    "config": ("pdd.shared.config_cli", "validate a config file"),
    "generate": ("pdd.launch.generate", "run one engine locally on a prompt"),
    "wan": ("pdd.transports.wan_cli", "kernel WAN emulation between two network namespaces (root)"),
    "trace": ("pdd.traceview.cli", "render a request's handoff timeline from a JSONL span file"),
    "bench": ("pdd.loadgen.cli", "load generator for OpenAI-compatible endpoints"),
    "sim": ("pdd.sim.cli", "discrete-event simulator of a PDD deployment"),
    "plan": ("pdd.sim.plan", "which system and instance split to deploy for a traffic trace (simulated)"),
    "keys": ("pdd.transports.keys_cli", "generate CURVE key pairs for the WAN transport"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdd", description="PDD: LLM serving across datacenters.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_path, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # only the chosen subcommand pays for its imports
            module = importlib.import_module(module_path)
            module.add_arguments(sp)
            sp.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
