"""OneSidedConnection: the lease protocol of the transports where the client moves the bytes itself.

    put:  reserve (the pool picks slots, evicting if needed) -> write rows into them -> commit
    get:  acquire (the pool keeps the blocks from eviction) -> read them into rows -> release
          or, for blocks this connection put or read before: read them where they were -> check their slots'
          generations -> tell the pool (touch); no round trip before the copy (locations.py)

Shared memory (shm.py: the client copies into and out of the pool's mapped file) and RDMA (rdma.py: one-sided
RDMA WRITE and READ into the pool's registered memory) differ only in ``_write`` and ``_read``. A batch is cut
into requests of up to ``REQUEST_BYTES``, the next one in flight on the same connection, so the pool reserves or
looks up the next chunk while this process copies the current one; a put's first request is small
(``FIRST_REQUEST_BYTES``, the next ones RAMP times larger: ``request_spans``), since nothing is copied before
its reply. Commits ride on the next reserve (once the
reserves are out, on commits of their own in the batch) and releases on the next acquire (the last ones go after
the batch, once its connections are free: a reply handler never waits for a connection, so concurrent calls
cannot starve each other of them).

Leases (never wrong bytes): the pool holds what it handed out for ``lease_s`` from when it got the request,
then quarantines it for another ``lease_s`` before reusing the slots (pool/leases.py). This side times
the lease from when it *sent* the request, which is earlier, so:
  * no copy starts later than ``START_FRACTION`` of the lease after the request was sent; those blocks are
    misses (get) or not stored (put, committed as failed);
  * a get's bytes count only if the read finished inside the lease (the pool cannot have reused the slots)
    *and* each slot's generation, read again after the copy, is the one the acquire named (no writer was
    given the slot meanwhile: kvtier/wire/generations.py); otherwise its row is zeroed and the block is a miss;
  * a put is stored only where the pool confirms the commit inside its lease (``valid``).
Leases are bound to this connection's session (from its hello) and its client identity: nobody else can
release or commit them (pool/leases.py). What is left: a *writer* that stalls for over a lease and a
half mid-copy (a SIGSTOPped process) can still scribble over a slot the pool has since given to another key;
the next reader of that key sees an unchanged generation. Blocks carry no checksum on this path.

Each request covers at most REQUEST_BYTES and the pool's request_bytes (an eighth of a client's share), and a
batch keeps WINDOW (2) in flight on one lane, refilled before a reply's chunk is copied (kvtier.transport.channel):
what a call holds at once (those, the chunk being copied and the one copied before it, whose commit or release
rides on the request just sent: WINDOW + 2 requests' worth, half the share) stays inside one client's share of
the pool (pool/budget.py).
A call has one deadline (kvtier.transport.connection), shared by its batch and its final commit or release.

Every reply carries the pool's epoch; ``_write``/``_read`` get the epoch the offsets belong to, so a
transport can re-attach to a restarted pool (a new file to map, a new queue pair) before it moves bytes.
Thread-safe.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from kvtier import wire
from kvtier.transport.base import PoolError, PoolProtocolError
from kvtier.transport.channel import Answer, Request
from kvtier.transport.connection import ConnectionBase
from kvtier.transport.locations import Locations
from kvtier.wire import pool as P

log = logging.getLogger(__name__)

T = TypeVar("T")

# Blocks per reserve/acquire (at most the pool's request_bytes): the next request is served while this one is
# copied. Large, because each request is a round trip through the pool's dispatcher and workers while the copy
# itself runs at memory speed: 64 MiB measured about 15 % above 16 MiB on the shm bench here.
REQUEST_BYTES = 64 << 20
# A put's first request (at least one block), each next one RAMP times the one before, up to REQUEST_BYTES: a
# put's first reply came 1.5-13.9 ms after the call with a 64 MiB first reserve (the pool serving the first two
# at once) and sooner in 7 of 8 interleaved runs with a 4 MiB one; put GB/s rose in 6 of 8 (median ~1.2x, on a
# machine at load 4-20). A get's first reply came no sooner with a small first acquire (~1 ms either way) and its
# GB/s did not rise (4 of 8), so gets keep full-size requests (fewer round trips for a loaded host to delay).
FIRST_REQUEST_BYTES = 4 << 20
RAMP = 4
WINDOW = 2  # requests in flight on the batch's one lane: the pool answers the next one while this one copies
START_FRACTION = 0.5  # no copy starts later than this fraction of the pool's lease after its request was sent


class OneSidedConnection(ConnectionBase):
    """put/get by reserve/commit and acquire/release; subclasses move the bytes."""

    def __init__(self, channel: Any, info: Any, **kw: Any) -> None:
        super().__init__(channel, info, **kw)
        # Where this connection last saw its blocks: a get of them copies at once (kvtier/transport/locations.py)
        self.locations = Locations()

    def _write(self, offsets: np.ndarray, src: np.ndarray, epoch: int) -> None:
        """Copy rows at ``src`` into the pool's buffer at byte ``offsets`` (pool of ``epoch``)."""
        raise NotImplementedError

    def _read(self, dst: np.ndarray, offsets: np.ndarray, epoch: int) -> None:
        """Copy the pool's blocks at byte ``offsets`` (pool of ``epoch``) into rows at ``dst``."""
        raise NotImplementedError

    def _generations(self, offsets: np.ndarray, epoch: int) -> np.ndarray:
        """The generations of the slots at byte ``offsets`` now (read after the copy)."""
        raise NotImplementedError

    def _still_serving(self, epoch: int) -> bool:
        """Whether the memory of the pool of ``epoch`` is still a live pool's, as far as this side can tell
        without a request (a read where blocks were last seen asks first)."""
        return True

    def put(self, keys: Sequence[bytes], rows: np.ndarray) -> list[bool]:
        n, bb = len(keys), self.block_bytes
        self._check_fits(n)
        rows = np.asarray(rows, dtype=np.uint64)
        held = [False] * n
        copied: list[tuple[int, int, np.ndarray, bool]] = []  # not committed yet: (lease, chunk start, fresh, ok)
        placed: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}  # lease -> (epoch, offsets, generations)
        carried: list[tuple[Request, list[tuple[int, int, np.ndarray, bool]]]] = []  # requests carrying commits

        def unhold(a: int, fresh: np.ndarray) -> None:
            for i in fresh.tolist():
                held[a + i] = False

        def settle(done: list[tuple[int, int, np.ndarray, bool]], valid: list[bool]) -> None:
            for (lease, a, fresh, copied_ok), ok in zip(done, valid):
                if not ok:  # the lease expired before the commit: those slots were taken back
                    unhold(a, fresh)
                elif copied_ok and lease in placed:  # stored where the reserve said: a get may read it there
                    epoch, offsets, gens = placed.pop(lease)
                    self.locations.learn(epoch, [keys[a + i] for i in fresh.tolist()], offsets, gens)

        def commit_body(done: list[tuple[int, int, np.ndarray, bool]]) -> dict[str, Any]:
            return {"leases": [d[0] for d in done], "oks": [d[3] for d in done]}

        def reserves() -> Iterator[Request]:
            for a, b in spans:
                piggyback, copied[:] = list(copied), []  # chunks copied by now: committed by this request

                def on_reply(ans: Answer, a: int = a, b: int = b, piggyback: list = piggyback) -> None:
                    settle(piggyback, ans.body.get("valid", []))
                    held[a:b] = P.unbitmap(ans.body["held"], b - a)
                    fresh = np.flatnonzero(P.unbitmap(ans.body["fresh"], b - a))
                    lease = int(ans.body["lease"])
                    if not lease:
                        return
                    ok = False
                    try:  # copied while the pool reserves the next chunk
                        if self._may_start(ans, len(fresh), "put"):
                            offsets = P.unoffsets(ans.body["offsets"], len(fresh))
                            self._write(offsets, rows[a + fresh], ans.epoch)
                            ok = True
                            gens = _generations_field(ans.body, len(fresh))
                            if gens is not None:
                                placed[lease] = (ans.epoch, offsets, gens)
                    finally:
                        if not ok:
                            unhold(a, fresh)
                        copied.append((lease, a, fresh, ok))
                body = self._body(keys[a:b], **commit_body(piggyback)) if piggyback else self._body(keys[a:b])
                req = Request(P.RESERVE, body, (), on_reply)
                if piggyback:
                    carried.append((req, piggyback))
                yield req
            # The reserves are all out: what is copied from now on is committed by a request of its own in the
            # batch, so the pool commits those chunks while the last ones are copied, and the commit after the
            # batch (a round trip nothing overlaps) carries only what was copied last, or nothing.
            while copied:
                done, copied[:] = list(copied), []
                req = Request(P.COMMIT, {**commit_body(done), "block_bytes": bb, "session": self.session}, (),
                              lambda ans, done=done: settle(done, ans.body["valid"]))
                carried.append((req, done))
                yield req
        spans = self._spans(n, FIRST_REQUEST_BYTES)
        deadline = self._deadline(n * bb)
        try:
            self._batch(reserves(), len(spans), deadline, lanes=1, window=WINDOW)
        finally:
            copied.extend(_not_delivered(carried))
            if copied:  # the last chunks (and, after a failure, whatever was reserved) in one round trip
                last = list(copied)
                try:
                    body = {**commit_body(last), "block_bytes": bb, "session": self.session}
                    settle(last, self._call(P.COMMIT, body, deadline).body["valid"])
                except PoolError:  # not confirmed by the deadline: not stored (the pool's lease ends it)
                    settle(last, [False] * len(last))
                    raise
        return held

    def get(self, keys: Sequence[bytes], rows: np.ndarray) -> list[bool]:
        rows = np.asarray(rows, dtype=np.uint64)
        hit = [False] * len(keys)
        rest = self._read_located(keys, rows, hit)
        if rest is None:
            return hit
        if len(rest) == len(keys):
            return self._acquire_get(keys, rows)
        for i, h in zip(rest.tolist(), self._acquire_get([keys[i] for i in rest.tolist()], rows[rest])):
            hit[i] = h
        return hit

    def remove(self, keys: Sequence[bytes]) -> int:
        self.locations.forget(keys)
        return super().remove(keys)

    def _new_epoch(self, epoch: int) -> None:
        self.locations.forget_all(epoch)
        super()._new_epoch(epoch)

    def _read_located(self, keys: Sequence[bytes], rows: np.ndarray, hit: list[bool]) -> np.ndarray | None:
        """Copy the blocks of ``keys`` this connection knows the place of, with no request (locations.py); mark
        them in ``hit`` and tell the pool afterwards. The positions of the keys still to acquire (None: none)."""
        epoch, everything = self.info.epoch, np.arange(len(keys), dtype=np.int64)
        index, offsets, named = self.locations.find(epoch, keys)
        if not len(index):
            return everything
        if not self._still_serving(epoch):  # gone or replaced: the next reply says so; nothing read meanwhile
            self.locations.forget_all()
            return everything
        dst = rows[index]
        try:
            self._read(dst, offsets, epoch)
            same = self._generations(offsets, epoch) == named
        except PoolError as e:  # the pool moved on (restarted, its file gone): what we knew of it is void
            log.info("pool %s: reading blocks where they were last seen failed (%s); asking for them", self.endpoint,
                     e.message)
            self.locations.forget_all()
            return everything
        good = index[same]
        if not same.all():  # taken by another key, or gone: those rows hold nothing of theirs
            moved = np.flatnonzero(~same)
            for d in dst[moved].tolist():
                ctypes.memset(d, 0, self.block_bytes)
            self.locations.forget([keys[i] for i in index[moved].tolist()])
        for i in good.tolist():
            hit[i] = True
        if len(good):
            read = [keys[i] for i in good.tolist()]
            try:  # the pool counts them as hits, and its eviction policy as accesses
                self.channel.notify(P.TOUCH, self._body(read))
            except PoolError as e:
                log.info("pool %s: could not report %d blocks read where they were (%s)", self.endpoint, len(read),
                         e.message)
        if len(good) == len(keys):
            return None
        keep = np.ones(len(keys), dtype=bool)
        keep[good] = False
        return np.flatnonzero(keep)

    def _acquire_get(self, keys: Sequence[bytes], rows: np.ndarray) -> list[bool]:
        """get by acquire: the pool names where the blocks are and keeps them there until they are copied."""
        n, bb = len(keys), self.block_bytes
        hit = [False] * n
        releases: list[int] = []  # leases done with (copied, skipped or failed), not released yet
        carried: list[tuple[Request, list[int]]] = []  # requests carrying releases

        def acquires() -> Iterator[Request]:
            for a, b in spans:
                def on_reply(ans: Answer, a: int = a, b: int = b) -> None:
                    lease = int(ans.body["lease"])
                    if not lease:
                        return  # all misses
                    releases.append(lease)  # given back whatever happens below
                    offsets = P.unoffsets(ans.body["offsets"], b - a)
                    index = np.flatnonzero(offsets >= 0)
                    if not self._may_start(ans, len(index), "get"):
                        return
                    dst = rows[a + index]
                    self._read(dst, offsets[index], ans.epoch)  # copied while the pool looks up the next chunk
                    if time.monotonic() >= ans.sent + self.info.lease_s:  # the pool may have let go mid-copy
                        log.warning("pool %s: a get's copy ended after the pool's %.3g s lease; %d blocks count "
                                    "as misses", self.endpoint, self.info.lease_s, len(index))
                        for d in dst.tolist():
                            ctypes.memset(d, 0, bb)
                        return
                    named = np.frombuffer(ans.body["generations"], "<u8")[index] if "generations" in ans.body \
                        else None
                    if named is None or len(named) != len(index):
                        raise PoolProtocolError(self.endpoint, "acquire: no slot generations in the reply",
                                                wire.ERR_BAD_MESSAGE)
                    same = self._generations(offsets[index], ans.epoch) == named
                    if not same.all():
                        changed = np.flatnonzero(~same)
                        log.warning("pool %s: %d blocks of a get were given to other keys while they were copied "
                                    "(their slots' generations changed); they count as misses", self.endpoint,
                                    len(changed))
                        for d in dst[changed].tolist():
                            ctypes.memset(d, 0, bb)
                    good = index[same]
                    for i in good.tolist():
                        hit[a + i] = True
                    self.locations.learn(ans.epoch, [keys[a + i] for i in good.tolist()], offsets[good], named[same])
                body = self._body(keys[a:b])
                req = Request(P.ACQUIRE, body, (), on_reply)
                if releases:  # chunks copied by now: released by this request
                    body["releases"], releases[:] = list(releases), []
                    carried.append((req, body["releases"]))
                yield req
        spans = self._spans(n, REQUEST_BYTES)
        deadline = self._deadline(n * bb)
        try:
            self._batch(acquires(), len(spans), deadline, lanes=1, window=WINDOW)
        finally:
            releases.extend(_not_delivered(carried))
            if releases:  # the batch's connections are free again: no reply to wait for (the lease ends anyway)
                try:
                    self.channel.notify(P.RELEASE, {"leases": list(releases), "session": self.session},
                                        timeout_s=max(0.001, deadline - time.monotonic()))
                except PoolError as e:  # the copies are done: a release that cannot go only ends with its lease
                    log.info("pool %s: %d leases not released (%s); they end with the pool's lease",
                             self.endpoint, len(releases), e.message)
        return hit

    def _may_start(self, ans: Answer, blocks: int, what: str) -> bool:
        """Whether a copy may start now: within START_FRACTION of the lease since the request was sent."""
        late = time.monotonic() - ans.sent
        if late < self.info.lease_s * START_FRACTION:
            return True
        log.warning("pool %s: a %s's reply came %.3g s after its request, past half the pool's %.3g s lease; "
                    "%d blocks not copied (%s)", self.endpoint, what, late, self.info.lease_s, blocks,
                    "misses" if what == "get" else "not stored")
        return False

    def _spans(self, n: int, first_bytes: int) -> list[tuple[int, int]]:
        """The batch's requests: the first of ``first_bytes`` (at least one block), growing to the largest."""
        most = self._per_request(REQUEST_BYTES)
        return request_spans(n, max(1, min(most, first_bytes // self.block_bytes)), most)


def request_spans(n: int, first: int, most: int) -> list[tuple[int, int]]:
    """A batch of ``n`` blocks as requests, (start, end) ranges in order: ``first`` blocks, then each RAMP times
    the one before, up to ``most``. Copying starts only once the first reply is in, so the first request is
    small: the pool answers it in about a bare round trip, where a full-size first request (and the full-size
    second one the pool serves beside it) kept every copy waiting for two large requests' work. The larger
    requests are answered while the earlier chunks are copied."""
    spans, a, per = [], 0, max(1, min(first, most))
    while a < n:
        spans.append((a, min(n, a + per)))
        a += per
        per = min(most, per * RAMP)
    return spans


def _generations_field(body: dict[str, Any], n: int) -> np.ndarray | None:
    """A reply's slot generations (``n`` little-endian uint64); None from a pool that sends none (older ones do
    not for a reserve: its blocks are then not remembered, and a get of them asks for them)."""
    raw = body.get("generations")
    if not isinstance(raw, bytes) or len(raw) != 8 * n:
        return None
    return np.frombuffer(raw, "<u8").astype(np.uint64)


def _not_delivered(carried: Sequence[tuple[Request, Sequence[T]]]) -> list[T]:
    """What requests carried for the pool (piggybacked commits or releases) where the pool may not have seen
    it: the request got no reply or an error (sending it again is harmless: a lease acts once)."""
    return [x for req, items in carried if not req.done or req.error is not None for x in items]
