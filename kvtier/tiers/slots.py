"""SlotAllocator: fixed-size slots in one buffer, handed out and taken back in batches, no allocation per put."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.pins import PinTable


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

    def free_idle(self, doomed: set[int], busy: np.ndarray) -> None:
        """Free the slots of ``doomed`` (dropped while in use) that ``busy`` now shows idle; keep the rest."""
        if doomed:
            idle = [s for s in doomed if busy[s] == 0]
            if idle:
                doomed.difference_update(idle)
                self.free(idle)


class ProtectedSlots:
    """What eviction must not take: pinned keys and keys whose slot is busy (being copied, read or written).

    A ``Container`` for ``EvictionPolicy.victims``; reads the owning tier's live maps (call under its lock).
    """

    __slots__ = ("pins", "slot_of", "busy")

    def __init__(self, pins: PinTable, slot_of: dict[bytes, int], busy: np.ndarray) -> None:
        self.pins, self.slot_of, self.busy = pins, slot_of, busy

    def __contains__(self, key: object) -> bool:
        return key in self.pins or self.busy[self.slot_of[key]] > 0  # type: ignore[index]
