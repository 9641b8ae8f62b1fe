"""Channel: request/reply with one kvtier-pool over zmq DEALER sockets ("lanes"), with timeouts that never hang.

    ch = Channel("tcp://node-3:7400", ctx, max_lanes=4, timeout_s=0.5)
    answer = ch.call(protocol.CONTAINS, {"keys": blob})               # one request on one lane
    ch.batch(requests, lanes=4)                                         # many, spread over parallel lanes

Each lane is its own socket, so its own TCP connection: a big batch goes out over several connections at once,
``window`` requests in flight per lane, so the pool works on one chunk while the next is on the wire. Request
data frames are sent zero-copy (``copy=False``) straight from the caller's memory; the channel waits for zmq
to let go of them before it returns, so the caller may reuse its buffers as soon as a call returns, even
after a timeout. Reply frames are zmq's own buffers, handed to the request's ``on_reply`` to copy from.

Timeouts: a batch fails when no reply has come for ``timeout_s`` (a slow but moving transfer goes on, up to
``total_s``). A lane that timed out is closed and replaced (what it had queued for a dead pool is dropped,
never delivered to a restarted one). Sockets use IMMEDIATE, so nothing queues for a pool that is not
connected: a send waits for a connection at most until the deadline.

With ``auth`` (kvtier.auth.ClientKeys) every lane is a CurveZMQ client: authenticated and encrypted; without, a
lane presents the owner token of a keyless pool of this user (kvtier/auth/owner.py). A pool that refuses the
keys or the token (or wants keys the channel lacks) never answers; a timeout before any reply says so.

Thread-safe: lanes are checked out per call, so calls from several threads run at once (up to ``max_lanes``
lanes in all; a call waits for a free lane until its deadline).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from kvtier import wire
from kvtier.auth import ClientKeys, secure_client, silence_hint
from kvtier.auth.client import not_owner
from kvtier.auth.peercred import peer_address
from kvtier.ratelog import RateLimitedLog
from kvtier.transport.base import PoolError, PoolProtocolError, PoolRefused, PoolUnavailable

log = logging.getLogger(__name__)

TRACKER_WAIT_S = 5.0  # after closing a lane, zmq releases the frames it held within milliseconds


@dataclass
class Answer:
    """A reply: its body and data frames, the pool's epoch, and when (time.monotonic()) its request was last
    handed to zmq, i.e. no later than the pool began serving it (a lease it grants runs from after this).
    ``head``: the reply's first frame, kept for ``peer``."""

    body: dict[str, Any]
    data: list[Any]
    epoch: int
    sent: float = 0.0
    head: Any = None

    @property
    def peer(self) -> str:
        """zmq's Peer-Address of the connection the reply came on (over ipc:// the pool process's kernel-reported
        uid, gid and pid: kvtier/auth/peercred.py). Read when asked (only the hello does), not for every reply."""
        return peer_address(self.head) if self.head is not None else ""


@dataclass
class Request:
    """One request of a batch. ``on_reply(answer)`` runs on the calling thread when its reply comes; an error
    reply, or an exception from ``on_reply``, lands in ``error`` and the batch goes on."""

    op: str
    body: dict[str, Any]
    data: Sequence[Any] = ()
    on_reply: Callable[[Answer], None] | None = None
    error: PoolError | None = None
    done: bool = False
    sent: float = 0.0


class _Lane:
    __slots__ = ("sock",)

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock = sock


class Channel:
    """Lanes to one pool endpoint. ``ctx`` is owned by the caller (shared by its channels)."""

    def __init__(self, endpoint: str, ctx: zmq.Context[Any], *, max_lanes: int = 4, timeout_s: float = 0.5,
                 auth: ClientKeys | None = None) -> None:
        if max_lanes < 1:
            raise ValueError(f"max_lanes must be >= 1, got {max_lanes}")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.max_lanes = max_lanes
        self.auth = auth
        self.epoch: int | None = None  # of the last reply (None: the pool has never answered)
        self._ctx = ctx
        self._ids = itertools.count(1)
        self._free: list[_Lane] = []
        self._count = 0
        self._cv = threading.Condition()
        self._closed = False
        # An owner token is published for the endpoint: only this user's own daemon may answer. Over ipc each
        # reply's kernel credentials say who did; the last peer proven ours is kept, so a reply from the same
        # connection costs one string compare.
        self._owner_only = False
        self._peer_ok = ""
        self._bad = RateLimitedLog(log)

    # ---- calls -----------------------------------------------------------------------------------------

    def call(self, op: str, body: dict[str, Any], data: Sequence[Any] = (), timeout_s: float | None = None) -> Answer:
        """One request; its Answer, or PoolRefused / PoolProtocolError / PoolUnavailable."""
        out: list[Answer] = []
        req = Request(op, body, data, out.append)
        self.batch([req], 1, timeout_s)
        if req.error is not None:
            raise req.error
        return out[0]

    def notify(self, op: str, body: dict[str, Any], timeout_s: float | None = None) -> None:
        """Send a request the pool does not answer (``noreply``), waiting at most ``timeout_s`` (default: the
        channel's) for a connection (a lane opened just now connects asynchronously); not sent then, a release's
        or commit's lease expires instead, and a touch's reads go uncounted."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        lane = self._take(1, deadline)[0]
        frame = wire.encode_request(next(self._ids), op, {**body, "noreply": True})
        try:
            while True:
                try:
                    lane.sock.send(frame, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    left = deadline - time.monotonic()
                    if left <= 0 or not lane.sock.poll(max(1, int(left * 1000)), zmq.POLLOUT):
                        log.info("pool %s: %s not sent within %.3g s (a release or commit: the pool's lease "
                                 "ends it instead; a touch: those reads go uncounted)", self.endpoint, op,
                                 self.timeout_s)
                        return
        finally:
            self._give([lane])

    def batch(self, requests: Iterable[Request], lanes: int = 1, timeout_s: float | None = None,
              total_s: float | None = None, window: int = 2) -> None:
        """Send ``requests`` over up to ``lanes`` lanes, ``window`` in flight per lane, and handle every reply.

        Raises PoolUnavailable when no reply comes for ``timeout_s`` (or the whole batch passes ``total_s``);
        the requests answered before that have run their ``on_reply`` (``done`` says which).
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        taken = self._take(lanes, time.monotonic() + timeout)
        run = _Run(self, taken, iter(requests), timeout, total_s, window)
        try:
            run.go()
        except _Timeout as e:
            self._finish(taken, run.busy(), run.trackers)
            hint = silence_hint(self.endpoint, self.auth) if self.epoch is None else ""
            raise PoolUnavailable(self.endpoint, f"{e}{hint} ({len(run.inflight)} requests unanswered)",
                                  "timeout") from None
        except _Unreadable as e:
            self._finish(taken, taken, run.trackers)
            raise PoolProtocolError(self.endpoint, str(e), wire.ERR_BAD_MESSAGE) from None
        except BaseException:
            self._finish(taken, taken, run.trackers)
            raise
        self._finish(taken, [], run.trackers)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for lane in self._free:
                lane.sock.close(linger=0)
            self._free.clear()

    # ---- internals -------------------------------------------------------------------------------------

    def _handle(self, req: Request, ok: bool, body: dict[str, Any], data: list[Any], head: Any) -> None:
        # Only a channel that presented an owner token pays for the peer's credentials, on every reply.
        peer = peer_address(head) if self._owner_only else ""
        if self._owner_only and peer != self._peer_ok:
            uid = not_owner(peer)
            if uid is not None:  # nothing of this reply is used: not its epoch, not its bytes
                why = (f"{req.op}: refused a reply from uid {uid} (the kernel's credentials of the ipc peer): this "
                       f"user's own pool should be there (an owner token is published for it); a process of "
                       f"another user is squatting the socket path")
                self._bad("not_owner", logging.WARNING, "pool %s: %s", self.endpoint, why)
                req.error = PoolUnavailable(self.endpoint, why, "not_owner")
                return
            self._peer_ok = peer
        epoch = body.get("epoch")
        if isinstance(epoch, int):
            self.epoch = epoch
        if not ok:
            code, message = str(body.get("code", wire.ERR_INTERNAL)), str(body.get("message", ""))
            cls = PoolProtocolError if code == wire.ERR_BAD_VERSION else PoolRefused
            req.error = cls(self.endpoint, f"{req.op}: {message}", code)
            return
        if req.on_reply is not None:
            try:
                req.on_reply(Answer(body, data, epoch if isinstance(epoch, int) else -1, req.sent, head))
            except PoolError as e:
                req.error = e
            except (wire.WireError, KeyError, TypeError, ValueError) as e:
                req.error = PoolProtocolError(self.endpoint, f"{req.op}: malformed reply ({type(e).__name__}: {e})",
                                              wire.ERR_BAD_MESSAGE)

    def _take(self, n: int, deadline: float) -> list[_Lane]:
        with self._cv:
            while True:
                if self._closed:
                    raise PoolUnavailable(self.endpoint, "the connection is closed", "closed")
                got = [self._free.pop() for _ in range(min(n, len(self._free)))]
                while len(got) < n and self._count < self.max_lanes:
                    got.append(_Lane(self._socket()))
                    self._count += 1
                if got:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PoolUnavailable(self.endpoint, f"all {self.max_lanes} connections stayed busy", "busy")
                self._cv.wait(left)

    def _give(self, lanes: list[_Lane]) -> None:
        with self._cv:
            for lane in lanes:
                if self._closed:
                    lane.sock.close(linger=0)
                    self._count -= 1
                else:
                    self._free.append(lane)
            self._cv.notify_all()

    def _finish(self, taken: list[_Lane], broken: list[_Lane], trackers: list[zmq.MessageTracker]) -> None:
        """Replace the ``broken`` lanes (closing a socket drops what it queued for a dead pool), wait until zmq
        has let go of every frame we gave it (so the caller's buffers are free again), give the lanes back."""
        for lane in broken:
            lane.sock.close(linger=0)
            lane.sock = self._socket()
        for t in trackers:
            if not t.done:
                try:
                    t.wait(TRACKER_WAIT_S)
                except zmq.NotDone:
                    log.error("pool %s: zmq still holds a request's buffer %.0f s after its connection was "
                              "closed", self.endpoint, TRACKER_WAIT_S)
        self._give(taken)

    def _socket(self) -> zmq.Socket[Any]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if secure_client(sock, self.endpoint, self.auth):
            self._owner_only = True
        sock.connect(self.endpoint)
        return sock


class _Timeout(Exception):
    pass


class _Unreadable(Exception):
    pass


class _Run:
    """One batch in progress on its lanes (the calling thread's loop)."""

    def __init__(self, ch: Channel, lanes: list[_Lane], pending: Iterator[Request], timeout: float,
                 total_s: float | None, window: int) -> None:
        self.ch, self.lanes, self.pending = ch, lanes, pending
        self.timeout, self.window = timeout, window
        self.hard_deadline = time.monotonic() + (total_s if total_s is not None else float("inf"))
        self.total_s = total_s
        self.inflight: dict[int, tuple[_Lane, Request]] = {}
        self.load = {id(lane): 0 for lane in lanes}
        self.trackers: list[zmq.MessageTracker] = []
        self.progress = time.monotonic()
        self.exhausted = False

    def busy(self) -> list[_Lane]:
        return [lane for lane in self.lanes if self.load[id(lane)]]

    def go(self) -> None:
        by_sock = {lane.sock: lane for lane in self.lanes}
        poller = zmq.Poller()
        for lane in self.lanes:
            poller.register(lane.sock, zmq.POLLIN)
        while True:
            self._fill()
            if not self.inflight:
                return
            deadline = min(self.progress + self.timeout, self.hard_deadline)
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Timeout(f"no reply within {self.timeout:g} s" if deadline < self.hard_deadline
                               else f"batch not done within {self.total_s:g} s")
            for sock, _ in poller.poll(max(1, int(left * 1000))):
                while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self._receive(by_sock[sock], sock.recv_multipart(zmq.NOBLOCK, copy=False))

    def _fill(self) -> None:
        for lane in self.lanes:
            while not self.exhausted and self.load[id(lane)] < self.window:
                req = next(self.pending, None)
                if req is None:
                    self.exhausted = True
                    return
                req_id = next(self.ch._ids)
                self._send(lane, req_id, req, min(self.progress + self.timeout, self.hard_deadline))
                self.inflight[req_id] = (lane, req)
                self.load[id(lane)] += 1

    def _send(self, lane: _Lane, req_id: int, req: Request, deadline: float) -> None:
        frames = [wire.encode_request(req_id, req.op, req.body), *req.data]
        while True:
            try:
                req.sent = time.monotonic()
                tracker = lane.sock.send_multipart(frames, zmq.NOBLOCK, copy=False, track=bool(req.data))
                if tracker is not None:
                    self.trackers.append(tracker)
                return
            except zmq.Again:  # not connected (IMMEDIATE) or the queue is full: wait, up to the deadline
                left = deadline - time.monotonic()
                if left <= 0 or not lane.sock.poll(max(1, int(left * 1000)), zmq.POLLOUT):
                    raise _Timeout(f"not connected within {self.timeout:g} s") from None

    def _receive(self, lane: _Lane, frames: list[Any]) -> None:
        try:
            req_id, ok, body = wire.decode_reply(frames[0].buffer, peer=f"the pool at {self.ch.endpoint}")
        except wire.WireError as e:
            raise _Unreadable(e.message if e.code == wire.ERR_BAD_VERSION else f"unreadable reply: {e.message}") \
                from None
        entry = self.inflight.pop(req_id, None)
        if entry is None:
            return  # a late reply to a request given up on earlier
        self.load[id(entry[0])] -= 1
        self.progress = time.monotonic()
        entry[1].done = True
        # The next request goes out before this reply is handled: the pool serves it while ``on_reply`` runs
        # (a one-sided transport copies a whole chunk there). Handled first, a lane whose window's replies had
        # all come in sat idle for a round trip after every ``window`` chunks.
        self._fill()
        self.ch._handle(entry[1], ok, body, frames[1:], frames[0])


__all__ = ["Answer", "Channel", "Request"]
