"""PoolWriter: write-behind for a PoolTier, so a DRAM eviction or a write-through never waits for the network.

``submit`` copies the blocks into staging memory before it returns (the caller's memory, e.g. a DRAM slot
being evicted, is free again at once) and queues them; one sender thread sends queued blocks to the pools in
batches. Until a block is sent it stays readable here (``read``), so a block on its way down is never in
neither place. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from kvtier.hostcopy import copy_rows
from kvtier.tiers.ssd_io import StagingPool

log = logging.getLogger(__name__)

STAGE_TIMEOUT_S = 10.0  # longest a waiting submit blocks for staging memory before it drops the blocks
MAX_BATCH_BYTES = 256 << 20  # one send: at most this much

Send = Callable[[list[bytes], np.ndarray], list[bool]]  # (keys, staged row addresses) -> held per key


@dataclass
class _Job:
    keys: list[bytes]
    chunks: list[int]
    future: Future[list[bytes]]


class PoolWriter:
    """Staging memory of ``staging_bytes`` in blocks of ``block_bytes``, drained by one thread calling ``send``."""

    def __init__(self, send: Send, block_bytes: int, staging_bytes: int, name: str = "pool") -> None:
        count = staging_bytes // block_bytes
        if count < 1:
            raise ValueError(f"staging of {staging_bytes} B holds no block of {block_bytes} B")
        self._send = send
        self.block_bytes = block_bytes
        self._staging = StagingPool(block_bytes, count)
        self._staged: dict[bytes, int] = {}  # key -> staging chunk
        self._queue: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._active = False
        self._closing = False
        self.counts = {"queued": 0, "sent": 0, "dropped": 0, "failed": 0}
        self._thread = threading.Thread(target=self._run, name=f"kvtier-{name}-writer", daemon=True)
        self._thread.start()

    def submit(self, keys: Sequence[bytes], ptrs: np.ndarray, *, wait: bool) -> Future[list[bytes]]:
        """Stage and queue the blocks not staged already; the Future gives the keys the pools now hold.
        Without ``wait`` blocks that find no staging memory are dropped (counted), with it the call waits."""
        future: Future[list[bytes]] = Future()
        with self._cv:
            todo = [i for i, k in enumerate(keys) if k not in self._staged]
            todo = list({keys[i]: i for i in reversed(todo)}.values())[::-1]  # first occurrence of each key
        chunks = self._staging.alloc(len(todo), wait=wait, timeout=STAGE_TIMEOUT_S) if todo else []
        if len(chunks) < len(todo):
            with self._cv:
                self.counts["dropped"] += len(todo) - len(chunks)
            todo = todo[: len(chunks)]
        if not todo:
            future.set_result([])
            return future
        copy_rows(self._staging.addresses(chunks), np.asarray(ptrs, np.uint64)[todo], self.block_bytes)
        job = _Job([keys[i] for i in todo], chunks, future)
        with self._cv:
            for k, c in zip(job.keys, chunks):
                self._staged[k] = c
            self.counts["queued"] += len(job.keys)
            if self._closing:
                self._finish([job], set())
                return future
            self._queue.append(job)
            self._cv.notify_all()
        return future

    def held(self, keys: Sequence[bytes]) -> list[bool]:
        staged = self._staged
        return [k in staged for k in keys]

    def read(self, keys: Sequence[bytes], dst: np.ndarray) -> list[bool]:
        """Copy staged blocks into ``dst`` rows; True where one was copied."""
        with self._cv:  # a chunk cannot be freed (and reused) while we copy from it
            index = [i for i, k in enumerate(keys) if k in self._staged]
            if index:
                src = self._staging.addresses([self._staged[keys[i]] for i in index])
                copy_rows(np.asarray(dst, np.uint64)[index], src, self.block_bytes)
        hit = [False] * len(keys)
        for i in index:
            hit[i] = True
        return hit

    def flush(self, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._active, timeout)

    def close(self) -> None:
        """Send what is queued, then stop."""
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
                jobs, nbytes = [], 0
                while self._queue and (not jobs or nbytes + len(self._queue[0].keys) * self.block_bytes
                                       <= MAX_BATCH_BYTES):
                    jobs.append(self._queue.popleft())
                    nbytes += len(jobs[-1].keys) * self.block_bytes
                self._active = True
            keys = [k for j in jobs for k in j.keys]
            stored: set[bytes] = set()
            try:
                rows = self._staging.addresses([c for j in jobs for c in j.chunks])
                stored = {k for k, h in zip(keys, self._send(keys, rows)) if h}
            except Exception:  # a bug, not a pool failure (those come back as False): never wedge the queue
                log.exception("pool write-behind failed for %d blocks; they are dropped", len(keys))
            with self._cv:
                self._finish(jobs, stored)
                self.counts["sent"] += len(stored)
                self.counts["failed"] += len(keys) - len(stored)
                self._active = False
                self._cv.notify_all()

    def _finish(self, jobs: list[_Job], stored: set[bytes]) -> None:
        """Unstage and free the jobs' blocks (call under the lock) and complete their futures."""
        for job in jobs:
            for k, c in zip(job.keys, job.chunks):
                if self._staged.get(k) == c:
                    del self._staged[k]
            self._staging.free(job.chunks)
            job.future.set_result([k for k in job.keys if k in stored])
