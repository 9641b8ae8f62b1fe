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
prefix instead of zmq's. Batches are cut into requests of ``REQUEST_BYTES`` spread over parallel sockets
(``lanes``), one thread each. Every socket operation has the timeout: a silent pool is PoolUnavailable and its
socket is closed (a stream cannot be resynchronised mid-message; the pool closes it too after an error reply).

A pool started with --auth-dir hands out a token in its hello reply (over CurveZMQ); each data socket sends
it as its first bytes. The block bytes themselves cross the wire unencrypted (README "Authenticated sockets").

Thread-safe: sockets are checked out per request.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvtier import wire
from kvtier.pool import protocol as P
from kvtier.transport import frames as F
from kvtier.transport.base import PoolError, PoolInfo, PoolProtocolError, PoolRefused, PoolUnavailable
from kvtier.transport.connection import ConnectionBase, hello

log = logging.getLogger(__name__)

REQUEST_BYTES = 16 << 20
HEADER = struct.Struct("<I")
MAX_ENVELOPE = 16 << 20  # a 1M-key blob and change
IOV_MAX = 512  # buffers per sendmsg call


# ---- framing (shared with the pool's side, kvtier/pool/stream.py) -----------------------------------------

def send_message(sock: socket.socket, envelope: bytes, payload: Sequence[Any] = ()) -> None:
    """[u32 length][envelope] then the payload buffers, all of it (sendmsg, partial writes resumed)."""
    buffers = [memoryview(HEADER.pack(len(envelope)) + envelope), *(memoryview(b).cast("B") for b in payload)]
    while buffers:
        sent = sock.sendmsg(buffers[:IOV_MAX])
        while sent and buffers:
            if sent >= len(buffers[0]):
                sent -= len(buffers[0])
                buffers.pop(0)
            else:
                buffers[0] = buffers[0][sent:]
                sent = 0


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket; ConnectionError on end of stream."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if not k:
            raise ConnectionError("the peer closed the connection")
        got += k


def read_envelope(sock: socket.socket) -> bytes | None:
    """The next length-prefixed envelope, or None at a clean end of stream (before its first byte)."""
    head = bytearray(HEADER.size)
    k = sock.recv_into(head, HEADER.size, socket.MSG_WAITALL)
    if k == 0:
        return None
    if k < HEADER.size:
        recv_exact(sock, memoryview(head)[k:])
    (length,) = HEADER.unpack(head)
    if length > MAX_ENVELOPE:
        raise wire.WireError(wire.ERR_TOO_LARGE, f"an envelope of {length} bytes, the limit is {MAX_ENVELOPE}")
    body = bytearray(length)
    recv_exact(sock, memoryview(body))
    return bytes(body)


def recv_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill ``views`` in order (recvmsg_into scatters into up to IOV_MAX of them per call, resumed after partial
    reads); ConnectionError on end of stream."""
    pending = [v for v in views if len(v)]
    while pending:
        batch = pending[:IOV_MAX]
        got = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        if not got:
            raise ConnectionError("the peer closed the connection")
        while got and pending:
            if got >= len(pending[0]):
                got -= len(pending[0])
                pending.pop(0)
            else:
                pending[0] = pending[0][got:]
                got = 0


def recv_rows(sock: socket.socket, rows: np.ndarray, block_bytes: int) -> None:
    """Receive ``len(rows)`` blocks in order straight into the rows (runs of consecutive rows as one buffer)."""
    recv_views(sock, [memoryview(F.view(addr, count * block_bytes)).cast("B")
                      for addr, count in F.runs(rows, block_bytes, max_bytes=1 << 30)])


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
        self._lanes = ThreadPoolExecutor(max_workers=self.lanes, thread_name_prefix="kvtier-stream")
        self._staging = F.Staging(keep=2 * self.lanes)  # for puts of scattered small blocks

    def put(self, keys: Sequence[bytes], rows: np.ndarray) -> list[bool]:
        n, bb = len(keys), self.block_bytes
        self._check_fits(n)
        rows = np.asarray(rows, dtype=np.uint64)
        held = [False] * n

        def one(a: int, b: int, sock: socket.socket) -> None:
            frames, used = F.frames_for(rows[a:b], bb, self._staging)
            try:
                send_message(sock, wire.encode_request(0, P.PUT, self._body(keys[a:b])), frames)
            finally:
                self._staging.give(used)  # sendmsg returned: the kernel has the bytes
            body = self._reply(sock, P.PUT)
            held[a:b] = P.unbitmap(body["held"], b - a)
        self._run(n, one)
        return held

    def get(self, keys: Sequence[bytes], rows: np.ndarray) -> list[bool]:
        n, bb = len(keys), self.block_bytes
        rows = np.asarray(rows, dtype=np.uint64)
        hit = [False] * n

        def one(a: int, b: int, sock: socket.socket) -> None:
            send_message(sock, wire.encode_request(0, P.GET, self._body(keys[a:b])))
            got = P.unbitmap(self._reply(sock, P.GET)["hit"], b - a)
            recv_rows(sock, rows[a:b][np.flatnonzero(got)], bb)
            hit[a:b] = got
        self._run(n, one)
        return hit

    def close(self) -> None:
        self._lanes.shutdown(wait=True)
        with self._lock:
            for s in self._free:
                s.close()
            self._free.clear()
        super().close()

    # ---- internals -------------------------------------------------------------------------------------

    def _run(self, n: int, one: Callable[[int, int, socket.socket], None]) -> None:
        """Cut the batch into requests and run them over parallel sockets; raise the first failure."""
        per = max(1, min(self.info.max_keys, REQUEST_BYTES // self.block_bytes))
        chunks = list(self._chunks(n, per))
        deadline = time.monotonic() + self.channel.timeout_s + n * self.block_bytes / 100e6
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
        for f in [self._lanes.submit(lane) for _ in range(lanes)]:
            try:
                f.result()
            except PoolError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _on_socket(self, one: Callable[[int, int, socket.socket], None], a: int, b: int, deadline: float) -> None:
        if time.monotonic() > deadline:
            raise PoolUnavailable(self.endpoint, "batch not done within its time budget", "timeout")
        sock = self._take()
        try:
            one(a, b, sock)
        except (OSError, ConnectionError) as e:  # socket.timeout is an OSError
            sock.close()
            # A pool restarted on a fixed data port refuses our old token by closing: fetch a fresh one.
            self._retoken = self._token() is not None
            what = f"no progress within {self.channel.timeout_s:g} s" if isinstance(e, socket.timeout) else str(e)
            raise PoolUnavailable(self.endpoint, f"data connection: {what}", "timeout") from None
        except PoolError:
            sock.close()  # the pool closes after an error reply: this stream is done
            raise
        except wire.WireError as e:
            sock.close()
            raise PoolProtocolError(self.endpoint, e.message, e.code) from None
        with self._lock:
            self._free.append(sock)

    def _reply(self, sock: socket.socket, op: str) -> dict[str, Any]:
        envelope = read_envelope(sock)
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

    def _take(self) -> socket.socket:
        if self._retoken:
            self._retoken = False
            self.info = self._refresh()
        while True:
            with self._lock:
                sock = self._free.pop() if self._free else None
            if sock is None:
                break
            if not _closed_by_peer(sock):
                return sock
            sock.close()  # the pool dropped it while idle (its idle timeout, a restart): open a fresh one
        try:
            return self._open()
        except OSError:  # a restarted pool listens on another data port: ask it again
            self.info = self._refresh()
            try:
                return self._open()
            except OSError as e:
                raise PoolUnavailable(self.endpoint, f"cannot open a data connection: {e}", "unreachable") from None

    def _open(self) -> socket.socket:
        port = int((self.info.transports.get("stream") or {}).get("port", 0))
        if not port:
            raise ConnectionRefusedError("the pool offers no stream data port")
        sock = socket.create_connection((self._host, port), timeout=self.channel.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        token = self._token()
        if token is not None:  # a pool with --auth-dir: the token from our (encrypted) hello opens the port
            sock.sendall(token)
        return sock

    def _token(self) -> bytes | None:
        token = (self.info.transports.get("stream") or {}).get("token")
        return token if isinstance(token, bytes) else None

    def _hello_again(self) -> None:
        """After a restart the pool has another data port and, with --auth-dir, other tokens: take both."""
        self.info = hello(self.channel, self.block_bytes)

    def _refresh(self) -> PoolInfo:
        info = hello(self.channel, self.block_bytes)
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
