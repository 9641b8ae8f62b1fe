"""Directory: key -> placements (which node tiers hold it), block bytes and heat, for millions of keys.

A *location* is one tier of one node incarnation, numbered 0, 1, 2, ... by the node registry. A key's
placements are one bit per location in a per-slot mask of ``words`` uint64 words (64 locations per word; the
mask widens when a cluster needs more). Per slot the master pays 16 B of key, 8 B per mask word, 4 B each of
block bytes, heat score, access count and last access (unix seconds), and 1 B of slot state: 41 B with one
word, 60-120 B per key at the table's 0.35-0.7 load. See kvtier.keys.table for the layout.

Dead placements vanish from answers at once without touching the table: callers AND masks with the live
mask of the registry. ``retire`` queues a dead location's bits for clearing; ``sweep`` clears them a chunk at
a time from the master's timer, drops entries left with no placement, and hands fully swept locations back
for reuse.

Runs in the master's event loop; not thread-safe. Keys are (n, 2) uint64 arrays (see table.as_key_array).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtier.master.heat import HeatClock
from kvtier.keys.table import LIVE, KeyTable

WORD_BITS = 64


@dataclass
class PrefixCounts:
    """``by_location[loc]`` = leading keys that location holds (only locations holding >= 1 leading key);
    ``any`` = leading keys held by at least one of the locations looked at."""

    by_location: dict[int, int]
    any: int


def _mask_maker(words: int) -> Callable[[int], np.ndarray]:
    return lambda cap: np.zeros((cap, words), np.uint64)


def location_words(locations: list[int], words: int) -> np.ndarray:
    """A (words,) uint64 mask with the bits of ``locations`` set."""
    out = np.zeros(words, np.uint64)
    for loc in locations:
        out[loc // WORD_BITS] |= np.uint64(1 << (loc % WORD_BITS))
    return out


def mask_locations(mask: np.ndarray) -> list[int]:
    """The locations whose bits are set in a (words,) mask."""
    out = []
    for w, word in enumerate(mask.tolist()):
        while word:
            low = word & -word
            out.append(w * WORD_BITS + low.bit_length() - 1)
            word ^= low
    return out


class Directory:
    """The placement and heat columns over one KeyTable. ``clock`` converts heat scores (see heat.py)."""

    def __init__(self, clock: HeatClock, words: int = 1, count_unsent: bool = False) -> None:
        self.clock = clock
        # Shared directories: accesses counted here and not yet logged for the other masters (4 B per slot).
        self.count_unsent = count_unsent
        self.table = KeyTable()
        self.words = words
        self.table.add_column("mask", _mask_maker(words))
        self.table.add_column("nbytes", lambda cap: np.zeros(cap, np.uint32))
        self.table.add_column("score", lambda cap: np.zeros(cap, np.float32))
        self.table.add_column("count", lambda cap: np.zeros(cap, np.uint32))
        self.table.add_column("last", lambda cap: np.zeros(cap, np.uint32))
        if count_unsent:
            self.table.add_column("unsent", lambda cap: np.zeros(cap, np.uint32))
        self._sweeping = np.zeros(words, np.uint64)  # bits being cleared by the current sweep pass
        self._queued = np.zeros(words, np.uint64)  # bits retired while a pass runs: they need a pass of their own
        self._cursor = -1  # next slot of the current pass; -1: no pass running
        self._pass_generation = 0

    # ---- size ------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.table.live

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def ensure_locations(self, count: int) -> None:
        """Widen the masks so that locations 0..count-1 fit."""
        need = max(1, -(-count // WORD_BITS))
        if need <= self.words:
            return
        old = self.table.column("mask")
        new = np.zeros((self.table.capacity, need), np.uint64)
        new[:, : self.words] = old
        self.table.replace_column("mask", new)
        self.table.set_column_maker("mask", _mask_maker(need))
        for name in ("_sweeping", "_queued"):
            grown = np.zeros(need, np.uint64)
            grown[: self.words] = getattr(self, name)
            setattr(self, name, grown)
        self.words = need

    # ---- placements ------------------------------------------------------------------------------------

    def add(self, loc: int, keys: np.ndarray, block_bytes: int, now: float) -> int:
        """Record that location ``loc`` holds ``keys`` (blocks of ``block_bytes``); returns new placements."""
        if len(keys) == 0:
            return 0
        slots, is_new = self.table.insert(keys)
        w, bit = loc // WORD_BITS, np.uint64(1 << (loc % WORD_BITS))
        mask = self.table.column("mask")
        had = (mask[slots, w] & bit) != 0
        mask[slots, w] |= bit
        self.table.column("nbytes")[slots] = block_bytes
        if is_new.any():
            self.table.column("last")[slots[is_new]] = int(now)
        return int(len(np.unique(slots[~had])))

    def remove(self, loc: int, keys: np.ndarray) -> int:
        """Record that ``loc`` no longer holds ``keys``; entries left with no placement are dropped."""
        slots = self.table.find(keys)
        slots = np.unique(slots[slots >= 0])
        if slots.size == 0:
            return 0
        w, bit = loc // WORD_BITS, np.uint64(1 << (loc % WORD_BITS))
        mask = self.table.column("mask")
        had = (mask[slots, w] & bit) != 0
        slots = slots[had]
        mask[slots, w] &= ~bit
        empty = slots[~mask[slots].any(axis=1)]
        if empty.size:
            self.table.delete(empty)
        return int(len(slots))

    def masks(self, keys: np.ndarray, live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slots, masks): each key's slot (-1 if unknown) and its placements ANDed with ``live``."""
        slots = self.table.find(keys)
        missing = slots < 0
        m = self.table.column("mask").take(np.where(missing, 0, slots), axis=0)
        m &= live
        if missing.any():
            m[missing] = 0
        return slots, m

    @staticmethod
    def prefix_counts(m: np.ndarray, held: np.ndarray | None = None) -> PrefixCounts:
        """Leading keys held per location, from masks as returned by ``masks`` (in prompt order); ``held``:
        ``m.any(axis=1)`` if the caller has it already."""
        n = len(m)
        if n == 0:
            return PrefixCounts({}, 0)
        held = m.any(axis=1) if held is None else held
        any_len = n if held.all() else int(np.argmin(held))
        if any_len == 0:
            return PrefixCounts({}, 0)
        acc = np.bitwise_and.accumulate(m[:any_len], axis=0)
        # A location's count is the row where its bit first drops out of the running AND: only those rows
        # (at most one per location) are decoded in Python.
        lost = acc[:-1] & ~acc[1:]
        counts: dict[int, int] = {}
        for r in np.flatnonzero(lost.any(axis=1)).tolist():
            for loc in mask_locations(lost[r]):
                counts[loc] = r + 1
        for loc in mask_locations(acc[-1]):
            counts[loc] = any_len
        return PrefixCounts(counts, any_len)

    def block_bytes(self, slots: np.ndarray) -> np.ndarray:
        """Block bytes per slot (0 for slot -1)."""
        out = np.zeros(len(slots), np.int64)
        found = slots >= 0
        out[found] = self.table.column("nbytes")[slots[found]]
        return out

    # ---- heat ------------------------------------------------------------------------------------------

    def touch(self, slots: np.ndarray, now: float) -> None:
        """One access of each slot at ``now`` (slots >= 0; duplicates count once)."""
        if slots.size == 0:
            return
        if self.clock.needs_renormalize(now):
            self.clock.renormalize(self.table.column("score"), now)
        score, count = self.table.column("score"), self.table.column("count")
        score[slots] = score.take(slots) + np.float32(self.clock.weight(now))
        count[slots] = count.take(slots) + np.uint32(1)
        self.table.column("last")[slots] = int(now)
        if self.count_unsent:
            unsent = self.table.column("unsent")
            unsent[slots] = unsent.take(slots) + np.uint32(1)

    def take_unsent(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys (n, 2), access counts) counted by ``touch`` since the last call (a pass over the table)."""
        unsent = self.table.column("unsent")
        s = np.flatnonzero(unsent)
        s = s[self.table.state[s] == LIVE]
        counts = unsent[s].copy()
        unsent[:] = 0
        return np.stack([self.table.k0[s], self.table.k1[s]], axis=1), counts

    def touch_counts(self, keys: np.ndarray, counts: np.ndarray, now: float) -> None:
        """``counts[i]`` accesses of each (distinct) key at ``now``, counted by another master; unknown keys are
        skipped (removed since)."""
        slots = self.table.find(keys)
        found = slots >= 0
        s, c = slots[found], counts[found].astype(np.uint32)
        if s.size == 0:
            return
        if self.clock.needs_renormalize(now):
            self.clock.renormalize(self.table.column("score"), now)
        score, count, last = self.table.column("score"), self.table.column("count"), self.table.column("last")
        score[s] = score.take(s) + np.float32(self.clock.weight(now)) * c.astype(np.float32)
        count[s] = count.take(s) + c
        last[s] = np.maximum(last.take(s), np.uint32(int(now)))

    def heat(self, keys: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(access count, decayed heat, last access unix seconds) per key; zeros for unknown keys."""
        slots = self.table.find(keys)
        found = slots >= 0
        count = np.zeros(len(keys), np.uint32)
        heat = np.zeros(len(keys), np.float64)
        last = np.zeros(len(keys), np.uint32)
        s = slots[found]
        count[found] = self.table.column("count")[s]
        heat[found] = self.clock.heat(self.table.column("score")[s], now)
        last[found] = self.table.column("last")[s]
        return count, heat, last

    def top(self, n: int, now: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The ``n`` hottest keys: (keys (k, 2), heat, count, last), hottest first."""
        live = self.table.live_slots()
        if n <= 0 or live.size == 0:
            return np.zeros((0, 2), np.uint64), np.zeros(0), np.zeros(0, np.uint32), np.zeros(0, np.uint32)
        scores = self.table.column("score")[live]
        k = min(n, live.size)
        pick = np.argpartition(-scores, k - 1)[:k] if k < live.size else np.arange(live.size)
        pick = pick[np.argsort(-scores[pick], kind="stable")]
        s = live[pick]
        keys = np.stack([self.table.k0[s], self.table.k1[s]], axis=1)
        return (keys, self.clock.heat(self.table.column("score")[s], now), self.table.column("count")[s].copy(),
                self.table.column("last")[s].copy())

    # ---- dead locations --------------------------------------------------------------------------------

    def retire(self, locations: list[int]) -> None:
        """Queue the bits of dead locations for clearing (callers already exclude them from ``live``)."""
        if not locations:
            return
        self._queued |= location_words(locations, self.words)
        if self._cursor < 0:
            self._start_pass()

    @property
    def sweeping(self) -> bool:
        return self._cursor >= 0

    def sweep(self, budget: int) -> list[int]:
        """Clear retired bits in up to ``budget`` slots; returns locations whose bits are now gone everywhere."""
        if self._cursor < 0:
            return []
        if self.table.generation != self._pass_generation:  # a rehash moved every slot: start over
            self._cursor = 0
            self._pass_generation = self.table.generation
        a, b = self._cursor, min(self._cursor + budget, self.table.capacity)
        mask = self.table.column("mask")
        chunk = mask[a:b]
        hit = (chunk & self._sweeping).any(axis=1)
        if hit.any():
            chunk &= ~self._sweeping
            rows = np.flatnonzero(hit & ~chunk.any(axis=1) & (self.table.state[a:b] == LIVE)) + a
            if rows.size:
                self.table.delete(rows)
        if self.table.generation != self._pass_generation:
            return []  # delete() rehashed: restart on the next call
        self._cursor = b
        if b < self.table.capacity:
            return []
        freed = mask_locations(self._sweeping)
        self._cursor = -1
        if self._queued.any():
            self._start_pass()
        return freed

    def _start_pass(self) -> None:
        self._sweeping = self._queued
        self._queued = np.zeros(self.words, np.uint64)
        self._cursor = 0
        self._pass_generation = self.table.generation

    def present_locations(self) -> list[int]:
        """Locations with a bit set in some live entry (a full pass over the masks: start-up only)."""
        live = self.table.state == LIVE
        if not live.any():
            return []
        return mask_locations(np.bitwise_or.reduce(self.table.column("mask")[live], axis=0))

    # ---- snapshot --------------------------------------------------------------------------------------

    def export(self) -> dict[str, np.ndarray]:
        """Copies of every live entry's columns (what a snapshot stores)."""
        live = self.table.live_slots()
        out = {"k0": self.table.k0[live], "k1": self.table.k1[live]}
        for name in ("mask", "nbytes", "score", "count", "last"):
            out[name] = self.table.column(name)[live]
        return out

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Load entries exported by ``export`` into an empty directory."""
        keys = np.stack([arrays["k0"], arrays["k1"]], axis=1)
        if not len(keys):
            return  # an empty snapshot (reshape(0, -1) cannot infer the width)
        mask = arrays["mask"].reshape(len(keys), -1)
        self.ensure_locations(mask.shape[1] * WORD_BITS)
        self.table.reserve(len(keys))
        slots, _ = self.table.insert(keys)
        self.table.column("mask")[slots, : mask.shape[1]] = mask
        for name in ("nbytes", "score", "count", "last"):
            self.table.column(name)[slots] = arrays[name]
