"""``kvtier``: the command line. ``kvtier --help`` lists the subcommands."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvtier.config import Config, ConfigError

# Modules that add subcommands: each has register(subparsers). Kept as names so `kvtier --help` stays fast.
COMMAND_MODULES = [
    "kvtier.bench.cli",
    "kvtier.tools.replay.cli",
    "kvtier.auth.cli",
    "kvtier.tools.status",
    "kvtier.client.prefetch_cli",
]


def _register_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="show every config key with its default, or the effective config")
    p.add_argument("--effective", metavar="FILE", nargs="?", const="",
                   help="print the config after applying FILE (optional) and KVTIER_* variables")
    p.set_defaults(func=_run_config)


def _run_config(args: argparse.Namespace) -> int:
    if args.effective is not None:
        cfg = Config.load(args.effective or None)
        for k, v in cfg.to_dict().items():
            print(f"{k} = {v!r}")
        return 0
    for key, default, help_text in Config.describe():
        print(f"{key:<18} {default:<14} {help_text}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="KV-cache tiering for LLM serving")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True)
    _register_config(sub)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ConfigError, ValueError, OSError) as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
