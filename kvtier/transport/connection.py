"""ConnectionBase: what every transport's connection shares (hello, contains, remove, stats, deadlines,
epochs), and ``hello()``. The transports (tcp.py, stream.py, onesided.py -> shm.py, rdma.py) build on it;
building one for an endpoint is dial.py's (``kvtier.transport.connect``), so this base imports no transport.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

from kvtier import wire
from kvtier.auth.peercred import ipc_cred
from kvtier.transport.base import PoolError, PoolInfo, PoolRefused, PoolUnavailable
from kvtier.transport.channel import Answer, Channel, Request
from kvtier.wire import pool as P

log = logging.getLogger(__name__)

MIN_BANDWIDTH = 100e6  # bytes/s: a batch moving slower than this is given up (timeout + bytes / this)
# A request covers at most the pool's request_bytes (its hello; 1/REQUEST_SHARE of the pool from a pool that
# does not say): what a batch holds there at once (its lanes' requests in flight) stays inside one client's
# share of the pool's held budget (pool/budget.py).
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

    def observe(self, body: dict[str, Any]) -> None:
        self._call(P.OBSERVE, body)

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
    cred = ipc_cred(answer.peer)
    return PoolInfo.from_wire(channel.endpoint, {**answer.body, "epoch": answer.epoch}, block_bytes,
                              cred.uid if cred is not None else None, cred.pid if cred is not None else None)


__all__ = ["ConnectionBase", "hello"]
