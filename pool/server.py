"""PoolServer: the kvtier-pool process. One zmq ROUTER on every endpoint, a dispatcher, and worker threads.

    client DEALER --[envelope, *data]--> ROUTER (tcp://, ipc://) --dispatcher--> inproc --> worker 1..N
                                                                                              |
    client DEALER <--[envelope, *data]-- ROUTER <------------dispatcher---------- inproc <----+

    client socket <--[length, envelope] + bytes--> data port (pool/stream.py, a thread per connection)

The dispatcher (pool/dispatch.py) tells each worker who sent a request, queues per client and hands
requests out in turn. Workers decode a request, run its op (pool/ops.py) and send the reply. Several
workers copy at once (the batched copies release the GIL); zmq's I/O threads move bytes meanwhile. A get's
reply frames point into the pool's slots (zero-copy send) or a copy sized to the reply; the worker keeps
those blocks acquired (or the copy charged to the client) until zmq's tracker says the bytes are gone. The
main thread expires leases and waits for a signal; ``metrics`` (pool/metrics.py) serves Prometheus.

A bad request gets an error reply naming the problem (a wrong protocol version is logged here too, so both
sides say why); a bug in an op gets ERR_INTERNAL and a logged traceback; the pool keeps serving.
Shutdown (SIGTERM/SIGINT, or ``stop()``): stop taking requests, drop what waits and what zmq still holds for
clients that do not read (no waiting on them: a second or two whatever the load), say goodbye to the master,
free the DRAM.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from kvtier import wire
from kvtier.auth import OwnerGate, ServerAuth, forget_tokens
from kvtier.pool import clients, ops
from kvtier.pool.dispatch import BACKEND, IDLE, REPLY, Dispatcher
from kvtier.pool.ports import PortWatch, bind_private, raise_fd_limit
from kvtier.pool.state import PoolSettings, PoolState
from kvtier.ratelog import RateLimitedLog
from kvtier.units import format_bytes
from kvtier.wire import WireError

log = logging.getLogger("kvtier.pool")

TICK_S = 0.1
# Replies queued per client connection before further ones are dropped (counted and logged: see run()). zmq
# counts a connection's queue with a lag of up to half of it (a pipe acknowledges reads in batches), so a client
# keeps at most REPLY_HWM / 2 requests in flight per connection: one with 6 lost a reply in 3 of 10 runs here
# (kvtier's own keep 2 per connection: a batch's window, kvtier/transport/channel.py).
REPLY_HWM = 8
REQUEST_HWM = 64  # requests zmq buffers per connection before the dispatcher has read them
JOIN_S = 1.0  # at shutdown: how long the threads get, all together, to notice


class PoolServer:
    """Serves one PoolState on ``settings.bind`` until ``stop()``. ``run()`` blocks; create it in the process
    that serves (it installs signal handlers when run on the main thread)."""

    def __init__(self, settings: PoolSettings, ready_file: str | None = None) -> None:
        self.settings = settings
        self.ready_file = ready_file
        self.state = PoolState(settings)
        self._stop = threading.Event()
        self._bad = RateLimitedLog(log)
        self._ctx = zmq.Context(io_threads=max(1, min(4, settings.workers)))
        self._stream: Any = None  # kvtier.pool.stream.StreamServer
        self._watch: PortWatch | None = None
        self.metrics: Any = None  # kvtier.pool.metrics.PoolMetrics
        # Who may connect: keys (--auth-dir), else this user's processes (the owner token), else anyone
        # (--insecure-bind). Read now: a missing key or an unsafe token directory is a start-up error (AuthError),
        # before any memory is taken.
        count = lambda name: self.state.count(**{name: 1})  # noqa: E731
        self.auth = ServerAuth(settings.auth_dir, count=count) if settings.auth_dir else None
        keyless = not settings.auth_dir and not settings.insecure_bind
        self.owner = OwnerGate(count, settings.bind) if keyless else None
        self.gate = self.auth or self.owner

    # ---- requests --------------------------------------------------------------------------------------

    def serve(self, client: clients.Client, envelope: Any, data: list[Any]) -> tuple[bytes, ops.Reply | None, bool]:
        """Answer one request (never raises): (reply envelope, the op's reply or None, send a reply at all)."""
        op, req_id, t0, status = "?", 0, time.perf_counter(), "ok"
        try:
            req_id, op, body = wire.decode_request(envelope.buffer if hasattr(envelope, "buffer") else envelope)
            handler = ops.OPS.get(op)
            if handler is None:
                raise WireError(wire.ERR_UNKNOWN_OP, f"unknown op {op[:64]!r}; known: {', '.join(sorted(ops.OPS))}")
            if self.auth is not None:  # keys required: each op needs its permission (kvtier/auth/roles.py)
                self.auth.book.check(op, ops.PERMISSIONS.get(op), client.key)
            reply = handler(self.state, client, body, data)
            wanted = not (op in ops.NO_REPLY_OPS and body.get("noreply") is True)
            return wire.encode_reply(req_id, True, {**reply.body, "epoch": self.state.epoch}), reply, wanted
        except WireError as e:
            status = e.code
            req_id = req_id or wire.salvage_req_id(e)
            self.state.count(**{f"error_{e.code}": 1})
            if e.code == wire.ERR_BAD_VERSION:
                self._bad("version", logging.WARNING, "refused a client: %s", e.message)
            else:
                self._bad(e.code, logging.WARNING, "bad request (op %s) from %s: %s", op[:64], client.account, e)
            body = {"code": e.code, "message": e.message, "epoch": self.state.epoch}
            return wire.encode_reply(req_id, False, body), None, True
        except Exception as e:  # a bug in an op: answer, log, keep serving
            status = wire.ERR_INTERNAL
            self.state.count(error_internal=1)
            self._bad("internal:" + op[:64], logging.ERROR, "internal error serving op %s", op[:64], exc_info=True)
            err = WireError(wire.ERR_INTERNAL, f"{type(e).__name__} in op {op[:64]}: {e}"[:500])
            return wire.encode_reply(req_id, False, {"code": err.code, "message": err.message,
                                                     "epoch": self.state.epoch}), None, True
        finally:
            if self.metrics is not None:
                self.metrics.observe(op, status, time.perf_counter() - t0)

    # ---- lifetime --------------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        s = self.settings
        raise_fd_limit()
        frontend = self._ctx.socket(zmq.ROUTER)
        frontend.setsockopt(zmq.LINGER, 0)
        # A frame is at most MAX_FRAME_BYTES of blocks, or one block (clients' frames, kvtier/wire/frames.py):
        # zmq allocates a frame as its header declares it, so no larger one is taken in.
        frontend.setsockopt(zmq.MAXMSGSIZE, max(s.max_frame_bytes, s.block_bytes))
        frontend.setsockopt(zmq.RCVHWM, REQUEST_HWM)
        # Replies queued per client connection: a client has a few requests in flight per connection (its
        # window); past REPLY_HWM it is not reading (stalled, SIGSTOPped), and further replies to it are dropped
        # instead of queued, which frees the staging buffers and slots they hold. ROUTER_MANDATORY: a reply zmq
        # cannot queue (or route: the client is gone) fails its send instead of vanishing, so the dispatcher
        # counts and logs each one (pool/dispatch.py).
        frontend.setsockopt(zmq.SNDHWM, REPLY_HWM)
        frontend.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A connection that has not finished its handshake (greeting, CURVE, ZAP) this fast is dropped.
        frontend.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(s.handshake_s * 1000)))
        # Connections of hosts that vanished (power loss, a cut link) are found and closed by TCP keepalives.
        frontend.setsockopt(zmq.TCP_KEEPALIVE, 1)
        frontend.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 60)
        frontend.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 10)
        endpoints = []
        try:
            if self.gate is not None:
                self.gate.start(self._ctx)
            self._watch = PortWatch(frontend, self._ctx, lambda name, n: self.state.count(**{name: n}), self.gate)
            for endpoint in s.bind:
                if self.gate is not None:
                    self.gate.secure(frontend, endpoint)  # per bind: each endpoint admits its own owner token
                bind_private(frontend, endpoint)
                endpoints.append(frontend.getsockopt_string(zmq.LAST_ENDPOINT))
            if self.owner is not None:
                self.owner.publish(endpoints)
            elif self.auth is None:
                forget_tokens(endpoints)  # a token left by an earlier pool here would make clients speak PLAIN
            stream = self._start_stream(endpoints)
            self.state.start(endpoints)
            if s.metrics_port is not None:
                from kvtier.pool.metrics import PoolMetrics

                self.metrics = PoolMetrics(self.state, self._watch, self._stream)
                self.state.metrics_port = self.metrics.serve(s.metrics_port, s.metrics_host)
            dispatcher = Dispatcher(self._ctx, frontend, self.state, self._stop)
        except BaseException:
            frontend.close(linger=0)
            self._release([])
            raise
        self.state.dispatcher = dispatcher
        sending: list[list[_Sending]] = [[] for _ in range(s.workers)]
        threads = [threading.Thread(target=dispatcher.run, name="kvtier-pool-dispatch", daemon=True)]
        threads += [threading.Thread(target=self._work, args=(i, sending[i]), name=f"kvtier-pool-worker-{i}",
                                     daemon=True) for i in range(s.workers)]
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        for t in threads:
            t.start()
        tier = self.state.tier
        log.info("kvtier-pool %s (%s): serving on %s%s%s; capacity %s%s; %d workers; lease %.3g s; master %s%s",
                 os.getpid(), self.state.node_id, ", ".join(endpoints),
                 f" (CurveZMQ, keys in {s.auth_dir}; data port by token)" if self.auth else
                 f" (owner token: {self.owner.user}'s processes only; data port by token)" if self.owner else
                 " (WITHOUT AUTHENTICATION: --insecure-bind)",
                 f" (data port {stream})" if stream else "", format_bytes(s.capacity),
                 f" in blocks of {tier.block_bytes} B" if tier else " (block size set by the first put)",
                 s.workers, s.lease_s, s.master or "none (clients list this pool themselves)",
                 f"; metrics on {s.metrics_host}:{self.state.metrics_port}" if self.metrics else "")
        self._write_ready(endpoints)
        try:
            while not self._stop.wait(TICK_S):
                self.state.leases.expire()
        finally:
            log.info("kvtier-pool %s: shutting down", os.getpid())
            t0 = time.monotonic()
            for t in threads:  # the dispatcher closes the frontend as it ends (its socket, its thread)
                t.join(max(0.0, t0 + JOIN_S - time.monotonic()))
            stats = self.state.stats()
            self._release([x for per in sending for x in per])
            log.info("kvtier-pool %s: stopped in %.2f s (%s)", os.getpid(), time.monotonic() - t0,
                     json.dumps(stats["counters"], sort_keys=True))

    def _release(self, sending: list[_Sending]) -> None:
        """Free what run() set up, once its sockets are closed: the port monitor, the authenticator (its ZAP
        socket lives in the context, so it stops before the context ends), the context (its end drops what
        zmq still held for clients, so the replies' slots and copies can go), the data port, the DRAM, the
        agent."""
        if self._watch is not None:
            self._watch.stop()
        if self.gate is not None:
            self.gate.stop()
        self._ctx.term()
        for s in sending:
            s.release()
        if self._stream is not None:
            self._stream.close()
        if self.metrics is not None:
            self.metrics.close()
        self.state.close()

    def _start_stream(self, endpoints: list[str]) -> int:
        """Open the raw TCP data port next to the first tcp endpoint (unless --stream off); its port or 0."""
        spec = self.settings.stream
        tcp = [e for e in endpoints if e.startswith("tcp://")]
        if spec == "off" or (spec == "auto" and not tcp):
            return 0
        if spec == "auto":
            host, port = tcp[0][len("tcp://"):].rpartition(":")[0].strip("[]"), 0
        else:
            host, _, p = spec.rpartition(":")
            port = int(p)
        from kvtier.pool.stream import StreamServer

        self._stream = StreamServer(self.state, host, port, timeout_s=self.settings.lease_s, tokens=self.state.tokens,
                                    message_timeout_s=self.settings.stream_message_timeout_s,
                                    max_connections=self.settings.stream_max_connections,
                                    max_pending=self.settings.stream_pending_max,
                                    handshake_s=self.settings.handshake_s)
        self.state.stream_port = self._stream.start()
        return self.state.stream_port

    def _work(self, index: int, sending: list[_Sending]) -> None:
        """A worker: one request at a time from the dispatcher. Replies zmq is still sending stay in
        ``sending`` (owned by run() after this returns: released once the context is gone)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, b"w%d" % index)
        sock.connect(BACKEND)
        try:
            sock.send(IDLE)
            while not self._stop.is_set():
                if sock.poll(5 if sending else 200):
                    try:
                        self._answer(sock, sock.recv_multipart(copy=False), sending)
                    except zmq.ContextTerminated:
                        raise
                    except Exception:  # never lose a worker: the client times out, the next request is served
                        self._bad("worker", logging.ERROR, "worker %d failed to answer a request", index,
                                  exc_info=True)
                        sock.send(IDLE)
                if sending:
                    sending[:] = [s for s in sending if not s.finish(self.state)]
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)

    def _answer(self, sock: zmq.Socket[Any], frames: list[Any], sending: list[_Sending]) -> None:
        # [client, identity, (empty delimiter from REQ-style clients), envelope, *data]
        client_frame = frames[0].bytes
        client = clients.decode(client_frame)
        frames = frames[1:]
        route = 2 if len(frames) > 2 and len(frames[1]) == 0 else 1
        t0 = time.perf_counter()
        envelope, reply, wanted = self.serve(client, frames[route], frames[route + 1:])
        release = reply.release if reply is not None else None
        if not wanted:
            sock.send(IDLE)
            if release is not None:
                release()
            return
        # Routing frames were received (zmq.Frame, untracked): re-sent as bytes so the reply can be tracked. The
        # client's frame goes back with it: a reply the dispatcher cannot deliver names its client in the log.
        out = [REPLY, client_frame, *(f.bytes for f in frames[:route]), envelope,
               *(reply.data if reply is not None else [])]
        try:
            tracker = sock.send_multipart(out, zmq.NOBLOCK, copy=False, track=release is not None)
        except zmq.Again:
            self._bad("send", logging.WARNING, "reply dropped: the dispatcher's queue is full")
            sock.send(IDLE)
            tracker = None
        if release is not None:
            if tracker is None:
                release()
            else:
                sending.append(_Sending(tracker, release, t0, sum(len(d) for d in out[route + 3:])))

    def _on_signal(self, sig: int, _frame: Any) -> None:
        log.info("kvtier-pool: %s received, shutting down", signal.Signals(sig).name)
        self.stop()

    def _write_ready(self, endpoints: list[str]) -> None:
        if not self.ready_file:
            return
        path = Path(self.ready_file)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"endpoints": endpoints, "node": self.state.node_id, "pid": os.getpid(),
                                   "epoch": self.state.epoch, "shm_path": str(self.state.shm_path or ""),
                                   "stream_port": self.state.stream_port,
                                   "metrics_port": self.state.metrics_port}))
        tmp.replace(path)


class _Sending:
    """A zero-copy reply zmq is still sending: what to release when it is sent, and when its request came in."""

    __slots__ = ("tracker", "release", "t0", "nbytes")
    MEASURE_BYTES = 1 << 20  # smaller replies are all latency: they say nothing about bandwidth

    def __init__(self, tracker: zmq.MessageTracker, release: Any, t0: float, nbytes: int) -> None:
        self.tracker, self.release, self.t0, self.nbytes = tracker, release, t0, nbytes

    def finish(self, state: PoolState) -> bool:
        """Release what the reply holds if zmq is done with it; True when released."""
        if not self.tracker.done:
            return False
        self.release()
        if self.nbytes >= self.MEASURE_BYTES:
            state.record_read(self.nbytes, time.perf_counter() - self.t0)
        return True
