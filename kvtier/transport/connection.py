"""ConnectionBase (what every transport's connection shares: hello, contains, remove, stats, epochs) and
``connect()``, which says hello to a pool and picks the data path.

Transport choice (``transport="auto"``): an ipc:// endpoint means the pool runs on this host: shared memory
(shm.py). A tcp:// endpoint: RDMA (rdma.py) when pyverbs imports, this host has an RDMA device and the pool
offers RDMA; else raw TCP data sockets received straight into place (stream.py) when the pool has a data
port; else block bytes in zmq frames (tcp.py). ``transport`` names one to insist on it; a path the pool
or this host cannot do is an error naming why.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from kvtier import wire
from kvtier.auth import ClientKeys
from kvtier.pool import protocol as P
from kvtier.transport.base import PoolConnection, PoolError, PoolInfo, PoolRefused
from kvtier.transport.channel import Answer, Channel, Request

log = logging.getLogger(__name__)

TRANSPORTS = {"tcp": "kvtier.transport.tcp:TcpConnection", "stream": "kvtier.transport.stream:StreamConnection",
              "shm": "kvtier.transport.shm:ShmConnection", "rdma": "kvtier.transport.rdma:RdmaConnection"}
MIN_BANDWIDTH = 100e6  # bytes/s: a batch moving slower than this is given up (timeout + bytes / this)


class ConnectionBase:
    """A connection to one pool over a Channel. Subclasses move the block bytes (put/get). Thread-safe."""

    transport = "?"

    def __init__(self, channel: Channel, info: PoolInfo, *, lanes: int = 4) -> None:
        self.channel = channel
        self.info = info
        self.endpoint = channel.endpoint
        self.block_bytes = info.block_bytes
        self.lanes = lanes
        self._greet = False  # the pool restarted or said not_ready, and no hello has got through since

    # ---- control ops -----------------------------------------------------------------------------------

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        held = [False] * len(keys)

        def requests() -> Iterator[Request]:
            for a, b in self._chunks(len(keys), self.info.max_keys):
                yield Request(P.CONTAINS, self._body(keys[a:b]),
                              on_reply=lambda ans, a=a, b=b: held.__setitem__(slice(a, b),
                                                                              P.unbitmap(ans.body["held"], b - a)))
        self._batch(requests(), self._count(len(keys), self.info.max_keys), 0)
        return held

    def remove(self, keys: Sequence[bytes]) -> int:
        removed = [0]

        def requests() -> Iterator[Request]:
            for a, b in self._chunks(len(keys), self.info.max_keys):
                yield Request(P.REMOVE, self._body(keys[a:b]),
                              on_reply=lambda ans: removed.__setitem__(0, removed[0] + int(ans.body["removed"])))
        self._batch(requests(), self._count(len(keys), self.info.max_keys), 0)
        return removed[0]

    def stats(self) -> dict[str, Any]:
        return self._call(P.STATS, {}).body

    def close(self) -> None:
        self.channel.close()

    # ---- helpers for the transports --------------------------------------------------------------------

    def _body(self, keys: Sequence[bytes], **extra: Any) -> dict[str, Any]:
        # block_bytes rides along so the pool refuses a request for blocks of another size (it never sizes by it).
        return {"keys": wire.pack_keys(keys), "block_bytes": self.block_bytes, **extra}

    @staticmethod
    def _chunks(n: int, per: int) -> Iterator[tuple[int, int]]:
        per = max(1, per)
        for a in range(0, n, per):
            yield a, min(n, a + per)

    @staticmethod
    def _count(n: int, per: int) -> int:
        return -(-n // max(1, per))

    def _check_fits(self, n: int) -> None:
        why = P.too_large(n, self.block_bytes, self.info.capacity)
        if why:
            raise PoolRefused(self.endpoint, why, wire.ERR_TOO_LARGE)

    def _call(self, op: str, body: dict[str, Any]) -> Answer:
        self._greet_if_needed()
        try:
            return self.channel.call(op, body)
        except PoolRefused as e:
            self._not_ready(e)
            raise
        finally:
            self._saw_epoch()

    def _batch(self, requests: Iterator[Request], count: int, nbytes: int) -> None:
        """Run ``count`` requests over up to ``lanes`` lanes; raise the first error any of them met."""
        self._greet_if_needed()
        done: list[Request] = []

        def track() -> Iterator[Request]:
            for r in requests:
                done.append(r)
                yield r
        try:
            self.channel.batch(track(), max(1, min(self.lanes, count)),
                               total_s=self.channel.timeout_s + nbytes / MIN_BANDWIDTH)
        finally:
            self._saw_epoch()
        for r in done:
            if r.error is not None:
                self._not_ready(r.error)
                raise r.error

    def _saw_epoch(self) -> None:
        epoch = self.channel.epoch
        if epoch is not None and epoch != self.info.epoch:
            self._new_epoch(epoch)

    def _new_epoch(self, epoch: int) -> None:
        """The pool restarted (a new epoch): everything it held is gone. Subclasses re-map what they mapped."""
        log.warning("pool %s restarted (epoch %x -> %x): the blocks it held are gone", self.endpoint,
                    self.info.epoch, epoch)
        self.info.epoch = epoch
        self._greet = True
        self._greet_if_needed()

    def _not_ready(self, error: BaseException) -> None:
        """A pool that answers not_ready has no block size yet (restarted without --block-bytes, and our hello
        after its restart was lost): greet it before the next call."""
        if isinstance(error, PoolRefused) and error.code == P.ERR_NOT_READY:
            self._greet = True

    def _greet_if_needed(self) -> None:
        """Say hello to a restarted pool (which only a hello sizes when it runs without --block-bytes). Best
        effort: until one gets through, every call tries again first (and the pool answers not_ready)."""
        if not self._greet:
            return
        try:
            self._hello_again()
            self._greet = False
        except PoolError as e:
            log.info("pool %s: hello after its restart failed (%s); retrying at the next call", self.endpoint,
                     e.message)

    def _hello_again(self) -> None:
        hello(self.channel, self.block_bytes)


def hello(channel: Channel, block_bytes: int) -> PoolInfo:
    """Say hello (sizing a pool that does not know its block size yet); PoolRefused if the sizes differ."""
    answer = channel.call(P.HELLO, {"block_bytes": block_bytes})
    return PoolInfo.from_wire(channel.endpoint, {**answer.body, "epoch": answer.epoch})


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
            lanes: int = 4, auth: ClientKeys | None = None) -> PoolConnection:
    """A connection to the pool at ``endpoint`` for blocks of ``block_bytes``; ``auth`` for a pool that requires
    CurveZMQ keys (kvtier.auth.ClientKeys.load(auth_dir, endpoint)). Raises PoolError (unreachable, refused,
    another protocol version) or ValueError (an unknown transport)."""
    if transport != "auto" and transport not in TRANSPORTS:
        raise ValueError(f"unknown pool transport {transport!r}; known: auto, {', '.join(TRANSPORTS)}")
    channel = Channel(endpoint, shared_context(), max_lanes=2 * lanes, timeout_s=timeout_s, auth=auth)
    try:
        info = hello(channel, block_bytes)
        kind = choose_transport(transport, endpoint, info)
        module, _, name = TRANSPORTS[kind].partition(":")
        cls = getattr(importlib.import_module(module), name)
        conn: PoolConnection = cls(channel, info, lanes=lanes)
    except BaseException:
        channel.close()
        raise
    log.info("pool %s (%s): connected over %s%s; %d B blocks, capacity %d B", endpoint, info.node, kind,
             " (CurveZMQ)" if auth is not None else "", info.block_bytes, info.capacity)
    return conn


def choose_transport(transport: str, endpoint: str, info: PoolInfo) -> str:
    offered = info.transports
    if transport == "auto":
        if endpoint.startswith("ipc://"):
            transport = "shm"
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
    from kvtier.transport import rdma

    return rdma.unavailable_reason()


__all__ = ["ConnectionBase", "connect", "hello"]
