"""RdmaServer: the pool's side of the RDMA data path (the client's is kvtier/transport/rdma.py).

The pool registers its whole DRAM buffer once (remote read + write) and its slot generations (remote read:
kvtier/wire/generations.py), and for each client that asks (the ``rdma_connect`` op, over the usual zmq
control channel) makes an RC queue pair connected to the client's, answering with its QP number, GID, LID, the
buffer's address and rkey, and the generations' address and rkey. The verbs pieces both ends build (ports,
queue pairs, access flags) are kvtier/wire/verbs.py. Optional: needs pyverbs and an RDMA device
(``unavailable_reason()`` says what is missing; PoolState asks it before building one).

Thread-safe: ``connect`` runs on the pool's worker threads (the queue-pair table locks).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from kvtier import wire
from kvtier.wire.verbs import MAX_SERVER_QPS, Port, QueuePair, remote_access

log = logging.getLogger(__name__)


class RdmaServer:
    """The pool's side: its DRAM buffer registered for remote read and write, one queue pair per client."""

    def __init__(self, address: int, nbytes: int, device: str | None = None, *,
                 generations: tuple[int, int] | None = None) -> None:
        from pyverbs import enums as e
        from pyverbs.mr import MR

        self.port = Port.open(device)
        self.mr = MR(self.port.pd, nbytes, remote_access(e), address=address)
        self.address, self.nbytes = address, nbytes
        self.gen_mr = None
        self.generations = generations  # (address, nbytes) of the slots' generation counters
        if generations is not None:
            self.gen_mr = MR(self.port.pd, generations[1], e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ,
                             address=generations[0])
        self._qps: OrderedDict[int, QueuePair] = OrderedDict()
        self._lock = threading.Lock()
        log.info("pool RDMA: %d B registered on %s port %d (gid %s)", nbytes, self.port.ctx.name, self.port.port,
                 self.port.gid)

    def describe(self) -> dict[str, Any]:
        return {"gid": self.port.gid, "lid": self.port.lid}

    def connect(self, body: dict[str, Any]) -> dict[str, Any]:
        """The ``rdma_connect`` op: a queue pair for the client's, and where the buffer is."""
        remote = {k: wire.field(body, k, str if k == "gid" else int) for k in ("qpn", "psn", "gid", "lid", "mtu")}
        qp = QueuePair(self.port)
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


__all__ = ["RdmaServer"]
