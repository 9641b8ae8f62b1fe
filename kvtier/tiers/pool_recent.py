"""RecentlyHeld: which keys this process recently saw a pool hold, without asking one (kvtier/tiers/pool.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier import wire


class RecentlyHeld:
    """Keys this process recently saw held by a pool (stored or fetched), as a direct-mapped table of their first
    8 bytes (keys are already hashes). Local and cheap (``slots`` x 8 bytes), never authoritative: a key can
    drop out (another key took its slot) or be gone from the pool since. It answers "was this sent already?"
    where asking the pool would be a network round trip (an eviction, under the DRAM tier's lock)."""

    def __init__(self, slots: int = 1 << 20) -> None:
        self._table = np.zeros(slots, np.uint64)
        self._mask = np.uint64(slots - 1)

    def _prints(self, keys: Sequence[bytes]) -> np.ndarray:
        return np.frombuffer(wire.pack_keys(keys), "<u8")[::2] | np.uint64(1)  # never 0: 0 marks an empty slot

    def add(self, keys: Sequence[bytes]) -> None:
        if keys:
            fp = self._prints(keys)
            self._table[fp & self._mask] = fp

    def drop(self, keys: Sequence[bytes]) -> None:
        if keys:
            fp = self._prints(keys)
            slots = fp & self._mask
            self._table[slots[self._table[slots] == fp]] = 0

    def clear(self) -> None:
        self._table[:] = 0

    def has(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        fp = self._prints(keys)
        return (self._table[fp & self._mask] == fp).tolist()
