"""Locations: where a one-sided client last saw its blocks in a pool, so a get of them needs no round trip.

A get through a one-sided transport (shm, rdma) is a request to the pool (acquire: where are they, keep them
there) and then the client's own copy. The request costs a round trip through the pool's dispatcher and
workers before the first byte moves: about a millisecond here, a tenth of a 256 MiB get over shared memory.
An engine reads back what it wrote, and what it read before (an agent's prefix, every turn), so the client
keeps, per key, the slot offset and the slot's generation from the reply that named them (its own reserve, once
the pool confirmed the commit, or an acquire whose copy checked out), and reads those blocks straight away:

    copy from the slot -> read the slot's generation again -> the same as remembered: the key's bytes

The pool bumps a slot's generation before anyone may write into it (a reserve) and whenever its key leaves it
(removed, evicted, a failed write: DramTier.watch_frees), so an unchanged generation after the copy proves the
slot held the key for the whole copy (the ordering argument is kvtier/wire/generations.py's, the one an
acquired read relies on). A changed one is not a miss yet: the row is zeroed and the key asked for by acquire
as usual. The pool learns of the reads afterwards (``touch``, no reply): hits and accesses for its eviction
policy, as an acquire's would be.

Bounded: at most MAX_ENTRIES keys (the oldest learned are forgotten first), and at most one key per slot (a slot
seen holding a new key forgets the old one). Entries belong to one pool epoch: a restarted pool's are dropped.
Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

# ~150 B of Python objects per entry: ~10 MiB per connection at most. 65,536 blocks is 256 GiB of 4 MiB blocks,
# 4 GiB of 64 KiB ones: every prefix a pool serves one engine at a time, where an engine reads back its own.
MAX_ENTRIES = 1 << 16


class Locations:
    """key -> (byte offset in the pool's buffer, the slot's generation), for one pool epoch."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self.epoch: int | None = None
        self._at: dict[bytes, tuple[int, int]] = {}
        self._key_in: dict[int, bytes] = {}  # offset -> the key last seen there
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._at)

    def learn(self, epoch: int, keys: Sequence[bytes], offsets: np.ndarray, generations: np.ndarray) -> None:
        """``keys`` are at ``offsets`` in the pool of ``epoch``, in slots of ``generations``."""
        if not len(keys):
            return
        with self._lock:
            if epoch != self.epoch:
                self._forget_all(epoch)
            at, key_in = self._at, self._key_in
            for k, off, gen in zip(keys, offsets.tolist(), generations.tolist()):
                old = key_in.get(off)
                if old is not None and old != k:
                    at.pop(old, None)
                was = at.pop(k, None)  # re-inserted: the newest learned are forgotten last
                if was is not None and was[0] != off:
                    key_in.pop(was[0], None)
                at[k] = (off, gen)
                key_in[off] = k
            while len(at) > self.max_entries:
                k, (off, _) = next(iter(at.items()))
                del at[k]
                key_in.pop(off, None)

    def find(self, epoch: int, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The positions in ``keys`` of those known in the pool of ``epoch``, their offsets and generations."""
        with self._lock:
            if epoch != self.epoch or not self._at:
                empty = np.zeros(0, dtype=np.int64)
                return empty, empty, np.zeros(0, dtype=np.uint64)
            get = self._at.get
            found = [(i, loc) for i, loc in enumerate(map(get, keys)) if loc is not None]
        if not found:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, np.zeros(0, dtype=np.uint64)
        index = np.fromiter((i for i, _ in found), dtype=np.int64, count=len(found))
        offsets = np.fromiter((loc[0] for _, loc in found), dtype=np.int64, count=len(found))
        gens = np.fromiter((loc[1] for _, loc in found), dtype=np.uint64, count=len(found))
        return index, offsets, gens

    def forget(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                loc = self._at.pop(k, None)
                if loc is not None and self._key_in.get(loc[0]) == k:
                    del self._key_in[loc[0]]

    def forget_all(self, epoch: int | None = None) -> None:
        with self._lock:
            self._forget_all(epoch)

    def _forget_all(self, epoch: int | None) -> None:
        self._at.clear()
        self._key_in.clear()
        self.epoch = epoch
