"""The stream data path's framing, spoken by both ends: kvtier.transport.stream (the client) and the pool's data
port (kvtier.pool.stream). Plain TCP, no zmq:

    [u32 length][envelope]  then the message's block bytes, sent as they lie (sendmsg over runs of rows) and
                            received straight into place (recv_into / recvmsg_into)

The envelope is kvtier.wire's (same codec, versions and error codes); only the framing differs from zmq's.
Every function takes ``deadline`` (time.monotonic()): before each system call the socket's timeout is set to
what is left of it, so the whole message ends by then (socket.timeout) however the peer paces its bytes; a
per-call timeout alone lets a peer sending a byte every 0.3 s hold a call for ever. Stateless: callers own their
sockets (one thread per socket at a time).
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier import wire
from kvtier.wire import frames as F
from kvtier.wire import pool as P

HEADER = struct.Struct("<I")
MAX_ENVELOPE = 16 << 20  # a 1M-key blob and change
ENVELOPE_STEP = 64 << 10  # an envelope's body is received in steps from this size up, doubling
IOV_MAX = 512  # buffers per sendmsg call


def _left(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("deadline passed")
    sock.settimeout(left)


def _advance(buffers: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``buffers`` (what one sendmsg / recvmsg_into moved), in place."""
    while n and buffers:
        if n >= len(buffers[0]):
            n -= len(buffers[0])
            buffers.pop(0)
        else:
            buffers[0] = buffers[0][n:]
            n = 0


def send_message(sock: socket.socket, envelope: bytes, payload: Sequence[Any] = (), *, deadline: float) -> None:
    """[u32 length][envelope] then the payload buffers, all of it (sendmsg, partial writes resumed)."""
    # Empty buffers are left out: sendmsg moves 0 bytes of one at the front, which would never be dropped (the
    # loop would spin to the deadline).
    _send_all(sock, [memoryview(HEADER.pack(len(envelope)) + envelope),
                     *(v for v in (memoryview(b).cast("B") for b in payload) if len(v))], deadline)


def send_message_raw(sock: socket.socket, data: bytes, *, deadline: float) -> None:
    """``data`` as it is (no length prefix), by the deadline."""
    _send_all(sock, [memoryview(data)] if data else [], deadline)


def _send_all(sock: socket.socket, buffers: list[memoryview], deadline: float) -> None:
    """Every byte of ``buffers`` (none of them empty), partial writes resumed, by the deadline."""
    while buffers:
        _left(sock, deadline)
        _advance(buffers, sock.sendmsg(buffers[:IOV_MAX]))


def recv_exact(sock: socket.socket, view: memoryview, *, deadline: float) -> None:
    """Fill ``view`` from the socket; ConnectionError on end of stream."""
    recv_views(sock, [view], deadline=deadline)


def read_envelope(sock: socket.socket, *, deadline: float, max_bytes: int = MAX_ENVELOPE,
                  charge: Callable[[int], bool] | None = None) -> bytes | None:
    """The next length-prefixed envelope, or None at a clean end of stream (before its first byte). The body
    grows as its bytes arrive (a declared length allocates nothing by itself); ``charge(n)`` is asked before
    each growth by ``n`` bytes, and a False ends the read (WireError ERR_TOO_LARGE: no memory for it now)."""
    head = bytearray(HEADER.size)
    _left(sock, deadline)
    k = sock.recv_into(head, HEADER.size)
    if k == 0:
        return None
    if k < HEADER.size:
        recv_exact(sock, memoryview(head)[k:], deadline=deadline)
    (length,) = HEADER.unpack(head)
    if length > max_bytes:
        raise wire.WireError(wire.ERR_TOO_LARGE, f"an envelope of {length} bytes, the limit is {max_bytes}")
    body = bytearray()
    while len(body) < length:
        step = min(length - len(body), max(ENVELOPE_STEP, len(body)))  # doubling: few copies, no big promise
        if charge is not None and not charge(step):
            raise wire.WireError(P.ERR_BUSY, "no memory for this envelope now (the pool's budget is in use)")
        part = bytearray(step)
        recv_exact(sock, memoryview(part), deadline=deadline)
        body += part
    return bytes(body)


def recv_views(sock: socket.socket, views: Sequence[memoryview], *, deadline: float) -> None:
    """Fill ``views`` in order (recvmsg_into scatters into up to IOV_MAX of them per call, resumed after partial
    reads); ConnectionError on end of stream."""
    pending = [v for v in views if len(v)]
    while pending:
        _left(sock, deadline)
        got = sock.recvmsg_into(pending[:IOV_MAX])[0]
        if not got:
            raise ConnectionError("the peer closed the connection")
        _advance(pending, got)


def recv_rows(sock: socket.socket, rows: np.ndarray, block_bytes: int, *, deadline: float) -> None:
    """Receive ``len(rows)`` blocks in order straight into the rows (runs of consecutive rows as one buffer)."""
    recv_views(sock, [memoryview(F.view(addr, count * block_bytes)).cast("B")
                      for addr, count in F.runs(rows, block_bytes, max_bytes=1 << 30)], deadline=deadline)


