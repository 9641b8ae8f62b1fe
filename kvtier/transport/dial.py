"""``connect()``: says hello to a pool and builds the connection of the data path it picks (the transport
construction, kept apart from ConnectionBase in connection.py so that the base imports none of the transports
built on it: connection <- onesided <- rdma was an import circle while connect() lived there).

Transport choice (``transport="auto"``): an ipc:// endpoint means the pool runs on this host: shared memory
(shm.py). A tcp:// endpoint: RDMA (rdma.py) when pyverbs imports, this host has an RDMA device and the pool
offers RDMA; else raw TCP data sockets received straight into place (stream.py) when the pool has a data
port; else block bytes in zmq frames (tcp.py). ``transport`` names one to insist on it; a path the pool
or this host cannot do is an error naming why. The transports are imported when first chosen (rdma pulls in
nothing of pyverbs until then either).
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Any

import zmq

from kvtier import wire
from kvtier.auth import ClientKeys
from kvtier.transport.base import PoolConnection, PoolError, PoolInfo, PoolRefused
from kvtier.transport.channel import Channel
from kvtier.transport.connection import hello
from kvtier.wire.verbs import unavailable_reason

log = logging.getLogger(__name__)

TRANSPORTS = {"tcp": "kvtier.transport.tcp:TcpConnection", "stream": "kvtier.transport.stream:StreamConnection",
              "shm": "kvtier.transport.shm:ShmConnection", "rdma": "kvtier.transport.rdma:RdmaConnection"}


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
    the shm transport (0: by measured rate, kvtier.hostcopy.CopyThreads; the other transports copy no host
    memory themselves). ``shared_memory`` False: never map a file the pool names (a daemon dialing a pool: the
    blocks come as bytes on a socket; "auto" picks tcp on an ipc:// endpoint, "shm" is refused). Raises
    PoolError (unreachable, refused, another protocol version) or ValueError (an unknown transport, or "shm"
    without shared memory)."""
    if transport != "auto" and transport not in TRANSPORTS:
        raise ValueError(f"unknown pool transport {transport!r}; known: auto, {', '.join(TRANSPORTS)}")
    if transport == "shm" and not shared_memory:
        raise ValueError("transport 'shm' maps the pool's memory, and this connection may not (shared_memory "
                         "False)")
    channel = Channel(endpoint, shared_context(), max_lanes=2 * lanes, timeout_s=timeout_s, auth=auth)
    try:
        info = hello(channel, block_bytes)
        kind = choose_transport(transport, endpoint, info, shared_memory)
        module, _, name = TRANSPORTS[kind].partition(":")
        cls = getattr(importlib.import_module(module), name)
        extra = {"copy_threads": copy_threads} if kind == "shm" else {}
        conn: PoolConnection = cls(channel, info, lanes=lanes, **extra)
    except BaseException:
        channel.close()
        raise
    log.info("pool %s (%s): connected over %s%s; %d B blocks, capacity %d B", endpoint, info.node, kind,
             " (CurveZMQ)" if auth is not None else "", info.block_bytes, info.capacity)
    return conn


def choose_transport(transport: str, endpoint: str, info: PoolInfo, shared_memory: bool = True) -> str:
    offered = info.transports
    if transport == "auto":
        if endpoint.startswith("ipc://"):
            transport = "shm" if shared_memory else "tcp"  # tcp: block bytes in zmq frames, over the ipc socket
        elif "rdma" in offered and _rdma_reason() is None:
            transport = "rdma"
        elif "stream" in offered:
            transport = "stream"
        else:
            transport = "tcp"
    if transport == "shm" and "shm" not in offered:
        raise PoolRefused(endpoint, "the pool offers no shared memory (it does so on an ipc:// endpoint it binds)",
                          wire.ERR_BAD_REQUEST)
    if transport == "stream" and "stream" not in offered:
        raise PoolRefused(endpoint, "the pool offers no stream data port (started with --stream off?)",
                          wire.ERR_BAD_REQUEST)
    if transport == "rdma":
        reason = _rdma_reason() or (None if "rdma" in offered else "the pool serves no RDMA")
        if reason:
            raise PoolError(endpoint, f"RDMA is not possible: {reason}", "no_rdma")
    return transport


def _rdma_reason() -> str | None:
    return unavailable_reason()


__all__ = ["TRANSPORTS", "choose_transport", "connect", "shared_context"]
