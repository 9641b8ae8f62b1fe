"""Where a master's state lives: the DirectoryBackend protocol, and LocalBackend (this process, lmdb under it).

Two backends:

* ``LocalBackend`` (the default): the state is this process's; with ``--data-dir`` node records and hint
  entries are written to lmdb as they change and a directory snapshot every ``--snapshot-interval-s``
  (master/persist.py), all on one writer thread so a large snapshot never stalls answers. One master.
* ``SharedBackend`` (``--directory redis://HOST:PORT/N``, master/shared.py): every state change goes through a
  log in Redis that every master of the cluster applies in the same order; several masters serve at once.

The server asks the backend for the state (``state``: a shared backend may replace it after a reload), hands
it the writes when ``shared`` (``submit``: the backend answers them once they are applied), and calls ``tick``
from its timer and ``close`` at shutdown. Runs on the master's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from kvtier.master.access import Caller
from kvtier.master.metrics import MasterMetrics
from kvtier.master.persist import MasterDisk
from kvtier.master.service import MasterSettings, MasterState

log = logging.getLogger("kvtier.master")

Answer = Callable[[int, bytes, str, str], None]  # (req_id, reply frame, status, error text): sends and counts it


class DirectoryBackend(Protocol):
    """A master's state and how its changes are recorded (see the module doc)."""

    shared: bool  # writes go through ``submit`` (else the server applies them to ``state`` itself)
    state: MasterState

    async def open(self) -> None:
        """Restore or catch up; returns once ``state`` may be served."""

    def submit(self, req_id: int, op: str, body: dict[str, Any], caller: Caller, answer: Answer) -> None:
        """A write to record (shared backends only); ``answer`` is called once, when it is applied or refused."""

    def tick(self) -> None:
        """Periodic work (the server's timer, ~100 ms)."""

    def status(self) -> dict[str, Any]:
        """What ``ping`` reports about the backend."""

    async def close(self, flush: bool) -> None:
        """Write what must survive (``flush``: the master got as far as serving) and let go of resources."""


class LocalBackend:
    """The state in this process; with ``settings.data_dir``, persisted to lmdb (persist.py)."""

    shared = False

    def __init__(self, settings: MasterSettings, metrics: MasterMetrics) -> None:
        self.settings = settings
        self.state = MasterState(settings, metrics)
        self.state.backend_status = self.status
        self.disk: MasterDisk | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-master-disk")
        self._last_snapshot = time.monotonic()
        self._snapshot_running = False
        self._hints_job: Future[Any] | None = None  # the hint records being written (at most one at a time)

    async def open(self) -> None:
        if self.settings.data_dir:
            self.disk = MasterDisk(self.settings.data_dir)
            self.state.restore(self.disk)

    def submit(self, req_id: int, op: str, body: dict[str, Any], caller: Caller, answer: Answer) -> None:
        raise RuntimeError("a local backend applies writes in the server, not through submit")

    def status(self) -> dict[str, Any]:
        return {"kind": "lmdb" if self.settings.data_dir else "memory", "state": "ok"}

    def tick(self) -> None:
        self._persist_small()
        due = self.settings.snapshot_interval_s > 0 and \
            time.monotonic() - self._last_snapshot >= self.settings.snapshot_interval_s
        if due and not self._snapshot_running and self.disk is not None:
            self._snapshot_running = True
            self._last_snapshot = time.monotonic()
            fut = self._writer.submit(self._write_snapshot, *self.state.snapshot())
            fut.add_done_callback(lambda _f: setattr(self, "_snapshot_running", False))

    def _persist_small(self) -> None:
        """Queue node records and hint entries that changed since the last call for the writer thread (only
        those: a pin writes its own record, never the hint table)."""
        if self.disk is None:
            return
        records, forgotten = self.state.dirty_records()
        for rec in records:
            self._writer.submit(self._guarded, self.disk.save_node, rec)
        for node_id in forgotten:
            self._writer.submit(self._guarded, self.disk.delete_node, node_id)
        # One hint write at a time: while one runs, changes gather in the table's log (one entry per hint
        # changed, however often), so a burst of pins never queues work behind a SIGTERM.
        if self._hints_job is not None and not self._hints_job.done():
            return
        changes = self.state.hints.take_changes()
        if changes:
            self._hints_job = self._writer.submit(self._guarded, self.disk.save_hints, changes,
                                                  self.state.hints.version)

    def _write_snapshot(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        if self.disk is None:
            return
        t0 = time.perf_counter()
        try:
            n = self.disk.save_snapshot(arrays, meta)
        except Exception:
            log.exception("directory snapshot failed (the previous one stays); nodes would resync after a crash")
            return
        log.info("directory snapshot: %d keys, %.1f MiB in %.2f s", len(arrays["k0"]), n / 2**20,
                 time.perf_counter() - t0)

    @staticmethod
    def _guarded(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("writing master state to disk failed")

    async def close(self, flush: bool) -> None:
        """Flush state (if the daemon got as far as serving: a failed start must not overwrite the last
        snapshot with a partial one) and close the disk."""
        loop = asyncio.get_running_loop()
        if self.disk is not None:
            if flush:
                if self._hints_job is not None:
                    await asyncio.wrap_future(self._hints_job)
                self._persist_small()
                await loop.run_in_executor(self._writer, self._write_snapshot, *self.state.snapshot())
            await loop.run_in_executor(self._writer, self.disk.close)
        self._writer.shutdown(wait=True)


def make_backend(settings: MasterSettings, metrics: MasterMetrics) -> DirectoryBackend:
    """The backend ``settings.directory`` names ("" or lmdb: local; redis://...: shared)."""
    if not settings.directory:
        return LocalBackend(settings, metrics)
    from kvtier.master.shared import SharedBackend

    return SharedBackend(settings, metrics)
