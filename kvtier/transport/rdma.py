"""RDMA through pyverbs: one-sided RDMA WRITE (put) and READ (get) straight into the pool's registered DRAM.

Optional: needs pyverbs (``pip install kvtier[rdma]``, or the distribution's ``python3-pyverbs``) and an RDMA
device (InfiniBand or RoCE) on both ends; ``unavailable_reason()`` says what is missing, and ``connect()``
picks RDMA automatically only when nothing is. Device spec: ``name[:port[:gid_index]]`` (e.g. ``mlx5_0:1:3``
for RoCE v2 at GID index 3), or $KVTIER_RDMA_DEVICE; default: the first device, port 1, GID index 0.

    pool (RdmaServer)    registers its whole DRAM buffer once (remote read + write) and its slot generations
                         (remote read: pool/rdma.py, the daemon's side), and for each client that asks (the ``rdma_connect`` op, over the usual
                         zmq control channel) makes an RC queue pair connected to the client's, answering with
                         its QP number, GID, LID, the buffer's address and rkey, and the generations' address
                         and rkey (a get READs its slots' generations after its data: kvtier/wire/generations.py).
    client (RdmaConnection)  the lease protocol of OneSidedConnection (reserve/commit, acquire/release); the
                         bytes move by RDMA WRITE/READ work requests posted on its queue pair, runs of
                         consecutive rows on both sides merged into one request, completions polled with a
                         deadline (a silent NIC or peer is PoolUnavailable, never a hang).

Local memory must be registered for the NIC: rows inside a region passed to ``register(addr, nbytes)``
(e.g. the store's DRAM buffer, registered once) move zero-copy; other rows go through a registered bounce
buffer (one host copy). After a pool restart (a new epoch) the client connects a new queue pair.
Thread-safe: one transfer at a time per connection (its queue pair and completion queue are shared). The
pyverbs pieces (device lookup, ports, queue pairs), which both ends build, are kvtier/wire/verbs.py.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier import wire
from kvtier.memory.hostcopy import copy_rows
from kvtier.transport.base import PoolInfo, PoolProtocolError, PoolUnavailable
from kvtier.transport.onesided import OneSidedConnection
from kvtier.wire import pool as P
from kvtier.wire.verbs import BOUNCE_BYTES, MAX_WR_BYTES, Broken, Port, QueuePair, unavailable_reason

__all__ = ["RdmaConnection", "unavailable_reason"]  # unavailable_reason: where callers ask

log = logging.getLogger(__name__)

@dataclass
class _Session:
    """A queue pair connected to one pool epoch, and where that pool's buffer is."""

    epoch: int
    qp: QueuePair
    addr: int
    length: int
    rkey: int
    gen_addr: int = 0
    gen_length: int = 0
    gen_rkey: int = 0


class RdmaConnection(OneSidedConnection):
    """Blocks by one-sided RDMA. See OneSidedConnection and kvtier.transport.base.PoolConnection."""

    transport = "rdma"

    def __init__(self, channel: Any, info: PoolInfo, *, device: str | None = None, **kw: Any) -> None:
        super().__init__(channel, info, **kw)
        from pyverbs import enums as e
        from pyverbs.mr import MR

        self._port = Port.open(device)
        self._access = e.IBV_ACCESS_LOCAL_WRITE
        self._bounce = MR(self._port.pd, max(BOUNCE_BYTES, self.block_bytes), self._access)
        self._bounce_addr = int(self._bounce.buf)
        self._gens = MR(self._port.pd, 8 * max(1, info.max_keys), self._access)  # generations READ after a get
        self._regions: list[tuple[int, int, Any]] = []  # (start, end, MR), sorted by start
        self._lock = threading.Lock()
        self._session: _Session | None = None
        self._connect(info.epoch)

    def register(self, address: int, nbytes: int) -> None:
        """Register long-lived local memory (e.g. the store's DRAM buffer): rows inside it skip the bounce."""
        from pyverbs.mr import MR

        mr = MR(self._port.pd, nbytes, self._access, address=address)
        with self._lock:
            bisect.insort(self._regions, (address, address + nbytes, mr), key=lambda r: r[0])

    def close(self) -> None:
        with self._lock:
            if self._session is not None:
                self._session.qp.close()
            for _, _, mr in self._regions:
                mr.close()
            self._bounce.close()
            self._gens.close()
            self._port.close()
        super().close()

    # ---- OneSidedConnection ------------------------------------------------------------------------------

    def _write(self, offsets: np.ndarray, src: np.ndarray, epoch: int) -> None:
        self._move(True, src, offsets, epoch)

    def _read(self, dst: np.ndarray, offsets: np.ndarray, epoch: int) -> None:
        self._move(False, dst, offsets, epoch)

    def _generations(self, offsets: np.ndarray, epoch: int) -> np.ndarray:
        """READ the generation counters of the slots at ``offsets`` (after the data READs completed: issued
        after their completions, so the NIC reads them later)."""
        n = len(offsets)
        with self._lock:
            s = self._session_for(epoch)
            if not s.gen_rkey:
                raise PoolProtocolError(self.endpoint, "the pool registered no slot generations for RDMA",
                                        wire.ERR_BAD_MESSAGE)
            slots = offsets.astype(np.uint64) // np.uint64(self.block_bytes)
            if n > self._gens.length // 8 or (n and int(slots.max()) * 8 + 8 > s.gen_length):
                raise PoolProtocolError(self.endpoint, "a get's slots fall outside the pool's generations",
                                        wire.ERR_BAD_MESSAGE)
            base = int(self._gens.buf)
            local = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(8)
            remote = np.uint64(s.gen_addr) + slots * np.uint64(8)
            deadline = time.monotonic() + self.channel.timeout_s
            try:
                s.qp.transfer(False, local, np.full(n, self._gens.lkey, dtype=np.int64), remote,
                              np.full(n, 8, dtype=np.int64), s.gen_rkey, deadline)
            except Broken as e:
                s.qp.close()
                self._session = None
                raise PoolUnavailable(self.endpoint, str(e), "rdma") from None
            return np.frombuffer(ctypes.string_at(base, 8 * n), dtype=np.uint64).copy()

    def _move(self, write: bool, rows: np.ndarray, offsets: np.ndarray, epoch: int) -> None:
        bb = self.block_bytes
        with self._lock:
            session = self._session_for(epoch)
            if len(offsets) and (int(offsets.min()) < 0 or int(offsets.max()) + bb > session.length):
                raise PoolProtocolError(self.endpoint, "the pool named an offset outside its buffer",
                                        wire.ERR_BAD_MESSAGE)
            remote = np.uint64(session.addr) + offsets.astype(np.uint64)
            per = max(1, BOUNCE_BYTES // bb)
            for a in range(0, len(rows), per):
                self._move_some(write, session, rows[a : a + per], remote[a : a + per])

    def _move_some(self, write: bool, s: _Session, rows: np.ndarray, remote: np.ndarray) -> None:
        bb = self.block_bytes
        lkeys = self._lkeys(rows)
        bounced = np.flatnonzero(lkeys < 0)
        local = rows.copy()
        if len(bounced):
            local[bounced] = np.uint64(self._bounce_addr) + np.arange(len(bounced), dtype=np.uint64) * np.uint64(bb)
            lkeys[bounced] = self._bounce.lkey
            if write:
                copy_rows(local[bounced], rows[bounced], bb)
        starts, sizes = _merge(local, remote, bb)
        deadline = time.monotonic() + max(self.channel.timeout_s, len(rows) * bb / 1e9)
        try:
            s.qp.transfer(write, local[starts], lkeys[starts], remote[starts], sizes, s.rkey, deadline)
        except Broken as e:
            s.qp.close()
            self._session = None
            raise PoolUnavailable(self.endpoint, str(e), "rdma") from None
        if len(bounced) and not write:
            copy_rows(rows[bounced], local[bounced], bb)

    def _lkeys(self, rows: np.ndarray) -> np.ndarray:
        """The lkey of the registered region holding each row, -1 where none does (those bounce)."""
        out = np.full(len(rows), -1, dtype=np.int64)
        bb = self.block_bytes
        for i, r in enumerate(rows.tolist()):
            j = bisect.bisect_right(self._regions, r, key=lambda reg: reg[0]) - 1
            if j >= 0 and r + bb <= self._regions[j][1]:
                out[i] = self._regions[j][2].lkey
        return out

    def _session_for(self, epoch: int) -> _Session:
        session = self._session
        if session is None or session.epoch != epoch:
            session = self._connect(epoch)
        return session

    def _connect(self, epoch: int) -> _Session:
        """A new queue pair connected to the pool of ``epoch`` (call with the lock held or from __init__)."""
        if self._session is not None:
            self._session.qp.close()
            self._session = None
        qp = QueuePair(self._port)
        try:
            ans = self.channel.call(P.RDMA_CONNECT, qp.local())
            if ans.epoch != epoch:
                raise PoolUnavailable(self.endpoint, "the pool restarted while connecting RDMA", "restarted")
            qp.connect(ans.body)
        except BaseException:
            qp.close()
            raise
        b = ans.body
        session = self._session = _Session(epoch, qp, int(b["addr"]), int(b["length"]), int(b["rkey"]),
                                           int(b.get("gen_addr", 0)), int(b.get("gen_length", 0)),
                                           int(b.get("gen_rkey", 0)))
        log.info("pool %s: RDMA queue pair %d connected to the pool's %d", self.endpoint, qp.local()["qpn"],
                 int(ans.body["qpn"]))
        return session


def _merge(local: np.ndarray, remote: np.ndarray, block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices where a work request starts and its size: runs consecutive on both sides become one request."""
    n = len(local)
    if n == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    bb = np.uint64(block_bytes)
    joins = (local[1:] == local[:-1] + bb) & (remote[1:] == remote[:-1] + bb)
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    counts = np.diff(np.append(starts, n))
    per = max(1, MAX_WR_BYTES // block_bytes)
    if counts.max() > per:  # split runs over the largest request size
        starts = np.concatenate([np.arange(s, s + c, per) for s, c in zip(starts.tolist(), counts.tolist())])
        counts = np.diff(np.append(starts, n))
    return starts, counts * block_bytes
