"""SlotAllocator: fixed-size slots in one buffer, handed out and taken back in batches, no allocation per put."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class SlotAllocator:
    """A stack of free slot indices in a numpy array. Not thread-safe: the owning tier locks around it."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"need at least one slot, got {num_slots}")
        self.num_slots = num_slots
        # Lowest slots on top, so a lightly used tier touches (and faults in) the start of its buffer only.
        self._free = np.arange(num_slots - 1, -1, -1, dtype=np.int64)
        self._top = num_slots  # free[:top] are free
        self._is_free = np.ones(num_slots, dtype=bool)

    @property
    def free_count(self) -> int:
        return self._top

    @property
    def used_count(self) -> int:
        return self.num_slots - self._top

    def alloc(self, n: int) -> list[int]:
        """Up to ``n`` free slots (fewer when the buffer is full)."""
        take = min(n, self._top)
        if take <= 0:
            return []
        slots = self._free[self._top - take : self._top][::-1]
        self._top -= take
        self._is_free[slots] = False
        return slots.tolist()

    def free(self, slots: Sequence[int]) -> None:
        """Return slots. Freeing a slot twice is a bug in the caller and raises instead of corrupting."""
        if not len(slots):
            return
        arr = np.asarray(slots, dtype=np.int64)
        if self._is_free[arr].any() or len(np.unique(arr)) != len(arr):
            raise RuntimeError(f"slot freed twice: {sorted(set(arr[self._is_free[arr]].tolist()))}")
        self._free[self._top : self._top + len(arr)] = arr[::-1]
        self._top += len(arr)
        self._is_free[arr] = True
