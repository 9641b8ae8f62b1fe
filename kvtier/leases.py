"""LeaseTable: named sets of store pins that expire, ranked by priority when too many keys are leased.

Two users, one mechanism:

* a connector pins the blocks a lookup reported, from the lookup until the load that reads them (a block
  evicted in between would turn a hit into a recompute), under a lease that expires in case the load
  never comes (the request was aborted, the scheduler died);
* an agent framework tells the store to keep a session's blocks for a while ("the next turn comes within
  10 minutes"): ``lease("session:abc", keys, ttl_s=600, priority=1)``. A repeated lease of the same name
  adds keys and extends the expiry, so a session that keeps growing stays pinned as one lease.

A lease pins each of its keys once in the store's ``PinTable`` (per-block reference counts), so leases
compose with every other pin holder. ``max_keys`` caps the keys held by all leases together: past it,
whole leases are released lowest priority first, then soonest to expire (an agent that hints everything
cannot pin the whole cache). Expired leases are released on the next call that touches the table (lease,
keys_of, len, in, leased_keys), by ``sweep()``, and by the store when a put finds no evictable space (the
table registers its sweep with a store that has ``add_reclaimer``); a call with nothing due costs O(1). Time
comes from an injectable clock, so tests never sleep.

Thread-safe. Runs in the process that owns the store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)


class Pinnable(Protocol):
    """What a LeaseTable needs from a store (TieredStore has both)."""

    def pin(self, keys: Sequence[bytes]) -> list[bool]: ...

    def unpin(self, keys: Sequence[bytes]) -> None: ...


Reclaimer = Callable[[], int]  # releases pins nobody needs any more (expired leases); returns how many holders


@dataclass
class Lease:
    """Keys pinned under one name until ``expires`` (clock seconds)."""

    name: str
    expires: float
    priority: float
    keys: set[bytes] = field(default_factory=set)


class LeaseTable:
    """Leases over ``store``'s pins. ``max_keys`` <= 0: no cap."""

    def __init__(self, store: Pinnable, *, max_keys: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self.max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._total = 0  # keys held by all leases
        self._earliest = float("inf")  # no lease expires before this (a lower bound: extensions only raise)
        self.released_by_budget = 0  # leases dropped to honour max_keys
        self.expired = 0
        add_reclaimer: Callable[[Reclaimer], None] | None = getattr(store, "add_reclaimer", None)
        if add_reclaimer is not None:  # a full store releases expired leases before it refuses a put
            add_reclaimer(self.sweep)

    def lease(self, name: str, keys: Sequence[bytes], ttl_s: float, priority: float = 0.0) -> list[bool]:
        """Pin the held ``keys`` under ``name`` until now + ``ttl_s``; True where the key is leased afterwards.

        Keys the store does not hold are not pinned (False). Keys already in the lease stay pinned once.
        The expiry and the priority only ever grow. Raises ValueError for ttl_s <= 0: every lease ends.
        """
        if not ttl_s > 0:
            raise ValueError(f"lease {name!r}: ttl_s must be > 0, got {ttl_s}")
        self._release_expired()
        now = self._clock()
        # One lock over the pin call too: the store never calls back into this table, and two lease() calls
        # of one name must not both pin a key.
        with self._lock:
            lease = self._leases.get(name)
            if lease is None:
                lease = self._leases[name] = Lease(name, now + ttl_s, priority)
            fresh = list(dict.fromkeys(k for k in keys if k not in lease.keys))
            held = self._store.pin(fresh) if fresh else []
            pinned = [k for k, h in zip(fresh, held) if h]
            lease.keys.update(pinned)
            self._total += len(pinned)
            lease.expires = max(lease.expires, now + ttl_s)
            self._earliest = min(self._earliest, lease.expires)
            lease.priority = max(lease.priority, priority)
            victims = self._over_budget()
            for victim in victims:
                self._unpin(victim)
            # This lease itself may have gone for the budget: then none of its keys is leased any more.
            result = [k in lease.keys for k in keys] if self._leases.get(name) is lease else [False] * len(keys)
        for victim in victims:
            log.info("lease %r released early (%d keys, priority %s): leases held more than max_keys=%d keys",
                     victim.name, len(victim.keys), victim.priority, self.max_keys)
        return result

    def release(self, name: str) -> int:
        """Unpin every key of lease ``name``; return how many (0 for an unknown or already released lease)."""
        with self._lock:
            lease = self._leases.pop(name, None)
            if lease is not None:
                self._total -= len(lease.keys)
        if lease is None:
            return 0
        self._unpin(lease)
        return len(lease.keys)

    def sweep(self) -> int:
        """Release expired leases; return how many."""
        return self._release_expired()

    def keys_of(self, name: str) -> set[bytes]:
        self._release_expired()
        with self._lock:
            lease = self._leases.get(name)
            return set(lease.keys) if lease is not None else set()

    def __contains__(self, name: object) -> bool:
        self._release_expired()
        return name in self._leases

    def __len__(self) -> int:
        self._release_expired()
        return len(self._leases)

    @property
    def leased_keys(self) -> int:
        self._release_expired()
        return self._total

    # ---- internals -------------------------------------------------------------------------------------

    def _release_expired(self) -> int:
        now = self._clock()
        if now < self._earliest:  # nothing due (a float read: no lock needed)
            return 0
        with self._lock:
            gone = [lease for lease in self._leases.values() if lease.expires <= now]
            for lease in gone:
                del self._leases[lease.name]
                self._total -= len(lease.keys)
            self.expired += len(gone)
            self._earliest = min((lease.expires for lease in self._leases.values()), default=float("inf"))
        for lease in gone:
            self._unpin(lease)
        return len(gone)

    def _over_budget(self) -> list[Lease]:
        """Leases to drop so the total fits max_keys (called with the lock held)."""
        if self.max_keys <= 0 or self._total <= self.max_keys:
            return []
        victims = []
        for lease in sorted(self._leases.values(), key=lambda x: (x.priority, x.expires)):
            if self._total <= self.max_keys:
                break
            del self._leases[lease.name]
            self._total -= len(lease.keys)
            victims.append(lease)
        self.released_by_budget += len(victims)
        return victims

    def _unpin(self, lease: Lease) -> None:
        if lease.keys:
            self._store.unpin(list(lease.keys))
