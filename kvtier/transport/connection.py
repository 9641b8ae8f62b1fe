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
import time
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from kvtier import wire
from kvtier.auth import ClientKeys
from kvtier.pool import protocol as P
from kvtier.transport.base import PoolConnection, PoolError, PoolInfo, PoolRefused, PoolUnavailable
from kvtier.transport.channel import Answer, Channel, Request

log = logging.getLogger(__name__)

TRANSPORTS = {"tcp": "kvtier.transport.tcp:TcpConnection", "stream": "kvtier.transport.stream:StreamConnection",
              "shm": "kvtier.transport.shm:ShmConnection", "rdma": "kvtier.transport.rdma:RdmaConnection"}
MIN_BANDWIDTH = 100e6  # bytes/s: a batch moving slower than this is given up (timeout + bytes / this)
# A request covers at most the pool's request_bytes (its hello; 1/REQUEST_SHARE of the pool from a pool that
# does not say): what a batch holds there at once (its lanes' requests in flight) stays inside one client's
# share of the pool's held budget (kvtier/pool/budget.py).
REQUEST_SHARE = 32


class ConnectionBase:
    """A connection to one pool over a Channel. Subclasses move the block bytes (put/get). Thread-safe.

    Deadlines: a call's deadline is fixed when it starts (``_deadline``: the channel's timeout plus its bytes at
    MIN_BANDWIDTH), and every step of it (a hello after a restart, the batch, a final commit or release, a data
    socket's reads and writes) gets only what is left of it."""

    transport = "?"

    def __init__(self, channel: Channel, info: PoolInfo, *, lanes: int = 4) -> None:
        self.channel = channel
        self.info = info
        self.endpoint = channel.endpoint
        self.block_bytes = info.block_bytes
        self.session = info.session  # what the pool binds this connection's leases to
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
        self._batch(requests(), self._count(len(keys), self.info.max_keys), self._deadline(0))
        return held

    def remove(self, keys: Sequence[bytes]) -> int:
        removed = [0]

        def requests() -> Iterator[Request]:
            for a, b in self._chunks(len(keys), self.info.max_keys):
                yield Request(P.REMOVE, self._body(keys[a:b]),
                              on_reply=lambda ans: removed.__setitem__(0, removed[0] + int(ans.body["removed"])))
        self._batch(requests(), self._count(len(keys), self.info.max_keys), self._deadline(0))
        return removed[0]

    def stats(self) -> dict[str, Any]:
        return self._call(P.STATS, {}).body

    def close(self) -> None:
        self.channel.close()

    # ---- helpers for the transports --------------------------------------------------------------------

    def _body(self, keys: Sequence[bytes], **extra: Any) -> dict[str, Any]:
        # block_bytes rides along so the pool refuses a request for blocks of another size (and an unsized
        # pool's first put sizes it); the session says whose leases a lease op acts on.
        return {"keys": wire.pack_keys(keys), "block_bytes": self.block_bytes, "session": self.session, **extra}

    def _deadline(self, nbytes: int) -> float:
        """The deadline of a call moving ``nbytes``, from now."""
        return time.monotonic() + self.channel.timeout_s + nbytes / MIN_BANDWIDTH

    def _time_left(self, deadline: float | None) -> float:
        """What a step may wait: the rest of the call's deadline (the channel's timeout without one);
        PoolUnavailable once it has passed."""
        if deadline is None:
            return self.channel.timeout_s
        left = deadline - time.monotonic()
        if left <= 0:
            raise PoolUnavailable(self.endpoint, "the call's deadline passed", "timeout")
        return left

    @staticmethod
    def _chunks(n: int, per: int) -> Iterator[tuple[int, int]]:
        per = max(1, per)
        for a in range(0, n, per):
            yield a, min(n, a + per)

    def _per_request(self, request_bytes: int) -> int:
        """Keys per request: at most ``request_bytes``, the pool's max_keys and the largest request it wants
        (but the few blocks a pool lets any client hold, however small it is)."""
        wanted = self.info.request_bytes or self.info.capacity // REQUEST_SHARE
        most = min(request_bytes, max(wanted, P.MIN_REQUEST_BLOCKS * self.block_bytes))
        return max(1, min(self.info.max_keys, most // self.block_bytes))

    @staticmethod
    def _count(n: int, per: int) -> int:
        return -(-n // max(1, per))

    def _check_fits(self, n: int) -> None:
        why = P.too_large(n, self.block_bytes, self.info.capacity)
        if why:
            raise PoolRefused(self.endpoint, why, wire.ERR_TOO_LARGE)

    def _call(self, op: str, body: dict[str, Any], deadline: float | None = None) -> Answer:
        self._greet_if_needed(deadline)
        try:
            return self.channel.call(op, body, timeout_s=self._time_left(deadline))
        except PoolRefused as e:
            self._not_ready(e)
            raise
        finally:
            self._saw_epoch()

    def _batch(self, requests: Iterator[Request], count: int, deadline: float, lanes: int | None = None,
               window: int = 2) -> None:
        """Run ``count`` requests over up to ``lanes`` lanes, ``window`` in flight on each, by ``deadline``; raise
        the first error any met."""
        self._greet_if_needed(deadline)
        done: list[Request] = []

        def track() -> Iterator[Request]:
            for r in requests:
                done.append(r)
                yield r
        left = self._time_left(deadline)
        try:
            self.channel.batch(track(), max(1, min(lanes or self.lanes, count)),
                               timeout_s=min(self.channel.timeout_s, left), total_s=left, window=window)
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
        """The pool restarted (a new epoch): everything it held is gone, and this connection's session with
        it. Subclasses re-map what they mapped."""
        log.warning("pool %s restarted (epoch %x -> %x): the blocks it held are gone", self.endpoint,
                    self.info.epoch, epoch)
        self.info.epoch = epoch
        self._greet = True
        try:
            self._greet_if_needed(None)
        except PoolError:
            pass  # the next call tries again

    def _not_ready(self, error: BaseException) -> None:
        """A pool that answers not_ready has no block size yet (restarted without --block-bytes, and our hello
        after its restart was lost): greet it before the next call."""
        if isinstance(error, PoolRefused) and error.code == P.ERR_NOT_READY:
            self._greet = True

    def _greet_if_needed(self, deadline: float | None) -> None:
        """Say hello to a restarted pool (a new session; for some transports a new file or port). Best effort:
        until one gets through, every call tries again first."""
        if not self._greet:
            return
        try:
            self._hello_again(deadline)
            self._greet = False
        except PoolError as e:
            log.info("pool %s: hello after its restart failed (%s); retrying at the next call", self.endpoint,
                     e.message)

    def _hello_again(self, deadline: float | None) -> None:
        self._adopt(hello(self.channel, self.block_bytes, self._time_left(deadline), self.session))

    def _adopt(self, info: PoolInfo) -> None:
        """A hello's answer: this connection's session (and what the pool offers) from now on."""
        self.info = info
        self.session = info.session


def hello(channel: Channel, block_bytes: int, timeout_s: float | None = None, session: bytes = b"") -> PoolInfo:
    """Say hello: what the pool offers and this client's session (``session`` again if the pool still knows it,
    so the leases taken under it stay this client's; else a new one); PoolRefused if the sizes differ (or the
    client's blocks are too small for any pool). Never sizes the pool (its first put does)."""
    body: dict[str, Any] = {"block_bytes": block_bytes}
    if session:
        body["session"] = session
    answer = channel.call(P.HELLO, body, timeout_s=timeout_s)
    return PoolInfo.from_wire(channel.endpoint, {**answer.body, "epoch": answer.epoch}, block_bytes)


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
            lanes: int = 4, auth: ClientKeys | None = None, copy_threads: int = 0) -> PoolConnection:
    """A connection to the pool at ``endpoint`` for blocks of ``block_bytes``; ``auth`` for a pool that requires
    CurveZMQ keys (kvtier.auth.ClientKeys.load(auth_dir, endpoint)); ``copy_threads``: threads per host copy of
    the shm transport (0: by batch size, kvtier.hostcopy.copy_threads; the other transports copy no host
    memory themselves). Raises PoolError (unreachable, refused, another protocol version) or ValueError (an
    unknown transport)."""
    if transport != "auto" and transport not in TRANSPORTS:
        raise ValueError(f"unknown pool transport {transport!r}; known: auto, {', '.join(TRANSPORTS)}")
    channel = Channel(endpoint, shared_context(), max_lanes=2 * lanes, timeout_s=timeout_s, auth=auth)
    try:
        info = hello(channel, block_bytes)
        kind = choose_transport(transport, endpoint, info)
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
