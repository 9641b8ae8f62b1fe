"""What the two daemons' commands share (``kvtier-pool``: pool/cli.py, ``kvtier-master``: master/cli.py): the
``--ready-file`` and ``--log-level`` options, logging set up one way, and a start-up error said as one line with
exit status 2. A neutral room, so neither daemon imports the other for it (tests/test_layering.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("debug", "info", "warning", "error")
START_ERROR = 2  # the exit status of a daemon that could not start (address in use, bad option, ...)


def add_start_options(parser: argparse.ArgumentParser, ready_fields: str) -> None:
    """``--ready-file`` (the daemon writes ``ready_fields`` there as JSON once serving) and ``--log-level``."""
    parser.add_argument("--ready-file", help=f"write {ready_fields} as JSON here once serving")
    parser.add_argument("--log-level", default="info", choices=list(LOG_LEVELS))


def parse_and_log(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The parsed command line, with logging set up at its ``--log-level``."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    return args


def start_error(prog: str, message: object) -> int:
    """Say why ``prog`` cannot start, on one line of stderr; the exit status to return."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return START_ERROR


__all__ = ["add_start_options", "parse_and_log", "start_error"]
