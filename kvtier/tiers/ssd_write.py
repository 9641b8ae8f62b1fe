"""The SSD tier's write path: the batch pipeline, parallel vectored writes, and write-behind from staging memory.

``DiskWriter`` is DiskTier's pipeline for one batch, from slot reservation to the published index entries
(it works on the tier's shared ``DiskSlots``, ssd_slots.py).
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
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvtier.hostcopy import copy_rows
from kvtier.tiers.ssd_index import DiskIndex, IndexEntry, block_checksum
from kvtier.tiers.ssd_io import ALIGN, STAGE_TIMEOUT_S, StagingPool, raw_view
from kvtier.tiers.ssd_read import RUN_BYTES
from kvtier.tiers.ssd_slots import DiskSlots, SlotDevice
from kvtier.writebehind import WriteQueue

log = logging.getLogger(__name__)

class WriteBatch(Protocol):
    """How a batch reaches the disk (DiskWriter.write_batch, through DiskTier): the held mask, the keys stored."""

    def __call__(self, keys: Sequence[bytes], ptrs: np.ndarray, *, staged: bool
                 ) -> tuple[list[bool], list[bytes]]: ...


def write_slots(dev: SlotDevice, keys: Sequence[bytes], slots: Sequence[int], ptrs: np.ndarray) -> list[int]:
    """Write block j (``dev.slot_bytes`` at ``ptrs[j]``) to ``slots[j]``; return the checksums.

    Raises the first OSError after every run has finished (no I/O is left running on the caller's memory).
    """
    max_run = max(1, RUN_BYTES // dev.slot_bytes)
    place = dev.files.place
    runs: list[list[int]] = []
    for j in sorted(range(len(slots)), key=slots.__getitem__):
        last = runs[-1] if runs else None
        if (last is not None and slots[j] == slots[last[-1]] + 1 and len(last) < max_run
                and place(slots[j])[0] == place(slots[last[0]])[0]):
            last.append(j)
        else:
            runs.append([j])
    futures = [dev.io.submit(_write_run, dev, [keys[j] for j in run], slots[run[0]], ptrs[run]) for run in runs]
    wait_all(futures)
    sums = [0] * len(slots)
    for run, f in zip(runs, futures):
        for j, c in zip(run, f.result()):  # .result() raises the run's OSError
            sums[j] = c
    return sums


def _write_run(dev: SlotDevice, keys: list[bytes], first_slot: int, ptrs: np.ndarray) -> list[int]:
    views = [raw_view(int(p), dev.slot_bytes) for p in ptrs]
    sums = [block_checksum(v[: dev.block_bytes], k) for v, k in zip(views, keys)]
    dev.files.write(first_slot, views)
    return sums


class DiskWriter:
    """A DiskTier's write pipeline and, once the tier is open (ssd_restore.py prunes it before), the only code
    that changes its index. Thread-safe: it works on the tier's DiskSlots under their lock, and does its I/O
    outside it.

    One batch: reserve slots (evicting if needed) -> delete the victims' index entries -> write the blocks in
    parallel and checksum them -> fdatasync the segments -> commit the new entries -> publish them in memory.
    Any OSError on the way abandons the batch (its slots are freed, no entry points at them) and stops
    admission. Reads the caller's rows only until the call returns.
    """

    def __init__(self, slots: DiskSlots, dev: SlotDevice, index: DiskIndex, staging: StagingPool, *,
                 fsync: bool, fingerprint: int) -> None:
        self._slots = slots
        self._dev = dev
        self._index = index
        self._staging = staging  # bounce buffers for sources O_DIRECT cannot write from
        self._fsync = fsync
        self._fingerprint = fingerprint

    def store_rows(self, keys: Sequence[bytes], ptrs: np.ndarray) -> tuple[list[bool], list[bytes]]:
        """Write the blocks at ``ptrs``; return (held mask, keys newly stored). Bounces unaligned sources.

        The batch's keys that are held already are protected meanwhile: a put never evicts what it names.
        """
        b = self._slots
        with b.lock:
            protect = [s for s in (b.slot_of.get(k) for k in set(keys)) if s is not None]
            b.busy[protect] += 1
        try:
            return self._store_rows(keys, ptrs)
        finally:
            with b.lock:
                b.busy[protect] -= 1
                b.free_idle_doomed()

    def _store_rows(self, keys: Sequence[bytes], ptrs: np.ndarray) -> tuple[list[bool], list[bytes]]:
        if not self._needs_bounce(ptrs):
            return self.write_batch(keys, ptrs, staged=False)
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
                copy_rows(addresses, ptrs[i:j], self._dev.block_bytes)
                h, s = self.write_batch(keys[i:j], addresses, staged=False)
            finally:
                self._staging.free(chunks)
            held[i:j] = h
            stored += s
            i = j
        return held, stored

    def write_batch(self, keys: Sequence[bytes], ptrs: np.ndarray, *, staged: bool
                    ) -> tuple[list[bool], list[bytes]]:
        """Write one batch from rows O_DIRECT can use as they are; ``staged``: only keys still queued in
        ``DiskSlots.staged`` (the others were removed meanwhile). Returns (held mask, keys newly stored)."""
        b = self._slots
        held = [True] * len(keys)
        with b.lock:
            if b.stopped:
                held = [k in b.slot_of for k in keys]
                b.stats.rejected += held.count(False)
                return held, []
            index, slots, victims, refused = self._reserve(keys, staged)
        for i in refused:
            held[i] = False
        b.report_gone(victims)
        if not slots:
            return held, []
        files = self._dev.files
        try:
            self._index.write(delete=victims)  # before their slots are overwritten: no entry points at new bytes
            sums = write_slots(self._dev, [keys[i] for i in index], slots, ptrs[index])
            if self._fsync:
                files.sync(sorted({files.place(s)[0] for s in slots}))
            self._index.write(put=self._entries(keys, index, slots, sums))
        except OSError as e:
            self._abandon(keys, index, slots)
            with b.lock:
                b.counts["write_errors"] += 1
            b.stop_admitting(e, "write")
            for i in index:
                held[i] = False
            return held, []
        return held, self._publish(keys, index, slots, sums)

    def unindex(self, keys: list[bytes], held_slots: Sequence[int] = ()) -> None:
        """Delete keys from the index, then release ``held_slots`` (slots kept busy so that they are not
        reused while an entry on disk still points at them). Lock not held."""
        b = self._slots
        if keys:
            try:
                self._index.write(delete=keys)
            except OSError as e:  # the entries stay on disk; their keyed checksums fail if the slot is reused
                with b.lock:
                    b.counts["index_errors"] += 1
                b.stop_admitting(e, "index update")
        if len(held_slots):
            with b.lock:
                np.subtract.at(b.busy, list(held_slots), 1)
                b.free_idle_doomed()

    def _reserve(self, keys: Sequence[bytes], staged: bool) -> tuple[list[int], list[int], list[bytes], list[int]]:
        """Take a slot per new key, evicting if needed (lock held). Returns (index, slots, victims, refused)."""
        b = self._slots
        slot_of, pending = b.slot_of, b.pending
        new, seen = [], set()
        for i, k in enumerate(keys):
            if k in slot_of or k in pending or k in seen or (staged and k not in b.staged):
                continue
            seen.add(k)
            new.append(i)
        slots = b.alloc.alloc(len(new))
        victims: list[bytes] = []
        if len(slots) < len(new):
            victims = b.policy.victims(len(new) - len(slots), b.protected)
            slots += [slot_of.pop(v) for v in victims]
            b.stats.evictions += len(victims)
        refused = new[len(slots):]
        new = new[: len(slots)]
        for i, s in zip(new, slots):
            pending[keys[i]] = s
        b.busy[slots] += 1
        b.stats.rejected += len(refused)
        return new, slots, victims, refused

    def _entries(self, keys: Sequence[bytes], index: list[int], slots: list[int], sums: Sequence[int]
                 ) -> list[tuple[bytes, IndexEntry]]:
        b = self._slots
        with b.lock:
            seq0 = b.seq
            b.seq += len(slots)
        out = []
        place, bb = self._dev.files.place, self._dev.block_bytes
        for n, (i, s, c) in enumerate(zip(index, slots, sums)):
            seg, off = place(s)
            out.append((keys[i], IndexEntry(seg, off, bb, c, self._fingerprint, seq0 + n)))
        return out

    def _publish(self, keys: Sequence[bytes], index: list[int], slots: list[int], sums: Sequence[int]
                 ) -> list[bytes]:
        b = self._slots
        stored, removed = [], []
        with b.lock:
            for i, s, c in zip(index, slots, sums):
                k = keys[i]
                if b.pending.get(k) == s:
                    del b.pending[k]
                    b.slot_of[k] = s
                    b.checksum[s] = c
                    stored.append(k)
                else:  # removed while being written: remove() doomed the slot
                    removed.append(k)
            b.busy[slots] -= 1
            b.free_idle_doomed()
            b.policy.insert(stored)
            b.stats.puts += len(stored)
            b.stats.put_bytes += len(stored) * self._dev.block_bytes
        self.unindex(removed)  # entries just written for keys removed meanwhile
        return stored

    def _abandon(self, keys: Sequence[bytes], index: list[int], slots: list[int]) -> None:
        b = self._slots
        with b.lock:
            for i, s in zip(index, slots):
                if b.pending.get(keys[i]) == s:
                    del b.pending[keys[i]]
                b.doomed.add(s)
            b.busy[slots] -= 1
            b.free_idle_doomed()

    def _needs_bounce(self, ptrs: np.ndarray) -> bool:
        d = self._dev
        return d.direct and (d.slot_bytes != d.block_bytes or bool((ptrs % np.uint64(ALIGN)).any()))


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
    """Staging and a WriteQueue (one writer thread) in front of a DiskTier's ``write_batch``. Thread-safe.
    Staged blocks stay readable through the tier (``DiskSlots.staged``) until they are on disk and indexed,
    so a block is never in neither place. Owns the staging chunks it takes until the batch is written."""

    def __init__(self, slots: DiskSlots, staging: StagingPool, write_batch: WriteBatch, block_bytes: int,
                 max_batch: int) -> None:
        self._slots = slots
        self._staging = staging
        self._write_batch = write_batch
        self._block_bytes = block_bytes
        self._lock = threading.Lock()  # the groups' counts
        self._queue = WriteQueue(self._write, self._finish_all, max_batch=max_batch, name="ssd", what="SSD")

    def submit(self, keys: Sequence[bytes], ptrs: np.ndarray, *, wait: bool) -> Future[list[bytes]]:
        b = self._slots
        group = _Group(Future(), remaining=1)  # the submitter holds one count until every job is queued
        with b.lock:
            todo, seen = [], set()
            for i, k in enumerate(keys):
                if k not in b.slot_of and k not in b.pending and k not in b.staged and k not in seen:
                    seen.add(k)
                    todo.append(i)
        while todo:
            chunks = self._staging.alloc(len(todo), wait=wait, timeout=STAGE_TIMEOUT_S)
            if not chunks:
                with b.lock:
                    b.counts["offload_dropped"] += len(todo)
                break
            part, todo = todo[: len(chunks)], todo[len(chunks):]
            self._queue_job(keys, ptrs, part, chunks, group)  # queued at once: the writer frees chunks for us
        self._done(group, [])
        return group.future

    def _queue_job(self, keys: Sequence[bytes], ptrs: np.ndarray, part: list[int], chunks: list[int],
                   group: _Group) -> None:
        b, staging = self._slots, self._staging
        addresses = staging.addresses(chunks)
        copy_rows(addresses, ptrs[part], self._block_bytes)  # from here on the caller's memory is free
        job = _Job([], [], np.empty(0, np.uint64), group)
        unused = []
        with b.lock:
            for i, c, a in zip(part, chunks, addresses.tolist()):
                k = keys[i]
                if k in b.slot_of or k in b.pending or k in b.staged:
                    unused.append(c)  # another thread got it there first
                    continue
                b.staged[k] = a
                job.keys.append(k)
                job.chunks.append(c)
        staging.free(unused)
        if not job.keys:
            return
        job.addresses = staging.addresses(job.chunks)
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
        _, new = self._write_batch(keys, np.concatenate([j.addresses for j in jobs]), staged=True)
        return set(new)

    def _finish_all(self, jobs: Sequence[_Job], stored: set[bytes]) -> None:
        for job in jobs:
            self._finish(job, stored)

    def _finish(self, job: _Job, stored: set[bytes]) -> None:
        b = self._slots
        with b.lock:  # after publish: the key moved from staged to committed with no gap in between
            for k, a in zip(job.keys, job.addresses.tolist()):
                if b.staged.get(k) == a:
                    del b.staged[k]
        self._staging.free(job.chunks)
        self._done(job.group, [k for k in job.keys if k in stored])

    def _done(self, group: _Group, stored: list[bytes]) -> None:
        with self._lock:
            group.stored += stored
            group.remaining -= 1
            last = group.remaining == 0
        if last:
            group.future.set_result(group.stored)
