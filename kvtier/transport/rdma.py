"""RDMA through pyverbs: one-sided RDMA WRITE (put) and READ (get) straight into the pool's registered DRAM.

Optional: needs pyverbs (``pip install kvtier[rdma]``, or the distribution's ``python3-pyverbs``) and an RDMA
device (InfiniBand or RoCE) on both ends; ``unavailable_reason()`` says what is missing, and ``connect()``
picks RDMA automatically only when nothing is. Device spec: ``name[:port[:gid_index]]`` (e.g. ``mlx5_0:1:3``
for RoCE v2 at GID index 3), or $KVTIER_RDMA_DEVICE; default: the first device, port 1, GID index 0.

    pool (RdmaServer)    registers its whole DRAM buffer once (remote read + write) and its slot generations
                         (remote read), and for each client that asks (the ``rdma_connect`` op, over the usual
                         zmq control channel) makes an RC queue pair connected to the client's, answering with
                         its QP number, GID, LID, the buffer's address and rkey, and the generations' address
                         and rkey (a get READs its slots' generations after its data: kvtier/pool/generations.py).
    client (RdmaConnection)  the lease protocol of OneSidedConnection (reserve/commit, acquire/release); the
                         bytes move by RDMA WRITE/READ work requests posted on its queue pair, runs of
                         consecutive rows on both sides merged into one request, completions polled with a
                         deadline (a silent NIC or peer is PoolUnavailable, never a hang).

Local memory must be registered for the NIC: rows inside a region passed to ``register(addr, nbytes)``
(e.g. the store's DRAM buffer, registered once) move zero-copy; other rows go through a registered bounce
buffer (one host copy). After a pool restart (a new epoch) the client connects a new queue pair.
Thread-safe: one transfer at a time per connection (its queue pair and completion queue are shared).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier import wire
from kvtier.config import ENV_RDMA_DEVICE
from kvtier.hostcopy import copy_rows
from kvtier.pool import protocol as P
from kvtier.transport.base import PoolInfo, PoolProtocolError, PoolUnavailable
from kvtier.transport.onesided import OneSidedConnection

log = logging.getLogger(__name__)

QUEUE_DEPTH = 128  # work requests in flight per queue pair
BOUNCE_BYTES = 64 << 20
MAX_WR_BYTES = 1 << 30
MAX_SERVER_QPS = 1024  # queue pairs a pool keeps (the oldest go first: clients that left without a word)
PSN_BITS = 24
# What the pool's memory region and every queue pair allow: the peer READs and WRITEs our memory, the NIC
# writes into it locally (READ responses land in local memory).
REMOTE_ACCESS = ("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_READ", "IBV_ACCESS_REMOTE_WRITE")


def remote_access(enums: Any) -> int:
    """The REMOTE_ACCESS flags as one mask, from pyverbs' ``enums`` module (a parameter so it is testable)."""
    mask = 0
    for name in REMOTE_ACCESS:
        mask |= int(getattr(enums, name))
    return mask


def init_fields(enums: Any, port_num: int) -> dict[str, int]:
    """The QPAttr fields the RESET -> INIT transition of an RC queue pair needs (pyverbs' INIT mask is
    PKEY_INDEX | PORT | ACCESS_FLAGS). They must be there when the queue pair is created with a QPAttr:
    pyverbs then moves it to INIT at once, and to_rts() later skips INIT, so access flags set only in the
    RTR/RTS attributes are never applied (every remote READ or WRITE would fail with a remote access error)."""
    return {"port_num": port_num, "pkey_index": 0, "qp_access_flags": remote_access(enums)}


@functools.lru_cache(maxsize=8)
def unavailable_reason(device: str | None = None) -> str | None:
    """Why RDMA cannot be used here (None: it can). Cached: devices do not come and go at run time."""
    try:
        from pyverbs import device as d
    except ImportError:
        return "pyverbs is not installed (pip install 'kvtier[rdma]', or the distribution's python3-pyverbs)"
    try:
        names = [dev.name.decode() for dev in d.get_device_list()]
    except Exception as e:  # PyverbsRDMAError when the host has no RDMA subsystem at all
        return f"no RDMA device on this host ({e})"
    if not names:
        return "no RDMA device on this host"
    wanted = _spec(device)[0]
    if wanted and wanted not in names:
        return f"RDMA device {wanted!r} not found (this host has {', '.join(names)})"
    return None


def _spec(device: str | None) -> tuple[str | None, int, int]:
    """``name[:port[:gid_index]]`` (default: $KVTIER_RDMA_DEVICE) -> (name or None, port, gid index)."""
    device = device or os.environ.get(ENV_RDMA_DEVICE)
    if not device:
        return None, 1, 0
    parts = device.split(":")
    return parts[0] or None, int(parts[1]) if len(parts) > 1 else 1, int(parts[2]) if len(parts) > 2 else 0


@dataclass
class _Port:
    """An opened device, its protection domain, and the port and GID this process uses."""

    ctx: Any
    pd: Any
    port: int
    gid_index: int
    gid: str
    lid: int
    mtu: int

    @classmethod
    def open(cls, device: str | None) -> _Port:
        from pyverbs import device as d
        from pyverbs.pd import PD

        name, port, gid_index = _spec(device)
        name = name or d.get_device_list()[0].name.decode()
        ctx = d.Context(name=name)
        attr = ctx.query_port(port)
        gid = str(ctx.query_gid(port, gid_index).gid)
        return cls(ctx, PD(ctx), port, gid_index, gid, int(attr.lid), int(attr.active_mtu))

    def close(self) -> None:
        self.pd.close()
        self.ctx.close()


class _QueuePair:
    """One RC queue pair with its own completion queue, connected to one peer."""

    def __init__(self, port: _Port, depth: int = QUEUE_DEPTH) -> None:
        from pyverbs import enums as e
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        self.port = port
        self.cq = CQ(port.ctx, depth, None, None, 0)
        cap = QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPAttr()
        for name, value in init_fields(e, port.port).items():
            setattr(init, name, value)
        # Created with INIT attributes: pyverbs moves an RC queue pair to INIT here, with these access flags.
        self.qp = QP(port.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap), init)
        self.psn = secrets.randbits(PSN_BITS)
        self.depth = depth

    def local(self) -> dict[str, Any]:
        return {"qpn": int(self.qp.qp_num), "psn": self.psn, "gid": self.port.gid, "lid": self.port.lid,
                "mtu": self.port.mtu}

    def connect(self, remote: dict[str, Any]) -> None:
        """INIT -> RTR -> RTS against the peer's queue pair (fields as ``local()`` gives them); INIT, with the
        access flags, happened when the queue pair was made."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=self.port.port)
        attr.path_mtu = min(int(remote["mtu"]), self.port.mtu)
        attr.dest_qp_num = int(remote["qpn"])
        attr.rq_psn = int(remote["psn"])
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = 16
        attr.max_rd_atomic = 16
        attr.min_rnr_timer = 12
        attr.timeout = 14  # 4.096 us * 2^14 = 67 ms per retry
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        gr = GlobalRoute(dgid=GID(str(remote["gid"])), sgid_index=self.port.gid_index)
        attr.ah_attr = AHAttr(port_num=self.port.port, is_global=1, gr=gr, dlid=int(remote["lid"]))
        self.qp.to_rts(attr)

    def transfer(self, write: bool, local: np.ndarray, lkeys: np.ndarray, remote: np.ndarray, sizes: np.ndarray,
                 rkey: int, deadline: float) -> None:
        """Post one RDMA WRITE (or READ) per (local, remote, size) and wait for every completion."""
        from pyverbs import enums as e
        from pyverbs.wr import SGE, SendWR

        opcode = e.IBV_WR_RDMA_WRITE if write else e.IBV_WR_RDMA_READ
        outstanding = 0
        for i, (la, lk, ra, size) in enumerate(zip(local.tolist(), lkeys.tolist(), remote.tolist(), sizes.tolist())):
            wr = SendWR(wr_id=i, opcode=opcode, num_sge=1, sg=[SGE(la, size, lk)], send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(rkey, ra)
            while outstanding >= self.depth:
                outstanding -= self._poll(deadline)
            self.qp.post_send(wr)
            outstanding += 1
        while outstanding:
            outstanding -= self._poll(deadline)

    def _poll(self, deadline: float) -> int:
        from pyverbs import enums as e

        while True:
            n, wcs = self.cq.poll(16)
            if n:
                bad = [wc for wc in wcs[:n] if wc.status != e.IBV_WC_SUCCESS]
                if bad:
                    raise _Broken(f"RDMA completion failed with status {bad[0].status} (vendor error "
                                  f"{bad[0].vendor_err})")
                return n
            if time.monotonic() > deadline:
                raise _Broken("RDMA completions did not come within the timeout")

    def close(self) -> None:
        self.qp.close()
        self.cq.close()


class _Broken(Exception):
    """The queue pair is in error (or silent): it must be replaced."""


class RdmaServer:
    """The pool's side: its DRAM buffer registered for remote read and write, one queue pair per client."""

    def __init__(self, address: int, nbytes: int, device: str | None = None, *,
                 generations: tuple[int, int] | None = None) -> None:
        from pyverbs import enums as e
        from pyverbs.mr import MR

        self.port = _Port.open(device)
        self.mr = MR(self.port.pd, nbytes, remote_access(e), address=address)
        self.address, self.nbytes = address, nbytes
        self.gen_mr = None
        self.generations = generations  # (address, nbytes) of the slots' generation counters
        if generations is not None:
            self.gen_mr = MR(self.port.pd, generations[1], e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ,
                             address=generations[0])
        self._qps: OrderedDict[int, _QueuePair] = OrderedDict()
        self._lock = threading.Lock()
        log.info("pool RDMA: %d B registered on %s port %d (gid %s)", nbytes, self.port.ctx.name, self.port.port,
                 self.port.gid)

    def describe(self) -> dict[str, Any]:
        return {"gid": self.port.gid, "lid": self.port.lid}

    def connect(self, body: dict[str, Any]) -> dict[str, Any]:
        """The ``rdma_connect`` op: a queue pair for the client's, and where the buffer is."""
        remote = {k: wire.field(body, k, str if k == "gid" else int) for k in ("qpn", "psn", "gid", "lid", "mtu")}
        qp = _QueuePair(self.port)
        try:
            qp.connect(remote)
        except Exception as e:
            qp.close()
            raise wire.WireError(wire.ERR_BAD_REQUEST, f"cannot connect a queue pair to the client's: {e}") from None
        with self._lock:
            self._qps[qp.local()["qpn"]] = qp
            while len(self._qps) > MAX_SERVER_QPS:
                self._qps.popitem(last=False)[1].close()
        gens = {} if self.gen_mr is None or self.generations is None else {
            "gen_addr": self.generations[0], "gen_length": self.generations[1], "gen_rkey": int(self.gen_mr.rkey)}
        return {**qp.local(), "rkey": int(self.mr.rkey), "addr": self.address, "length": self.nbytes, **gens}

    def close(self) -> None:
        with self._lock:
            for qp in self._qps.values():
                qp.close()
            self._qps.clear()
        if self.gen_mr is not None:
            self.gen_mr.close()
        self.mr.close()
        self.port.close()


@dataclass
class _Session:
    """A queue pair connected to one pool epoch, and where that pool's buffer is."""

    epoch: int
    qp: _QueuePair
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

        self._port = _Port.open(device)
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
            except _Broken as e:
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
        except _Broken as e:
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
        qp = _QueuePair(self._port)
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
