"""Write-behind, the one mechanism behind the pool tier's and the SSD tier's ``put_later``: ``WriteBehind`` (staging
and bookkeeping) in front of a ``WriteQueue`` (the queue and its writer thread).

``WriteBehind.submit`` copies blocks into chunks of a ssd.io.StagingPool before it returns (the caller's memory,
e.g. a DRAM slot being evicted, is free again at once), records each in a staged map (key -> staging address,
readable until the block is down, so a block on its way down is never in neither place) and queues them. When
staging is short it waits (``wait=True``, at most ``stage_timeout_s`` per wait) or drops the rest (counted).
One thread takes queued jobs in batches of at most ``max_batch`` blocks and calls the tier's ``write(keys,
staged addresses)`` (the keys it stored); then each job's keys are unstaged (under the tier's lock, after
``write`` returned: for the SSD that is after the index commit, so a reader moves from the staged copy to the
committed one with no gap), their chunks freed, and the submit's Future completed with the keys stored.

What differs between the tiers is an explicit hook, not a second copy:
- ``lock`` and ``staged``: the pool tier lets WriteBehind own both; the SSD tier passes ``DiskSlots.lock`` and
  ``DiskSlots.staged``, because its reads, ``remove`` (which pops a staged key: that write is then skipped) and
  slot reservation (``staged=True`` writes only keys still staged) must see the staged keys under that one lock.
- ``held(key)``, lock held: a key the tier holds already is not staged (SSD: a slot or a write in flight).
- ``count(event, n)``, lock held: the tier's counters ("queued", "sent", "failed", "dropped"). By default
  WriteBehind keeps all four in ``counts`` (the pool tier's ``write_behind`` stats); the SSD tier counts only
  drops, as its ``offload_dropped``.
Nothing here reads a clock: the only bounded wait is StagingPool.alloc's condition wait, whose bound
(``stage_timeout_s``) a test can shorten.

WriteQueue: one background thread takes queued jobs in batches of at most ``max_batch`` blocks, calls
``write(batch)`` (the keys it stored), then ``finish(batch, stored)`` (unstage, free the staging memory, complete
futures). A ``write`` that raises is a bug, not a device or network failure (those come back as keys not
stored): it is logged and the batch is finished as not stored, so the queue never wedges. ``flush`` waits until
every job put so far is finished; ``close`` writes what is queued, then stops the thread. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

import numpy as np

from kvtier.memory.hostcopy import copy_rows
from kvtier.tiers.ssd.io import STAGE_TIMEOUT_S, StagingPool

log = logging.getLogger(__name__)


class Job(Protocol):
    keys: list[bytes]  # the blocks of this job, one key each


J = TypeVar("J", bound=Job)


class WriteQueue(Generic[J]):
    """Jobs drained by one thread named ``kvtier-<name>-writer``; ``what`` names the tier in log lines."""

    def __init__(self, write: Callable[[list[J]], set[bytes]], finish: Callable[[Sequence[J], set[bytes]], None],
                 *, max_batch: int, name: str, what: str) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self._write, self._finish = write, finish
        self._max_batch = max_batch
        self._what = what
        self._queue: deque[J] = deque()
        self._cv = threading.Condition()
        self._active = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"kvtier-{name}-writer", daemon=True)
        self._thread.start()

    def put(self, job: J) -> bool:
        """Queue ``job``; False if the queue is closing (nothing will write it: the caller finishes it)."""
        with self._cv:
            if self._closing:
                return False
            self._queue.append(job)
            self._cv.notify_all()
            return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job put so far is finished; False if ``timeout`` passed first."""
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
                jobs: list[J] = []
                n = 0
                while self._queue and (not jobs or n + len(self._queue[0].keys) <= self._max_batch):
                    jobs.append(self._queue.popleft())
                    n += len(jobs[-1].keys)
                self._active = True
            try:
                stored: set[bytes] = set()
                try:
                    stored = self._write(jobs)
                except Exception:  # a bug, not a failed write (those come back as not stored): never wedge
                    log.exception("%s write-behind failed for %d blocks; they are dropped", self._what, n)
                self._finish(jobs, stored)
            finally:
                with self._cv:
                    self._active = False
                    self._cv.notify_all()


Write = Callable[[list[bytes], np.ndarray], set[bytes]]  # (keys, staged addresses) -> the keys now held below
Event = Literal["queued", "sent", "failed", "dropped"]


def staging_of(block_bytes: int, staging_bytes: int) -> StagingPool:
    """Staging memory of ``staging_bytes`` in whole blocks; ValueError when that is not one block."""
    count = staging_bytes // block_bytes
    if count < 1:
        raise ValueError(f"staging of {staging_bytes} B holds no block of {block_bytes} B")
    return StagingPool(block_bytes, count)


@dataclass
class _Group:
    """The jobs of one submit: its Future completes when the last of them is finished."""

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
    """Staging chunks from ``staging`` and one writer thread (``kvtier-<name>-writer``) calling ``write``; see the
    module doc for the hooks. Thread-safe. Owns the chunks it takes until their batch is finished; reads the
    caller's rows only until ``submit`` returns. ``write`` runs on the writer thread, ``count`` and ``held``
    with ``lock`` held (so they must not take it), the Futures complete outside it (their callbacks, the
    store's listeners, may call back into the tier)."""

    def __init__(self, write: Write, staging: StagingPool, *, block_bytes: int, max_batch: int, name: str,
                 what: str, lock: threading.Lock | None = None, staged: dict[bytes, int] | None = None,
                 held: Callable[[bytes], bool] = lambda key: False,
                 count: Callable[[Event, int], None] | None = None,
                 stage_timeout_s: float = STAGE_TIMEOUT_S) -> None:
        self._tier_write = write
        self._staging = staging
        self.block_bytes = block_bytes
        self.lock = lock if lock is not None else threading.Lock()  # guards staged; readers copy under it
        self.staged = staged if staged is not None else {}  # key -> staging address
        self._held = held
        self.counts: dict[Event, int] = {"queued": 0, "sent": 0, "dropped": 0, "failed": 0}  # without ``count``
        self._count = count if count is not None else self._count_here
        self._stage_timeout_s = stage_timeout_s
        self._groups = threading.Lock()  # the groups' counts
        self._queue = WriteQueue(self._write, self._finish_all, max_batch=max_batch, name=name, what=what)

    def submit(self, keys: Sequence[bytes], ptrs: np.ndarray, *, wait: bool) -> Future[list[bytes]]:
        """Stage and queue the blocks neither held nor staged already (first occurrence of each key); the
        Future gives the keys ``write`` stored. Blocks that find no staging memory (at once without ``wait``,
        within ``stage_timeout_s`` with it) are dropped and counted."""
        ptrs = np.asarray(ptrs, np.uint64)
        group = _Group(Future(), remaining=1)  # the submitter holds one count until every job is queued
        with self.lock:
            todo, seen = [], set()
            for i, k in enumerate(keys):
                if k not in self.staged and k not in seen and not self._held(k):
                    seen.add(k)
                    todo.append(i)
        while todo:
            chunks = self._staging.alloc(len(todo), wait=wait, timeout=self._stage_timeout_s)
            if not chunks:
                with self.lock:
                    self._count("dropped", len(todo))
                break
            part, todo = todo[: len(chunks)], todo[len(chunks):]
            self._queue_job(keys, ptrs, part, chunks, group)  # queued at once: the writer frees chunks for us
        self._done(group, [])
        return group.future

    def read(self, keys: Sequence[bytes], dst: np.ndarray) -> list[bool]:
        """Copy staged blocks into ``dst`` rows; True where one was copied (for a tier that reads nothing else
        under ``lock``; the SSD tier reads ``staged`` in its own locked pass)."""
        with self.lock:  # a staged chunk is unstaged under it before it is freed (and reused)
            index = [i for i, k in enumerate(keys) if k in self.staged]
            if index:
                src = np.array([self.staged[keys[i]] for i in index], np.uint64)
                copy_rows(np.asarray(dst, np.uint64)[index], src, self.block_bytes)
        hit = [False] * len(keys)
        for i in index:
            hit[i] = True
        return hit

    def is_staged(self, keys: Sequence[bytes]) -> list[bool]:
        staged = self.staged
        return [k in staged for k in keys]  # dict reads are atomic under the GIL

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block queued so far is finished (written or failed); False on timeout."""
        return self._queue.flush(timeout)

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        self._queue.close()

    def _count_here(self, event: Event, n: int) -> None:
        self.counts[event] += n

    def _queue_job(self, keys: Sequence[bytes], ptrs: np.ndarray, part: list[int], chunks: list[int],
                   group: _Group) -> None:
        staging = self._staging
        addresses = staging.addresses(chunks)
        copy_rows(addresses, ptrs[part], self.block_bytes)  # from here on the caller's memory is free
        job = _Job([], [], np.empty(0, np.uint64), group)
        unused = []
        with self.lock:
            for i, c, a in zip(part, chunks, addresses.tolist()):
                k = keys[i]
                if k in self.staged or self._held(k):
                    unused.append(c)  # another thread got it there first
                    continue
                self.staged[k] = a
                job.keys.append(k)
                job.chunks.append(c)
            self._count("queued", len(job.keys))
        staging.free(unused)
        if not job.keys:
            return
        job.addresses = staging.addresses(job.chunks)
        with self._groups:
            group.remaining += 1
        if not self._queue.put(job):  # raced with close(): nothing will write it
            self._finish(job, set())

    def _write(self, jobs: list[_Job]) -> set[bytes]:
        return self._tier_write([k for j in jobs for k in j.keys], np.concatenate([j.addresses for j in jobs]))

    def _finish_all(self, jobs: Sequence[_Job], stored: set[bytes]) -> None:
        for job in jobs:
            self._finish(job, stored)

    def _finish(self, job: _Job, stored: set[bytes]) -> None:
        sent = [k for k in job.keys if k in stored]
        with self.lock:  # after write: the key moved from staged to held below with no gap in between
            for k, a in zip(job.keys, job.addresses.tolist()):
                if self.staged.get(k) == a:
                    del self.staged[k]
            self._count("sent", len(sent))
            self._count("failed", len(job.keys) - len(sent))
        self._staging.free(job.chunks)  # unstaged first: no reader can find these chunks any more
        self._done(job.group, sent)

    def _done(self, group: _Group, stored: list[bytes]) -> None:
        with self._groups:
            group.stored += stored
            group.remaining -= 1
            last = group.remaining == 0
        if last:
            group.future.set_result(group.stored)
