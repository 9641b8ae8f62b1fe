"""HintTable: pins and priorities that routers set on keys or sessions, kept for the nodes to apply.

A router that knows an agent session comes back in 30 s pins that session (or its prefix keys) with a TTL;
each node turns the hints into leases of its store (kvtier/client/store_hints.py): pinned keys and the
blocks of pinned sessions stay, under the node's lease budget, ranked by priority. The master does not
enforce hints (the nodes own their memory); it keeps them, persists them, expires them, and serves them
with a version number that heartbeat replies carry, so nodes refetch only when something changed.

Expiry times are wall-clock unix seconds (they persist across restarts); 0 on the wire means "no expiry".
``expire`` runs on every tick of the master's loop, so it must cost nothing when nothing is due: a heap of
(expiry, hint) entries, stale ones (a hint extended, re-set or removed since) skipped when they surface.
Runs in the master's event loop; not thread-safe.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

from kvtier.wire import ERR_TOO_LARGE, WireError, pack_keys, unpack_keys

NEVER = float("inf")


def _expiry(now: float, ttl_s: float) -> float:
    return now + ttl_s if ttl_s > 0 else NEVER


def _wire_time(t: float) -> float:
    return 0.0 if t == NEVER else t


def _from_wire_time(t: float) -> float:
    return NEVER if t == 0 else t


def _until(value: float | tuple[int, float]) -> float:
    """The expiry of a pin (the value itself) or of a priority ((level, expiry))."""
    return value[1] if isinstance(value, tuple) else value


_KEY_PINS, _SESSION_PINS, _KEY_PRIORITY, _SESSION_PRIORITY = range(4)  # indexes into HintTable._tables()


class HintTable:
    """Pins and priorities by key (16-byte) or session (a string), each with an expiry; at most ``max_keys``
    keyed hints in all (a router bug must not grow the master without bound)."""

    def __init__(self, max_keys: int = 1 << 20) -> None:
        self.max_keys = max_keys
        self.key_pins: dict[bytes, float] = {}
        self.session_pins: dict[str, float] = {}
        self.key_priority: dict[bytes, tuple[int, float]] = {}
        self.session_priority: dict[str, tuple[int, float]] = {}
        self.version = 0
        # (expiry, which table, key or session) for every finite expiry set; may hold stale entries.
        self._due: list[tuple[float, int, Any]] = []

    def __len__(self) -> int:
        return len(self.key_pins) + len(self.session_pins) + len(self.key_priority) + len(self.session_priority)

    def _room(self, adding: int) -> None:
        """Refuse ``adding`` new keyed hints past max_keys (keys already hinted are not new)."""
        if len(self.key_pins) + len(self.key_priority) + adding > self.max_keys:
            raise WireError(ERR_TOO_LARGE, f"hints would exceed {self.max_keys} keyed hints; unpin some, "
                                           "pin sessions instead of keys, or use shorter TTLs")

    def pin(self, keys: Iterable[bytes], session: str | None, ttl_s: float, now: float) -> int:
        """Pin keys and/or a session until now + ttl_s (0: until unpinned). A repeated pin extends it."""
        keys = list(keys)
        self._room(len({k for k in keys if k not in self.key_pins}))
        until = _expiry(now, ttl_s)
        for k in keys:
            self.key_pins[k] = until
        if session is not None:
            self.session_pins[session] = until
        self._schedule(until, _KEY_PINS, keys)
        self._schedule(until, _SESSION_PINS, [session] if session is not None else [])
        self.version += 1
        return len(keys) + (session is not None)

    def unpin(self, keys: Iterable[bytes], session: str | None) -> int:
        n = sum(self.key_pins.pop(k, None) is not None for k in keys)
        if session is not None:
            n += self.session_pins.pop(session, None) is not None
        self.version += 1
        return n

    def set_priority(self, keys: Iterable[bytes], session: str | None, level: int, ttl_s: float,
                     now: float) -> int:
        """Priority ``level`` (higher: keep longer; 0 removes the hint) for keys and/or a session."""
        keys = list(keys)
        until = _expiry(now, ttl_s)
        if level == 0:
            for k in keys:
                self.key_priority.pop(k, None)
            if session is not None:
                self.session_priority.pop(session, None)
        else:
            self._room(len({k for k in keys if k not in self.key_priority}))
            for k in keys:
                self.key_priority[k] = (level, until)
            if session is not None:
                self.session_priority[session] = (level, until)
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
                del tables[which][name]
                changed = True
        if changed:
            self.version += 1
        return changed

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

    # ---- wire and disk (one form for both) -----------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        pins = list(self.key_pins.items())
        prio = list(self.key_priority.items())
        return {
            "version": self.version,
            "pins": {"keys": pack_keys([k for k, _ in pins]), "expires": [_wire_time(t) for _, t in pins]},
            "session_pins": {s: _wire_time(t) for s, t in self.session_pins.items()},
            "priority": {"keys": pack_keys([k for k, _ in prio]), "levels": [lv for _, (lv, _) in prio],
                         "expires": [_wire_time(t) for _, (_, t) in prio]},
            "session_priority": {s: [lv, _wire_time(t)] for s, (lv, t) in self.session_priority.items()},
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any], max_keys: int = 1 << 20) -> HintTable:
        table = cls(max_keys)
        table.version = int(data["version"])
        pins = data["pins"]
        table.key_pins = {k: _from_wire_time(t) for k, t in zip(unpack_keys(pins["keys"]), pins["expires"])}
        table.session_pins = {s: _from_wire_time(t) for s, t in data["session_pins"].items()}
        prio = data["priority"]
        table.key_priority = {k: (lv, _from_wire_time(t))
                              for k, lv, t in zip(unpack_keys(prio["keys"]), prio["levels"], prio["expires"])}
        table.session_priority = {s: (lv, _from_wire_time(t)) for s, (lv, t) in data["session_priority"].items()}
        table._rebuild_due()
        return table
