"""HbmPrefixCache: an engine-side model of the GPU's own prefix cache, in front of the store.

It stands for vLLM's or SGLang's HBM block pool: a least-recently-used set of blocks whose longest held prefix
a request reuses for free. A request's blocks are touched tail first, so its root is the most recent and an
eviction takes a prefix's tail before its root (as vLLM frees a finished request's blocks in reverse order).
Requests are not pinned while running: a request longer than the whole cache keeps its leading blocks only.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import islice, repeat, takewhile


class HbmPrefixCache:
    """LRU of block keys, ``capacity`` blocks. Used by one replayer thread; not thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"HBM capacity must be >= 0 blocks, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # oldest first

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are held."""
        return len(list(takewhile(self._lru.__contains__, keys)))  # looped in C

    def admit(self, keys: Sequence[bytes]) -> list[bytes]:
        """Make every key of a request the most recent (root last), then evict down to capacity.

        Returns the evicted keys, oldest first (a write-back offload stores them). With capacity 0 every key
        passes straight through and is returned.
        """
        if self.capacity == 0:
            return list(reversed(keys))
        lru = self._lru
        # Drop the keys, then add them back tail first: both loops run in C (a request has thousands).
        _drain(map(lru.pop, keys, repeat(None)))
        lru.update(zip(reversed(keys), repeat(None)))
        excess = len(lru) - self.capacity
        if excess <= 0:
            return []
        victims = list(islice(lru, excess))
        _drain(map(lru.pop, victims))
        return victims

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru


def _drain(it: Iterable[object]) -> None:
    deque(it, maxlen=0)
