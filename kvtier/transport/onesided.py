"""OneSidedConnection: the lease protocol of the transports where the client moves the bytes itself.

    put:  reserve (the pool picks slots, evicting if needed) -> write rows into them -> commit
    get:  acquire (the pool keeps the blocks from eviction) -> read them into rows -> release

Shared memory (shm.py: the client copies into and out of the pool's mapped file) and RDMA (rdma.py: one-sided
RDMA WRITE and READ into the pool's registered memory) differ only in ``_write`` and ``_read``. Between the
two requests the pool holds a lease (``lease_s``); a get that finishes well inside it releases without
waiting for the answer, so a get costs one round trip and one transfer. A get whose lease expired before its
release (this process stalled) counts those blocks as misses and zeroes their rows: the pool may have reused
the slots meanwhile. A put whose lease expired reports those keys not stored.

Every reply carries the pool's epoch; ``_write``/``_read`` get the epoch the offsets belong to, so a
transport can re-attach to a restarted pool (a new file to map, a new queue pair) before it moves bytes.
Thread-safe.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence

import numpy as np

from kvtier.pool import protocol as P
from kvtier.transport.connection import ConnectionBase

log = logging.getLogger(__name__)


class OneSidedConnection(ConnectionBase):
    """put/get by reserve/commit and acquire/release; subclasses move the bytes."""

    def _write(self, offsets: np.ndarray, src: np.ndarray, epoch: int) -> None:
        """Copy rows at ``src`` into the pool's buffer at byte ``offsets`` (pool of ``epoch``)."""
        raise NotImplementedError

    def _read(self, dst: np.ndarray, offsets: np.ndarray, epoch: int) -> None:
        """Copy the pool's blocks at byte ``offsets`` (pool of ``epoch``) into rows at ``dst``."""
        raise NotImplementedError

    def put(self, keys: Sequence[bytes], rows: np.ndarray) -> list[bool]:
        n, bb = len(keys), self.block_bytes
        self._check_fits(n)
        rows = np.asarray(rows, dtype=np.uint64)
        held = [False] * n
        for a, b in self._chunks(n, self.info.max_keys):
            ans = self._call(P.RESERVE, self._body(keys[a:b]))
            got = P.unbitmap(ans.body["held"], b - a)
            fresh = np.flatnonzero(P.unbitmap(ans.body["fresh"], b - a))
            lease = int(ans.body["lease"])
            if lease:
                ok = False
                try:
                    self._write(P.unoffsets(ans.body["offsets"], len(fresh)), rows[a + fresh], ans.epoch)
                    ok = True
                finally:
                    done = self._call(P.COMMIT, {"lease": lease, "ok": ok, "block_bytes": bb})
                if not done.body["valid"]:  # the lease expired mid-copy: those slots were taken back
                    for i in fresh.tolist():
                        got[i] = False
            held[a:b] = got
        return held

    def get(self, keys: Sequence[bytes], rows: np.ndarray) -> list[bool]:
        n, bb = len(keys), self.block_bytes
        rows = np.asarray(rows, dtype=np.uint64)
        hit = [False] * n
        for a, b in self._chunks(n, self.info.max_keys):
            t0 = time.monotonic()
            ans = self._call(P.ACQUIRE, self._body(keys[a:b]))
            lease = int(ans.body["lease"])
            if not lease:
                continue  # all misses
            offsets = P.unoffsets(ans.body["offsets"], b - a)
            index = np.flatnonzero(offsets >= 0)
            dst = rows[a + index]
            try:
                self._read(dst, offsets[index], ans.epoch)
            except BaseException:
                self.channel.notify(P.RELEASE, {"lease": lease})
                raise
            if time.monotonic() - t0 < self.info.lease_s / 2:
                self.channel.notify(P.RELEASE, {"lease": lease})  # well inside the lease: no need to wait
            elif not self._call(P.RELEASE, {"lease": lease}).body["valid"]:
                log.warning("pool %s: a get took longer than the pool's %.3g s lease; %d blocks count as misses",
                            self.endpoint, self.info.lease_s, len(index))
                for d in dst.tolist():
                    ctypes.memset(d, 0, bb)
                continue
            for i in index.tolist():
                hit[a + i] = True
        return hit
