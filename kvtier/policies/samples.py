"""Samples: a sliding window of durations, sorted, for medians and residual medians learned online.

The session-aware policy learns how long requests take and how long agents stay away, with no prior: every
estimate comes from the last ``window`` samples seen. Adding a sample is O(window) memmove in C (bisect.insort
on a list of floats), which is per request, not per block.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque


class Samples:
    """The last ``window`` values added. Not thread-safe (its policy runs under its tier's lock)."""

    __slots__ = ("_sorted", "_fifo", "window")

    def __init__(self, window: int = 1024) -> None:
        if window < 1:
            raise ValueError(f"a sample window needs room for at least one sample, got {window}")
        self.window = window
        self._sorted: list[float] = []
        self._fifo: deque[float] = deque()

    def add(self, value: float) -> None:
        insort(self._sorted, value)
        self._fifo.append(value)
        if len(self._fifo) > self.window:
            old = self._fifo.popleft()
            del self._sorted[bisect_left(self._sorted, old)]

    def __len__(self) -> int:
        return len(self._sorted)

    @property
    def values(self) -> list[float]:
        """The samples, ascending (the live list: read, never change it)."""
        return self._sorted

    def max(self) -> float | None:
        return self._sorted[-1] if self._sorted else None

    def quantile(self, q: float) -> float | None:
        s = self._sorted
        return s[min(len(s) - 1, int(q * len(s)))] if s else None

    def median(self) -> float | None:
        s = self._sorted
        return s[len(s) // 2] if s else None

    def residual(self, elapsed: float) -> float | None:
        """The median time left given ``elapsed`` already passed: over the samples longer than ``elapsed``,
        their median minus ``elapsed``. Past every sample seen: as long again (``elapsed``). None if empty."""
        s = self._sorted
        if not s:
            return None
        elapsed = max(0.0, elapsed)
        i = bisect_right(s, elapsed)
        if i == len(s):
            return elapsed
        return s[(i + len(s)) // 2] - elapsed
