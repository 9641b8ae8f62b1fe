"""StoreHints: kvtier-master's hints applied to one node's TieredStore, as leases (kvtier/store/leases.py).

The master keeps what routers and agent frameworks say (master/hints.py); a node's NodeAgent fetches the
hints when their version changes and hands them to ``StoreHints.apply``, which turns them into the same
leases the engine connectors use, in the store's one ``LeaseTable`` (``store.leases``), under one budget:

* key pins: the held keys pinned by one master ``pin`` call (the same expiry and priority) form one lease,
  ending when the master's pin ends, whether or not the master speaks again; unpinned keys are released;
  keys pinned again with another TTL move to that pin's lease (leased there before they leave the old one,
  so they are never unpinned in between). Keys the store does not hold yet are retried at every change of
  the hints; a key whose lease went for the budget is not, until the master changes its pin.
* session pins: a hold on the session's lease (``session_lease``: the one the connectors lease a session's
  blocks under), so "session agent-7 comes back within 5 minutes" keeps agent-7's blocks on every node that
  holds them, and a lease the connector creates later lives at least as long. The master's unpin drops the
  hold: the lease lives by the connector's own TTL again.
* priorities: a session's priority ranks its lease in the budget (the lowest goes first when leases pin
  more than ``store.leases.max_keys`` blocks); a key's priority ranks its pin's lease. They are not an
  eviction order: eviction policies choose among unpinned blocks and know nothing of leases; a priority
  without a pin orders nothing here. A priority that ends before its pin counts until the master says so.

Expiry times are the master's unix clock, read against this node's (``wall``): nodes and master keep NTP
time. Runs on the NodeAgent's thread; not thread-safe itself (the LeaseTable it drives is).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvtier.client.api import MasterHints
from kvtier.store.leases import session_lease

log = logging.getLogger(__name__)


def pin_lease(expires: float, priority: float) -> str:
    """The lease of the keys one master pin call pinned (they share its expiry and priority)."""
    return f"master-pin:{expires!r}:{priority!r}"


class StoreHints:
    """Applies master ``MasterHints`` to ``store.leases``. A store whose lease table has no budget yet gets one:
    ``hint_max_fraction`` of the top tier's blocks (0: none), so the master cannot pin all of DRAM."""

    def __init__(self, store: Any, *, hint_max_fraction: float = 0.5,
                 wall: Callable[[], float] = time.time) -> None:
        if not 0 <= hint_max_fraction <= 1:
            raise ValueError(f"hint_max_fraction must be in [0, 1], got {hint_max_fraction}")
        self.leases = store.leases
        self._contains: Callable[[list[bytes]], list[bool]] = store.contains
        self._wall = wall
        if self.leases.max_keys <= 0 and hint_max_fraction > 0:
            self.leases.max_keys = max(1, int(store.capacity_blocks * hint_max_fraction))
        self._given: dict[str, set[bytes]] = {}  # pin lease -> the keys given to it (held at the time)
        self._sessions: set[str] = set()  # sessions holding their lease

    def apply(self, hints: MasterHints) -> None:
        if hints.unchanged:
            return
        now = self._wall()
        self._apply_key_pins(hints, now)
        self._apply_sessions(hints, now)

    def _apply_key_pins(self, hints: MasterHints, now: float) -> None:
        wanted: dict[str, tuple[float, float, set[bytes]]] = {}  # lease -> (ttl_s, priority, keys)
        for key, expires in hints.key_pins.items():
            if expires > now:
                priority = _live_level(hints.key_priority, key, now)
                wanted.setdefault(pin_lease(expires, priority), (expires - now, priority, set()))[2].add(key)
        for name, (ttl_s, priority, keys) in wanted.items():  # first lease, then release (see the module doc)
            given = self._given.get(name, set())
            new = [k for k in keys if k not in given]
            held = [k for k, h in zip(new, self._contains(new)) if h] if new else []
            if held:
                self.leases.lease(name, held, ttl_s, priority)
                self._given[name] = given | set(held)
        for name, given in list(self._given.items()):
            keep = wanted[name][2] if name in wanted else set()
            gone = given - keep
            if not gone:
                continue
            if gone == given:
                self.leases.release(name)
                del self._given[name]
            else:
                self.leases.release_keys(name, list(gone))
                given -= gone

    def _apply_sessions(self, hints: MasterHints, now: float) -> None:
        held: set[str] = set()
        for session in hints.session_pins.keys() | hints.session_priority.keys():
            pinned_until = hints.session_pins.get(session, 0.0)
            priority = _live_level(hints.session_priority, session, now)
            if pinned_until > now:
                self.leases.hold(session_lease(session), pinned_until - now, priority)
            elif priority:
                ranked_until = hints.session_priority[session][1]
                self.leases.hold(session_lease(session), ranked_until - now, priority, keep=False)
            else:
                continue
            held.add(session)
        for session in self._sessions - held:
            self.leases.unhold(session_lease(session))
        if held != self._sessions:
            log.info("master hints: %d sessions held on this node (%d new, %d dropped)", len(held),
                     len(held - self._sessions), len(self._sessions - held))
        self._sessions = held


def _live_level(priorities: Mapping[Any, tuple[int, float]], name: Any, now: float) -> float:
    """The priority level of ``name`` if its hint has not ended, else 0."""
    level, until = priorities.get(name, (0, 0.0))
    return float(level) if until > now else 0.0
