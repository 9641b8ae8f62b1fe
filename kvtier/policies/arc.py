"""ARC (Megiddo and Modha, FAST '03): recency and frequency lists with ghost lists that steer the split.

T1 holds keys seen once since they entered, T2 keys hit again; B1 and B2 remember keys evicted from each
(ghosts, no bytes). A key put again while in B1 says T1 is too small (its target ``p`` grows), in B2 that T2 is
(``p`` shrinks); both go straight to T2. Eviction takes T1's oldest while T1 is over its target, else T2's
oldest. Keys only: it ignores observations (on agentic traffic it is within a point of LRU, POLICY-STUDY.md).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Container, Sequence

from kvtier.policies.base import Clock, Policy
from kvtier.policies.registry import register_policy


@register_policy("arc")
class ARCPolicy(Policy):
    """A protected key that eviction passes goes to the young end of its list, as in LRU."""

    name = "arc"

    def __init__(self, capacity: int, *, clock: Clock = time.monotonic) -> None:
        if capacity <= 0:
            raise ValueError(f"arc needs the tier's capacity in blocks (> 0), got {capacity}")
        super().__init__(capacity, clock=clock)
        self._t1: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._p = 0.0  # target size of T1

    def insert(self, keys: Sequence[bytes]) -> None:
        t1, t2, b1, b2, c = self._t1, self._t2, self._b1, self._b2, self.capacity
        for k in keys:
            if k in b1:
                self._p = min(float(c), self._p + max(len(b2) / len(b1), 1.0))
                del b1[k]
                t2[k] = None
            elif k in b2:
                self._p = max(0.0, self._p - max(len(b1) / len(b2), 1.0))
                del b2[k]
                t2[k] = None
            else:
                t1[k] = None

    def access(self, keys: Sequence[bytes]) -> None:
        t1, t2 = self._t1, self._t2
        for k in keys:
            if k in t1:
                del t1[k]
                t2[k] = None
            elif k in t2:
                t2.move_to_end(k)

    def remove(self, keys: Sequence[bytes]) -> None:
        t1, t2 = self._t1, self._t2
        for k in keys:
            if k in t1:
                del t1[k]
            else:
                t2.pop(k, None)

    def victims(self, n: int, protected: Container[bytes]) -> list[bytes]:
        out: list[bytes] = []
        t1, t2 = self._t1, self._t2
        blocked = [0, 0]  # protected keys seen in a row at each list's head: a full pass ends it
        while len(out) < n:
            open1, open2 = blocked[0] < len(t1), blocked[1] < len(t2)
            if open1 and (len(t1) > self._p or not open2):
                side = 0
            elif open2:
                side = 1
            else:
                break
            lst, ghosts = (t1, self._b1) if side == 0 else (t2, self._b2)
            k = next(iter(lst))
            if k in protected:
                lst.move_to_end(k)
                blocked[side] += 1
                continue
            del lst[k]
            self._ghost(ghosts, k)
            blocked[side] = 0
            out.append(k)
        return out

    def _ghost(self, ghosts: OrderedDict[bytes, None], key: bytes) -> None:
        ghosts[key] = None
        c = self.capacity
        b1, b2 = self._b1, self._b2
        while len(b1) + len(b2) > c:  # ghosts remember at most one capacity of keys, the oldest forgotten
            (b1 if len(b1) > len(b2) else b2).popitem(last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)
