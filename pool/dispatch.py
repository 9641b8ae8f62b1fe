"""Dispatcher: between the pool's ROUTER (every client connection) and its worker threads.

    clients --> ROUTER --(dispatcher: per-client queues, round robin)--> backend ROUTER --> worker 1..N
    clients <-- ROUTER <-------------(replies, forwarded as they are)---- backend ROUTER <-- worker 1..N

It replaces zmq's own proxy for three reasons:

* **Who sent it.** zmq's metadata (``Peer-Address``, and with CURVE ``User-Id``: the client's public key) is
  readable only on the socket a message arrived on; the dispatcher reads it and hands it to the worker with
  the request (pool/clients.py), so leases, quotas and roles know their client.
* **Fairness.** Requests wait in one queue per client account (its key, or its IP address / ipc process), and
  an idle worker takes the next request of the next account in turn: a client that floods the pool gets its
  share of the workers, not all of them.
* **Bounds.** An account may queue at most ``QUEUE_PER_CLIENT`` requests, and their data is charged to the
  pool's memory budget (a client's share, then everyone's); past either, the request is answered ERR_BUSY
  at once (a small reply, or none for noreply ops). A get, whose reply holds memory or slots until the
  client reads it, is held back while its account is at its share of either budget: a client that never
  reads its replies stops being served once its share is used, and holds no more. Others are not held back
  (a full budget only makes their replies go zero-copy instead of staged).

Workers speak a small protocol to it: ``[b"I"]`` (idle, ready for a request) or ``[b"R", client, *reply frames]``
(a reply to forward, with the client frame its request came with; the worker is idle again). A reply that
cannot be delivered (the client's connection holds REPLY_HWM unread replies: it is not reading; or the client is
gone) is dropped, counted (``replies_dropped_not_reading``, ``_gone``, ``_error``) and, unless the client is
gone, logged with its account: a client waiting on it times out, and the log says why.

It runs on its own thread until ``stop`` is set; the sockets it is given are its own from then on, and it closes
them as it ends.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from kvtier import wire
from kvtier.pool import clients
from kvtier.pool.ops import HOLDING_OPS, NO_REPLY_OPS
from kvtier.pool.state import PoolState
from kvtier.ratelog import RateLimitedLog
from kvtier.wire import pool as P

log = logging.getLogger("kvtier.pool")

BACKEND = "inproc://kvtier-pool-workers"
QUEUE_PER_CLIENT = 256  # requests one account may have waiting (a few engines' windows on one host)
QUEUE_TOTAL = 16384
DRAIN = 256  # frontend messages read per turn before replies are forwarded again
IDLE, REPLY = b"I", b"R"


@dataclass
class _Queued:
    frames: list[Any]  # [routing id, (empty delimiter), envelope, *data] as received
    route: int  # index of the envelope
    client: bytes  # kvtier.pool.clients.encode(key, peer)
    nbytes: int  # data bytes, charged to the memory budget while queued
    op: str | None = None  # decoded only when needed


class Dispatcher:
    """Routes requests from ``frontend`` to ``workers`` worker sockets connected to BACKEND."""

    def __init__(self, ctx: zmq.Context[Any], frontend: zmq.Socket[Any], state: PoolState, stop: threading.Event,
                 *, queue_per_client: int = QUEUE_PER_CLIENT, queue_total: int = QUEUE_TOTAL) -> None:
        self.ctx, self.frontend, self.state, self._stop = ctx, frontend, state, stop
        self.queue_per_client, self.queue_total = queue_per_client, queue_total
        self.curve = bool(frontend.curve_server)  # CURVE: each message names its client's key (ZAP's User-Id)
        self.backend = ctx.socket(zmq.ROUTER)
        self.backend.setsockopt(zmq.LINGER, 0)
        self.backend.bind(BACKEND)
        self._queues: dict[str, deque[_Queued]] = {}
        self._turns: deque[str] = deque()  # accounts with requests waiting and not held back, in turn order
        self._held_back: set[str] = set()  # accounts whose next request waits for their budget
        self._idle: deque[bytes] = deque()  # worker ids
        self._queued = 0
        self._bad = RateLimitedLog(log, 10.0)

    @property
    def queued(self) -> int:
        return self._queued

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(5 if self._held_back else 100))
                if self.backend in events:
                    self._from_workers()
                if self.frontend in events:
                    self._from_clients()
                if self._held_back:
                    self._recheck()
                self._dispatch()
        except zmq.ContextTerminated:
            pass
        finally:
            self._drop_all()
            self.backend.close(linger=0)
            self.frontend.close(linger=0)

    # ---- clients -> queues ---------------------------------------------------------------------------------

    def _from_clients(self) -> None:
        for _ in range(DRAIN):
            try:
                frames = self.frontend.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            route = 2 if len(frames) > 2 and len(frames[1]) == 0 else 1
            if len(frames) <= route:
                continue  # nothing to answer
            key, peer = clients.from_zmq(frames[route], self.curve)
            account = clients.Client(key, peer).account
            item = _Queued(frames, route, clients.encode(key, peer), sum(len(f) for f in frames[route + 1:]))
            q = self._queues.get(account)
            if q is None:
                q = self._queues[account] = deque()
            if (len(q) >= self.queue_per_client or self._queued >= self.queue_total
                    or not self.state.memory.take(account, item.nbytes)):
                self._busy(item, account, len(q))
                continue
            q.append(item)
            self._queued += 1
            if len(q) == 1 and account not in self._held_back:
                self._turns.append(account)

    def _busy(self, item: _Queued, account: str, waiting: int) -> None:
        """Answer ERR_BUSY at once (nothing for a noreply op): the client counts it as a failed call."""
        self.state.count(busy_refused=1)
        self._bad("busy:" + account, logging.WARNING, "client %s: request refused, busy (%d of its requests "
                  "waiting, %d in all; %s of memory in use)", account, waiting, self._queued, self.state.memory)
        try:
            req_id, op, body = wire.decode_request(item.frames[item.route].buffer)
        except wire.WireError:
            return
        if op in NO_REPLY_OPS and body.get("noreply") is True:
            return
        reply = wire.encode_reply(req_id, False, {"code": P.ERR_BUSY, "epoch": self.state.epoch,
                                                  "message": "the pool is busy: too many requests or too much "
                                                             "data waiting from this client; try again"})
        self._reply(item.client, [*(f.bytes for f in item.frames[: item.route]), reply])

    # ---- queues -> workers ---------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        st = self.state
        while self._idle and self._turns:
            account = self._turns.popleft()
            q = self._queues[account]
            item = q[0]
            if self._over(account) and self._op(item) in HOLDING_OPS:
                self._held_back.add(account)  # its replies hold its share: this waits until some are read
                continue
            q.popleft()
            self._queued -= 1
            st.memory.give(account, item.nbytes)  # the worker has it now
            self.backend.send_multipart([self._idle.popleft(), item.client, *item.frames], copy=False)
            if q:
                self._turns.append(account)
            else:
                del self._queues[account]

    def _over(self, account: str) -> bool:
        """Whether the account is at its share of either budget (only its own share: clients over theirs must
        not hold everyone else back)."""
        return self.state.memory.over_account(account) or self.state.held.over_account(account)

    def _recheck(self) -> None:
        for account in list(self._held_back):
            if not self._over(account):
                self._held_back.discard(account)
                self._turns.append(account)

    @staticmethod
    def _op(item: _Queued) -> str:
        if item.op is None:
            try:
                item.op = wire.decode_request(item.frames[item.route].buffer)[1]
            except wire.WireError:
                item.op = ""  # the worker answers the error
        return item.op

    # ---- workers -> clients --------------------------------------------------------------------------------

    def _from_workers(self) -> None:
        while True:
            try:
                frames = self.backend.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            worker, kind = frames[0].bytes, frames[1].bytes
            self._idle.append(worker)
            if kind == REPLY and len(frames) > 3:
                self._reply(frames[2].bytes, frames[3:], copy=False)

    def _reply(self, client: bytes, frames: list[Any], copy: bool = True) -> None:
        """Send a reply to its client without waiting (the frontend is ROUTER_MANDATORY: pool/server.py)."""
        try:
            self.frontend.send_multipart(frames, zmq.NOBLOCK, copy=copy)
        except zmq.Again:  # its connection holds REPLY_HWM replies it has not read
            self.state.count(replies_dropped_not_reading=1)
            who = clients.decode(client)
            self._bad("unread:" + who.account, logging.WARNING, "client %s is not reading its replies: its "
                      "connection is at its limit of %d unread (a client keeps at most half that in flight); "
                      "replies dropped, and a call waiting on one times out", who.account,
                      self.frontend.getsockopt(zmq.SNDHWM))
        except zmq.ContextTerminated:
            raise
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:  # the client closed its connection: nobody waits for it
                self.state.count(replies_dropped_gone=1)
                return
            self.state.count(replies_dropped_error=1)  # never the dispatcher's end: the pool serves on
            self._bad("send", logging.ERROR, "a reply to client %s could not be sent: %s",
                      clients.decode(client).account, e)

    def _drop_all(self) -> None:
        for account, q in self._queues.items():
            for item in q:
                self.state.memory.give(account, item.nbytes)
        self._queues.clear()
        self._turns.clear()
        self._held_back.clear()
        self._queued = 0
