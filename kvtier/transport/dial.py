"""``connect()``: says hello to a pool and builds the connection of the data path it picks (the transport
construction, kept apart from ConnectionBase in connection.py so that the base imports none of the transports
built on it: connection <- onesided <- rdma was an import circle while connect() lived there).

Transport choice: from the transports' table (registry.py). ``transport="auto"``: an ipc:// endpoint means the
pool runs on this host: shared memory (shm.py). A tcp:// endpoint: RDMA (rdma.py) when pyverbs imports, this host
has an RDMA device and the pool offers RDMA; else raw TCP data sockets received straight into place (stream.py)
when the pool has a data port; else block bytes in zmq frames (tcp.py), which every pool serves.
``transport`` names one to insist on it; a path the pool or this host cannot do is an error naming why. The
transports are imported when first chosen (rdma pulls in nothing of pyverbs until then either).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from kvtier import wire
from kvtier.auth import ClientKeys
from kvtier.transport.base import PoolConnection, PoolError, PoolInfo, PoolRefused
from kvtier.transport.channel import Channel
from kvtier.transport.connection import hello
from kvtier.transport.registry import Transport, auto_order, known_transports, transport as registered

log = logging.getLogger(__name__)


_shared: zmq.Context[Any] | None = None
_shared_lock = threading.Lock()


def shared_context() -> zmq.Context[Any]:
    """The zmq context every pool connection of this process uses (4 I/O threads, so parallel connections
    move bytes in parallel). Never terminated: a context collected with sockets still open would block."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = zmq.Context(io_threads=4)
        return _shared


def connect(endpoint: str, block_bytes: int, *, transport: str = "auto", timeout_s: float = 0.5,
            lanes: int = 4, auth: ClientKeys | None = None, copy_threads: int = 0,
            shared_memory: bool = True) -> PoolConnection:
    """A connection to the pool at ``endpoint`` for blocks of ``block_bytes``; ``auth`` for a pool that requires
    CurveZMQ keys (kvtier.auth.ClientKeys.load(auth_dir, endpoint)); ``copy_threads``: threads per host copy of
    the shm transport (0: by measured rate, kvtier.memory.hostcopy.CopyThreads; the other transports copy no host
    memory themselves). ``shared_memory`` False: never map a file the pool names (a daemon dialing a pool: the
    blocks come as bytes on a socket; "auto" picks tcp on an ipc:// endpoint, "shm" is refused). Raises
    PoolError (unreachable, refused, another protocol version) or ValueError (an unknown transport, or one that
    maps the pool's memory without shared memory)."""
    named = None if transport == "auto" else registered(transport)  # ValueError naming the known ones
    if named is not None and named.maps_memory and not shared_memory:
        raise ValueError(f"transport {transport!r} maps the pool's memory, and this connection may not "
                         "(shared_memory False)")
    channel = Channel(endpoint, shared_context(), max_lanes=2 * lanes, timeout_s=timeout_s, auth=auth)
    try:
        info = hello(channel, block_bytes)
        chosen = choose_transport(transport, endpoint, info, shared_memory)
        extra = {"copy_threads": copy_threads} if chosen.copy_threads else {}
        conn: PoolConnection = chosen.connection_class()(channel, info, lanes=lanes, **extra)
    except BaseException:
        channel.close()
        raise
    log.info("pool %s (%s): connected over %s%s; %d B blocks, capacity %d B", endpoint, info.node, chosen.name,
             " (CurveZMQ)" if auth is not None else "", info.block_bytes, info.capacity)
    return conn


def choose_transport(transport: str, endpoint: str, info: PoolInfo, shared_memory: bool = True) -> Transport:
    """The transport for ``endpoint`` (registry.py): ``auto``, the first of the table's order that the endpoint,
    the pool's offer (``info.transports``) and this host allow; a named one, or an error naming why it cannot be."""
    scheme = "ipc" if endpoint.startswith("ipc://") else "tcp"
    offered = info.transports
    if transport == "auto":
        for t in auto_order():
            if scheme in t.schemes and t.offer in offered and (shared_memory or not t.maps_memory) \
                    and t.cannot_here() is None:
                return t
        raise PoolRefused(endpoint, f"no transport fits: the pool offers {sorted(offered)}, this host knows "
                                    f"{known_transports()}", wire.ERR_BAD_REQUEST)
    chosen = registered(transport)
    reason = chosen.cannot_here()
    if reason is None and chosen.offer not in offered:
        reason = chosen.not_offered or f"the pool does not offer {chosen.offer!r}"
    if reason is not None:
        if chosen.host_reason is not None:  # a path this host or the pool lacks (rdma): the caller may fall back
            raise PoolError(endpoint, f"{chosen.name.upper()} is not possible: {reason}", f"no_{chosen.name}")
        raise PoolRefused(endpoint, reason, wire.ERR_BAD_REQUEST)
    return chosen


__all__ = ["choose_transport", "connect", "shared_context"]
