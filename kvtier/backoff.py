"""Backoff: the health record of one peer that can fail (a pool endpoint, kvtier-master, one of several masters).

One mechanism for every back-off in the client: a failure puts the peer in a back-off of ``first_s``, each
further failure doubles it up to ``max_s``, and any answer ends it and resets the length. A caller that must
hold a peer off for a fixed time instead (a pool speaking another protocol version) passes ``hold_s``.

Time comes from ``clock`` (a callable returning monotonic seconds, ``time.monotonic`` by default), so a test
drives the back-off by moving its clock instead of sleeping. No thread or timer of its own; thread-safe (a lock
around each update; ``up`` and ``left_s`` read one float).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

Clock = Callable[[], float]  # monotonic seconds


class Backoff:
    """Exponential back-off of one peer: ``failed`` starts (or lengthens) it, ``answered`` ends it."""

    def __init__(self, first_s: float, max_s: float, clock: Clock = time.monotonic) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"a back-off needs 0 < first_s <= max_s, got {first_s}, {max_s}")
        self.first_s, self.max_s = first_s, max_s
        self.clock = clock
        self._lock = threading.Lock()
        self._next_s = first_s  # the length of the next back-off
        self._current_s = 0.0  # the length of the back-off now running (0: answering)
        self._down_until = 0.0
        self._failing = False  # failed since the last answer

    def up(self) -> bool:
        """The peer may be asked now (no back-off, or it has run out)."""
        return self.clock() >= self._down_until

    def left_s(self) -> float:
        """Seconds until the back-off now running ends (0 when the peer may be asked)."""
        return max(0.0, self._down_until - self.clock())

    @property
    def down_until(self) -> float:
        """The clock reading at which the back-off now running ends (0: none ran since the last answer)."""
        return self._down_until

    @property
    def current_s(self) -> float:
        """The length of the back-off started by the last failure (0 once the peer answered)."""
        return self._current_s

    @property
    def failing(self) -> bool:
        """The peer failed since it last answered (whether or not its back-off has run out)."""
        return self._failing

    def failed(self, hold_s: float | None = None) -> bool:
        """Start a back-off: the next doubling length, or ``hold_s`` (which leaves the doubling as it was).
        Returns True when the peer was answering until now (the caller logs the change once)."""
        with self._lock:
            length = self._next_s if hold_s is None else hold_s
            self._down_until = self.clock() + length
            self._current_s = length
            if hold_s is None:
                self._next_s = min(self._next_s * 2, self.max_s)
            was_answering = not self._failing
            self._failing = True
            return was_answering

    def answered(self) -> bool:
        """End any back-off and reset its length. Returns True when the peer was failing until now."""
        if not self._failing:  # the common case (a healthy peer's every answer) takes no lock
            return False
        with self._lock:
            was_failing = self._failing
            self._failing = False
            self._next_s, self._current_s, self._down_until = self.first_s, 0.0, 0.0
            return was_failing
