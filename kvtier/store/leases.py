"""LeaseTable: named sets of store pins that expire, ranked by priority when too many keys are leased.

Two users, one mechanism:

* a connector pins the blocks a lookup reported, from the lookup until the load that reads them (a block
  evicted in between would turn a hit into a recompute), under a lease that expires in case the load
  never comes (the request was aborted, the scheduler died);
* an agent framework tells the store to keep a session's blocks for a while ("the next turn comes within
  10 minutes"): ``lease(session_lease("abc"), keys, ttl_s=600, priority=1)``. A repeated lease of the same
  name adds keys and extends the expiry, so a session that keeps growing stays pinned as one lease.

A *hold* is someone else's say over a lease they did not create: ``hold(name, ttl_s, priority)`` keeps lease
``name`` (the one there now, or the one a later ``lease(name, ...)`` creates) alive until now + ``ttl_s`` and
ranks it at least ``priority``, without pinning anything itself. kvtier-master's session pins reach a node
this way ("session abc comes back within 5 minutes": every node that holds abc's lease keeps it). A hold is
replaced by the next hold of the name (it can shorten: the holder restates its wish) and ends at its expiry or
at ``unhold``; the lease then lives by its own expiry and priority again. ``keep=False`` holds only rank.

A lease pins each of its keys once in the store's ``PinTable`` (per-block reference counts), so leases
compose with every other pin holder. ``max_keys`` caps the keys held by all leases together: past it,
whole leases are released lowest priority first, then soonest to expire (an agent that hints everything
cannot pin the whole cache). Expired leases are released on the next call that touches the table (lease,
hold, keys_of, len, in, leased_keys), by ``sweep()``, and by the store when a put finds no evictable space
(the table registers its sweep with a store that has ``add_reclaimer``); a call with nothing due costs O(1).
Time comes from an injectable clock, so tests never sleep.

Thread-safe. Runs in the process that owns the store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.store.types import StoreLookup

log = logging.getLogger(__name__)


Reclaimer = Callable[[], int]  # releases pins nobody needs any more (expired leases); returns how many holders


class Pinnable(Protocol):
    """What a LeaseTable needs from a store (TieredStore has them all): pins (``lookup_prefix(pin=True)``: a
    prefix lookup that pins what it finds in the same pass), and a hook to release expired leases when the
    store finds no evictable space."""

    def pin(self, keys: Sequence[bytes]) -> list[bool]: ...

    def lookup_prefix(self, keys: Sequence[bytes], *, pin: bool = False) -> StoreLookup: ...

    def unpin(self, keys: Sequence[bytes]) -> None: ...

    def add_reclaimer(self, reclaim: Reclaimer) -> None: ...


def session_lease(session: str) -> str:
    """The lease that keeps an agent session's blocks: the connectors lease under it, the master's session
    pins hold it."""
    return f"session:{session}"


@dataclass
class Lease:
    """Keys pinned under one name until ``expires`` (clock seconds; a hold may keep them longer)."""

    name: str
    expires: float
    priority: float
    keys: set[bytes] = field(default_factory=set)


@dataclass(frozen=True)
class Hold:
    """One party's hold on a lease name: the lease lives at least until ``until`` (clock seconds; only with
    ``keep``) and ranks at least ``priority`` until then."""

    until: float
    priority: float
    keep: bool = True


class LeaseTable:
    """Leases over ``store``'s pins. ``max_keys`` <= 0: no cap."""

    def __init__(self, store: Pinnable, *, max_keys: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self.max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._holds: dict[str, Hold] = {}
        self._total = 0  # keys held by all leases
        # No lease or hold ends before this (a lower bound, lowered by every call that can bring an end closer).
        self._earliest = float("inf")
        self.released_by_budget = 0  # leases dropped to honour max_keys
        self.expired = 0
        store.add_reclaimer(self.sweep)  # a full store releases expired leases before it refuses a put

    def lease(self, name: str, keys: Sequence[bytes], ttl_s: float, priority: float = 0.0) -> list[bool]:
        """Pin the held ``keys`` under ``name`` until now + ``ttl_s``; True where the key is leased afterwards.

        Keys the store does not hold are not pinned (False). Keys already in the lease stay pinned once.
        The expiry and the priority only ever grow. Raises ValueError for ttl_s <= 0: every lease ends.
        """
        now = self._start(name, ttl_s)
        # One lock over the pin call too: the store never calls back into this table, and two lease() calls
        # of one name must not both pin a key.
        with self._lock:
            have = self._leases.get(name)
            fresh = list(dict.fromkeys(k for k in keys if have is None or k not in have.keys))
            held = self._store.pin(fresh) if fresh else []
            lease = self._adopt(name, [k for k, h in zip(fresh, held) if h], now, ttl_s, priority)
            # This lease itself may have gone for the budget: then none of its keys is leased any more.
            return [k in lease.keys for k in keys] if lease is not None else [False] * len(keys)

    def lease_prefix(self, name: str, keys: Sequence[bytes], ttl_s: float, priority: float = 0.0) -> StoreLookup:
        """Find the leading ``keys`` the store holds and pin them under ``name`` until now + ``ttl_s``, in one
        pass over the tiers (``lookup_prefix(pin=True)``: pinned before they are looked for). Returns the
        prefix found and leased (length 0 if the budget dropped the lease at once); keys already in the lease
        stay pinned once. No lease is made when nothing is held.
        """
        now = self._start(name, ttl_s)
        with self._lock:  # as in lease(): two leases of one name must not both keep a key's pin
            found = self._store.lookup_prefix(keys, pin=True)
            if not found.length:
                return found
            lease = self._adopt(name, list(keys[: found.length]), now, ttl_s, priority)
            return found if lease is not None else StoreLookup(0, [])

    def _start(self, name: str, ttl_s: float) -> float:
        """What every new pin under a lease begins with: its ttl checked, the expired released; the time now."""
        if not ttl_s > 0:
            raise ValueError(f"lease {name!r}: ttl_s must be > 0, got {ttl_s}")
        self._release_expired()
        return self._clock()

    def _adopt(self, name: str, pinned: list[bytes], now: float, ttl_s: float, priority: float) -> Lease | None:
        """Give lease ``name`` (made if new) the keys of ``pinned``, one store pin each taken by the caller (a
        key the lease has already, or a repeat, gives its pin back), extend it, then keep the budget. Returns
        the lease, or None when the budget released it at once. Lock held."""
        lease = self._leases.get(name)
        if lease is None:
            lease = self._leases[name] = Lease(name, now + ttl_s, priority)
        distinct = set(pinned)
        if len(distinct) == len(pinned):  # no repeats (a prompt's chain): set operations, no loop per key
            extra = list(lease.keys.intersection(distinct))
            before = len(lease.keys)
            lease.keys |= distinct
            self._total += len(lease.keys) - before
        else:
            extra = []
            for k in pinned:
                if k in lease.keys:
                    extra.append(k)
                else:
                    lease.keys.add(k)
                    self._total += 1
        if extra:
            self._store.unpin(extra)
        lease.expires = max(lease.expires, now + ttl_s)
        self._earliest = min(self._earliest, self._until(lease))
        lease.priority = max(lease.priority, priority)
        for victim in self._over_budget():
            self._unpin(victim)
            log.info("lease %r released early (%d keys, priority %s): leases held more than max_keys=%d keys",
                     victim.name, len(victim.keys), victim.priority, self.max_keys)
        return lease if self._leases.get(name) is lease else None

    def release(self, name: str) -> int:
        """Unpin every key of lease ``name``; return how many (0 for an unknown or already released lease).
        A hold on ``name`` stays: it applies to the next lease of that name."""
        with self._lock:
            lease = self._leases.pop(name, None)
            if lease is not None:
                self._total -= len(lease.keys)
        if lease is None:
            return 0
        self._unpin(lease)
        return len(lease.keys)

    def release_keys(self, name: str, keys: Sequence[bytes]) -> int:
        """Unpin ``keys`` from lease ``name``, which keeps the rest (and ends when it has none left); return
        how many of them it held."""
        with self._lock:
            lease = self._leases.get(name)
            gone = [k for k in dict.fromkeys(keys) if k in lease.keys] if lease is not None else []
            if lease is not None:
                lease.keys.difference_update(gone)
                self._total -= len(gone)
                if not lease.keys:
                    del self._leases[name]
        if gone:
            self._store.unpin(gone)
        return len(gone)

    def hold(self, name: str, ttl_s: float, priority: float = 0.0, *, keep: bool = True) -> None:
        """Keep lease ``name`` (now or once created) until now + ``ttl_s`` (``keep``) and rank it at least
        ``priority`` until then, in place of any earlier hold of ``name``. ``ttl_s`` may be inf (until
        ``unhold``). Raises ValueError for ttl_s <= 0."""
        if not ttl_s > 0:
            raise ValueError(f"hold {name!r}: ttl_s must be > 0, got {ttl_s}")
        self._release_expired()
        until = self._clock() + ttl_s
        with self._lock:  # the budget is enforced when keys are added; a new rank counts from then on
            self._holds[name] = Hold(until, priority, keep)
            lease = self._leases.get(name)
            # The lease now ends at its own expiry (keep=False) or later: both bound its end from below.
            self._earliest = min(self._earliest, until, lease.expires if lease is not None else until)
        self._release_expired()  # a shortened hold may have ended the lease's life already

    def unhold(self, name: str) -> bool:
        """Drop the hold on ``name`` (the lease lives by its own expiry again); False if there was none."""
        with self._lock:
            hold = self._holds.pop(name, None)
            lease = self._leases.get(name)
            if lease is not None:
                self._earliest = min(self._earliest, lease.expires)
        self._release_expired()
        return hold is not None

    def sweep(self) -> int:
        """Release expired leases (and forget expired holds); return how many leases."""
        return self._release_expired()

    def keys_of(self, name: str) -> set[bytes]:
        self._release_expired()
        with self._lock:
            lease = self._leases.get(name)
            return set(lease.keys) if lease is not None else set()

    def expires_in(self, name: str) -> float | None:
        """Seconds until lease ``name`` ends, holds included; None if there is no such lease."""
        self._release_expired()
        with self._lock:
            lease = self._leases.get(name)
            return self._until(lease) - self._clock() if lease is not None else None

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

    def _until(self, lease: Lease) -> float:
        """When ``lease`` ends: its own expiry, or its hold's if that keeps it longer (lock held)."""
        hold = self._holds.get(lease.name)
        return max(lease.expires, hold.until) if hold is not None and hold.keep else lease.expires

    def _rank(self, lease: Lease) -> tuple[float, float]:
        """Budget order, lowest released first: priority (its own or its hold's), then end (lock held)."""
        hold = self._holds.get(lease.name)
        priority = max(lease.priority, hold.priority) if hold is not None else lease.priority
        return priority, self._until(lease)

    def _release_expired(self) -> int:
        now = self._clock()
        if now < self._earliest:  # nothing due (a float read: no lock needed)
            return 0
        with self._lock:
            for name in [n for n, h in self._holds.items() if h.until <= now]:
                del self._holds[name]
            gone = [lease for lease in self._leases.values() if self._until(lease) <= now]
            for lease in gone:
                del self._leases[lease.name]
                self._total -= len(lease.keys)
            self.expired += len(gone)
            self._earliest = min(min((self._until(x) for x in self._leases.values()), default=float("inf")),
                                 min((h.until for h in self._holds.values()), default=float("inf")))
        for lease in gone:
            self._unpin(lease)
        return len(gone)

    def _over_budget(self) -> list[Lease]:
        """Leases to drop so the total fits max_keys (called with the lock held)."""
        if self.max_keys <= 0 or self._total <= self.max_keys:
            return []
        victims = []
        for lease in sorted(self._leases.values(), key=self._rank):
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
