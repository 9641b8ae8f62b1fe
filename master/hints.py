"""HintTable: pins and priorities that routers set on keys or sessions, kept for the nodes to apply.

A router that knows an agent session comes back in 30 s pins that session (or its prefix keys) with a TTL;
each node turns the hints into leases of its store (kvtier/client/store_hints.py): pinned keys and the
blocks of pinned sessions stay, under the node's lease budget, ranked by priority. The master does not
enforce hints (the nodes own their memory); it keeps them, persists them, expires them, and serves them
with a version number that heartbeat replies carry, so nodes refetch only when something changed.

Expiry times are wall-clock unix seconds (they persist across restarts); 0 on the wire means "no expiry".
``expire`` runs on every tick of the master's loop, so it must cost nothing when nothing is due: a heap of
(expiry, hint) entries, stale ones (a hint extended, re-set or removed since) skipped when they surface.
Memory: at most ``max_keys`` keyed and ``max_sessions`` session entries (session names of at most
limits.MAX_SESSION characters), optionally fewer per client (the key that set them). Persistence is per
entry: ``take_changes`` hands the server what changed since it last asked (persist.py writes those records
only). Runs in the master's event loop; not thread-safe.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvtier.wire import ERR_TOO_LARGE, WireError, pack_keys, unpack_keys

NEVER = float("inf")


def _expiry(now: float, ttl_s: float) -> float:
    return now + ttl_s if ttl_s > 0 else NEVER


def wire_time(t: float) -> float:
    """An expiry as disk and wire write it (0: never)."""
    return 0.0 if t == NEVER else t


def from_wire_time(t: float) -> float:
    return NEVER if t == 0 else t


def _until(value: float | tuple[int, float]) -> float:
    """The expiry of a pin (the value itself) or of a priority ((level, expiry))."""
    return value[1] if isinstance(value, tuple) else value


_KEY_PINS, _SESSION_PINS, _KEY_PRIORITY, _SESSION_PRIORITY = range(4)  # indexes into HintTable._tables()
KEYED = (_KEY_PINS, _KEY_PRIORITY)
ANONYMOUS = "anonymous"  # the owner of hints set without keys (master/access.py's quota name)


@dataclass(frozen=True)
class HintChange:
    """One entry as it is now (``value`` None: removed), for persisting changes one entry at a time. ``which``
    is the table (0 key pins, 1 session pins, 2 key priorities, 3 session priorities), ``name`` a 16-byte key
    or a session name, ``value`` an expiry (pins) or (level, expiry) (priorities)."""

    which: int
    name: bytes | str
    value: float | tuple[int, float] | None
    owner: str = ANONYMOUS


class HintTable:
    """Pins and priorities by key (16-byte) or session (a string), each with an expiry. Bounded: at most
    ``max_keys`` keyed hints and ``max_sessions`` session hints in all, and, when ``max_per_client`` > 0, that
    many entries per owner (the CurveZMQ key that set them; without keys only the totals apply), so a router
    bug or a hostile client cannot grow the master without bound. Changes are logged per entry
    (``take_changes``) so persisting one pin writes one record, not the table."""

    def __init__(self, max_keys: int = 1 << 20, max_sessions: int = 1 << 18, max_per_client: int = 0, *,
                 track_changes: bool = False) -> None:
        self.max_keys = max_keys
        self.max_sessions = max_sessions
        self.max_per_client = max_per_client
        self.key_pins: dict[bytes, float] = {}
        self.session_pins: dict[str, float] = {}
        self.key_priority: dict[bytes, tuple[int, float]] = {}
        self.session_priority: dict[str, tuple[int, float]] = {}
        self.version = 0
        # (expiry, which table, key or session) for every finite expiry set; may hold stale entries.
        self._due: list[tuple[float, int, Any]] = []
        self._owner_of: dict[tuple[int, Any], str] = {}  # entries set by a named owner (absent: ANONYMOUS)
        self._per_owner: Counter[str] = Counter()
        self._changes: dict[tuple[int, Any], None] = {}  # entries changed since take_changes (an ordered set)
        self._track = track_changes  # only a master with a data dir takes them (else they would pile up)

    def __len__(self) -> int:
        return len(self.key_pins) + len(self.session_pins) + len(self.key_priority) + len(self.session_priority)

    def owned_by(self, owner: str) -> int:
        """Entries ``owner`` set that are still kept."""
        return self._per_owner[owner]

    def _room(self, which: tuple[int, int], keys: list[bytes], session: str | None, owner: str) -> None:
        """Refuse what would pass a limit (keys and sessions already hinted in that table are not new)."""
        keyed, sessioned = (self._tables()[w] for w in which)
        new_keys = len({k for k in keys if k not in keyed})
        new_sessions = int(session is not None and session not in sessioned)
        if len(self.key_pins) + len(self.key_priority) + new_keys > self.max_keys:
            raise WireError(ERR_TOO_LARGE, f"hints would exceed {self.max_keys} keyed hints; unpin some, "
                                           "pin sessions instead of keys, or use shorter TTLs")
        if len(self.session_pins) + len(self.session_priority) + new_sessions > self.max_sessions:
            raise WireError(ERR_TOO_LARGE, f"hints would exceed {self.max_sessions} session hints; unpin sessions "
                                           "that are done, or use shorter TTLs")
        if self.max_per_client and owner != ANONYMOUS and \
                self._per_owner[owner] + new_keys + new_sessions > self.max_per_client:
            raise WireError(ERR_TOO_LARGE, f"this client ({owner[:12]}) would hold more than {self.max_per_client} "
                                           "hints (the master's --max-hints-per-client); unpin some first")

    def pin(self, keys: Iterable[bytes], session: str | None, ttl_s: float, now: float,
            owner: str = ANONYMOUS) -> int:
        """Pin keys and/or a session until now + ttl_s (0: until unpinned). A repeated pin extends it."""
        keys = list(keys)
        self._room((_KEY_PINS, _SESSION_PINS), keys, session, owner)
        until = _expiry(now, ttl_s)
        for k in keys:
            self._set(_KEY_PINS, k, until, owner)
        if session is not None:
            self._set(_SESSION_PINS, session, until, owner)
        self._schedule(until, _KEY_PINS, keys)
        self._schedule(until, _SESSION_PINS, [session] if session is not None else [])
        self.version += 1
        return len(keys) + (session is not None)

    def unpin(self, keys: Iterable[bytes], session: str | None) -> int:
        n = sum(self._drop(_KEY_PINS, k) for k in keys)
        if session is not None:
            n += self._drop(_SESSION_PINS, session)
        self.version += 1
        return n

    def set_priority(self, keys: Iterable[bytes], session: str | None, level: int, ttl_s: float,
                     now: float, owner: str = ANONYMOUS) -> int:
        """Priority ``level`` (higher: keep longer; 0 removes the hint) for keys and/or a session."""
        keys = list(keys)
        until = _expiry(now, ttl_s)
        if level == 0:
            for k in keys:
                self._drop(_KEY_PRIORITY, k)
            if session is not None:
                self._drop(_SESSION_PRIORITY, session)
        else:
            self._room((_KEY_PRIORITY, _SESSION_PRIORITY), keys, session, owner)
            for k in keys:
                self._set(_KEY_PRIORITY, k, (level, until), owner)
            if session is not None:
                self._set(_SESSION_PRIORITY, session, (level, until), owner)
            self._schedule(until, _KEY_PRIORITY, keys)
            self._schedule(until, _SESSION_PRIORITY, [session] if session is not None else [])
        self.version += 1
        return len(keys) + (session is not None)

    def expire(self, now: float) -> bool:
        """Drop expired hints; True if anything changed. Costs O(1) when nothing is due."""
        due, changed = self._due, False
        tables = self._tables()
        while due and due[0][0] <= now:
            _, which, name = heapq.heappop(due)
            value = tables[which].get(name)
            if value is not None and _until(value) <= now:  # else stale: extended or removed since
                self._drop(which, name)
                changed = True
        if changed:
            self.version += 1
        return changed

    # ---- entries and their owners --------------------------------------------------------------------------

    def _set(self, which: int, name: Any, value: Any, owner: str) -> None:
        table = self._tables()[which]
        if name not in table:  # a new entry belongs to whoever made it; updates keep its owner
            self._per_owner[owner] += 1
            if owner != ANONYMOUS:
                self._owner_of[(which, name)] = owner
        table[name] = value
        if self._track:
            self._changes[(which, name)] = None

    def _drop(self, which: int, name: Any) -> bool:
        if self._tables()[which].pop(name, None) is None:
            return False
        owner = self._owner_of.pop((which, name), ANONYMOUS)
        self._per_owner[owner] -= 1
        if not self._per_owner[owner]:
            del self._per_owner[owner]
        if self._track:
            self._changes[(which, name)] = None
        return True

    def take_changes(self) -> list[HintChange]:
        """Every entry changed since the last call, as it is now (removed ones with value None)."""
        tables = self._tables()
        out = [HintChange(which, name, tables[which].get(name), self._owner_of.get((which, name), ANONYMOUS))
               for which, name in self._changes]
        self._changes = {}
        return out

    def entries(self) -> Iterable[HintChange]:
        """Every entry kept (for a full rewrite, and for tests)."""
        for which, table in enumerate(self._tables()):
            for name, value in table.items():
                yield HintChange(which, name, value, self._owner_of.get((which, name), ANONYMOUS))

    @classmethod
    def from_entries(cls, entries: Iterable[HintChange], version: int, max_keys: int = 1 << 20,
                     max_sessions: int = 1 << 18, max_per_client: int = 0, *,
                     track_changes: bool = False) -> HintTable:
        """A table of ``entries`` (as ``take_changes`` or ``entries`` gave them) at ``version``; nothing is
        logged as changed. Entries past the limits are loaded all the same (they were admitted once)."""
        table = cls(max_keys, max_sessions, max_per_client)
        for e in entries:
            if e.value is not None:
                table._set(e.which, e.name, e.value, e.owner)
        table.version = version
        table._track = track_changes
        table._rebuild_due()
        return table

    def _tables(self) -> tuple[dict[Any, Any], ...]:
        return self.key_pins, self.session_pins, self.key_priority, self.session_priority

    def _schedule(self, until: float, which: int, names: Iterable[Any]) -> None:
        if until == NEVER:
            return
        due = self._due
        for name in names:
            heapq.heappush(due, (until, which, name))
        if len(due) > 2 * len(self) + 1024:  # mostly stale (hints re-set again and again): rebuild
            self._rebuild_due()

    def _rebuild_due(self) -> None:
        self._due = [(_until(v), which, name) for which, table in enumerate(self._tables())
                     for name, v in table.items() if _until(v) != NEVER]
        heapq.heapify(self._due)

    # ---- the wire (what the hints op answers, and nodes apply) ------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        pins = list(self.key_pins.items())
        prio = list(self.key_priority.items())
        return {
            "version": self.version,
            "pins": {"keys": pack_keys([k for k, _ in pins]), "expires": [wire_time(t) for _, t in pins]},
            "session_pins": {s: wire_time(t) for s, t in self.session_pins.items()},
            "priority": {"keys": pack_keys([k for k, _ in prio]), "levels": [lv for _, (lv, _) in prio],
                         "expires": [wire_time(t) for _, (_, t) in prio]},
            "session_priority": {s: [lv, wire_time(t)] for s, (lv, t) in self.session_priority.items()},
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any], max_keys: int = 1 << 20, max_sessions: int = 1 << 18) -> HintTable:
        """A table from ``to_wire``'s form (the hints op's reply; the master's data dir before format 2)."""
        pins, prio = data["pins"], data["priority"]
        entries = [HintChange(_KEY_PINS, k, from_wire_time(t)) for k, t in zip(unpack_keys(pins["keys"]),
                                                                                 pins["expires"])]
        entries += [HintChange(_SESSION_PINS, s, from_wire_time(t)) for s, t in data["session_pins"].items()]
        entries += [HintChange(_KEY_PRIORITY, k, (lv, from_wire_time(t)))
                    for k, lv, t in zip(unpack_keys(prio["keys"]), prio["levels"], prio["expires"])]
        entries += [HintChange(_SESSION_PRIORITY, s, (lv, from_wire_time(t)))
                    for s, (lv, t) in data["session_priority"].items()]
        return cls.from_entries(entries, int(data["version"]), max_keys, max_sessions)

