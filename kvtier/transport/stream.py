"""StreamConnection: block bytes over plain TCP sockets, received straight into the destination (no copy in
user space on either side); zmq stays the control channel (hello, contains, remove).

Why a second TCP path: with zmq, received bytes land in zmq's buffers and need one more copy, and every
message costs an allocation; measured here that holds zmq frames to about half of a raw socket. A stream
socket puts the kernel's one copy straight where the bytes belong:

    put:  [u32 length][envelope {keys, block_bytes}] + the blocks' bytes, sent from the caller's rows
          (sendmsg over runs of rows) -> the pool recv_into()s each run straight into its reserved slots
    get:  [u32 length][envelope {keys, block_bytes}] -> the pool answers [u32 length][envelope {hit}] + the hits'
          bytes, sent from its slots; here each run is recv_into()'d straight into the caller's rows

The envelope is kvtier.wire's (same codec, same versions and error codes); only the framing is a length
prefix instead of zmq's (kvtier/wire/framing.py, which the pool's data port speaks too). Batches are cut into
requests of ``REQUEST_BYTES`` spread over parallel sockets (``lanes``), one thread each. Every call has one deadline (the timeout plus its bytes at the slowest bandwidth
a call may take) and every socket operation waits at most what is left of it, so a pool that goes silent or
trickles its reply is PoolUnavailable by then and its socket is closed (a stream cannot be resynchronised
mid-message; the pool closes it too after an error reply).

A pool started with --auth-dir hands out a token in its hello reply (over CurveZMQ); each data socket sends
it as its first bytes. The block bytes themselves cross the wire unencrypted (docs/pool.md "Authenticated sockets").

Thread-safe: sockets are checked out per request.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier import wire
from kvtier.iothreads import IoThreads
from kvtier.transport.base import PoolError, PoolInfo, PoolProtocolError, PoolRefused, PoolUnavailable
from kvtier.transport.connection import MIN_BANDWIDTH, ConnectionBase, hello
from kvtier.wire import frames as F
from kvtier.wire import pool as P
from kvtier.wire.framing import read_envelope, recv_rows, send_message, send_message_raw

log = logging.getLogger(__name__)

REQUEST_BYTES = 16 << 20


# ---- the client --------------------------------------------------------------------------------------------

class StreamConnection(ConnectionBase):
    """Blocks over raw TCP sockets (control over zmq). See ConnectionBase and PoolConnection."""

    transport = "stream"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._host = self.endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
        self._free: list[socket.socket] = []
        self._retoken = False  # a data connection failed on a pool that wants tokens: hello again before the next
        self._lock = threading.Lock()
        self._lanes = IoThreads(self.lanes, "kvtier-stream", f"pool connection {self.endpoint}")
        self._staging = F.Staging(keep=2 * self.lanes)  # for puts of scattered small blocks

    def put(self, keys: Sequence[bytes], rows: np.ndarray) -> list[bool]:
        n, bb = len(keys), self.block_bytes
        self._check_fits(n)
        rows = np.asarray(rows, dtype=np.uint64)
        held = [False] * n

        def one(a: int, b: int, sock: socket.socket, deadline: float) -> None:
            frames, used = F.frames_for(rows[a:b], bb, self._staging)
            try:
                send_message(sock, wire.encode_request(0, P.PUT, self._body(keys[a:b])), frames, deadline=deadline)
            finally:
                self._staging.give(used)  # sendmsg returned: the kernel has the bytes
            body = self._reply(sock, P.PUT, deadline)
            held[a:b] = P.unbitmap(body["held"], b - a)
        self._run(n, one)
        return held

    def get(self, keys: Sequence[bytes], rows: np.ndarray) -> list[bool]:
        n, bb = len(keys), self.block_bytes
        rows = np.asarray(rows, dtype=np.uint64)
        hit = [False] * n

        def one(a: int, b: int, sock: socket.socket, deadline: float) -> None:
            send_message(sock, wire.encode_request(0, P.GET, self._body(keys[a:b])), deadline=deadline)
            got = P.unbitmap(self._reply(sock, P.GET, deadline)["hit"], b - a)
            recv_rows(sock, rows[a:b][np.flatnonzero(got)], bb, deadline=deadline)
            hit[a:b] = got
        self._run(n, one)
        return hit

    def close(self) -> None:
        self._lanes.close()
        with self._lock:
            for s in self._free:
                s.close()
            self._free.clear()
        super().close()

    # ---- internals -------------------------------------------------------------------------------------

    def _run(self, n: int, one: Callable[[int, int, socket.socket, float], None]) -> None:
        """Cut the batch into requests and run them over parallel sockets, all by one deadline (the call's:
        kvtier.transport.connection); raise the first failure."""
        deadline = self._deadline(n * self.block_bytes)
        self._greet_if_needed(deadline)
        per = self._per_request(REQUEST_BYTES)
        chunks = list(self._chunks(n, per))
        if len(chunks) == 1:
            self._on_socket(one, *chunks[0], deadline)
            return
        lanes = min(self.lanes, len(chunks))
        todo = iter(chunks)
        lock = threading.Lock()

        def lane() -> None:
            while True:
                with lock:
                    chunk = next(todo, None)
                if chunk is None:
                    return
                self._on_socket(one, *chunk, deadline)
        errors = []
        for f in self._lanes.run_each(lane, [()] * lanes):
            try:
                f.result()
            except PoolError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _on_socket(self, one: Callable[[int, int, socket.socket, float], None], a: int, b: int,
                   deadline: float) -> None:
        if time.monotonic() > deadline:
            raise PoolUnavailable(self.endpoint, "batch not done within its time budget", "timeout")
        sock = self._take(deadline)
        try:
            one(a, b, sock, deadline)
        except (OSError, ConnectionError) as e:  # socket.timeout is an OSError
            sock.close()
            # A pool restarted on a fixed data port refuses our old token by closing: fetch a fresh one.
            self._retoken = self._token() is not None
            what = (f"not done by its deadline ({self.channel.timeout_s:g} s + its bytes at "
                    f"{MIN_BANDWIDTH / 1e6:.0f} MB/s)" if isinstance(e, socket.timeout) else str(e))
            raise PoolUnavailable(self.endpoint, f"data connection: {what}", "timeout") from None
        except PoolError:
            sock.close()  # the pool closes after an error reply: this stream is done
            raise
        except wire.WireError as e:
            sock.close()
            raise PoolProtocolError(self.endpoint, e.message, e.code) from None
        with self._lock:
            self._free.append(sock)

    def _reply(self, sock: socket.socket, op: str, deadline: float) -> dict[str, Any]:
        envelope = read_envelope(sock, deadline=deadline)
        if envelope is None:
            raise ConnectionError("the pool closed the data connection")
        _, ok, body = wire.decode_reply(envelope, peer=f"the pool at {self.endpoint}")
        epoch = body.get("epoch")
        if isinstance(epoch, int) and epoch != self.info.epoch:
            self.channel.epoch = epoch
            self._saw_epoch()
        if not ok:
            code = str(body.get("code", wire.ERR_INTERNAL))
            cls = PoolProtocolError if code == wire.ERR_BAD_VERSION else PoolRefused
            raise cls(self.endpoint, f"{op}: {body.get('message', '')}", code)
        return body

    def _take(self, deadline: float) -> socket.socket:
        if self._retoken:
            self._retoken = False
            self.info = self._refresh(deadline)
        while True:
            with self._lock:
                sock = self._free.pop() if self._free else None
            if sock is None:
                break
            if not _closed_by_peer(sock):
                return sock
            sock.close()  # the pool dropped it while idle (its idle timeout, a restart): open a fresh one
        try:
            return self._open(deadline)
        except OSError:  # a restarted pool listens on another data port: ask it again
            self.info = self._refresh(deadline)
            try:
                return self._open(deadline)
            except OSError as e:
                raise PoolUnavailable(self.endpoint, f"cannot open a data connection: {e}", "unreachable") from None

    def _open(self, deadline: float) -> socket.socket:
        port = int((self.info.transports.get("stream") or {}).get("port", 0))
        if not port:
            raise ConnectionRefusedError("the pool offers no stream data port")
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("deadline passed")
        sock = socket.create_connection((self._host, port), timeout=left)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        token = self._token()
        if token is not None:  # a pool with --auth-dir: the token from our (encrypted) hello opens the port
            send_message_raw(sock, token, deadline=deadline)
        return sock

    def _token(self) -> bytes | None:
        token = (self.info.transports.get("stream") or {}).get("token")
        return token if isinstance(token, bytes) else None

    def _hello_again(self, deadline: float) -> None:
        """After a restart the pool has another data port and, with --auth-dir, other tokens: take both."""
        self._adopt(hello(self.channel, self.block_bytes, self._time_left(deadline), self.session))

    def _refresh(self, deadline: float) -> PoolInfo:
        info = hello(self.channel, self.block_bytes, self._time_left(deadline), self.session)
        self.session = info.session
        if info.epoch != self.info.epoch:
            self.channel.epoch = info.epoch
            self._saw_epoch()
        return info


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle data socket is dead: between requests the pool sends nothing, so a readable socket has
    reached its end of stream (or holds bytes it should not: unusable either way)."""
    poller = select.poll()  # not select.select: it fails for descriptors >= 1024 (an engine has many)
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
