"""OneSidedConnection: the lease protocol of the transports where the client moves the bytes itself.

    put:  reserve (the pool picks slots, evicting if needed) -> write rows into them -> commit
    get:  acquire (the pool keeps the blocks from eviction) -> read them into rows -> release

Shared memory (shm.py: the client copies into and out of the pool's mapped file) and RDMA (rdma.py: one-sided
RDMA WRITE and READ into the pool's registered memory) differ only in ``_write`` and ``_read``. A batch is cut
into requests of ``REQUEST_BYTES``, several in flight over parallel connections, so the pool reserves or looks
up the next chunk while this process copies the current one. Between the two requests the pool holds a lease
(``lease_s``); a get that finishes well inside it releases without waiting for the answer, so a get costs
one round trip and one transfer. A get whose lease expired before its
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
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvtier.pool import protocol as P
from kvtier.transport.channel import Answer, Request
from kvtier.transport.connection import ConnectionBase

log = logging.getLogger(__name__)

REQUEST_BYTES = 16 << 20  # blocks per reserve/acquire: the next request is served while this one is copied


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
        copied: list[tuple[int, int, np.ndarray, bool]] = []  # not committed yet: (lease, chunk start, fresh, ok)

        def settle(done: list[tuple[int, int, np.ndarray, bool]], valid: list[bool]) -> None:
            for (_, a, fresh, _), ok in zip(done, valid):
                if not ok:  # the lease expired mid-copy: those slots were taken back
                    for i in fresh.tolist():
                        held[a + i] = False

        def commit_body(done: list[tuple[int, int, np.ndarray, bool]]) -> dict[str, Any]:
            return {"leases": [d[0] for d in done], "oks": [d[3] for d in done]}

        def reserves() -> Iterator[Request]:
            for a, b in self._chunks(n, self._per_request()):
                piggyback, copied[:] = list(copied), []  # chunks copied by now: committed by this request

                def on_reply(ans: Answer, a: int = a, b: int = b, piggyback: list = piggyback) -> None:
                    settle(piggyback, ans.body.get("valid", []))
                    held[a:b] = P.unbitmap(ans.body["held"], b - a)
                    fresh = np.flatnonzero(P.unbitmap(ans.body["fresh"], b - a))
                    lease = int(ans.body["lease"])
                    if not lease:
                        return
                    ok = False
                    try:  # copied while the pool reserves the next chunk
                        self._write(P.unoffsets(ans.body["offsets"], len(fresh)), rows[a + fresh], ans.epoch)
                        ok = True
                    finally:
                        copied.append((lease, a, fresh, ok))
                body = self._body(keys[a:b], **commit_body(piggyback)) if piggyback else self._body(keys[a:b])
                yield Request(P.RESERVE, body, (), on_reply)
        try:
            self._batch(reserves(), self._count(n, self._per_request()), 0)
        finally:
            if copied:  # the last chunks (and, after a failure, whatever was reserved) in one round trip
                last = list(copied)
                settle(last, self._call(P.COMMIT, {**commit_body(last), "block_bytes": bb}).body["valid"])
        return held

    def get(self, keys: Sequence[bytes], rows: np.ndarray) -> list[bool]:
        n, bb = len(keys), self.block_bytes
        rows = np.asarray(rows, dtype=np.uint64)
        hit = [False] * n

        def acquires() -> Iterator[Request]:
            for a, b in self._chunks(n, self._per_request()):
                def on_reply(ans: Answer, a: int = a, b: int = b) -> None:
                    lease = int(ans.body["lease"])
                    if not lease:
                        return  # all misses
                    t0 = time.monotonic()
                    offsets = P.unoffsets(ans.body["offsets"], b - a)
                    index = np.flatnonzero(offsets >= 0)
                    dst = rows[a + index]
                    try:  # copied while the pool looks up the next chunk
                        self._read(dst, offsets[index], ans.epoch)
                    except BaseException:
                        self.channel.notify(P.RELEASE, {"lease": lease})
                        raise
                    if time.monotonic() - t0 < self.info.lease_s / 2:
                        self.channel.notify(P.RELEASE, {"lease": lease})  # well inside the lease: no need to wait
                    elif not self._call(P.RELEASE, {"lease": lease}).body["valid"]:
                        log.warning("pool %s: a get took longer than the pool's %.3g s lease; %d blocks count as "
                                    "misses", self.endpoint, self.info.lease_s, len(index))
                        for d in dst.tolist():
                            ctypes.memset(d, 0, bb)
                        return
                    for i in index.tolist():
                        hit[a + i] = True
                yield Request(P.ACQUIRE, self._body(keys[a:b]), (), on_reply)
        self._batch(acquires(), self._count(n, self._per_request()), 0)
        return hit

    def _per_request(self) -> int:
        return max(1, min(self.info.max_keys, REQUEST_BYTES // self.block_bytes))
