"""Least recently used: evict the block whose last put or hit is oldest.

A protected key (pinned, or being copied) that eviction passes goes to the most recently used end, as S3-FIFO
reinserts it: it is in use, so "recently used" is honest, and the next eviction does not scan it again (with
half of a 512K-slot tier pinned at the head, rescanning cost 63 ms per eviction under the tier's lock).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Container, Sequence

from kvtier.policies.base import Clock, Policy, take_oldest
from kvtier.policies.registry import register_policy


@register_policy("lru")
class LRUPolicy(Policy):
    """Keys in use order; ignores observations (the store forwards it none) and takes every new block."""

    name = "lru"

    def __init__(self, capacity: int = 0, *, clock: Clock = time.monotonic) -> None:
        super().__init__(capacity, clock=clock)
        self._order: OrderedDict[bytes, None] = OrderedDict()  # oldest first

    def insert(self, keys: Sequence[bytes]) -> None:
        self._order.update(dict.fromkeys(keys))

    def access(self, keys: Sequence[bytes]) -> None:
        move, order = self._order.move_to_end, self._order
        for k in keys:
            if k in order:
                move(k)

    def remove(self, keys: Sequence[bytes]) -> None:
        pop = self._order.pop
        for k in keys:
            pop(k, None)

    def victims(self, n: int, protected: Container[bytes]) -> list[bytes]:
        out: list[bytes] = []
        take_oldest(self._order, n, protected, out)  # each key looked at once: a protected queue is not cycled
        return out

    def __len__(self) -> int:
        return len(self._order)
