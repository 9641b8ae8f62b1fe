"""Least recently used: evict the block whose last put or hit is oldest."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence

from kvtier.policies.registry import register_policy


@register_policy("lru")
class LRUPolicy:
    name = "lru"

    def __init__(self, capacity: int = 0) -> None:
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
        if n <= 0:
            return out
        for k in self._order:
            if k not in protected:
                out.append(k)
                if len(out) == n:
                    break
        self.remove(out)
        return out

    def __len__(self) -> int:
        return len(self._order)
