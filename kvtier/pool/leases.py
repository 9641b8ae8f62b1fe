"""ClientLeases: what one-sided clients (shared memory, RDMA) hold in the pool between two requests.

(Not kvtier.leases.LeaseTable, which pins a store's blocks by name: these are slot reservations and
acquisitions of remote clients, identified by number and given back by a callback.)

A ``reserve`` hands a client slots to write into until its ``commit``; an ``acquire`` keeps blocks from being
evicted until its ``release``. The client does the copy itself, outside the pool's process, so the pool keeps
the reservation or the acquired blocks in this table under a lease number.

Expiry is two-staged, because the pool cannot see a client's copy: a lease not returned within ``lease_s``
(a client that died, hung or was cut off) is *quarantined* for another ``lease_s``: a late ``commit`` or
``release`` learns that the lease is gone (the client counts those blocks as misses / not stored), but the
slots are not reused until the quarantine ends, so a client still copying (it starts no copy later than half
a lease after it sent its request, see kvtier/transport/onesided.py) never reads or writes another key's
block. A late ``commit``/``release`` of a quarantined lease ends its quarantine at once (that client is done
copying). Only then does ``on_expire`` give the slots back.

Lease numbers start at a random 62-bit value per pool start, so a commit or release carrying a number from a
previous run of the pool (same endpoint, new epoch) finds nothing rather than another client's lease.

Thread-safe: every pool worker and the pool's janitor thread call it. Callbacks run outside the table's lock.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

LEASE_ID_BITS = 62  # lease numbers travel as wire ints below 1 << 62


@dataclass
class _Lease:
    kind: str
    value: Any
    on_expire: Callable[[], None]
    deadline: float
    quarantined: bool = False


class ClientLeases:
    """Leases by number. ``clock`` is injectable so tests expire leases without sleeping."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._clock = clock
        # Random start, far below the limit: 2**61 leases would have to be handed out before it wraps.
        self._ids = itertools.count(1 + secrets.randbits(LEASE_ID_BITS - 1))
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
        """The value of a live lease of ``kind`` (now returned), or None if it expired or never existed.
        A quarantined lease is given back now (its holder is done copying) and None is returned."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.kind != kind:
                return None
            del self._leases[lease_id]
        if lease.quarantined:
            self._give_back([lease])
            return None
        return lease.value

    def expire(self) -> int:
        """Quarantine overdue leases, give back those whose quarantine is over; returns how many expired now."""
        now = self._clock()
        with self._lock:
            overdue = [(i, lease) for i, lease in self._leases.items() if lease.deadline <= now]
            gone = []
            newly = 0
            for i, lease in overdue:
                if lease.quarantined:
                    gone.append(self._leases.pop(i))
                else:
                    lease.quarantined, lease.deadline = True, now + self.lease_s
                    newly += 1
        self._give_back(gone)
        if newly:
            self.expired += newly
            log.warning("%d leases expired after %.3g s (a client died, hung or lost its connection mid-copy); "
                        "their slots are quarantined for another %.3g s, then given back", newly, self.lease_s,
                        self.lease_s)
        return newly

    def expire_all(self) -> int:
        """Give everything back now (shutdown: no client can copy into a pool that is gone)."""
        with self._lock:
            gone = list(self._leases.values())
            self._leases.clear()
        self._give_back(gone)
        return len(gone)

    @staticmethod
    def _give_back(leases: list[_Lease]) -> None:
        for lease in leases:
            try:
                lease.on_expire()
            except Exception:
                log.exception("giving back an expired %s lease failed", lease.kind)

    @property
    def quarantined(self) -> int:
        with self._lock:
            return sum(lease.quarantined for lease in self._leases.values())

    def __len__(self) -> int:
        return len(self._leases)
