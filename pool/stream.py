"""StreamServer: the pool's raw TCP data port (kvtier/transport/stream.py is the client, kvtier/wire/framing.py
the framing both speak).

Who gets a connection, and for how long, is pool/admission.py's (pending connections apart from
admitted ones, each limited and timed out on its own, so idle or unauthenticated peers cannot lock honest
clients out). This module serves the messages of admitted connections, one thread each.

Each message, from its first byte to the end of its reply, ends within ``message_timeout_s``, its envelope
within ``handshake_s`` of that first byte (a client sends it at once: one that sends a byte and stalls holds
its thread no longer): every socket
operation waits at most what is left of that deadline (kvtier/wire/framing.py), so a peer that trickles
bytes is cut off on time. An envelope is received as its bytes arrive, at most the pool's largest request,
and its memory is charged to the pool's memory budget; its reservations and acquisitions to the held budget,
within the client's quota (keys past it: not stored / a miss). Clients are known by their IP address here.

Only the two data ops come here:

    put: reserve slots, then recv_into() the payload straight into them, run by run (bytes for keys the pool
         already holds go to a scratch buffer), commit; reply {held}
    get: acquire, reply {hit}, then sendmsg() straight from the slots; release

Anything else, or a bad request, gets an error reply (kvtier.wire's codes and envelope) and the connection is
closed: a byte stream cannot be resynchronised after a message it did not fully read.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvtier import wire
from kvtier.auth import DataTokens
from kvtier.keys import KEY_BYTES
from kvtier.pool.admission import Admitted, DataPortAdmission
from kvtier.pool.budget import Budget
from kvtier.pool.clients import Client
from kvtier.pool.ops import check_fits
from kvtier.pool.state import PoolSettings, PoolState
from kvtier.ratelog import RateLimitedLog
from kvtier.wire import WireError
from kvtier.wire import frames as F
from kvtier.wire import pool as P
from kvtier.wire.framing import read_envelope, recv_exact, recv_views, send_message

log = logging.getLogger("kvtier.pool")

SCRATCH_BYTES = 4 << 20  # one buffer for every connection: bytes of keys already held are dropped into it
MAX_CONNECTIONS = PoolSettings.stream_max_connections
ENVELOPE_SLACK = 64 << 10  # an envelope: its keys and a few small fields


class StreamServer:
    """The data port of one pool. ``start()`` returns the port it listens on; ``close()`` stops everything.
    ``timeout_s``: how long an admitted connection may sit idle; ``message_timeout_s`` (default ``timeout_s``):
    the longest one message may take; ``max_connections`` / ``max_pending`` / ``handshake_s``: the
    admission's (pool/admission.py). Its threads are its admission's."""

    def __init__(self, state: PoolState, host: str, port: int = 0, timeout_s: float = 30.0, *,
                 message_timeout_s: float | None = None, max_connections: int = MAX_CONNECTIONS,
                 max_pending: int = 1024, handshake_s: float = 2.0, tokens: DataTokens | None = None) -> None:
        self.state = state
        self.timeout_s = timeout_s
        self.message_timeout_s = timeout_s if message_timeout_s is None else message_timeout_s
        self.max_envelope = state.settings.max_keys * KEY_BYTES + ENVELOPE_SLACK
        self.envelope_s = handshake_s  # a message's envelope arrives this soon after its first byte
        self._admission = DataPortAdmission(state, host, port, self._serve, idle_s=timeout_s,
                                            max_connections=max_connections, max_pending=max_pending,
                                            handshake_s=handshake_s, tokens=tokens)
        self.port = self._admission.port
        self._stop = threading.Event()
        self._bad = RateLimitedLog(log)
        self._memory: tuple[int, memoryview] | None = None  # (base address, the DRAM buffer as bytes)
        self._scratch = np.empty(0, np.uint8)  # allocated at the first put that needs it

    @property
    def pending(self) -> int:
        return self._admission.pending

    @property
    def admitted(self) -> int:
        return self._admission.admitted

    def start(self) -> int:
        return self._admission.start()

    def close(self) -> None:
        self._stop.set()
        self._admission.close()

    # ---- an admitted connection (its own thread) -------------------------------------------------------------

    def _serve(self, a: Admitted) -> None:
        conn, peer = a.sock, a.peer
        client = Client("", a.who)
        try:
            while not self._stop.is_set():
                req_id = 0
                try:
                    self._admission.idle(a)
                    conn.settimeout(self.timeout_s)
                    try:
                        if not conn.recv(1, socket.MSG_PEEK):  # idle until a message's first byte
                            return
                    except socket.timeout:
                        return  # idle for timeout_s: closed (the client opens a fresh one when it needs it)
                    if not self._admission.begin(a):  # chosen to make room while idle: already shut down
                        return
                    deadline = time.monotonic() + self.message_timeout_s
                    charged = [0]

                    def charge(n: int) -> bool:
                        if not self.state.memory.take(client.account, n):
                            return False
                        charged[0] += n
                        return True
                    try:
                        envelope = read_envelope(conn, deadline=min(deadline, time.monotonic() + self.envelope_s),
                                                 max_bytes=self.max_envelope, charge=charge)
                        if envelope is None:
                            return
                        req_id, op, body = wire.decode_request(envelope)
                        del envelope
                    finally:
                        self.state.memory.give(client.account, charged[0])
                    if op == P.PUT:
                        self._put(conn, client, req_id, body, deadline)
                    elif op == P.GET:
                        self._get(conn, client, req_id, body, deadline)
                    else:
                        raise WireError(wire.ERR_UNKNOWN_OP, f"op {op[:64]!r} is not served on the data port "
                                                             f"(only {P.PUT}, {P.GET}; the rest go to zmq)")
                except WireError as e:
                    self.state.count(**{f"error_{e.code}": 1})
                    self._bad(e.code, logging.WARNING, "bad request on the data port from %s: %s", peer, e)
                    send_message(conn, wire.encode_reply(req_id or wire.salvage_req_id(e), False,
                                                         {"code": e.code, "message": e.message,
                                                          "epoch": self.state.epoch}),
                                 deadline=time.monotonic() + min(1.0, self.message_timeout_s))
                    return  # the rest of the stream cannot be trusted
        except socket.timeout:
            self.state.count(stream_overdue=1)
            self._bad("stream-overdue", logging.WARNING, "data connection from %s dropped: a message not done "
                      "within %g s, or idle for %g s", peer, self.message_timeout_s, self.timeout_s)
        except (OSError, ConnectionError) as e:  # a client gone: its connection ends, the pool goes on
            self._bad("stream-io", logging.INFO, "data connection from %s ended: %s", peer, e)
        except Exception:
            self._bad("stream-internal", logging.ERROR, "internal error on the data port", exc_info=True)

    def _slots(self, tier: Any, starts: np.ndarray, lengths: np.ndarray) -> list[memoryview]:
        """Views of the tier's buffer at absolute addresses (slicing one memoryview: cheap per block)."""
        if self._memory is None or self._memory[0] != tier.buffer.ptr:
            self._memory = (tier.buffer.ptr, memoryview(tier.buffer.tensor.numpy()))
        base, mv = self._memory
        return [mv[a - base : a - base + n] for a, n in zip(starts.tolist(), lengths.tolist())]

    def _put(self, conn: socket.socket, client: Client, req_id: int, body: dict[str, Any], deadline: float) -> None:
        st = self.state
        tier = st.tier_for(body, stores=True)
        keys = st.keys(body)
        bb = tier.block_bytes
        check_fits(len(keys), bb, tier.capacity_bytes)
        ask, nbytes = self._room(client, keys, ~np.asarray(tier.contains(keys), dtype=bool), bb, deadline)
        try:
            res = st.reserve(tier, [keys[i] for i in ask])
        except BaseException:
            st.held.give(client.account, nbytes)
            raise
        ok = False
        try:
            held = np.zeros(len(keys), dtype=bool)
            held[ask] = res.held
            target = np.full(len(keys), -1, dtype=np.int64)  # where each block's bytes go: a slot, or scratch
            if res.slots:
                target[ask[np.asarray(res.index, dtype=np.int64)]] = res.addresses.astype(np.int64)
            self._receive(conn, tier, target, deadline)
            ok = True
        finally:
            tier.commit(res, success=ok)
            st.held.give(client.account, nbytes)
        st.emit("stored", res.keys)
        st.count(put_blocks=len(res.keys), put_bytes=len(res.keys) * bb, bytes_in_stream=len(keys) * bb)
        send_message(conn, wire.encode_reply(req_id, True, {"held": P.bitmap(held), "epoch": st.epoch}),
                     deadline=deadline)

    def _room(self, client: Client, keys: list[bytes], costs: np.ndarray, bb: int, deadline: float
              ) -> tuple[np.ndarray, int]:
        """The keys a put/get may act on and the held bytes taken for them: slots for at most the client's share
        of the held budget (past it: not stored / a miss), waiting until the message's deadline for its
        earlier requests to give room back (ERR_BUSY if they do not)."""
        st = self.state
        costly = np.flatnonzero(costs)
        keep = np.ones(len(keys), dtype=bool)
        most = st.held.per_account // bb
        if len(costly) > most:
            keep[costly[most:]] = False
            st.count(quota_refused_blocks=len(costly) - most)
            costly = costly[:most]
        nbytes = len(costly) * bb
        if not st.held.wait_take(client.account, nbytes, deadline):
            raise WireError(P.ERR_BUSY, f"this client holds its share of the pool ({st.held.per_account} B) "
                                        "and did not give any back in time")
        return np.flatnonzero(keep), nbytes

    def _receive(self, conn: socket.socket, tier: Any, target: np.ndarray, deadline: float) -> None:
        """Receive len(target) blocks: into slot addresses where target >= 0, into scratch (dropped) elsewhere."""
        bb = tier.block_bytes
        n = len(target)
        # Runs: consecutive slots, or consecutive blocks to drop.
        slot = target >= 0
        joins = (slot[1:] & slot[:-1] & (target[1:] == target[:-1] + bb)) | (~slot[1:] & ~slot[:-1])
        starts = np.flatnonzero(np.concatenate([[True], ~joins])) if n else np.empty(0, np.int64)
        counts = np.diff(np.append(starts, n))
        views: list[memoryview] = []
        for s, c, into_slot in zip(starts.tolist(), counts.tolist(), slot[starts].tolist() if n else []):
            if into_slot:
                views += self._slots(tier, target[s : s + 1], np.array([c * bb]))
                continue
            recv_views(conn, views, deadline=deadline)  # what came before, then the dropped bytes via scratch
            views = []
            if self._scratch.size == 0:
                self._scratch = np.empty(SCRATCH_BYTES, np.uint8)  # shared: its contents are never read
            left = c * bb
            while left:
                k = min(left, self._scratch.size)
                recv_exact(conn, memoryview(self._scratch)[:k], deadline=deadline)
                left -= k
        recv_views(conn, views, deadline=deadline)

    def _get(self, conn: socket.socket, client: Client, req_id: int, body: dict[str, Any], deadline: float) -> None:
        t0 = time.perf_counter()
        st = self.state
        tier = st.tier_for(body)
        keys = st.keys(body)
        bb = tier.block_bytes
        ask, held = self._room(client, keys, np.asarray(tier.contains(keys), dtype=bool), bb, deadline)
        with _giving_back(st.held, client.account, held), tier.acquire([keys[i] for i in ask]) as got:
            addresses: list[int | None] = [None] * len(keys)
            for i, addr in zip(ask.tolist(), got):
                addresses[i] = addr
            hit = [a is not None for a in addresses]
            rows = np.fromiter((a for a in addresses if a is not None), dtype=np.uint64)
            nbytes = len(rows) * bb
            spans = F.runs(rows, bb, max_bytes=1 << 30)
            views = self._slots(tier, np.array([a for a, _ in spans], np.int64), np.array([c * bb for _, c in spans]))
            send_message(conn, wire.encode_reply(req_id, True, {"hit": P.bitmap(hit), "epoch": st.epoch}), views,
                         deadline=deadline)
        st.count(get_hits=len(rows), get_misses=len(keys) - len(rows), get_bytes=nbytes, bytes_out_stream=nbytes)
        if nbytes >= 1 << 20:  # smaller gets are all latency: they say nothing about bandwidth
            st.record_read(nbytes, time.perf_counter() - t0)


@contextmanager
def _giving_back(budget: Budget, account: str, nbytes: int) -> Iterator[None]:
    try:
        yield
    finally:
        budget.give(account, nbytes)
