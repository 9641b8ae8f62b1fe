"""InflightPuts: the keys a put (or a promotion) is writing into a TieredStore's top tier right now."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np


class InflightPuts:
    """Which keys some thread is writing now, so that a concurrent put of the same key (sessions sharing a prefix)
    is skipped instead of written twice. One per TieredStore; thread-safe (its own lock, held only to update the
    set, never across a write)."""

    def __init__(self) -> None:
        self._keys: set[bytes] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._keys)

    @contextmanager
    def claim(self, keys: Sequence[bytes], held: Sequence[bool]) -> Iterator[list[int]]:
        """Positions of the keys ``held`` marks False that no other claim holds (a key repeated in ``keys``: its
        first position), in flight until the block exits."""
        unheld = np.flatnonzero(~np.asarray(held, dtype=bool)).tolist()  # no Python work per held key
        wanted = list(keys) if len(unheld) == len(keys) else [keys[i] for i in unheld]
        distinct = set(wanted)
        with self._lock:
            claimed = self._keys
            if len(distinct) == len(wanted) and claimed.isdisjoint(distinct):
                # No repeats and no other claim on them (the common case): one set operation, no loop per key.
                claimed.update(distinct)
                fresh, fresh_keys = unheld, wanted
            else:
                fresh, fresh_keys = [], []
                for i, k in zip(unheld, wanted):
                    if k not in claimed:
                        claimed.add(k)
                        fresh.append(i)
                        fresh_keys.append(k)
        try:
            yield fresh
        finally:
            with self._lock:
                self._keys.difference_update(fresh_keys)
