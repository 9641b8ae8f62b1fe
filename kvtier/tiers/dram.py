"""DramTier: packed blocks in one host buffer of fixed-size slots, with a pluggable eviction policy.

Runs in the engine process (embedded mode) or in the node pool daemon. Thread-safe: metadata changes under one
lock, byte copies outside it, so two threads copy at once. A slot being copied is *busy*: eviction skips it
and a remove() of its key frees it only when the copy is done, so a reader never sees its bytes reused.

Evictions are handed down outside the lock: the eviction listener (the store's offloads, which may write to a
disk or a pool synchronously when they stage nothing, and its event listeners, which may ask a master) runs
after the lock is released, before ``reserve`` returns the victims' slots to their new owner. Meanwhile the
victims are *leaving*: still held and readable here, so a block on its way down is never in neither place.

Writes are two-phase, as in vLLM's offloading manager: ``reserve`` takes slots (evicting if needed) and
returns their addresses, the caller fills them, ``commit`` publishes the keys. ``put`` is reserve + one
batched copy + commit; the pool daemon uses reserve/commit to receive bytes straight into slots. Which key
holds which slot, and the eviction rules, are the SlotTable (slots.py) the SSD tier's bookkeeping shares.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from kvtier.blocks import block_rows
from kvtier.memory.hostcopy import CopyThreads
from kvtier.memory.hostmem import HostBuffer
from kvtier.pins import PinTable
from kvtier.policies import Clock, Observations
from kvtier.tiers.base import AddressableSlots, EvictListener, PrefetchTarget, Reservation, TierStats
from kvtier.tiers.slots import SlotTable

log = logging.getLogger(__name__)


class DramTier(AddressableSlots, PrefetchTarget):
    """Host DRAM tier. ``capacity_bytes // block_bytes`` slots; the buffer is allocated once here.

    ``policy`` (a name or import path, ``default`` by default) decides evictions and, with ``admission``, which
    new blocks a full tier takes; it reads time from ``clock``, and learns from ``observe``. A policy that
    raises is logged once and replaced by LRU order (GuardedPolicy): puts and gets never see its errors."""

    name = "dram"

    def __init__(
        self, capacity_bytes: int, block_bytes: int, *, policy: str = "default", shm_path: str | None = None,
        pin_memory: str | bool = "auto", prefault: bool = False, copy_threads: int = 0,
        dtypes: Sequence[str] = (), clock: Clock | None = None, admission: bool = True,
    ) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        num_slots = capacity_bytes // block_bytes
        if num_slots == 0:
            raise ValueError(f"DRAM capacity {capacity_bytes} B holds no block of {block_bytes} B")
        self.block_bytes = block_bytes
        self.capacity_bytes = num_slots * block_bytes
        self._buffer = HostBuffer(self.capacity_bytes, shm_path=shm_path, pin_memory=pin_memory,
                                  prefault=prefault)
        self._rows = self._buffer.tensor.view(num_slots, block_bytes)
        self._base = np.uint64(self._buffer.ptr)
        self._dtypes = tuple(dtypes)
        # A put's copies and a get's are timed apart (as the shm transport's): their rates differ (a get copies
        # out of memory the put side just warmed, into the caller's), and neither is another tier's.
        self.put_copies, self.get_copies = CopyThreads(copy_threads), CopyThreads(copy_threads)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)  # removes wait here for keys being handed down
        self._stats = TierStats(self.name, self.capacity_bytes, 0, 0)
        # Under the lock. ``busy`` counts in-flight copies per slot; ``leaving``: evicted, being handed down
        # (key -> its slot, reserved for a new key), readable until the hand-down ends.
        self._table = t = SlotTable(num_slots, policy, clock, stats=self._stats, block_bytes=block_bytes,
                                    where="DRAM tier", admission="enforce" if admission else "advice",
                                    leaving=True, scan_busy=True)
        self._slot_of, self._pending, self._policy = t.slot_of, t.pending, t.policy
        self._leaving: dict[bytes, int] = t.leaving  # type: ignore[assignment]
        self._read_leaving: set[int] = set()  # slots acquired while leaving (rare): checked when their hand-down ends
        self._removers = 0  # removes waiting for a hand-down (notified only then)
        self._on_evict: EvictListener | None = None
        log.info("DRAM tier: %d slots of %d B (%s), policy %s", num_slots, block_bytes, self._buffer, policy)

    # ---- Tier protocol ---------------------------------------------------------------------------------

    def attach(self, pins: PinTable, on_evict: EvictListener | None) -> None:
        with self._lock:
            self._table.protected.pins = pins
            self._on_evict = on_evict

    def watch_frees(self, listener: Callable[[np.ndarray], None]) -> None:
        """Call ``listener(slots)`` (under the tier's lock) with every slot that goes free: a dropped or evicted
        key's, a failed write's. The pool bumps those slots' generations, so a client that reads a block where it
        saw it last (kvtier/transport/locations.py) learns the key left even when no new key took the slot."""
        with self._lock:
            self._table.alloc.on_free = listener

    def contains(self, keys: Sequence[bytes]) -> np.ndarray:
        """A numpy bool per key: committed, or evicted and still being handed down (readable here until then).
        One native probe pass over the table's index of held keys, under the lock (the index is no dict)."""
        with self._lock:
            return self._table.held(keys)

    def put(self, keys: Sequence[bytes], blocks: Any) -> list[bool]:
        return self._put(keys, blocks).held

    def put_new(self, keys: Sequence[bytes], blocks: Any) -> list[int]:
        """put() of keys the caller found missing, answering which it stored now: the positions (ascending) of
        the keys it reserved, copied and committed. A key held meanwhile (committed, being written, or evicted
        and still being handed down: held as ``contains`` says) is left as it is; asked once, in the reserve
        that takes the slots, so the caller need not ask ``contains`` first (the store's promotion)."""
        return self._put(keys, blocks, leaving_held=True).index

    def _put(self, keys: Sequence[bytes], blocks: Any, *, leaving_held: bool = False) -> Reservation:
        rows = block_rows(blocks, len(keys), self.block_bytes, dtypes=self._dtypes)
        res = self.reserve(keys, leaving_held=leaving_held)
        if res.slots:
            self.put_copies.copy(res.addresses, rows.ptrs[res.index], self.block_bytes)
        self.commit(res)
        return res

    def get(self, keys: Sequence[bytes], out: Any) -> list[bool]:
        rows = block_rows(out, len(keys), self.block_bytes, writable=True, dtypes=self._dtypes, what="out")
        with self._held_slots(keys) as (slots, held):
            if len(held) == len(slots):  # all hits (the common get): no Python work per key
                hit, dst = [True] * len(slots), rows.ptrs
            else:
                hit = [s is not None for s in slots]
                dst = rows.ptrs[[i for i, h in enumerate(hit) if h]]
            if len(held):
                src = self._base + held.astype(np.uint64) * np.uint64(self.block_bytes)
                self.get_copies.copy(dst, src, self.block_bytes)
        return hit

    def remove(self, keys: Sequence[bytes]) -> int:
        """Drop keys; a key being handed down to a lower tier is waited for first (outside the lock), so that the
        store's remove, which asks the tiers in order, finds and drops it in the tier it went to."""
        with self._cv:
            if self._leaving and any(k in self._leaving for k in keys):
                self._removers += 1
                self._cv.wait_for(lambda: not any(k in self._leaving for k in keys))
                self._removers -= 1
            removed, _ = self._table.drop(keys)  # a pending key's commit() sees it gone and frees the slot
        return len(removed)

    def stats(self) -> TierStats:
        s = self._stats
        s.blocks = len(self._slot_of)
        s.used_bytes = self._table.alloc.used_count * self.block_bytes
        s.extra = {"pending": len(self._pending), "shared_path": str(self._buffer.path or ""),
                   "pinned_memory": self._buffer.pinned, "policy": self._policy.name, "declined": self._table.declined,
                   **({"policy_failed": self._policy.failed} if self._policy.failed else {})}
        return s

    # ---- what the engine knows (observations) ------------------------------------------------------------

    @property
    def observes(self) -> bool:
        """Whether this tier's policy learns from observations (the store sends them only then)."""
        return self._policy.observes

    def observe(self, batch: Observations) -> None:
        """Hand the policy a batch of observations (sessions and times filled in: TieredStore.observe)."""
        with self._lock:
            self._policy.observe(batch)

    # ---- prefetch between turns (PrefetchTarget) --------------------------------------------------------

    def predicted_back(self, sessions: Sequence[str]) -> list[float | None]:
        with self._lock:
            return [self._policy.predicted_back(s) for s in sessions]

    def prefetch_room(self, session: str, chain: Sequence[bytes], start: int, need: int) -> int:
        with self._lock:
            return self._policy.prefetch_room(session, chain, start, need, self._table.alloc.free_count)

    def close(self) -> None:
        with self._lock:
            self._table.clear()
            self._buffer.close()

    # ---- two-phase writes and zero-copy reads ----------------------------------------------------------

    def reserve(self, keys: Sequence[bytes], protect: Sequence[bytes] = (), *,
                leaving_held: bool = False) -> Reservation:
        """Take a slot for each key not held or in flight, evicting unprotected blocks if needed (never a
        block of ``keys`` or of ``protect`` this tier holds: ``protect`` only guards, it reserves nothing).
        ``leaving_held``: a key evicted and still being handed down counts as held too (not reserved again).

        Keys that get no slot have ``held`` False: the policy declined them (admission), or every other block
        is pinned or busy. When slots run short, the root-most keys get them (the policy orders a batch by the
        chains it knows; batch order otherwise) and the tail-most are refused.
        """
        with self._lock:
            res, victims, vslots = self._table.reserve(keys, protect, leaving_held=leaving_held)
        if not res.slots:
            return res
        if victims:  # evicted by this reserve (now in ``res``'s slots): handed down with the lock released
            self._hand_down(victims, vslots, res)
        res.addresses = self._base + np.fromiter(res.slots, np.uint64, len(res.slots)) * np.uint64(self.block_bytes)
        return res

    def commit(self, res: Reservation, success: bool = True) -> None:
        """Publish the reserved keys (or, with success=False, give their slots back)."""
        if not res.slots:
            return
        with self._lock:
            self._table.publish(res.keys, res.slots, success)

    def touch(self, keys: Sequence[bytes]) -> int:
        """Count reads a one-sided client made without an acquire (where it saw the blocks last, checked by their
        slots' generations) as hits and as accesses for the eviction policy; how many of ``keys`` are held."""
        with self._lock:
            present = [k for k in keys if k in self._slot_of]
            self._policy.access(present)
            self._stats.hits += len(present)
            self._stats.get_bytes += len(present) * self.block_bytes
        return len(present)

    @contextmanager
    def acquire(self, keys: Sequence[bytes]) -> Iterator[list[int | None]]:
        """Addresses of held blocks (None for misses), readable until the context exits.

        The blocks cannot be evicted or reused meanwhile; counts as a hit for the eviction policy and stats.
        """
        with self._held_slots(keys) as (slots, _):
            bb, base = self.block_bytes, int(self._base)
            yield [None if s is None else base + s * bb for s in slots]

    @contextmanager
    def _held_slots(self, keys: Sequence[bytes]) -> Iterator[tuple[list[int | None], np.ndarray]]:
        """``acquire``'s slots (None for misses), and the hits' slots as an int64 array (in batch order), held
        until the context exits."""
        with self._lock:
            slots = list(map(self._slot_of.get, keys))
            all_hit = None not in slots
            self._policy.access(keys if all_hit else [k for k, s in zip(keys, slots) if s is not None])
            if self._leaving:  # being handed down: still readable, no longer the policy's
                leaving = self._leaving.get
                were = len(slots) - slots.count(None)
                slots = [leaving(k) if s is None else s for k, s in zip(keys, slots)]
                if len(slots) - slots.count(None) > were:
                    self._read_leaving.update(s for k, s in zip(keys, slots) if k in self._leaving)
            held = self._table.hold(slots if None not in slots else [s for s in slots if s is not None])
            st = self._stats
            st.hits += len(held)
            st.misses += len(slots) - len(held)
            st.get_bytes += len(held) * self.block_bytes
        try:
            yield slots, held
        finally:
            with self._lock:
                self._table.release(held)

    @contextmanager
    def read_views(self, keys: Sequence[bytes]) -> Iterator[list[torch.Tensor | None]]:
        """Zero-copy uint8 views of held blocks (None for misses), valid until the context exits."""
        with self.acquire(keys) as addresses:
            base, bb = int(self._base), self.block_bytes
            yield [None if a is None else self._rows[(a - base) // bb] for a in addresses]

    def keys(self) -> list[bytes]:
        """Every key held now (a snapshot: an inventory for the master, without mirroring keys elsewhere)."""
        with self._lock:
            return list(self._slot_of)

    @property
    def pinned(self) -> bool:
        return self._buffer.pinned

    @property
    def buffer(self) -> HostBuffer:
        return self._buffer

    # ---- internals (call with the lock held) ------------------------------------------------------------

    def _hand_down(self, victims: list[bytes], vslots: list[int], res: Reservation) -> None:
        """Call the eviction listener for ``victims`` (evicted by the reserve of ``res``, which holds their slots)
        with views of their bytes, with the lock released; then end their leaving state. A victim's slot that a
        reader still copies from (it acquired the block while it was leaving; a pool client's acquire lease can
        last seconds) is not waited for: it is freed when the reader is done, and its new key gets a free slot
        instead, or is refused (held False) when none is free."""
        try:
            if self._on_evict is not None:
                self._on_evict(victims, _RowViews(self._rows, vslots))
        except Exception:  # a failing demotion must not break the put that evicted
            log.exception("eviction listener failed for %d blocks; they are dropped", len(victims))
        finally:
            with self._lock:
                self._table.end_leaving(victims, vslots)
                if self._removers:
                    self._cv.notify_all()  # removes waiting for these keys
                if self._read_leaving:
                    read = self._read_leaving.intersection(vslots)
                    self._read_leaving.difference_update(read)
                    busy = self._table.busy  # the reservation's own count is 1 per slot; readers add theirs
                    read = [s for s in vslots if s in read and busy[s] > 1]
                    if read:
                        self._replace_read_slots(res, read)

    def _replace_read_slots(self, res: Reservation, read: list[int]) -> None:
        """Give the keys of ``res`` reserved in slots of ``read`` (still being read) a free slot each, or refuse
        them; the read slots are freed when their readers finish (lock held)."""
        t = self._table
        drop = set()
        for s in read:
            j = res.slots.index(s)
            k = res.keys[j]
            t.busy[s] -= 1
            t.doomed.add(s)
            if t.pending.get(k) == s:  # else removed meanwhile (remove() doomed the slot): nothing to store
                fresh = t.alloc.alloc(1)
                if fresh:
                    res.slots[j] = fresh[0]
                    t.pending[k] = fresh[0]
                    t.busy[fresh[0]] += 1
                    continue
                del t.pending[k]
            res.held[res.index[j]] = False
            drop.add(j)
        if drop:
            self._stats.rejected += len(drop)
            keep = [j for j in range(len(res.slots)) if j not in drop]
            res.keys, res.slots, res.index = ([xs[j] for j in keep] for xs in (res.keys, res.slots, res.index))


class _RowViews(Sequence[torch.Tensor]):
    """Views of evicted slots, made only when a listener reads them: most evictions are never demoted, and a
    tensor view per victim costs about a microsecond (a trace replay evicts millions of blocks)."""

    __slots__ = ("_rows", "_slots")

    def __init__(self, rows: torch.Tensor, slots: list[int]) -> None:
        self._rows, self._slots = rows, slots

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._rows[s] for s in self._slots[i]]
        return self._rows[self._slots[i]]
