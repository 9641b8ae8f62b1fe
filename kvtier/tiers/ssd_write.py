"""The SSD tier's write path: the batch pipeline, parallel vectored writes, and write-behind from staging memory.

``WritePath`` is DiskTier's pipeline for one batch, from slot reservation to the published index entries.
``write_slots`` writes a batch's blocks (already given slots) with one pwritev per run of consecutive slots,
the runs spread over the tier's I/O threads, and returns each block's checksum. ``WriteBehind`` lets a caller
hand blocks over without waiting for the disk: ``put_later`` copies them into aligned staging memory (so they
no longer depend on the caller's buffer: a DRAM slot may be reused the moment the call returns), and one
thread (kvtier/writebehind.py's WriteQueue) drains the queue in batches, so many small offloads cost one
fsync and one index transaction.

Why fixed slots reused per block and not log-structured segments with reinsertion (CacheLib Navy's regions):
a tier holds blocks of one size, so freed slots never fragment; every block is written once (segment FIFO
with reinsertion rewrites hit blocks when their segment is reclaimed); the eviction policy is the same
pluggable per-block one as DRAM's; and blocks of >= 64 KiB are written at full device speed wherever they
land. Measured on agentic-cc (bench/ssd_eviction.py, SSD of 5-20% of the working set under a 10% DRAM): the
per-block fifo policy serves exactly what segment FIFO does, and reinsertion cost 1.0-2.0 points of hit rate
while writing 1.3-3.1x the blocks.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvtier.hostcopy import copy_rows
from kvtier.tiers.ssd_index import IndexEntry, block_checksum
from kvtier.tiers.ssd_io import ALIGN, STAGE_TIMEOUT_S, raw_view
from kvtier.tiers.ssd_read import RUN_BYTES
from kvtier.writebehind import WriteQueue

if TYPE_CHECKING:
    from kvtier.policies import EvictionPolicy
    from kvtier.tiers.base import EvictListener, TierStats
    from kvtier.tiers.slots import ProtectedSlots, SlotAllocator
    from kvtier.tiers.ssd import DiskTier
    from kvtier.tiers.ssd_index import DiskIndex
    from kvtier.tiers.ssd_io import SegmentFiles, StagingPool

log = logging.getLogger(__name__)


def write_slots(tier: DiskTier, keys: Sequence[bytes], slots: Sequence[int], ptrs: np.ndarray) -> list[int]:
    """Write block j (``tier.slot_bytes`` at ``ptrs[j]``) to ``slots[j]``; return the checksums.

    Raises the first OSError after every run has finished (no I/O is left running on the caller's memory).
    """
    max_run = max(1, RUN_BYTES // tier.slot_bytes)
    place = tier._files.place
    runs: list[list[int]] = []
    for j in sorted(range(len(slots)), key=slots.__getitem__):
        last = runs[-1] if runs else None
        if (last is not None and slots[j] == slots[last[-1]] + 1 and len(last) < max_run
                and place(slots[j])[0] == place(slots[last[0]])[0]):
            last.append(j)
        else:
            runs.append([j])
    futures = [tier._io.submit(_write_run, tier, [keys[j] for j in run], slots[run[0]], ptrs[run]) for run in runs]
    wait_all(futures)
    sums = [0] * len(slots)
    for run, f in zip(runs, futures):
        for j, c in zip(run, f.result()):  # .result() raises the run's OSError
            sums[j] = c
    return sums


def _write_run(tier: DiskTier, keys: list[bytes], first_slot: int, ptrs: np.ndarray) -> list[int]:
    views = [raw_view(int(p), tier.slot_bytes) for p in ptrs]
    sums = [block_checksum(v[: tier.block_bytes], k) for v, k in zip(views, keys)]
    tier._files.write(first_slot, views)
    return sums


class WritePath:
    """DiskTier's write pipeline, one batch at a time (a mixin: it works on DiskTier's state, under its lock):

    reserve slots (evicting if needed) -> delete the victims' index entries -> write the blocks in parallel and
    checksum them -> fdatasync the segments -> commit the new entries -> publish them in memory. Any OSError
    on the way abandons the batch (its slots are freed, no entry points at them) and stops admission.
    """

    # DiskTier's state this pipeline uses (defined and documented there).
    block_bytes: int
    slot_bytes: int
    direct: bool
    _lock: threading.Lock
    _slot_of: dict[bytes, int]
    _pending: dict[bytes, int]
    _staged: dict[bytes, int]
    _checksum: np.ndarray
    _busy: np.ndarray
    _doomed: set[int]
    _alloc: SlotAllocator
    _policy: EvictionPolicy
    _protected: ProtectedSlots
    _files: SegmentFiles
    _index: DiskIndex
    _staging: StagingPool
    _on_evict: EvictListener | None
    _stats: TierStats
    _counts: Counter[str]
    _stopped: str
    _fsync: bool
    _fingerprint: int
    _seq: int

    if TYPE_CHECKING:
        def stop_admitting(self, err: OSError, what: str) -> None: ...
        def _unindex(self, keys: list[bytes], held_slots: Sequence[int] = ()) -> None: ...
        def _free_idle_doomed(self) -> None: ...

    def _report_gone(self, keys: list[bytes]) -> None:
        """Tell the store's eviction listener that ``keys`` are no longer held (evicted, or dropped as damaged):
        it emits their "removed" events, which keep the master and the engines' KV events honest."""
        if keys and self._on_evict is not None:
            try:
                self._on_evict(keys, [])
            except Exception:
                log.exception("SSD eviction listener failed for %d blocks", len(keys))

    def store_rows(self, keys: Sequence[bytes], ptrs: np.ndarray) -> tuple[list[bool], list[bytes]]:
        """Write the blocks at ``ptrs``; return (held mask, keys newly stored). Bounces unaligned sources.

        The batch's keys that are held already are protected meanwhile: a put never evicts what it names.
        """
        with self._lock:
            protect = [s for s in (self._slot_of.get(k) for k in set(keys)) if s is not None]
            self._busy[protect] += 1
        try:
            return self._store_rows(keys, ptrs)
        finally:
            with self._lock:
                self._busy[protect] -= 1
                self._free_idle_doomed()

    def _store_rows(self, keys: Sequence[bytes], ptrs: np.ndarray) -> tuple[list[bool], list[bytes]]:
        if not self._needs_bounce(ptrs):
            return self._write_batch(keys, ptrs, staged=False)
        held, stored = [False] * len(keys), []
        i = 0
        while i < len(keys):
            chunks = self._staging.alloc(len(keys) - i, wait=True, timeout=STAGE_TIMEOUT_S)
            if not chunks:
                log.warning("SSD tier: no bounce memory within %.0f s; %d blocks not written", STAGE_TIMEOUT_S,
                            len(keys) - i)
                break
            j = i + len(chunks)
            addresses = self._staging.addresses(chunks)
            try:
                copy_rows(addresses, ptrs[i:j], self.block_bytes)
                h, s = self._write_batch(keys[i:j], addresses, staged=False)
            finally:
                self._staging.free(chunks)
            held[i:j] = h
            stored += s
            i = j
        return held, stored

    def _write_batch(self, keys: Sequence[bytes], ptrs: np.ndarray, *, staged: bool
                     ) -> tuple[list[bool], list[bytes]]:
        held = [True] * len(keys)
        with self._lock:
            if self._stopped:
                held = [k in self._slot_of for k in keys]
                self._stats.rejected += held.count(False)
                return held, []
            index, slots, victims, refused = self._reserve(keys, staged)
        for i in refused:
            held[i] = False
        self._report_gone(victims)
        if not slots:
            return held, []
        try:
            self._index.write(delete=victims)  # before their slots are overwritten: no entry points at new bytes
            sums = write_slots(self, [keys[i] for i in index], slots, ptrs[index])  # type: ignore[arg-type]
            if self._fsync:
                self._files.sync(sorted({self._files.place(s)[0] for s in slots}))
            self._index.write(put=self._entries(keys, index, slots, sums))
        except OSError as e:
            self._abandon(keys, index, slots)
            with self._lock:
                self._counts["write_errors"] += 1
            self.stop_admitting(e, "write")
            for i in index:
                held[i] = False
            return held, []
        return held, self._publish(keys, index, slots, sums)

    def _reserve(self, keys: Sequence[bytes], staged: bool) -> tuple[list[int], list[int], list[bytes], list[int]]:
        """Take a slot per new key, evicting if needed (lock held). Returns (index, slots, victims, refused)."""
        slot_of, pending = self._slot_of, self._pending
        new, seen = [], set()
        for i, k in enumerate(keys):
            if k in slot_of or k in pending or k in seen or (staged and k not in self._staged):
                continue
            seen.add(k)
            new.append(i)
        slots = self._alloc.alloc(len(new))
        victims: list[bytes] = []
        if len(slots) < len(new):
            victims = self._policy.victims(len(new) - len(slots), self._protected)
            slots += [slot_of.pop(v) for v in victims]
            self._stats.evictions += len(victims)
        refused = new[len(slots):]
        new = new[: len(slots)]
        for i, s in zip(new, slots):
            pending[keys[i]] = s
        self._busy[slots] += 1
        self._stats.rejected += len(refused)
        return new, slots, victims, refused

    def _entries(self, keys: Sequence[bytes], index: list[int], slots: list[int], sums: Sequence[int]
                 ) -> list[tuple[bytes, IndexEntry]]:
        with self._lock:
            seq0 = self._seq
            self._seq += len(slots)
        out = []
        for n, (i, s, c) in enumerate(zip(index, slots, sums)):
            seg, off = self._files.place(s)
            out.append((keys[i], IndexEntry(seg, off, self.block_bytes, c, self._fingerprint, seq0 + n)))
        return out

    def _publish(self, keys: Sequence[bytes], index: list[int], slots: list[int], sums: Sequence[int]
                 ) -> list[bytes]:
        stored, removed = [], []
        with self._lock:
            for i, s, c in zip(index, slots, sums):
                k = keys[i]
                if self._pending.get(k) == s:
                    del self._pending[k]
                    self._slot_of[k] = s
                    self._checksum[s] = c
                    stored.append(k)
                else:  # removed while being written: remove() doomed the slot
                    removed.append(k)
            self._busy[slots] -= 1
            self._free_idle_doomed()
            self._policy.insert(stored)
            self._stats.puts += len(stored)
            self._stats.put_bytes += len(stored) * self.block_bytes
        self._unindex(removed)  # entries just written for keys removed meanwhile
        return stored

    def _abandon(self, keys: Sequence[bytes], index: list[int], slots: list[int]) -> None:
        with self._lock:
            for i, s in zip(index, slots):
                if self._pending.get(keys[i]) == s:
                    del self._pending[keys[i]]
                self._doomed.add(s)
            self._busy[slots] -= 1
            self._free_idle_doomed()

    def _needs_bounce(self, ptrs: np.ndarray) -> bool:
        return self.direct and (self.slot_bytes != self.block_bytes or bool((ptrs % np.uint64(ALIGN)).any()))


@dataclass
class _Group:
    """The jobs of one put_later call: its Future completes when the last of them is written."""

    future: Future[list[bytes]]
    remaining: int
    stored: list[bytes] = field(default_factory=list)


@dataclass
class _Job:
    keys: list[bytes]
    chunks: list[int]
    addresses: np.ndarray
    group: _Group


class WriteBehind:
    """Staging and a WriteQueue (one writer thread) for a DiskTier. Thread-safe. Staged blocks stay readable
    through the tier (``tier._staged``) until they are on disk and indexed, so a block is never in neither place."""

    def __init__(self, tier: DiskTier, max_batch: int) -> None:
        self._tier = tier
        self._lock = threading.Lock()  # the groups' counts
        self._queue = WriteQueue(self._write, self._finish_all, max_batch=max_batch, name="ssd", what="SSD")

    def submit(self, keys: Sequence[bytes], ptrs: np.ndarray, *, wait: bool) -> Future[list[bytes]]:
        tier = self._tier
        group = _Group(Future(), remaining=1)  # the submitter holds one count until every job is queued
        with tier._lock:
            todo, seen = [], set()
            for i, k in enumerate(keys):
                if k not in tier._slot_of and k not in tier._pending and k not in tier._staged and k not in seen:
                    seen.add(k)
                    todo.append(i)
        while todo:
            chunks = tier._staging.alloc(len(todo), wait=wait, timeout=STAGE_TIMEOUT_S)
            if not chunks:
                with tier._lock:
                    tier._counts["offload_dropped"] += len(todo)
                break
            part, todo = todo[: len(chunks)], todo[len(chunks):]
            self._queue_job(keys, ptrs, part, chunks, group)  # queued at once: the writer frees chunks for us
        self._done(group, [])
        return group.future

    def _queue_job(self, keys: Sequence[bytes], ptrs: np.ndarray, part: list[int], chunks: list[int],
                   group: _Group) -> None:
        tier = self._tier
        addresses = tier._staging.addresses(chunks)
        copy_rows(addresses, ptrs[part], tier.block_bytes)  # from here on the caller's memory is free
        job = _Job([], [], np.empty(0, np.uint64), group)
        unused = []
        with tier._lock:
            for i, c, a in zip(part, chunks, addresses.tolist()):
                k = keys[i]
                if k in tier._slot_of or k in tier._pending or k in tier._staged:
                    unused.append(c)  # another thread got it there first
                    continue
                tier._staged[k] = a
                job.keys.append(k)
                job.chunks.append(c)
        tier._staging.free(unused)
        if not job.keys:
            return
        job.addresses = tier._staging.addresses(job.chunks)
        with self._lock:
            group.remaining += 1
        if not self._queue.put(job):  # raced with close(): nothing will write it
            self._finish(job, set())

    def flush(self, timeout: float | None) -> bool:
        return self._queue.flush(timeout)

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        self._queue.close()

    def _write(self, jobs: list[_Job]) -> set[bytes]:
        keys = [k for j in jobs for k in j.keys]
        _, new = self._tier._write_batch(keys, np.concatenate([j.addresses for j in jobs]), staged=True)
        return set(new)

    def _finish_all(self, jobs: Sequence[_Job], stored: set[bytes]) -> None:
        for job in jobs:
            self._finish(job, stored)

    def _finish(self, job: _Job, stored: set[bytes]) -> None:
        tier = self._tier
        with tier._lock:  # after publish: the key moved from staged to committed with no gap in between
            for k, a in zip(job.keys, job.addresses.tolist()):
                if tier._staged.get(k) == a:
                    del tier._staged[k]
        tier._staging.free(job.chunks)
        self._done(job.group, [k for k in job.keys if k in stored])

    def _done(self, group: _Group, stored: list[bytes]) -> None:
        with self._lock:
            group.stored += stored
            group.remaining -= 1
            last = group.remaining == 0
        if last:
            group.future.set_result(group.stored)
