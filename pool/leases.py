"""ClientLeases: what one-sided clients (shared memory, RDMA) hold in the pool between two requests.

(Not kvtier.store.leases.LeaseTable, which pins a store's blocks by name: these are slot reservations and
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

Every lease belongs to the client that took it (``owner``: its account and session, pool/clients.py): a
commit or release from anyone else finds nothing, is counted (``foreign``) and leaves the lease alone. Lease
numbers are drawn at random (62 bits from the OS's CSPRNG), so neither a stranger nor a client of the pool's
previous run (same endpoint, new epoch) can name another client's lease.

What a lease holds is charged to the pool's ``held`` budget (pool/budget.py) by whoever adds it, for
``nbytes``; the table gives that back when the lease leaves it (returned, or given back after quarantine).
One account holds at most ``per_account`` leases at once (``full``): each costs a little bookkeeping, and a
client taking one-block leases in a loop must not turn the quota of bytes into millions of entries.

Thread-safe: every pool worker and the pool's janitor thread call it. Callbacks run outside the table's lock.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.pool.budget import Budget

log = logging.getLogger(__name__)

LEASE_ID_BITS = 62  # lease numbers travel as wire ints below 1 << 62
MAX_LEASES_PER_ACCOUNT = 1024  # a client's batches hold a few each; quarantined ones count until given back
Owner = tuple[str, bytes]  # (account, session): kvtier.pool.clients.Client.owner


@dataclass
class _Lease:
    kind: str
    value: Any
    on_expire: Callable[[], None]
    deadline: float
    owner: Owner
    nbytes: int = 0
    quarantined: bool = False


class ClientLeases:
    """Leases by number. ``clock`` is injectable so tests expire leases without sleeping; ``budget`` is what
    the leases' ``nbytes`` were charged to (given back here)."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic,
                 budget: Budget | None = None, per_account: int = MAX_LEASES_PER_ACCOUNT) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self.per_account = per_account
        self._clock = clock
        self._budget = budget
        self._leases: dict[int, _Lease] = {}
        self._by_account: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.expired = 0
        self.foreign = 0  # commits/releases that named a lease another client holds

    def add(self, kind: str, value: Any, on_expire: Callable[[], None], owner: Owner, nbytes: int = 0) -> int:
        lease = _Lease(kind, value, on_expire, self._clock() + self.lease_s, owner, nbytes)
        with self._lock:
            while True:
                lease_id = secrets.randbits(LEASE_ID_BITS)
                if lease_id and lease_id not in self._leases:
                    break
            self._leases[lease_id] = lease
            self._by_account[owner[0]] += 1
        return lease_id

    def full(self, account: str) -> bool:
        """Whether ``account`` holds ``per_account`` leases (quarantined ones included): it gets no more now."""
        with self._lock:
            return self._by_account[account] >= self.per_account

    def take(self, lease_id: int, kind: str, owner: Owner) -> Any | None:
        """The value of a live lease of ``kind`` held by ``owner`` (now returned), or None if it expired, never
        existed or is another client's (that one stays as it is). A quarantined lease is given back now (its
        holder is done copying) and None is returned."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.kind != kind:
                return None
            if lease.owner != owner:
                self.foreign += 1
                return None
            self._drop(lease_id)
        self._uncharge(lease)
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
                    gone.append(self._drop(i))
                else:
                    lease.quarantined, lease.deadline = True, now + self.lease_s
                    newly += 1
        for lease in gone:
            self._uncharge(lease)
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
            self._by_account.clear()
        for lease in gone:
            self._uncharge(lease)
        self._give_back(gone)
        return len(gone)

    def _drop(self, lease_id: int) -> _Lease:
        """(lock held) Remove a lease from the table and from its account's count."""
        lease = self._leases.pop(lease_id)
        account = lease.owner[0]
        self._by_account[account] -= 1
        if self._by_account[account] <= 0:
            del self._by_account[account]
        return lease

    def _uncharge(self, lease: _Lease) -> None:
        if self._budget is not None and lease.nbytes:
            self._budget.give(lease.owner[0], lease.nbytes)

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
