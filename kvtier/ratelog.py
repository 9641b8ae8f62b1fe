"""RateLimitedLog: at most one log line per kind per interval, counting what it held back.

For daemons that log bad requests: a fuzzer or a misconfigured client must not flood the log, and the line
that does get through says how many like it were held back. Thread-safe enough for logging (a race at worst
lets one extra line through).
"""

from __future__ import annotations

import logging
import time
from typing import Any


class RateLimitedLog:
    """``log(kind, level, msg, *args)`` on ``logger``, at most once per ``interval`` seconds per ``kind``."""

    def __init__(self, logger: logging.Logger, interval: float = 1.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def __call__(self, kind: str, level: int, msg: str, *args: Any, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -1e9) < self.interval:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        suffix = f" (+{held} more like it in the last {self.interval:.0f} s)" if held else ""
        self.logger.log(level, msg + suffix, *args, exc_info=exc_info)
