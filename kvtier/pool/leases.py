"""ClientLeases: what one-sided clients (shared memory, RDMA) hold in the pool between two requests.

(Not kvtier.leases.LeaseTable, which pins a store's blocks by name: these are slot reservations and
acquisitions of remote clients, identified by number and given back by a callback.)

A ``reserve`` hands a client slots to write into until its ``commit``; an ``acquire`` keeps blocks from being
evicted until its ``release``. The client does the copy itself, outside the pool's process, so the pool keeps
the reservation or the acquired blocks in this table under a lease number. A lease not returned within
``lease_s`` (a client that died, hung or was cut off) expires: its ``on_expire`` gives the slots back, and a
late ``commit``/``release`` learns that the lease is gone (the client then counts those blocks as misses).

Thread-safe: every pool worker and the pool's janitor thread call it. Callbacks run outside the table's lock.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class _Lease:
    kind: str
    value: Any
    on_expire: Callable[[], None]
    deadline: float


class ClientLeases:
    """Leases by number. ``clock`` is injectable so tests expire leases without sleeping."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._clock = clock
        self._ids = itertools.count(1)
        self._leases: dict[int, _Lease] = {}
        self._lock = threading.Lock()
        self.expired = 0

    def add(self, kind: str, value: Any, on_expire: Callable[[], None]) -> int:
        lease = _Lease(kind, value, on_expire, self._clock() + self.lease_s)
        with self._lock:
            lease_id = next(self._ids)
            self._leases[lease_id] = lease
        return lease_id

    def take(self, lease_id: int, kind: str) -> Any | None:
        """The value of a live lease of ``kind`` (now returned), or None if it expired or never existed."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.kind != kind:
                return None
            del self._leases[lease_id]
        return lease.value

    def expire(self) -> int:
        """Expire overdue leases (their callbacks give what they held back); returns how many."""
        now = self._clock()
        with self._lock:
            overdue = [i for i, lease in self._leases.items() if lease.deadline <= now]
            gone = [self._leases.pop(i) for i in overdue]
        for lease in gone:
            try:
                lease.on_expire()
            except Exception:
                log.exception("giving back an expired %s lease failed", lease.kind)
        if gone:
            self.expired += len(gone)
            log.warning("%d leases expired after %.3g s (a client died, hung or lost its connection mid-copy); "
                        "what they held is given back", len(gone), self.lease_s)
        return len(gone)

    def expire_all(self) -> int:
        """Give everything back (shutdown)."""
        with self._lock:
            for lease in self._leases.values():
                lease.deadline = float("-inf")
        return self.expire()

    def __len__(self) -> int:
        return len(self._leases)
