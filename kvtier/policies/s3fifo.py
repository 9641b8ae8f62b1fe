"""S3-FIFO (Yang et al., SOSP '23): a small probation FIFO, a main FIFO with reinsertion, a ghost FIFO.

New keys enter the small queue (10% of capacity). A key leaving the small queue moves to main if it was hit
at least ``move_threshold`` times there, else it is evicted and remembered in the ghost queue; a key put
again while remembered goes straight to main. Keys leaving main are reinserted while their hit count
(capped at 3, decremented on each pass) is positive. One-hit wonders (a subagent's private suffix) leave
quickly; a prefix hit every turn stays.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Container, Sequence

from kvtier.policies.base import Clock, Policy
from kvtier.policies.registry import register_policy

_MAX_FREQ = 3


@register_policy("s3fifo")
class S3FIFOPolicy(Policy):
    """Keys only: ignores observations and takes every new block."""

    name = "s3fifo"

    def __init__(self, capacity: int, small_ratio: float = 0.1, move_threshold: int = 1, *,
                 clock: Clock = time.monotonic) -> None:
        super().__init__(capacity, clock=clock)
        if capacity <= 0:
            raise ValueError(f"s3fifo needs the tier's capacity in blocks (> 0), got {capacity}")
        self._small_target = max(1, int(capacity * small_ratio))
        self._ghost_capacity = max(1, capacity - self._small_target)
        self._move_threshold = move_threshold
        self._small: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}

    def insert(self, keys: Sequence[bytes]) -> None:
        small, main, ghost, freq = self._small, self._main, self._ghost, self._freq
        for k in keys:
            if k in ghost:
                del ghost[k]
                main[k] = None
            else:
                small[k] = None
            freq[k] = 0

    def access(self, keys: Sequence[bytes]) -> None:
        freq = self._freq
        for k in keys:
            f = freq.get(k)
            if f is not None and f < _MAX_FREQ:
                freq[k] = f + 1

    def remove(self, keys: Sequence[bytes]) -> None:
        small, main, freq = self._small, self._main, self._freq
        for k in keys:
            if freq.pop(k, None) is not None:
                if k in small:
                    del small[k]
                else:
                    del main[k]

    def victims(self, n: int, protected: Container[bytes]) -> list[bytes]:
        out: list[bytes] = []
        small, main, freq = self._small, self._main, self._freq
        # A protected key goes to the back of its queue; *_blocked counts protected keys seen in a row at
        # each queue's head, so a queue whose keys are all protected is skipped, not cycled forever.
        small_blocked = main_blocked = 0
        budget = 2 * (_MAX_FREQ + 1) * len(freq) + n  # a safety net; the counters end the loop first
        while len(out) < n and budget > 0:
            budget -= 1
            small_open = small_blocked < len(small)
            main_open = main_blocked < len(main)
            if small_open and (len(small) >= self._small_target or not main_open):
                k = next(iter(small))
                del small[k]
                if k in protected:
                    small[k] = None
                    small_blocked += 1
                elif freq[k] >= self._move_threshold:
                    main[k] = None
                    freq[k] = 0
                    small_blocked = 0
                else:
                    del freq[k]
                    self._remember(k)
                    out.append(k)
                    small_blocked = 0
            elif main_open:
                k = next(iter(main))
                del main[k]
                f = freq[k]
                main[k] = None  # back of the queue unless evicted below
                if k in protected:
                    main_blocked += 1
                    continue
                main_blocked = 0
                if f > 0:
                    freq[k] = f - 1
                else:
                    del main[k], freq[k]
                    out.append(k)
            else:
                break
        return out

    def _remember(self, key: bytes) -> None:
        ghost = self._ghost
        ghost[key] = None
        if len(ghost) > self._ghost_capacity:
            ghost.popitem(last=False)

    def __len__(self) -> int:
        return len(self._freq)
