"""The pyverbs parts of kvtier's RDMA data path, which both ends build: device lookup, an opened port, RC queue
pairs and their transfers with a deadline. The client (kvtier/transport/rdma.py) and the pool
(pool/rdma.py) each open a Port and connect QueuePairs whose fields (qpn, psn, gid, lid, mtu) ride in the
pool protocol's ``rdma_connect`` op, with the access flags both must agree on (REMOTE_ACCESS): that agreement is
part of the wire contract, so it lives in kvtier.wire and neither side imports the other for it. Optional:
pyverbs is imported inside the functions that need it, so this module imports anywhere. Thread-safety: a
QueuePair is used by one thread at a time (its owner's lock)."""

from __future__ import annotations

import functools
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.envvars import ENV_RDMA_DEVICE

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
    wanted = device_spec(device)[0]
    if wanted and wanted not in names:
        return f"RDMA device {wanted!r} not found (this host has {', '.join(names)})"
    return None


def device_spec(device: str | None) -> tuple[str | None, int, int]:
    """``name[:port[:gid_index]]`` (default: $KVTIER_RDMA_DEVICE) -> (name or None, port, gid index)."""
    device = device or os.environ.get(ENV_RDMA_DEVICE)
    if not device:
        return None, 1, 0
    parts = device.split(":")
    return parts[0] or None, int(parts[1]) if len(parts) > 1 else 1, int(parts[2]) if len(parts) > 2 else 0


@dataclass
class Port:
    """An opened device, its protection domain, and the port and GID this process uses."""

    ctx: Any
    pd: Any
    port: int
    gid_index: int
    gid: str
    lid: int
    mtu: int

    @classmethod
    def open(cls, device: str | None) -> Port:
        from pyverbs import device as d
        from pyverbs.pd import PD

        name, port, gid_index = device_spec(device)
        name = name or d.get_device_list()[0].name.decode()
        ctx = d.Context(name=name)
        attr = ctx.query_port(port)
        gid = str(ctx.query_gid(port, gid_index).gid)
        return cls(ctx, PD(ctx), port, gid_index, gid, int(attr.lid), int(attr.active_mtu))

    def close(self) -> None:
        self.pd.close()
        self.ctx.close()


class QueuePair:
    """One RC queue pair with its own completion queue, connected to one peer."""

    def __init__(self, port: Port, depth: int = QUEUE_DEPTH) -> None:
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
                    raise Broken(f"RDMA completion failed with status {bad[0].status} (vendor error "
                                  f"{bad[0].vendor_err})")
                return n
            if time.monotonic() > deadline:
                raise Broken("RDMA completions did not come within the timeout")

    def close(self) -> None:
        self.qp.close()
        self.cq.close()


class Broken(Exception):
    """The queue pair is in error (or silent): it must be replaced."""
