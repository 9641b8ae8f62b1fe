"""Budget: bytes in use against one limit for all clients together and a smaller one per client account.

The pool keeps two (pool/state.py):

* ``memory``: memory beyond the DRAM capacity, i.e. what the pool allocates for clients: request data waiting
  for a worker, get replies gathered into staging copies, envelopes arriving on the stream data port. Its
  limit is ``--staging-bytes``; the pool's RSS stays under its capacity plus this plus a fixed overhead.
* ``held``: DRAM slots that cannot be evicted because a client holds them: one-sided leases (reserve and
  acquire) and get replies zmq is still sending straight from the slots. Limit: half the capacity, a quarter
  per client, so one client cannot make every other client's puts fail or keep the pool empty.

Callers either ``take`` (refused past a limit: the caller answers busy, grants less, or picks another way),
``wait_take`` (waits for room until a deadline: a data-port connection thread, whose client then waits for
its own earlier requests) or ``charge`` (always recorded, for memory that exists already; it only makes later
``take`` calls and ``over`` checks stricter). Every take/charge is given back exactly once with ``give``.

Thread-safe (one lock); counters for the metrics.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict


class Budget:
    """``limit`` bytes for everyone, ``per_account`` for each account (a client: pool/clients.py)."""

    def __init__(self, name: str, limit: int, per_account: int) -> None:
        if limit <= 0 or per_account <= 0:
            raise ValueError(f"budget {name}: limits must be > 0, got {limit} and {per_account}")
        self.name = name
        self.limit = limit
        self.per_account = min(per_account, limit)
        self.used = 0
        self.peak = 0
        self.refused = 0  # takes refused (count)
        self._by: defaultdict[str, int] = defaultdict(int)
        self._lock = threading.Condition()

    def room(self, account: str) -> int:
        """Bytes ``account`` may take now."""
        with self._lock:
            return max(0, min(self.limit - self.used, self.per_account - self._by.get(account, 0)))

    def take(self, account: str, nbytes: int) -> bool:
        """Record ``nbytes`` for ``account`` if both limits allow it; False (and nothing recorded) if not."""
        if nbytes <= 0:
            return True
        with self._lock:
            if self.used + nbytes > self.limit or self._by.get(account, 0) + nbytes > self.per_account:
                self.refused += 1
                return False
            self._add(account, nbytes)
        return True

    def wait_take(self, account: str, nbytes: int, deadline: float) -> bool:
        """``take``, waiting until ``deadline`` (time.monotonic()) for room; ``nbytes`` over the per-account
        limit is never granted (False at once)."""
        if nbytes <= 0:
            return True
        if nbytes > self.per_account:
            return self.take(account, nbytes)
        with self._lock:
            while self.used + nbytes > self.limit or self._by.get(account, 0) + nbytes > self.per_account:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.refused += 1
                    return False
                self._lock.wait(left)
            self._add(account, nbytes)
        return True

    def charge(self, account: str, nbytes: int) -> None:
        """Record ``nbytes`` whatever the limits (memory already allocated; at most one request's worth over)."""
        if nbytes > 0:
            with self._lock:
                self._add(account, nbytes)

    def give(self, account: str, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._lock:
            left = self._by.get(account, 0) - nbytes
            if left > 0:
                self._by[account] = left
            else:
                self._by.pop(account, None)
            self.used = max(0, self.used - nbytes)
            self._lock.notify_all()

    def over_account(self, account: str) -> bool:
        """Whether ``account`` is at its own limit: new work of its that would add to it waits."""
        with self._lock:
            return self._by.get(account, 0) >= self.per_account

    def of(self, account: str) -> int:
        with self._lock:
            return self._by.get(account, 0)

    def accounts(self) -> int:
        with self._lock:
            return len(self._by)

    def _add(self, account: str, nbytes: int) -> None:
        self._by[account] += nbytes
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def __repr__(self) -> str:
        return f"Budget({self.name}: {self.used}/{self.limit} B, {self.per_account} B per account)"
