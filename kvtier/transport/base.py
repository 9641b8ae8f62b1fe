"""What every pool transport offers: one connection to one kvtier-pool, batch-first, with a timeout.

    conn = kvtier.transport.connect("tcp://node-3:7400", block_bytes)     # tcp, rdma or shm: see connect()
    held = conn.put(keys, rows)          # rows: uint64 addresses of the blocks, one per key
    hit = conn.get(keys, rows)           # copies hits into the rows; the other rows are left alone
    conn.contains(keys); conn.remove(keys); conn.close()

The transports differ only in how block bytes move: in zmq frames (tcp.py), by the client copying into and
out of the pool's shared-memory file (shm.py, same host), or by one-sided RDMA reads and writes (rdma.py).
Control (hello, contains, remove, and the reserve/commit, acquire/release steps of the one-sided paths) is
the same zmq request/reply for all of them (channel.py).

Failures are typed: ``PoolUnavailable`` (no answer within the timeout: the pool is down, slow or cut off),
``PoolRefused`` (the pool answered with an error, e.g. a put larger than its capacity, naming the sizes),
``PoolProtocolError`` (a peer speaking another protocol version). A caller that wants a miss instead
(PoolTier) catches PoolError.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class PoolError(RuntimeError):
    """A pool operation did not complete; ``endpoint`` names the pool."""

    def __init__(self, endpoint: str, message: str, code: str = "") -> None:
        super().__init__(f"pool {endpoint}: {message}")
        self.endpoint = endpoint
        self.message = message
        self.code = code


class PoolUnavailable(PoolError):
    """No answer within the timeout (pool down, overloaded, or unreachable)."""


class PoolRefused(PoolError):
    """The pool answered with an error (``code`` is one of kvtier.wire.ERR_*)."""


class PoolProtocolError(PoolRefused):
    """The pool and this client speak different protocol versions, or the reply is unreadable."""


@dataclass
class PoolInfo:
    """What a pool says about itself in its hello reply. ``block_bytes`` is this connection's block size (the
    pool's; the client's own while the pool is unsized, ``sized`` False: its first put sizes it). ``session``:
    the token this client's lease ops carry (pool/clients.py). ``uid``: the pool process's uid as the kernel
    reported it for the ipc:// connection the hello came on (kvtier/auth/peercred.py), and ``pid`` its process id
    (0 where the kernel could not say: another pid namespace); None over tcp://."""

    endpoint: str
    node: str
    epoch: int
    block_bytes: int
    capacity: int
    max_keys: int
    lease_s: float
    transports: dict[str, Any] = field(default_factory=dict)
    session: bytes = b""
    sized: bool = True
    request_bytes: int = 0  # the largest request the pool wants (0: it did not say)
    uid: int | None = None
    pid: int | None = None

    @classmethod
    def from_wire(cls, endpoint: str, body: dict[str, Any], block_bytes: int = 0, uid: int | None = None,
                  pid: int | None = None) -> PoolInfo:
        pool_bb = int(body["block_bytes"])
        session = body.get("session")
        return cls(endpoint, str(body["node"]), int(body["epoch"]), pool_bb or block_bytes, int(body["capacity"]),
                   int(body["max_keys"]), float(body["lease_s"]), dict(body.get("transports") or {}),
                   session if isinstance(session, bytes) else b"", pool_bb > 0, int(body.get("request_bytes") or 0),
                   uid, pid)


class PoolConnection(Protocol):
    """A connection to one pool. Thread-safe: calls from several threads run at once on separate sockets.

    ``rows`` are uint64 addresses of host blocks of ``info.block_bytes`` bytes; the caller owns that memory
    and keeps it alive and unchanged (put) or unread (get) until the call returns. Every call ends by its
    deadline, ``timeout_s`` plus its bytes at 100 MB/s from when it starts, whatever the pool does (silent,
    trickling, refusing), raising PoolUnavailable.
    """

    endpoint: str
    transport: str
    info: PoolInfo

    def put(self, keys: Sequence[bytes], rows: np.ndarray) -> list[bool]:
        """Store blocks; True where the pool holds the key afterwards (stored now or already there)."""

    def get(self, keys: Sequence[bytes], rows: np.ndarray) -> list[bool]:
        """Copy held blocks into ``rows``; True where a block was copied."""

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    def remove(self, keys: Sequence[bytes]) -> int: ...

    def observe(self, body: dict[str, Any]) -> None:
        """Tell the pool's policy what the engine saw (one encoded batch of wire.observations, at most
        ``info.max_keys`` keys); the pool answers once it has applied it."""

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
