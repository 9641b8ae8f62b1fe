"""Prefix lookups between vLLM's scheduler process and its workers, over zmq ipc with kvtier's wire envelope.

Why a channel at all: vLLM runs the scheduler-side connector in the engine-core process and one worker-side
connector per TP/PP rank, each in its own process. In embedded mode each worker owns the store holding its
rank's blocks, so the scheduler asks every rank and takes the shortest prefix that all of them hold (a
prefix is loadable only if every rank has its slice). Nothing here blocks the scheduler: it sends, and
reads the replies that have arrived when vLLM asks again.

Frames (kvtier/wire.py envelope, one zmq frame; the ROUTER side adds the peer identity):

    request  [VERSION, lease, "kv_prefix", {"hashes": bin n*width, "width": uint, "ttl_s": float}]
    reply    [VERSION, lease, true, {"length": uint, "tiers": [[tier, count], ...],   # runs, in key order
                                     "valid": bin}]   # hybrid models only: which boundaries 1..length hit

A single-group model's hit is a prefix: every boundary up to ``length`` is one. A hybrid model's is not (a
sliding-window group holds only the windows before its hit points), so its ranks also say which boundaries
they can restore (``valid``, one bit each, numpy's packbits order) and the scheduler takes the deepest one
every rank can.

``lease`` names the lookup: the worker pins the blocks it reports under it until the scheduler's load
plan (or a release) ends it, or ``ttl_s`` passes.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from kvtier import wire
from kvtier.store.types import count_in_runs

log = logging.getLogger(__name__)

OP_PREFIX = "kv_prefix"
OP_PING = "ping"
MAX_HASHES = 1 << 20  # one lookup: a 16M-token prompt at 16 tokens per block
MAX_HASH_BYTES = 64


@dataclass(frozen=True)
class RankLookupReply:
    """One worker rank's answer to a prefix lookup: ``length`` leading blocks are held (and pinned under the
    lease); ``tiers`` says where, as runs of (tier name, count) in block order."""

    length: int
    tiers: tuple[tuple[str, int], ...] = ()
    valid: tuple[bool, ...] | None = None  # hybrid: boundary k + 1 restorable (length entries); None: a prefix

    def boundaries(self) -> list[bool]:
        """Which boundaries 1..length this rank can restore."""
        return list(self.valid) if self.valid is not None else [True] * self.length

    def count(self, tier: str, upto: int | None = None) -> int:
        """Blocks among the first ``upto`` (default all) held in ``tier``."""
        return count_in_runs(self.tiers, tier, self.length if upto is None else min(upto, self.length))


# A rank's answer to (lease, hashes, ttl_s): what LookupServer calls for each lookup.
RankLookupHandler = Callable[[int, list[bytes], float], RankLookupReply]


IPC_PATH_MAX = 107  # sockaddr_un.sun_path, less the terminating NUL


def endpoint(directory: str, engine_id: str, dp_rank: int, rank: int) -> str:
    """The ipc endpoint of one worker's lookup server (scheduler and worker derive it alike). The engine id
    is hashed to keep the path short: a Unix socket path has at most 107 bytes."""
    engine = hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    path = f"{directory.rstrip('/')}/kvtier-{engine}-dp{dp_rank}-r{rank}.ipc"
    if len(path.encode()) > IPC_PATH_MAX:
        raise ValueError(f"ipc_dir {directory!r} is too long for a Unix socket path ({len(path.encode())} > "
                         f"{IPC_PATH_MAX} bytes with the socket's name); set a shorter ipc_dir")
    return f"ipc://{path}"


class LookupServer:
    """Serves prefix lookups for one worker, on its own thread.

    Runs in the worker process. ``handler(lease, hashes, ttl_s)`` answers (it must be thread-safe: it runs on
    this server's thread while the worker's threads load and save); ``on_idle`` runs about every
    ``idle_s`` (the worker sweeps expired leases there). A malformed request gets an error reply and the
    server keeps serving; a failing handler is logged and answered with ERR_INTERNAL.
    """

    def __init__(self, address: str, handler: RankLookupHandler, *, on_idle: Callable[[], None] | None = None,
                 idle_s: float = 0.2) -> None:
        self.address = address
        self._handler = handler
        self._on_idle = on_idle
        self._idle_s = idle_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise OSError(f"kvtier lookup server cannot bind {address}: {e}") from None
        self._stop = threading.Event()
        self.served = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="kvtier-lookup", daemon=True)
        self._thread.start()
        log.info("kvtier lookup server on %s", address)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()  # sockets before the context: termination can hang otherwise
        self._ctx.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        next_idle = time.monotonic() + self._idle_s
        while not self._stop.is_set():
            if poller.poll(timeout=int(self._idle_s * 1000)):
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    # (Identity, Request): a DEALER client sends one frame, ROUTER prepends its identity.
                    reply = self._serve(frames[-1]) if len(frames) == 2 else None
                    if reply is not None:
                        self._sock.send_multipart([frames[0], reply])
            if self._on_idle is not None and time.monotonic() >= next_idle:
                next_idle = time.monotonic() + self._idle_s
                try:
                    self._on_idle()
                except Exception:
                    log.exception("kvtier lookup server: idle hook failed")

    def _serve(self, frame: bytes) -> bytes:
        req_id = 0
        try:
            req_id, op, body = wire.decode_request(frame)
            if op == OP_PING:
                return wire.encode_reply(req_id, True, {})
            if op != OP_PREFIX:
                raise wire.WireError(wire.ERR_UNKNOWN_OP, f"unknown op {op!r}; this server serves {OP_PREFIX}")
            hashes = _hashes_field(body)
            ttl_s = wire.float_field(body, "ttl_s", 1e-3, 86400.0)
            reply = self._handler(req_id, hashes, ttl_s)
            self.served += 1
            body = {"length": reply.length, "tiers": [list(t) for t in reply.tiers]}
            if reply.valid is not None:
                body["valid"] = np.packbits(np.asarray(reply.valid, dtype=bool)).tobytes()
            return wire.encode_reply(req_id, True, body)
        except wire.WireError as e:
            self.errors += 1
            log.warning("kvtier lookup server: bad request (%s)", e)
            return wire.encode_error(wire.salvage_req_id(e) or req_id, e)
        except Exception as e:  # a bug in the handler must not kill the worker's lookup service
            self.errors += 1
            log.exception("kvtier lookup server: lookup %d failed", req_id)
            return wire.encode_error(req_id, wire.WireError(wire.ERR_INTERNAL, f"{type(e).__name__}: {e}"))


def _hashes_field(body: dict[str, Any]) -> list[bytes]:
    width = wire.int_field(body, "width", 1, MAX_HASH_BYTES)
    blob = wire.field(body, "hashes", bytes)
    if len(blob) % width:
        raise wire.WireError(wire.ERR_BAD_REQUEST, f"field 'hashes': {len(blob)} bytes is not a whole number "
                                                   f"of {width}-byte hashes")
    if len(blob) // width > MAX_HASHES:
        raise wire.WireError(wire.ERR_TOO_LARGE, f"{len(blob) // width} hashes in one lookup, the limit is "
                                                 f"{MAX_HASHES}")
    return [blob[i : i + width] for i in range(0, len(blob), width)]


@dataclass
class _Pending:
    started: float
    replies: dict[int, RankLookupReply] = field(default_factory=dict)


@dataclass(frozen=True)
class ConnectorLookup:
    """The connector's answer to one lookup over every rank: the shortest prefix every rank holds, where the
    first rank holding exactly that many keeps it, and how long the answer took."""

    reply: RankLookupReply
    seconds: float

    @property
    def length(self) -> int:
        return self.reply.length


class LookupClient:
    """Sends prefix lookups to every worker and collects replies without blocking.

    Runs in the scheduler process and is used from the scheduler's thread only (not thread-safe). A rank
    that answers with an error counts as holding nothing; a lookup some rank has not answered within
    ``timeout_s`` is ``expired`` (the caller treats it as a miss and releases its lease).
    """

    def __init__(self, endpoints: Sequence[str], timeout_s: float, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        if not endpoints:
            raise ValueError("a LookupClient needs at least one worker endpoint")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._clock = clock
        self._ctx = zmq.Context()
        self._socks = []
        for address in self.endpoints:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # A worker that (re)starts after us is found within 10 ms, not zmq's default 100 ms and more.
            sock.setsockopt(zmq.RECONNECT_IVL, 10)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 100)
            sock.connect(address)
            self._socks.append(sock)
        self._pending: dict[int, _Pending] = {}

    def submit(self, lease: int, hashes: Sequence[bytes], ttl_s: float) -> None:
        """Ask every rank which leading ``hashes`` it holds, pinning them under ``lease`` for ``ttl_s``."""
        width = len(hashes[0]) if hashes else 32
        if any(len(h) != width for h in hashes):
            raise ValueError("block hashes of one request must all have the same length")
        frame = wire.encode_request(lease, OP_PREFIX, {"hashes": b"".join(hashes), "width": width, "ttl_s": ttl_s})
        pending = self._pending[lease] = _Pending(self._clock())
        for rank, sock in enumerate(self._socks):
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:  # the rank's queue is full: it is not reading; count it as holding nothing
                log.warning("kvtier lookup: rank %d at %s is not accepting lookups", rank, self.endpoints[rank])
                pending.replies[rank] = RankLookupReply(0)

    def poll(self) -> None:
        """Read every reply that has arrived."""
        for rank, sock in enumerate(self._socks):
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._take(rank, frame)

    def result(self, lease: int) -> ConnectorLookup | None:
        """The answer once every rank replied, else None (see ``expired``)."""
        pending = self._pending.get(lease)
        if pending is None or len(pending.replies) < len(self._socks):
            return None
        shortest = min(pending.replies.values(), key=lambda r: r.length)
        if all(r.valid is None for r in pending.replies.values()):
            return ConnectorLookup(shortest, self._clock() - pending.started)
        # Hybrid: the deepest boundary every rank can restore (each pinned what any of its boundaries needs).
        common = [all(v) for v in zip(*(r.boundaries()[: shortest.length] for r in pending.replies.values()))]
        length = max((k + 1 for k, v in enumerate(common) if v), default=0)
        # Where the blocks are: rank 0's runs (counted up to the common length only).
        tiers = pending.replies[0].tiers if 0 in pending.replies else shortest.tiers
        return ConnectorLookup(RankLookupReply(length, tiers, tuple(common[:length])), self._clock() - pending.started)

    def expired(self, lease: int) -> bool:
        pending = self._pending.get(lease)
        return pending is not None and self._clock() - pending.started > self.timeout_s

    def forget(self, lease: int) -> None:
        self._pending.pop(lease, None)

    def close(self) -> None:
        for sock in self._socks:
            sock.close()
        self._ctx.term()

    def _take(self, rank: int, frame: bytes) -> None:
        try:
            req_id, ok, body = wire.decode_reply(frame)
        except wire.WireError as e:
            log.warning("kvtier lookup: bad reply from rank %d: %s", rank, e)
            return
        pending = self._pending.get(req_id)
        if pending is None:
            return  # a late reply to a lookup already given up on
        if not ok:
            log.warning("kvtier lookup %d: rank %d answered %s: %s", req_id, rank, body.get("code"),
                        body.get("message"))
            pending.replies[rank] = RankLookupReply(0)
            return
        try:
            length = wire.int_field(body, "length", 0, MAX_HASHES)
            tiers = tuple((str(name), int(n)) for name, n in wire.field(body, "tiers", list, []))
            bits = wire.field(body, "valid", bytes, None)
            valid = None
            if bits is not None:
                if len(bits) != (length + 7) // 8:
                    raise ValueError(f"'valid' has {len(bits)} bytes for {length} boundaries")
                valid = tuple(bool(b) for b in np.unpackbits(np.frombuffer(bits, np.uint8), count=length))
        except (wire.WireError, TypeError, ValueError) as e:
            log.warning("kvtier lookup %d: malformed reply from rank %d: %s", req_id, rank, e)
            length, tiers, valid = 0, (), None
        pending.replies[rank] = RankLookupReply(length, tiers, valid)
