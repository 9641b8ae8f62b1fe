"""DataPortAdmission: who gets onto the pool's raw TCP data port, and for how long (pool/stream.py serves
the messages of those admitted).

Connections go through two stages, counted and limited apart, so idle or unauthenticated peers cannot lock
honest clients out:

* **pending**: accepted, not yet admitted. The accept thread holds them in a selector (no thread each) until
  they show they are clients: with ``tokens`` (a pool with --auth-dir) a connection's first TOKEN_BYTES bytes
  must be a token the pool handed out at hello (kvtier/auth/tokens.py); without, its first byte of a request
  admits it. A pending connection that has not done so within ``handshake_s`` is closed (counted as
  ``stream_pending_timeouts``), a wrong token too (``stream_auth_refused``), and when ``max_pending`` are
  pending the oldest is closed to make room (``stream_pending_dropped``): a flood of idle connections
  displaces itself, while a client that sends at once is admitted in microseconds.
* **admitted**: at most ``max_connections`` at once, one thread each (running ``serve``), and at most half of
  them from one peer (an IP address, an IPv6 /64): a peer that holds its half makes room among its own. When
  all are taken, the one idle the longest (between messages) is closed to make room (``stream_idle_closed``;
  clients replace a connection the pool closed while idle before their next request); only when every one
  is inside a message is a newcomer refused (``stream_refused``). An admitted connection idle for ``idle_s``
  is closed; a message's envelope must arrive within ``handshake_s`` of its first byte (pool/stream.py),
  so a connection that sends a byte and stalls holds its thread no longer than that.

Threads: one accept thread (this class's), one per admitted connection; ``begin``/``idle`` are called by a
connection's own thread, the rest by the accept thread. Counts are read from anywhere.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.auth import TOKEN_BYTES, DataTokens
from kvtier.pool.clients import peer_of
from kvtier.pool.state import PoolState
from kvtier.ratelog import RateLimitedLog

log = logging.getLogger("kvtier.pool")

SWEEP_S = 0.1  # how often the accept thread looks for pending connections past their deadline


@dataclass
class _Pending:
    sock: socket.socket
    peer: Any
    since: float
    token: bytearray


class Admitted:
    """An admitted data connection: its socket, its peer's address, whether it is inside a message."""

    __slots__ = ("sock", "peer", "who", "busy", "idle_since")

    def __init__(self, sock: socket.socket, peer: Any) -> None:
        self.sock, self.peer, self.busy, self.idle_since = sock, peer, False, time.monotonic()
        self.who = peer_of(str(peer[0]) if isinstance(peer, tuple) else str(peer))  # the client's account


class DataPortAdmission:
    """The listener on (host, port) and its two stages; ``serve(admitted)`` runs on a thread per admitted
    connection and closes nothing itself (``end`` does, when it returns)."""

    def __init__(self, state: PoolState, host: str, port: int, serve: Callable[[Admitted], None], *,
                 idle_s: float, max_connections: int, max_pending: int, handshake_s: float,
                 tokens: DataTokens | None) -> None:
        if max_connections < 1 or max_pending < 1:
            raise ValueError(f"max_connections and max_pending must be >= 1, got {max_connections}, {max_pending}")
        self.state, self._serve = state, serve
        self.idle_s, self.max_connections, self.max_pending = idle_s, max_connections, max_pending
        self.handshake_s, self.tokens = handshake_s, tokens
        self.per_peer = max(1, max_connections // 2)
        self._listener = socket.create_server((host, port), backlog=1024, reuse_port=False)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._pending: OrderedDict[socket.socket, _Pending] = OrderedDict()  # oldest first
        self._admitted: dict[socket.socket, Admitted] = {}
        self._lock = threading.Lock()  # _admitted and each Admitted's busy / idle_since
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._bad = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._accept, name="kvtier-pool-stream", daemon=True)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def admitted(self) -> int:
        return len(self._admitted)

    def start(self) -> int:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._thread.start()
        return self.port

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._listener.close()
        for p in list(self._pending.values()):
            p.sock.close()
        self._pending.clear()
        with self._lock:
            for c in self._admitted:
                shutdown(c)

    # ---- a connection's own thread ------------------------------------------------------------------------

    def idle(self, a: Admitted) -> None:
        """Between messages: it may be closed to make room."""
        with self._lock:
            a.busy, a.idle_since = False, time.monotonic()

    def begin(self, a: Admitted) -> bool:
        """A message's first byte arrived; False if the connection was chosen to make room meanwhile (it is
        being closed: drop it)."""
        with self._lock:
            if a.busy:
                return False
            a.busy = True
            return True

    def _run(self, a: Admitted) -> None:
        try:
            self._serve(a)
        finally:
            with self._lock:
                self._admitted.pop(a.sock, None)
            a.sock.close()

    # ---- accepting and admitting (the accept thread) ---------------------------------------------------------

    def _accept(self) -> None:
        swept = time.monotonic()
        while not self._stop.is_set():
            for key, _ in self._selector.select(SWEEP_S):
                if key.fileobj is self._listener:
                    self._take_new()
                else:
                    self._on_pending(key.fileobj)  # type: ignore[arg-type]
            if time.monotonic() - swept >= SWEEP_S:
                self._sweep()
                swept = time.monotonic()
        for p in list(self._pending):
            self._drop_pending(p)

    def _take_new(self) -> None:
        for _ in range(256):
            try:
                conn, peer = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:  # out of descriptors, an aborted handshake: the port must keep accepting
                self._bad("stream-accept", logging.WARNING, "data port: accept failed (%s); retrying", e)
                return
            if len(self._pending) >= self.max_pending:  # make room: the oldest pending goes
                oldest = next(iter(self._pending))
                self.state.count(stream_pending_dropped=1)
                self._bad("stream-pending-full", logging.WARNING, "data port: %d connections pending (none has "
                          "sent a request or token yet); dropping the oldest", self.max_pending)
                self._drop_pending(oldest)
            conn.setblocking(False)
            self._pending[conn] = _Pending(conn, peer, time.monotonic(), bytearray())
            self._selector.register(conn, selectors.EVENT_READ)

    def _on_pending(self, conn: socket.socket) -> None:
        p = self._pending.get(conn)
        if p is None:
            return
        if self.tokens is None:  # no token to check: a first byte (peeked, left for the thread) admits it
            try:
                first = conn.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                first = b""
            if not first:
                self._drop_pending(conn)
                return
            self._admit(p)
            return
        try:
            got = conn.recv(TOKEN_BYTES - len(p.token))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = b""
        if not got:
            self._refuse_token(p, "closed before sending a whole token")
            return
        p.token += got
        if len(p.token) < TOKEN_BYTES:
            return
        if not self.tokens.check(bytes(p.token)):
            self._refuse_token(p, "a wrong token")
            return
        self._admit(p)

    def _refuse_token(self, p: _Pending, why: str) -> None:
        self.state.count(stream_auth_refused=1)
        self._bad("stream-auth", logging.WARNING, "data connection from %s refused: %s (a client says hello over "
                  "the zmq port first, with keys or the owner token; its token opens a data connection)", p.peer, why)
        self._drop_pending(p.sock)

    def _sweep(self) -> None:
        """Pending connections past ``handshake_s`` are closed; so are admitted ones idle past ``idle_s``."""
        now = time.monotonic()
        for conn in [c for c, p in self._pending.items() if now - p.since > self.handshake_s]:
            p = self._pending[conn]
            self.state.count(stream_pending_timeouts=1)
            if self.tokens is not None:
                self.state.count(stream_auth_refused=1)
            self._bad("stream-pending", logging.INFO, "data connection from %s closed: nothing%s within %g s",
                      p.peer, " (no token)" if self.tokens is not None else "", self.handshake_s)
            self._drop_pending(conn)
        with self._lock:
            idle = [a for a in self._admitted.values() if not a.busy and now - a.idle_since > self.idle_s]
        for a in idle:
            shutdown(a.sock)  # its thread sees the end of the stream and exits

    def _drop_pending(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _admit(self, p: _Pending) -> None:
        self._pending.pop(p.sock, None)
        self._selector.unregister(p.sock)
        conn = p.sock
        a = Admitted(conn, p.peer)
        with self._lock:
            mine = [x for x in self._admitted.values() if x.who == a.who]
            if len(mine) >= self.per_peer:
                among, limit = mine, f"all {self.per_peer} of this peer's (half of max_connections)"
            elif len(self._admitted) >= self.max_connections:
                among, limit = list(self._admitted.values()), f"all {self.max_connections} (max_connections)"
            else:
                among, limit = [], ""
            if among:
                idle = [x for x in among if not x.busy]
                if idle:  # the one idle the longest makes room (its client opens a fresh one when it needs it)
                    victim = min(idle, key=lambda x: x.idle_since)
                    victim.busy = True  # being closed: not a victim twice
                    shutdown(victim.sock)
                    self.state.count(stream_idle_closed=1)
                else:
                    conn.close()
                    self.state.count(stream_refused=1)
                    self._bad("stream-full", logging.WARNING, "data connection from %s refused: %s are in the "
                              "middle of a message", p.peer, limit)
                    return
            self._admitted[conn] = a
        conn.setblocking(True)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            threading.Thread(target=self._run, args=(a,), name="kvtier-pool-stream-conn", daemon=True).start()
        except RuntimeError as e:  # no thread to be had: refuse this one, keep accepting
            with self._lock:
                self._admitted.pop(conn, None)
            conn.close()
            self.state.count(stream_refused=1)
            self._bad("stream-thread", logging.WARNING, "data connection from %s refused: %s", p.peer, e)

    # ---- an admitted connection (its own thread) -------------------------------------------------------------



def shutdown(conn: socket.socket) -> None:
    """Shut a connection down (its thread sees the end of the stream); closing is its thread's."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
