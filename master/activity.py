"""Activity: what the master served, for an operator's status screen (``kvtier status``, the ``ping`` reply).

Prometheus has the same request counts as rates; this is the "right now" view one ``ping`` returns without a
Prometheus server: requests by op and status, how many keys lookups asked for and how many of them were a
held leading prefix (hits) or not (misses), and the last errors the master answered, newest first.

Memory bound: ops are the master's own op names or "unknown" (the server passes them so), statuses are wire
error codes, and the error ring keeps ``RECENT_ERRORS`` entries of at most 300 characters. Event-loop thread
only.
"""

from __future__ import annotations

from collections import deque
from typing import Any

RECENT_ERRORS = 20


class Activity:
    """Counters since the master started, and a ring of its latest errors."""

    def __init__(self) -> None:
        self.requests: dict[str, dict[str, int]] = {}
        self.lookups = self.lookup_keys = self.lookup_hits = 0
        self.errors: deque[dict[str, Any]] = deque(maxlen=RECENT_ERRORS)

    def request(self, op: str, status: str) -> None:
        by_status = self.requests.setdefault(op, {})
        by_status[status] = by_status.get(status, 0) + 1

    def lookup(self, keys: int, leading_held: int) -> None:
        self.lookups += 1
        self.lookup_keys += keys
        self.lookup_hits += leading_held

    def error(self, at: float, op: str, code: str, message: str) -> None:
        self.errors.appendleft({"at": round(at, 3), "op": op[:64], "code": code, "message": message[:300]})

    def view(self) -> dict[str, Any]:
        return {"requests": {op: dict(s) for op, s in self.requests.items()},
                "lookups": {"count": self.lookups, "keys": self.lookup_keys, "hits": self.lookup_hits,
                            "misses": self.lookup_keys - self.lookup_hits},
                "recent_errors": list(self.errors)}
