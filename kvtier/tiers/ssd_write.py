"""The SSD tier's write path: parallel vectored writes of a batch, and write-behind from staging memory.

``write_slots`` writes a batch's blocks (already given slots) with one pwritev per run of consecutive slots,
the runs spread over the tier's I/O threads, and returns each block's checksum. ``WriteBehind`` lets a caller
hand blocks over without waiting for the disk: ``put_later`` copies them into aligned staging memory (so they
no longer depend on the caller's buffer: a DRAM slot may be reused the moment the call returns), and one
thread drains the queue in batches, so many small offloads cost one fsync and one index transaction.

Why fixed slots reused per block and not log-structured segments with reinsertion (CacheLib Navy's regions):
a tier holds blocks of one size, so freed slots never fragment; every block is written once (segment FIFO
with reinsertion rewrites hit blocks when their segment is reclaimed); the eviction policy is the same
pluggable per-block one as DRAM's; and blocks of >= 64 KiB are written at full device speed wherever they
land. The measured comparison is in the issue's closing note.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvtier.hostcopy import copy_rows
from kvtier.tiers.ssd_index import block_checksum
from kvtier.tiers.ssd_io import STAGE_TIMEOUT_S, raw_view
from kvtier.tiers.ssd_read import RUN_BYTES

if TYPE_CHECKING:
    from kvtier.tiers.ssd import DiskTier

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
    """Queue + one writer thread for a DiskTier. Thread-safe. Staged blocks stay readable through the tier
    (``tier._staged``) until they are on disk and indexed, so a block is never in neither place."""

    def __init__(self, tier: DiskTier, max_batch: int) -> None:
        self._tier = tier
        self._max_batch = max_batch
        self._queue: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._active = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvtier-ssd-writer", daemon=True)
        self._thread.start()

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
        with self._cv:
            group.remaining += 1
            if self._closing:  # raced with close(): nothing will write it
                self._finish(job, set())
                return
            self._queue.append(job)
            self._cv.notify_all()

    def flush(self, timeout: float | None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._active, timeout)

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                jobs, n = [], 0
                while self._queue and (not jobs or n + len(self._queue[0].keys) <= self._max_batch):
                    jobs.append(self._queue.popleft())
                    n += len(jobs[-1].keys)
                self._active += 1
            try:
                self._write(jobs)
            finally:
                with self._cv:
                    self._active -= 1
                    self._cv.notify_all()

    def _write(self, jobs: list[_Job]) -> None:
        keys = [k for j in jobs for k in j.keys]
        stored: set[bytes] = set()
        try:
            _, new = self._tier._write_batch(keys, np.concatenate([j.addresses for j in jobs]), staged=True)
            stored = set(new)
        except Exception:  # a bug, not an I/O error (those are handled inside): drop, never wedge the queue
            log.exception("SSD write-behind failed for %d blocks; they are dropped", len(keys))
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
        with self._cv:
            group.stored += stored
            group.remaining -= 1
            last = group.remaining == 0
        if last:
            group.future.set_result(group.stored)
