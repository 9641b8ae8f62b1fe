"""MasterServer: the kvtier-master process. One asyncio (uvloop) loop owns all state; one zmq ROUTER socket.

    client DEALER --[payload]--> ROUTER --[identity, payload]--> serve() --> [identity, reply] --> client

The loop watches the socket's file descriptor and, when zmq signals, drains every queued request (up to a
bound, so the timer still runs) and answers each before waiting again: a burst of lookups costs one wakeup,
not one per request, and no future is created per request. Ops are synchronous numpy work on the loop; nothing else touches the state, so nothing locks.
Where the state lives is the backend's business (backend.py): this process with lmdb under it, or a log in
Redis shared by several masters (shared.py), which answers writes once they are applied. A bad request gets an error reply naming the problem; a bug in an op gets ERR_INTERNAL and a
logged traceback, and the loop goes on.

Bounds on what clients can make the master hold (docs/reliability.md): zmq reads at most MAXMSGSIZE per message
(``MasterSettings.message_bytes``) and RCVHWM messages per connection before it stops reading that connection;
a connection has ``--handshake-timeout-s`` to finish zmq's handshake; ZMTP heartbeats drop peers that stop
answering; replies wait in SNDHWM per connection and, when large, in the ReplyBudget (replies.py). The
process raises its soft file-descriptor limit to the hard one at start, so idle connections do not lock new
clients out at the usual 1,024.

With keys (``--auth-dir``) every message carries its connection's CurveZMQ key (zmq's User-Id), and an op the
key's roles do not allow is refused with ERR_FORBIDDEN before it runs (access.py, kvtier/auth/roles.py).

Shutdown (SIGTERM or SIGINT): stop taking requests, write the final snapshot, node records and hints,
close lmdb, exit 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import signal
import time
from pathlib import Path
from typing import Any

import zmq

from kvtier import wire
from kvtier.auth import OwnerGate, ServerAuth, forget_tokens
from kvtier.master import ops_node, ops_router
from kvtier.master.access import ANONYMOUS, Caller
from kvtier.master.backend import make_backend
from kvtier.master.metrics import MasterMetrics
from kvtier.master.replies import ReplyBudget
from kvtier.master.service import MasterSettings, MasterState
from kvtier.ratelog import RateLimitedLog
from kvtier.wire import WireError

log = logging.getLogger("kvtier.master")

OPS = {**ops_router.OPS, **ops_node.OPS}
PERMISSIONS = {**ops_router.PERMISSIONS, **ops_node.PERMISSIONS}
# Ops that change the state: with a shared directory they are recorded in its log and applied from there.
WRITE_OPS = frozenset({wire.REGISTER, wire.HEARTBEAT, wire.EVENTS, wire.INVENTORY, wire.GOODBYE, wire.FORGET,
                       wire.PIN, wire.UNPIN, wire.PRIORITY, wire.PREFETCH})
DRAIN_LIMIT = 256  # requests answered per wakeup before the timer gets a turn
TICK_S = 0.1
RCVHWM = 32  # requests queued per connection before zmq stops reading it (backpressure: nothing is lost)
SNDHWM = 256  # replies queued per connection; past that its client is not reading: further replies are dropped
HEARTBEAT_IVL_MS = 5_000  # ZMTP pings: a peer that answers nothing for HEARTBEAT_TIMEOUT_MS is disconnected
HEARTBEAT_TIMEOUT_MS = 20_000
# Ops whose keys count toward kvtier_master_request_keys.
_KEYED = {wire.LOOKUP, wire.COST, wire.LOCATE, wire.HEAT, wire.PIN, wire.UNPIN, wire.PRIORITY}


class MasterServer:
    """Serves one MasterState on ``settings.bind`` until ``stop()``. Create and run inside one process."""

    def __init__(self, settings: MasterSettings, ready_file: str | None = None) -> None:
        self.settings = settings
        self.ready_file = ready_file
        self.metrics = MasterMetrics()
        self.backend = make_backend(settings, self.metrics)
        self.endpoint = ""
        self.metrics_port: int | None = None
        self._stop: asyncio.Event | None = None
        self._bad = RateLimitedLog(log)
        # Who may connect: keys (--auth-dir), else this user's processes (the owner token), else anyone
        # (--insecure-bind). Read now: a missing key or an unsafe token directory is a start-up error (AuthError),
        # before anything is opened.
        count = self.metrics.refused_connections
        self.auth = ServerAuth(settings.auth_dir, count) if settings.auth_dir else None
        keyless = not settings.auth_dir and not settings.insecure_bind
        self.owner = OwnerGate(count, [settings.bind]) if keyless else None
        self.gate = self.auth or self.owner
        self._callers: dict[str, Caller] = {}  # User-Id -> Caller (at most one per admitted key)
        self.replies = ReplyBudget(settings.reply_budget_bytes, settings.client_reply_bytes)

    @property
    def state(self) -> MasterState:
        return self.backend.state  # a shared backend replaces it when it reloads

    # ---- requests --------------------------------------------------------------------------------------

    def serve(self, frame: bytes | memoryview, caller: Caller = ANONYMOUS,
              answer: Any = None) -> tuple[int, bytes | None]:
        """Answer one request frame from ``caller``: (its req_id, the reply frame). Never raises. With a shared
        backend a write's reply is None here: ``answer(req_id, reply)`` sends it once the write is applied."""
        t0 = time.perf_counter()
        op, req_id, nkeys, error = "?", 0, 0, ""
        try:
            req_id, op, body = wire.decode_request(frame)
            handler = OPS.get(op)
            if handler is None:
                raise WireError(wire.ERR_UNKNOWN_OP, f"unknown op {op[:64]!r}; known: {', '.join(sorted(OPS))}")
            caller.check(op, PERMISSIONS[op], self.auth.book if self.auth else None)
            if self.backend.shared and op in WRITE_OPS and answer is not None:
                self.backend.submit(req_id, op, body, caller,
                                    lambda rid, reply, status, err: self._answered(op, t0, rid, reply, status, err,
                                                                                   answer))
                return req_id, None
            reply = wire.encode_reply(req_id, True, handler(self.state, body, caller))
            if op in _KEYED and isinstance(body.get("keys"), bytes):
                nkeys = len(body["keys"]) // 16
            status = "ok"
        except WireError as e:
            req_id = req_id or wire.salvage_req_id(e)
            reply = wire.encode_error(req_id, e)
            status, error = e.code, str(e)
            self._bad(e.code, logging.WARNING, "bad request (op %s): %s", op[:64], e)
        except (Exception, SystemExit) as e:  # a bug in an op (even a sys.exit in it): answer, log, keep serving
            status, error = wire.ERR_INTERNAL, f"{type(e).__name__}: {e}"
            reply = wire.encode_error(req_id, WireError(wire.ERR_INTERNAL, f"{type(e).__name__} in op {op[:64]}: "
                                                        f"{e}"[:500]))
            self._bad("internal:" + op[:64], logging.ERROR, "internal error serving op %s", op[:64], exc_info=True)
        self._count(op, status, error, t0, nkeys)
        return req_id, reply

    def _count(self, op: str, status: str, error: str, t0: float, nkeys: int = 0) -> None:
        self.metrics.observe(op, status, time.perf_counter() - t0, nkeys)
        self.state.activity.request(op if op in OPS else "unknown", status)
        if status != "ok":
            self.state.activity.error(time.time(), op, status, error)

    def _answered(self, op: str, t0: float, req_id: int, reply: bytes, status: str, error: str, answer: Any) -> None:
        """A write the shared backend applied (or refused): count it and send its reply."""
        if status == wire.ERR_UNAVAILABLE:  # the backend logs why once; each refusal, rate-limited, here
            self._bad(status, logging.WARNING, "write refused (op %s): %s", op[:64], error)
        elif status not in ("ok", wire.ERR_INTERNAL):
            self._bad(status, logging.WARNING, "bad request (op %s): %s", op[:64], error)
        self._count(op, status, error, t0)
        answer(req_id, reply)

    def _caller(self, auth: ServerAuth, frame: zmq.Frame) -> Caller:
        """Who sent ``frame``: its connection's CurveZMQ key, which the handshake proved."""
        key = frame.get("User-Id")
        caller = self._callers.get(key)
        if caller is None:
            caller = self._callers[key] = Caller(key, auth.permissions(key), auth.book.of(key))
        return caller

    # ---- lifetime --------------------------------------------------------------------------------------

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def run(self) -> None:
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        # Restored (lmdb) or caught up with the shared log: only then bind. A SIGTERM meanwhile stops it.
        opening = asyncio.ensure_future(self.backend.open())
        stopping = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({opening, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not opening.done():
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)
            await self.backend.close(flush=False)
            return
        opening.result()
        raise_fd_limit()
        ctx = zmq.Context()
        auth, gate = self.auth, self.gate
        if gate is not None:
            gate.start(ctx)  # a thread of its own: it answers ZAP requests beside the loop, on the same context
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.settings.message_bytes())
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or vanished client's reply raises: counted, not silent
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(self.settings.handshake_timeout_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        serving = False
        try:
            if gate is not None:
                gate.secure(sock, self.settings.bind)
                gate.watch(sock, ctx)
            sock.bind(self.settings.bind)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.owner is not None:
                self.owner.publish([self.endpoint])
            elif auth is None:
                forget_tokens([self.endpoint])  # a token left by an earlier master here would make clients speak PLAIN
            if self.settings.metrics_port is not None:
                self.metrics_port = self.metrics.serve(self.settings.metrics_port, self.settings.metrics_host)
            log.info("kvtier-master %s: serving on %s%s; metrics %s; state %s; lease %.3g s, heat half-life "
                     "%.3g s, placement %s", os.getpid(), self.endpoint,
                     f" (CurveZMQ, keys in {self.settings.auth_dir})" if auth else
                     f" (owner token: {self.owner.user}'s processes only)" if self.owner else
                     " (WITHOUT AUTHENTICATION: --insecure-bind)",
                     f"http://{self.settings.metrics_host}:{self.metrics_port}/metrics" if self.metrics_port
                     else "off", f"shared in {self.settings.directory}" if self.settings.directory
                     else f"in lmdb at {self.settings.data_dir}" if self.settings.data_dir
                     else "in memory (nothing persists)", self.settings.lease_s,
                     self.settings.heat_half_life_s, self.settings.placement)
            self._write_ready()
            serving = True
            # zmq signals readiness on its FD edge-triggered: on each wakeup, drain until zmq says nothing is
            # left (``_drain``); the timer drains too, as a safety net against a missed edge.
            loop.add_reader(sock.getsockopt(zmq.FD), self._drain, sock)
            timer = asyncio.create_task(self._timer(sock))
            try:
                self._drain(sock)
                await self._stop.wait()
            finally:
                loop.remove_reader(sock.getsockopt(zmq.FD))
                timer.cancel()
        finally:
            sock.close(linger=0)
            self.metrics.close()  # its port's thread (started only once serving; a no-op otherwise)
            if gate is not None:
                gate.stop()
            ctx.term()
            await self._shutdown(flush=serving)

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        """Answer every queued request (up to DRAIN_LIMIT, then yield to the loop and come back)."""
        auth = self.auth
        for _ in range(DRAIN_LIMIT):
            if self._stop is not None and self._stop.is_set():
                return
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            # With keys the frames stay zmq Frames: they carry the sender's User-Id (its key).
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=auth is None)
            if len(frames) < 2:
                continue  # not a routed message
            if auth is not None:
                caller, payload = self._caller(auth, frames[-1]), frames[-1].buffer
                route = [f.bytes for f in frames[:-1]]
            else:
                caller, payload, route = ANONYMOUS, frames[-1], frames[:-1]
            req_id, reply = self.serve(payload, caller, lambda rid, r, route=route: self._reply(sock, route, rid, r))
            if reply is not None:
                self._reply(sock, route, req_id, reply)
        asyncio.get_running_loop().call_soon(self._drain, sock)

    def _reply(self, sock: zmq.Socket[Any], route: list[Any], req_id: int, reply: bytes) -> None:
        """Queue ``reply`` for the client at ``route`` within the ReplyBudget; drops are counted and logged."""
        client = bytes(route[0])
        big = len(reply) >= self.replies.track_bytes
        if big and not self.replies.admits(client, len(reply)):
            self.metrics.replies_dropped.labels("budget").inc()
            self._bad("budget", logging.WARNING, "a %d-byte reply replaced by ERR_BUSY: %d bytes of replies are "
                      "unsent (a client not reading its replies?)", len(reply), self.replies.unsent)
            reply, big = wire.encode_error(req_id, WireError(
                wire.ERR_BUSY, f"this reply ({len(reply)} bytes) would pass the master's budget of unsent replies "
                f"({self.replies.unsent} bytes unsent, {self.replies.of(client)} of them to this "
                "client): read the replies you asked for, then retry")), False
        try:
            if big:
                tracker = sock.send_multipart([*route, reply], zmq.NOBLOCK, copy=False, track=True)
                self.replies.sent(client, len(reply), tracker)
                self.metrics.unsent_reply_bytes.set(self.replies.unsent)
            else:
                sock.send_multipart([*route, reply], zmq.NOBLOCK)
        except zmq.Again:
            self.metrics.replies_dropped.labels("queue_full").inc()
            self._bad("send", logging.WARNING, "reply dropped: the client's queue is full (%d replies unread)", SNDHWM)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.metrics.replies_dropped.labels("gone").inc()  # the client disconnected before its answer

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("kvtier-master: %s received, shutting down", signal.Signals(sig).name)
        self.stop()

    async def _timer(self, sock: zmq.Socket[Any]) -> None:
        interval = min(TICK_S, self.settings.lease_s / 5)
        while True:
            await asyncio.sleep(interval)
            try:
                self._drain(sock)
                self.state.tick()
                self.replies.collect()
                self.metrics.unsent_reply_bytes.set(self.replies.unsent)
                self.backend.tick()
            except Exception:
                log.exception("master housekeeping failed; retrying at the next tick")

    async def _shutdown(self, flush: bool) -> None:
        await self.backend.close(flush)
        if flush:
            where = (", state flushed to disk" if self.settings.data_dir
                     else f", state in {self.settings.directory}" if self.settings.directory else "")
            log.info("kvtier-master %s: stopped (%d keys, %d nodes%s)", os.getpid(), len(self.state.directory),
                     len(self.state.registry.nodes), where)

    def _write_ready(self) -> None:
        if not self.ready_file:
            return
        path = Path(self.ready_file)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"endpoint": self.endpoint, "metrics_port": self.metrics_port,
                                   "pid": os.getpid()}))
        tmp.replace(path)


def raise_fd_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit: every client connection is a descriptor, and at the usual soft
    1,024 a thousand idle connections would keep new clients out of the port."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft >= want:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        log.info("file descriptor limit raised from %d to %d (one per client connection)", soft, want)
    except (ValueError, OSError) as e:
        log.warning("file descriptor limit stays %d (%s): about that many idle connections lock new clients out",
                    soft, e)
