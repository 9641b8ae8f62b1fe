"""PoolWriter: write-behind for a PoolTier, so a DRAM eviction or a write-through never waits for the network.

``submit`` copies the blocks into staging memory before it returns (the caller's memory, e.g. a DRAM slot
being evicted, is free again at once) and queues them; one sender thread (kvtier/writebehind.py's WriteQueue)
sends queued blocks to the pools in batches. Until a block is sent it stays readable here (``read``), so a
block on its way down is never in neither place. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from kvtier.hostcopy import copy_rows
from kvtier.tiers.ssd_io import STAGE_TIMEOUT_S, StagingPool
from kvtier.writebehind import WriteQueue

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
        self._lock = threading.Lock()  # _staged, counts, and chunks while read() copies from them
        self.counts = {"queued": 0, "sent": 0, "dropped": 0, "failed": 0}
        self._queue = WriteQueue(self._write, self._finish, max_batch=max(1, MAX_BATCH_BYTES // block_bytes),
                                 name=name, what=name)

    def submit(self, keys: Sequence[bytes], ptrs: np.ndarray, *, wait: bool) -> Future[list[bytes]]:
        """Stage and queue the blocks not staged already; the Future gives the keys the pools now hold.
        Without ``wait`` blocks that find no staging memory are dropped (counted), with it the call waits."""
        future: Future[list[bytes]] = Future()
        with self._lock:
            todo = [i for i, k in enumerate(keys) if k not in self._staged]
            todo = list({keys[i]: i for i in reversed(todo)}.values())[::-1]  # first occurrence of each key
        chunks = self._staging.alloc(len(todo), wait=wait, timeout=STAGE_TIMEOUT_S) if todo else []
        if len(chunks) < len(todo):
            with self._lock:
                self.counts["dropped"] += len(todo) - len(chunks)
            todo = todo[: len(chunks)]
        if not todo:
            future.set_result([])
            return future
        copy_rows(self._staging.addresses(chunks), np.asarray(ptrs, np.uint64)[todo], self.block_bytes)
        job = _Job([keys[i] for i in todo], chunks, future)
        with self._lock:
            for k, c in zip(job.keys, chunks):
                self._staged[k] = c
            self.counts["queued"] += len(job.keys)
        if not self._queue.put(job):  # raced with close(): nothing will send it
            self._finish([job], set())
        return future

    def held(self, keys: Sequence[bytes]) -> list[bool]:
        staged = self._staged
        return [k in staged for k in keys]

    def read(self, keys: Sequence[bytes], dst: np.ndarray) -> list[bool]:
        """Copy staged blocks into ``dst`` rows; True where one was copied."""
        with self._lock:  # a chunk cannot be freed (and reused) while we copy from it
            index = [i for i, k in enumerate(keys) if k in self._staged]
            if index:
                src = self._staging.addresses([self._staged[keys[i]] for i in index])
                copy_rows(np.asarray(dst, np.uint64)[index], src, self.block_bytes)
        hit = [False] * len(keys)
        for i in index:
            hit[i] = True
        return hit

    def flush(self, timeout: float | None = None) -> bool:
        return self._queue.flush(timeout)

    def close(self) -> None:
        """Send what is queued, then stop."""
        self._queue.close()

    def _write(self, jobs: list[_Job]) -> set[bytes]:
        keys = [k for j in jobs for k in j.keys]
        rows = self._staging.addresses([c for j in jobs for c in j.chunks])
        return {k for k, h in zip(keys, self._send(keys, rows)) if h}

    def _finish(self, jobs: Sequence[_Job], stored: set[bytes]) -> None:
        """Unstage and free the jobs' blocks, count them, then complete their futures (outside the lock: a
        future's callbacks, the store's listeners, may call back into this writer)."""
        results = []
        with self._lock:
            for job in jobs:
                for k, c in zip(job.keys, job.chunks):
                    if self._staged.get(k) == c:
                        del self._staged[k]
                self._staging.free(job.chunks)
                sent = [k for k in job.keys if k in stored]
                self.counts["sent"] += len(sent)
                self.counts["failed"] += len(job.keys) - len(sent)
                results.append((job.future, sent))
        for future, sent in results:
            future.set_result(sent)
