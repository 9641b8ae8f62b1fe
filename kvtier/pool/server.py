"""PoolServer: the kvtier-pool process. One zmq ROUTER on every endpoint, a proxy, and worker threads.

    client DEALER --[envelope, *data]--> ROUTER (tcp://, ipc://) --proxy--> inproc --> worker 1..N
                                                                                        |
    client DEALER <--[envelope, *data]-- ROUTER <----------proxy-------- inproc <-------+

    client socket <--[length, envelope] + bytes--> data port (kvtier/pool/stream.py, a thread per connection)

Workers decode a request, run its op (kvtier/pool/ops.py) and send the reply. Several workers copy at once
(the batched copies release the GIL); zmq's I/O threads move bytes to and from the sockets meanwhile. A get's
reply frames point into the pool's slots (zero-copy send); the worker keeps those blocks acquired until
zmq's tracker says the bytes are gone, then releases them. The main thread expires leases and waits for a
signal.

A bad request gets an error reply naming the problem (a wrong protocol version is logged here too, so both
sides say why); a bug in an op gets ERR_INTERNAL and a logged traceback; the pool keeps serving.
Shutdown (SIGTERM/SIGINT, or ``stop()``): stop taking requests, say goodbye to the master, free the DRAM.
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
from kvtier.auth import ServerAuth
from kvtier.auth.gate import RoleGate
from kvtier.pool import ops
from kvtier.pool.state import PoolSettings, PoolState
from kvtier.ratelog import RateLimitedLog
from kvtier.units import format_bytes
from kvtier.wire import WireError

log = logging.getLogger("kvtier.pool")

BACKEND = "inproc://kvtier-pool-workers"
CONTROL = "inproc://kvtier-pool-control"
TICK_S = 0.1
REPLY_HWM = 8  # replies queued per client connection before zmq drops further ones (see run())


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
        # Keys are read now: a missing one is a start-up error (AuthError), before any memory is taken.
        self.auth = ServerAuth(settings.auth_dir, count=lambda name: self.state.count(**{name: 1})) \
            if settings.auth_dir else None

    # ---- requests --------------------------------------------------------------------------------------

    def serve(self, envelope: Any, data: list[Any]) -> tuple[bytes, ops.Reply | None, bool]:
        """Answer one request (never raises): (reply envelope, the op's reply or None, send a reply at all)."""
        op, req_id = "?", 0
        try:
            req_id, op, body = wire.decode_request(envelope.buffer if hasattr(envelope, "buffer") else envelope)
            handler = ops.OPS.get(op)
            if handler is None:
                raise WireError(wire.ERR_UNKNOWN_OP, f"unknown op {op[:64]!r}; known: {', '.join(sorted(ops.OPS))}")
            reply = handler(self.state, body, data)
            wanted = not (op in ops.NO_REPLY_OPS and body.get("noreply") is True)
            return wire.encode_reply(req_id, True, {**reply.body, "epoch": self.state.epoch}), reply, wanted
        except WireError as e:
            req_id = req_id or wire.salvage_req_id(e)
            self.state.count(**{f"error_{e.code}": 1})
            if e.code == wire.ERR_BAD_VERSION:
                self._bad("version", logging.WARNING, "refused a client: %s", e.message)
            else:
                self._bad(e.code, logging.WARNING, "bad request (op %s): %s", op[:64], e)
            body = {"code": e.code, "message": e.message, "epoch": self.state.epoch}
            return wire.encode_reply(req_id, False, body), None, True
        except Exception as e:  # a bug in an op: answer, log, keep serving
            self.state.count(error_internal=1)
            self._bad("internal:" + op[:64], logging.ERROR, "internal error serving op %s", op[:64], exc_info=True)
            err = WireError(wire.ERR_INTERNAL, f"{type(e).__name__} in op {op[:64]}: {e}"[:500])
            return wire.encode_reply(req_id, False, {"code": err.code, "message": err.message,
                                                     "epoch": self.state.epoch}), None, True

    # ---- lifetime --------------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        s = self.settings
        frontend = self._ctx.socket(zmq.ROUTER)
        frontend.setsockopt(zmq.LINGER, 0)
        frontend.setsockopt(zmq.MAXMSGSIZE, s.max_frame_bytes)
        frontend.setsockopt(zmq.RCVHWM, 10_000)
        # Replies queued per client connection: a client has a few requests in flight per connection (its
        # window); past REPLY_HWM it is not reading (stalled, SIGSTOPped), and zmq drops further replies to it
        # instead of queueing them, which frees the staging buffers and slots they hold.
        frontend.setsockopt(zmq.SNDHWM, REPLY_HWM)
        endpoints = []
        try:
            if self.auth is not None:
                self.auth.start(self._ctx)
                self.auth.secure(frontend)
                self.auth.watch(frontend, self._ctx)
            for endpoint in s.bind:
                if endpoint.startswith("ipc://"):
                    Path(endpoint[len("ipc://"):]).parent.mkdir(parents=True, exist_ok=True)
                frontend.bind(endpoint)
                endpoints.append(frontend.getsockopt_string(zmq.LAST_ENDPOINT))
                if self.auth is not None:
                    self.auth.restrict(endpoints[-1])
            stream = self._start_stream(endpoints)
            self.state.start(endpoints)
        except BaseException:
            frontend.close(linger=0)
            self._release()
            raise
        backend = self._ctx.socket(zmq.DEALER)
        backend.setsockopt(zmq.LINGER, 0)
        backend.bind(BACKEND)
        control = self._ctx.socket(zmq.PAIR)
        control.bind(CONTROL)
        proxy = threading.Thread(target=self._proxy, args=(frontend, backend), name="kvtier-pool-proxy", daemon=True)
        workers = [threading.Thread(target=self._work, args=(i,), name=f"kvtier-pool-worker-{i}", daemon=True)
                   for i in range(s.workers)]
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        proxy.start()
        for w in workers:
            w.start()
        tier = self.state.tier
        log.info("kvtier-pool %s (%s): serving on %s%s%s; capacity %s%s; %d workers; lease %.3g s; master %s",
                 os.getpid(), self.state.node_id, ", ".join(endpoints),
                 f" (CurveZMQ, keys in {s.auth_dir}; data port by token)" if self.auth else "",
                 f" (data port {stream})" if stream else "", format_bytes(s.capacity),
                 f" in blocks of {tier.block_bytes} B" if tier else " (block size set by the first client)",
                 s.workers, s.lease_s, s.master or "none (clients list this pool themselves)")
        self._write_ready(endpoints)
        try:
            while not self._stop.wait(TICK_S):
                self.state.leases.expire()
        finally:
            log.info("kvtier-pool %s: shutting down", os.getpid())
            for w in workers:
                w.join(5.0)
            control.send(b"TERMINATE")
            proxy.join(5.0)
            control.close(linger=0)
            stats = self.state.stats()
            self._release()
            log.info("kvtier-pool %s: stopped (%s)", os.getpid(), json.dumps(stats["counters"], sort_keys=True))

    def _release(self) -> None:
        """Free what run() set up, once its sockets are closed: the authenticator (its ZAP socket lives in the
        context, so it stops before the context ends), the context, the data port, the DRAM and the agent."""
        if self.auth is not None:
            self.auth.stop()
        self._ctx.term()
        if self._stream is not None:
            self._stream.close()
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
                                    max_connections=self.settings.stream_max_connections)
        self.state.stream_port = self._stream.start()
        return self.state.stream_port

    def _proxy(self, frontend: zmq.Socket[Any], backend: zmq.Socket[Any]) -> None:
        ctl = self._ctx.socket(zmq.PAIR)
        ctl.connect(CONTROL)
        try:
            if self.auth is not None:  # zmq's proxy drops the sender's key, which each op's role check needs
                RoleGate(self.auth, ops.PERMISSIONS, self._refusal, self._refused).run(frontend, backend, ctl)
            else:
                zmq.proxy_steerable(frontend, backend, None, ctl)
        except zmq.ContextTerminated:
            pass
        finally:
            frontend.close(linger=0)
            backend.close(linger=0)
            ctl.close(linger=0)

    def _refusal(self, req_id: int, err: WireError) -> bytes:
        return wire.encode_reply(req_id, False, {"code": err.code, "message": err.message, "epoch": self.state.epoch})

    def _refused(self, op: str, err: WireError) -> None:
        self.state.count(error_forbidden=1)
        self._bad("forbidden:" + op[:64], logging.WARNING, "bad request (op %s): %s", op[:64], err)

    def _work(self, index: int) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(BACKEND)
        sending: list[_Sending] = []  # zero-copy replies in flight, and the blocks they hold
        try:
            while not self._stop.is_set():
                if sock.poll(5 if sending else 200):
                    try:
                        self._answer(sock, sock.recv_multipart(copy=False), sending)
                    except Exception:  # never lose a worker: the client times out, the next request is served
                        self._bad("worker", logging.ERROR, "worker %d failed to answer a request", index,
                                  exc_info=True)
                if sending:
                    sending[:] = [s for s in sending if not s.finish(self.state)]
        finally:
            sock.close(linger=0)
            for s in sending:  # the context is still up: zmq lets go of the slots as the socket closes
                s.finish(self.state, wait_s=1.0)

    def _answer(self, sock: zmq.Socket[Any], frames: list[Any], sending: list[_Sending]) -> None:
        # [identity, (empty delimiter from REQ-style clients), envelope, *data]
        route = 2 if len(frames) > 2 and len(frames[1]) == 0 else 1
        if len(frames) <= route:
            return  # nothing to answer
        t0 = time.perf_counter()
        envelope, reply, wanted = self.serve(frames[route], frames[route + 1:])
        # Routing frames were received (zmq.Frame, untracked): re-sent as bytes so the reply can be tracked.
        out = [*(f.bytes for f in frames[:route]), envelope, *(reply.data if reply is not None else [])]
        release = reply.release if reply is not None else None
        if not wanted:
            return
        try:
            tracker = sock.send_multipart(out, zmq.NOBLOCK, copy=False, track=release is not None)
        except zmq.Again:
            self._bad("send", logging.WARNING, "reply dropped: the proxy's queue is full")
            tracker = None
        if release is not None:
            if tracker is None:
                release()
            else:
                sending.append(_Sending(tracker, release, t0, sum(len(d) for d in out[route + 1:])))

    def _on_signal(self, sig: int, _frame: Any) -> None:
        log.info("kvtier-pool: %s received, shutting down", signal.Signals(sig).name)
        self.stop()

    def _write_ready(self, endpoints: list[str]) -> None:
        if not self.ready_file:
            return
        path = Path(self.ready_file)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"endpoints": endpoints, "node": self.state.node_id, "pid": os.getpid(),
                                   "epoch": self.state.epoch, "shm_path": str(self.state.shm_path or "")}))
        tmp.replace(path)



class _Sending:
    """A zero-copy reply zmq is still sending: what to release when it is sent, and when its request came in."""

    __slots__ = ("tracker", "release", "t0", "nbytes")
    MEASURE_BYTES = 1 << 20  # smaller replies are all latency: they say nothing about bandwidth

    def __init__(self, tracker: zmq.MessageTracker, release: Any, t0: float, nbytes: int) -> None:
        self.tracker, self.release, self.t0, self.nbytes = tracker, release, t0, nbytes

    def finish(self, state: PoolState, wait_s: float = 0.0) -> bool:
        """Release what the reply holds if zmq is done with it (waiting up to ``wait_s``); True when released."""
        if not self.tracker.done:
            try:
                self.tracker.wait(wait_s) if wait_s else None
            except zmq.NotDone:
                pass
            if not self.tracker.done and not wait_s:
                return False
        self.release()
        if self.nbytes >= self.MEASURE_BYTES:
            state.record_read(self.nbytes, time.perf_counter() - self.t0)
        return True
