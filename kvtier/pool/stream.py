"""StreamServer: the pool's raw TCP data port (kvtier/transport/stream.py is the client and the framing).

One thread per data connection, blocking I/O with a timeout, and bounded so that idle or slow peers cannot
exhaust the daemon:

* at most ``max_connections`` data connections at once; one more is accepted and closed at once, with a log
  line (clients see a failed request: a miss, and the pool's back-off);
* each socket operation makes progress within ``timeout_s`` (an idle connection is closed after that long);
* each message, from its first byte to the end of its reply, finishes within ``message_timeout_s``: a peer
  that sends a header and then trickles a byte at a time has its connection shut down by the watchdog.

Only the two data ops come here:

    put: reserve slots, then recv_into() the payload straight into them, run by run (bytes for keys the pool
         already holds go to a scratch buffer), commit; reply {held}
    get: acquire, reply {hit}, then sendmsg() straight from the slots; release

With ``tokens`` (a pool with --auth-dir), a connection's first TOKEN_BYTES bytes must be a token the pool
handed out at hello (kvtier/auth/tokens.py), within TOKEN_DEADLINE_S; otherwise it is closed unanswered and
counted (``stream_auth_refused``). The bytes that follow are not encrypted.

Anything else, or a bad request, gets an error reply (kvtier.wire's codes and envelope) and the connection is
closed: a byte stream cannot be resynchronised after a message it did not fully read.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import numpy as np

from kvtier import wire
from kvtier.auth import TOKEN_BYTES, DataTokens
from kvtier.pool import protocol as P
from kvtier.pool.ops import check_fits
from kvtier.pool.state import PoolSettings, PoolState
from kvtier.ratelog import RateLimitedLog
from kvtier.transport import frames as F
from kvtier.transport.stream import read_envelope, recv_exact, recv_views, send_message
from kvtier.wire import WireError

log = logging.getLogger("kvtier.pool")

SCRATCH_BYTES = 4 << 20
# Data connections at once: a few lanes per engine process, for a node's worth of engines.
MAX_CONNECTIONS = PoolSettings.stream_max_connections
WATCHDOG_S = 0.2  # how often the accept thread looks for messages past their deadline
TOKEN_DEADLINE_S = 2.0  # a data connection presents its token within this long of being accepted, or is closed


class StreamServer:
    """The data port of one pool. ``start()`` returns the port it listens on; ``close()`` stops everything.
    ``timeout_s``: the longest a socket operation may wait without progress; ``message_timeout_s`` (default
    ``timeout_s``): the longest one message may take; ``max_connections``: data connections served at once.
    Its threads are its own (one accepting and watching deadlines, one per connection)."""

    def __init__(self, state: PoolState, host: str, port: int = 0, timeout_s: float = 30.0, *,
                 message_timeout_s: float | None = None, max_connections: int = MAX_CONNECTIONS,
                 tokens: DataTokens | None = None) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.state = state
        self.timeout_s = timeout_s
        self.message_timeout_s = timeout_s if message_timeout_s is None else message_timeout_s
        self.max_connections = max_connections
        self.tokens = tokens
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        self._listener.settimeout(WATCHDOG_S)
        self.port = self._listener.getsockname()[1]
        self._conns: dict[socket.socket, float] = {}  # connection -> when its message in progress began (0: idle)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bad = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._accept, name="kvtier-pool-stream", daemon=True)
        self._memory: tuple[int, memoryview] | None = None  # (base address, the DRAM buffer as bytes)

    def _slots(self, tier: Any, starts: np.ndarray, lengths: np.ndarray) -> list[memoryview]:
        """Views of the tier's buffer at absolute addresses (slicing one memoryview: cheap per block)."""
        if self._memory is None or self._memory[0] != tier.buffer.ptr:
            self._memory = (tier.buffer.ptr, memoryview(tier.buffer.tensor.numpy()))
        base, mv = self._memory
        return [mv[a - base : a - base + n] for a, n in zip(starts.tolist(), lengths.tolist())]

    def start(self) -> int:
        self._thread.start()
        return self.port

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._listener.close()
        with self._lock:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _accept(self) -> None:
        swept = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() - swept >= WATCHDOG_S:
                self._drop_overdue()
                swept = time.monotonic()
            try:
                conn, peer = self._listener.accept()
            except socket.timeout:
                continue
            except OSError as e:  # out of descriptors, an aborted handshake: the port must keep accepting
                if self._stop.is_set():
                    return
                self._bad("stream-accept", logging.WARNING, "data port: accept failed (%s); retrying", e)
                self._stop.wait(WATCHDOG_S)
                continue
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns[conn] = 0.0
            if full:
                conn.close()
                self.state.count(stream_refused=1)
                self._bad("stream-full", logging.WARNING, "data connection from %s refused: %d connections open, "
                          "the limit (max_connections)", peer, self.max_connections)
                continue
            conn.settimeout(self.timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                threading.Thread(target=self._serve, args=(conn, peer), name="kvtier-pool-stream-conn",
                                 daemon=True).start()
            except RuntimeError as e:  # no thread to be had: refuse this one, keep accepting
                with self._lock:
                    self._conns.pop(conn, None)
                conn.close()
                self.state.count(stream_refused=1)
                self._bad("stream-thread", logging.WARNING, "data connection from %s refused: %s", peer, e)

    def _drop_overdue(self) -> None:
        """Shut down connections whose message in progress is past its deadline (its thread then sees the end
        of the stream and exits): a peer trickling bytes makes progress, so the socket timeout never fires."""
        now = time.monotonic()
        with self._lock:
            overdue = [c for c, began in self._conns.items() if began and now - began > self.message_timeout_s]
        for c in overdue:
            self.state.count(stream_overdue=1)
            self._bad("stream-overdue", logging.WARNING, "data connection from %s dropped: a message not done "
                      "within %g s", _peer(c), self.message_timeout_s)
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._began(c, 0.0)  # dropped once: its thread ends at the shutdown

    def _began(self, conn: socket.socket, when: float) -> None:
        with self._lock:
            if conn in self._conns:
                self._conns[conn] = when

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        scratch = np.empty(0, np.uint8)
        try:
            if self.tokens is not None and not self._admit(conn, peer, self.tokens):
                return
            while not self._stop.is_set():
                req_id = 0
                try:
                    self._began(conn, 0.0)
                    if not conn.recv(1, socket.MSG_PEEK):  # idle until a message's first byte
                        return
                    self._began(conn, time.monotonic())
                    envelope = read_envelope(conn)
                    if envelope is None:
                        return
                    req_id, op, body = wire.decode_request(envelope)
                    if op == P.PUT:
                        if scratch.size == 0:
                            scratch = np.empty(SCRATCH_BYTES, np.uint8)
                        self._put(conn, req_id, body, scratch)
                    elif op == P.GET:
                        self._get(conn, req_id, body)
                    else:
                        raise WireError(wire.ERR_UNKNOWN_OP, f"op {op[:64]!r} is not served on the data port "
                                                             f"(only {P.PUT}, {P.GET}; the rest go to zmq)")
                except WireError as e:
                    self.state.count(**{f"error_{e.code}": 1})
                    self._bad(e.code, logging.WARNING, "bad request on the data port from %s: %s", peer, e)
                    send_message(conn, wire.encode_reply(req_id or wire.salvage_req_id(e), False,
                                                         {"code": e.code, "message": e.message,
                                                          "epoch": self.state.epoch}))
                    return  # the rest of the stream cannot be trusted
        except (OSError, ConnectionError) as e:  # a client gone or silent: its connection ends, the pool goes on
            self._bad("stream-io", logging.INFO, "data connection from %s ended: %s", peer, e)
        except Exception:
            self._bad("stream-internal", logging.ERROR, "internal error on the data port", exc_info=True)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _admit(self, conn: socket.socket, peer: Any, tokens: DataTokens) -> bool:
        """Read the connection's token (all of it within TOKEN_DEADLINE_S: a peer trickling bytes gets no
        longer); whether it is one the pool issued. Refused connections are counted and logged."""
        token = bytearray(TOKEN_BYTES)
        got, deadline, why = 0, time.monotonic() + TOKEN_DEADLINE_S, ""
        try:
            while got < TOKEN_BYTES:
                left = deadline - time.monotonic()
                if left <= 0:
                    why = f"no token within {TOKEN_DEADLINE_S:g} s"
                    break
                conn.settimeout(left)
                k = conn.recv_into(memoryview(token)[got:])
                if not k:
                    why = "closed before sending a whole token"
                    break
                got += k
        except socket.timeout:
            why = f"no token within {TOKEN_DEADLINE_S:g} s"
        finally:
            conn.settimeout(self.timeout_s)
        if not why and tokens.check(bytes(token)):
            return True
        self.state.count(stream_auth_refused=1)
        self._bad("stream-auth", logging.WARNING, "data connection from %s refused: %s (a client says hello over "
                  "the CurveZMQ port first; its token opens a data connection)", peer, why or "a wrong token")
        return False

    def _put(self, conn: socket.socket, req_id: int, body: dict[str, Any], scratch: np.ndarray) -> None:
        st = self.state
        tier = st.tier_for(body)
        keys = st.keys(body)
        bb = tier.block_bytes
        check_fits(len(keys), bb, tier.capacity_bytes)
        res = tier.reserve(keys)
        ok = False
        try:
            target = np.full(len(keys), -1, dtype=np.int64)  # where each block's bytes go: a slot, or scratch
            target[res.index] = res.addresses.astype(np.int64)
            self._receive(conn, tier, target, scratch)
            ok = True
        finally:
            tier.commit(res, success=ok)
        st.emit("stored", res.keys)
        st.count(put_blocks=len(res.keys), put_bytes=len(res.keys) * bb)
        send_message(conn, wire.encode_reply(req_id, True, {"held": P.bitmap(res.held), "epoch": st.epoch}))

    def _receive(self, conn: socket.socket, tier: Any, target: np.ndarray, scratch: np.ndarray) -> None:
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
            recv_views(conn, views)  # what came before, then the dropped bytes through the scratch buffer
            views = []
            left = c * bb
            while left:
                k = min(left, scratch.size)
                recv_exact(conn, memoryview(scratch)[:k])
                left -= k
        recv_views(conn, views)

    def _get(self, conn: socket.socket, req_id: int, body: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        st = self.state
        tier = st.tier_for(body)
        keys = st.keys(body)
        bb = tier.block_bytes
        with tier.acquire(keys) as addresses:
            hit = [a is not None for a in addresses]
            rows = np.fromiter((a for a in addresses if a is not None), dtype=np.uint64)
            spans = F.runs(rows, bb, max_bytes=1 << 30)
            views = self._slots(tier, np.array([a for a, _ in spans], np.int64), np.array([c * bb for _, c in spans]))
            send_message(conn, wire.encode_reply(req_id, True, {"hit": P.bitmap(hit), "epoch": st.epoch}), views)
        st.count(get_hits=len(rows), get_misses=len(keys) - len(rows), get_bytes=len(rows) * bb)
        if len(rows) * bb >= 1 << 20:  # smaller gets are all latency: they say nothing about bandwidth
            st.record_read(len(rows) * bb, time.perf_counter() - t0)


def _peer(conn: socket.socket) -> Any:
    try:
        return conn.getpeername()
    except OSError:
        return "a gone peer"
