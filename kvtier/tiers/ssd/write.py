"""The SSD tier's write path: the batch pipeline, parallel vectored writes, and write-behind from staging memory.

``DiskWriter`` is DiskTier's pipeline for one batch, from slot reservation to the published index entries
(it works on the tier's shared ``DiskSlots``, slots.py).
``write_slots`` writes a batch's blocks (already given slots) with one pwritev per run of consecutive slots,
the runs spread over the tier's I/O threads, and returns each block's checksum. Write-behind (``put_later``:
blocks copied into aligned staging memory, drained by one thread in batches, so many small offloads cost one
fsync and one index transaction) is kvtier/tiers/writebehind.py's WriteBehind, shared with the pool tier; its
batches come back here through ``DiskWriter.write_batch(..., staged=True)``.

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
from collections.abc import Sequence
from concurrent.futures import wait as wait_all

import numpy as np

from kvtier.memory.hostcopy import copy_rows
from kvtier.tiers.ssd.index import DiskIndex, IndexEntry, block_checksum
from kvtier.tiers.ssd.io import ALIGN, STAGE_TIMEOUT_S, StagingPool, raw_view
from kvtier.tiers.ssd.read import RUN_BYTES
from kvtier.tiers.ssd.slots import DiskSlots, SlotDevice

log = logging.getLogger(__name__)

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
    futures = dev.io.run_each(_write_run, [(dev, [keys[j] for j in run], slots[run[0]], ptrs[run]) for run in runs])
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
    """A DiskTier's write pipeline and, once the tier is open (restore.py prunes it before), the only code
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

        A put never evicts what it names: every chunk's reservation protects the keys of the whole batch the
        tier holds (SlotTable.reserve's ``protect``), those held before it and those earlier chunks wrote.
        """
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
                h, s = self.write_batch(keys[i:j], addresses, staged=False, protect=keys)
            finally:
                self._staging.free(chunks)
            held[i:j] = h
            stored += s
            i = j
        return held, stored

    def write_batch(self, keys: Sequence[bytes], ptrs: np.ndarray, *, staged: bool, protect: Sequence[bytes] = ()
                    ) -> tuple[list[bool], list[bytes]]:
        """Write one batch from rows O_DIRECT can use as they are; ``staged``: only keys still queued in
        ``DiskSlots.staged`` (the others were removed meanwhile). Evicts none of the keys of the batch or of
        ``protect`` the tier holds. Returns (held mask, keys newly stored)."""
        b = self._slots
        with b.lock:
            if b.stopped:
                held = [k in b.slot_of for k in keys]
                b.stats.rejected += held.count(False)
                return held, []
            res, victims, _ = b.reserve(keys, protect, only=b.staged if staged else None)
        held, index, slots = res.held, res.index, res.slots
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
                b.release(held_slots)

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
        with b.lock:
            # Every slot is still this batch's (busy until publish): a doomed one's checksum is never read.
            b.checksum[slots] = np.array(sums, dtype=np.uint64)
            stored, removed = b.publish([keys[i] for i in index], slots)
        self.unindex(removed)  # entries just written for keys removed meanwhile
        return stored

    def _abandon(self, keys: Sequence[bytes], index: list[int], slots: list[int]) -> None:
        b = self._slots
        with b.lock:
            b.publish([keys[i] for i in index], slots, success=False)

    def _needs_bounce(self, ptrs: np.ndarray) -> bool:
        d = self._dev
        return d.direct and (d.slot_bytes != d.block_bytes or bool((ptrs % np.uint64(ALIGN)).any()))
