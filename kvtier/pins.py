"""Per-block pin counts shared by the store and its tiers.

A pin is a reference count on a key, not on a holder: two requests sharing a prefix block each pin it once,
and the block is evictable again only when both have unpinned (LMCache learned this the hard way: per-holder
locks let one request release another's). Thread-safe.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable


class PinTable:
    """key -> pin count. ``key in table`` is True while the count is > 0 (what eviction checks)."""

    def __init__(self) -> None:
        # A Counter for its update(), which counts a batch in C (a lookup pins 2,000 keys before it looks).
        self._counts: Counter[bytes] = Counter()
        self._lock = threading.Lock()

    def pin(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            self._counts.update(keys)

    def unpin(self, keys: Iterable[bytes]) -> list[bytes]:
        """Drop one pin per key; return the keys that were not pinned (a caller's bookkeeping bug)."""
        unknown = []
        with self._lock:
            counts = self._counts
            get, pop = counts.get, counts.pop  # pop, not del: Counter's __delitem__ is a Python method
            for k in keys:
                c = get(k, 0)
                if c > 1:
                    counts[k] = c - 1
                elif c == 1:
                    pop(k)
                else:
                    unknown.append(k)
        return unknown

    def count(self, key: bytes) -> int:
        return self._counts.get(key, 0)

    def __contains__(self, key: object) -> bool:
        return key in self._counts  # a dict read is atomic under the GIL

    def __len__(self) -> int:
        return len(self._counts)
