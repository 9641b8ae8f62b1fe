"""WriteQueue: the queue and writer thread of a tier's write-behind (the pool tier's PoolWriter, the SSD tier's
WriteBehind).

Callers stage blocks in memory of their own (so the caller's buffer is free at once) and ``put`` a job naming
them; one background thread takes queued jobs in batches of at most ``max_batch`` blocks, calls ``write(batch)``
(the keys it stored), then ``finish(batch, stored)`` (unstage, free the staging memory, complete futures). A
``write`` that raises is a bug, not a device or network failure (those come back as keys not stored): it is
logged and the batch is finished as not stored, so the queue never wedges. ``flush`` waits until every job put
so far is finished; ``close`` writes what is queued, then stops the thread. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

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
