"""MasterServer: the kvtier-master process. One asyncio (uvloop) loop owns all state; one zmq ROUTER socket.

    client DEALER --[payload]--> ROUTER --[identity, payload]--> serve() --> [identity, reply] --> client

The loop watches the socket's file descriptor and, when zmq signals, drains every queued request (up to a
bound, so the timer still runs) and answers each before waiting again: a burst of lookups costs one wakeup,
not one per request, and no future is created per request. Ops are synchronous numpy work on the loop; nothing else touches the state, so nothing locks.
Disk writes (node records, hints, snapshots) run on one writer thread, so a large snapshot never stalls
answers. A bad request gets an error reply naming the problem; a bug in an op gets ERR_INTERNAL and a
logged traceback, and the loop goes on.

Shutdown (SIGTERM or SIGINT): stop taking requests, write the final snapshot, node records and hints,
close lmdb, exit 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zmq

from kvtier import wire
from kvtier.auth import ServerAuth
from kvtier.master import ops_node, ops_router
from kvtier.master.metrics import MasterMetrics
from kvtier.master.persist import MasterDisk
from kvtier.master.service import MasterSettings, MasterState
from kvtier.ratelog import RateLimitedLog
from kvtier.wire import WireError

log = logging.getLogger("kvtier.master")

OPS = {**ops_router.OPS, **ops_node.OPS}
DRAIN_LIMIT = 256  # requests answered per wakeup before the timer gets a turn
TICK_S = 0.1
# Ops whose keys count toward kvtier_master_request_keys.
_KEYED = {wire.LOOKUP, wire.COST, wire.HEAT, wire.PIN, wire.UNPIN, wire.PRIORITY}


class MasterServer:
    """Serves one MasterState on ``settings.bind`` until ``stop()``. Create and run inside one process."""

    def __init__(self, settings: MasterSettings, ready_file: str | None = None) -> None:
        self.settings = settings
        self.ready_file = ready_file
        self.metrics = MasterMetrics()
        self.state = MasterState(settings, self.metrics)
        self.disk: MasterDisk | None = None
        self.endpoint = ""
        self.metrics_port: int | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-master-disk")
        self._stop: asyncio.Event | None = None
        self._last_snapshot = time.monotonic()
        self._snapshot_running = False
        self._bad = RateLimitedLog(log)
        # Keys are read now: a missing one is a start-up error (AuthError), before anything is opened.
        self.auth = ServerAuth(settings.auth_dir) if settings.auth_dir else None

    # ---- requests --------------------------------------------------------------------------------------

    def serve(self, frame: bytes) -> bytes:
        """Answer one request frame (never raises)."""
        t0 = time.perf_counter()
        op, req_id, nkeys, error = "?", 0, 0, ""
        try:
            req_id, op, body = wire.decode_request(frame)
            handler = OPS.get(op)
            if handler is None:
                raise WireError(wire.ERR_UNKNOWN_OP, f"unknown op {op[:64]!r}; known: {', '.join(sorted(OPS))}")
            reply = wire.encode_reply(req_id, True, handler(self.state, body))
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
        self.metrics.observe(op, status, time.perf_counter() - t0, nkeys)
        self.state.activity.request(op if op in OPS else "unknown", status)
        if status != "ok":
            self.state.activity.error(time.time(), op, status, error)
        return reply

    # ---- lifetime --------------------------------------------------------------------------------------

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def run(self) -> None:
        self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        if self.settings.data_dir:
            self.disk = MasterDisk(self.settings.data_dir)
            self.state.restore(self.disk)
        ctx = zmq.Context()
        auth = self.auth
        if auth is not None:
            auth.start(ctx)  # a thread of its own: it answers ZAP requests beside the loop, on the same context
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.settings.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        serving = False
        try:
            if auth is not None:
                auth.secure(sock)
                auth.watch(sock, ctx)
            sock.bind(self.settings.bind)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.settings.metrics_port is not None:
                self.metrics_port = self.metrics.serve(self.settings.metrics_port, self.settings.metrics_host)
            log.info("kvtier-master %s: serving on %s%s; metrics %s; data dir %s; lease %.3g s, heat half-life "
                     "%.3g s, placement %s", os.getpid(), self.endpoint,
                     f" (CurveZMQ, keys in {self.settings.auth_dir})" if auth else "",
                     f"http://{self.settings.metrics_host}:{self.metrics_port}/metrics" if self.metrics_port
                     else "off", self.settings.data_dir or "none (nothing persists)", self.settings.lease_s,
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
            if auth is not None:
                auth.stop()
            ctx.term()
            await self._shutdown(flush=serving)

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        """Answer every queued request (up to DRAIN_LIMIT, then yield to the loop and come back)."""
        for _ in range(DRAIN_LIMIT):
            if self._stop is not None and self._stop.is_set():
                return
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            if len(frames) < 2:
                continue  # not a routed message
            frames[-1] = self.serve(frames[-1])
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                self._bad("send", logging.WARNING, "reply dropped: the client's queue is full")
        asyncio.get_running_loop().call_soon(self._drain, sock)

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
                self._persist_small()
                due = self.settings.snapshot_interval_s > 0 and \
                    time.monotonic() - self._last_snapshot >= self.settings.snapshot_interval_s
                if due and not self._snapshot_running and self.disk is not None:
                    self._snapshot_running = True
                    self._last_snapshot = time.monotonic()
                    fut = self._writer.submit(self._write_snapshot, *self.state.snapshot())
                    fut.add_done_callback(lambda _f: setattr(self, "_snapshot_running", False))
            except Exception:
                log.exception("master housekeeping failed; retrying at the next tick")

    def _persist_small(self) -> None:
        """Queue node records and hints that changed for the writer thread."""
        if self.disk is None:
            return
        for rec in self.state.dirty_records():
            self._writer.submit(self._guarded, self.disk.save_node, rec)
        if self.state.hints_dirty:
            self.state.hints_dirty = False
            self._writer.submit(self._guarded, self.disk.save_hints, self.state.hints.to_wire())

    def _write_snapshot(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        if self.disk is None:
            return
        t0 = time.perf_counter()
        try:
            n = self.disk.save_snapshot(arrays, meta)
        except Exception:
            log.exception("directory snapshot failed (the previous one stays); nodes would resync after a crash")
            return
        log.info("directory snapshot: %d keys, %.1f MiB in %.2f s", len(arrays["k0"]), n / 2**20,
                 time.perf_counter() - t0)

    @staticmethod
    def _guarded(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("writing master state to disk failed")

    async def _shutdown(self, flush: bool) -> None:
        """Flush state (if the daemon got as far as serving: a failed start must not overwrite the last
        snapshot with a partial one) and close the disk."""
        loop = asyncio.get_running_loop()
        if self.disk is not None:
            if flush:
                self._persist_small()
                await loop.run_in_executor(self._writer, self._write_snapshot, *self.state.snapshot())
            await loop.run_in_executor(self._writer, self.disk.close)
        self._writer.shutdown(wait=True)
        if flush:
            log.info("kvtier-master %s: stopped (%d keys, %d nodes%s)", os.getpid(), len(self.state.directory),
                     len(self.state.registry.nodes), ", state flushed to disk" if self.disk else "")

    def _write_ready(self) -> None:
        if not self.ready_file:
            return
        path = Path(self.ready_file)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"endpoint": self.endpoint, "metrics_port": self.metrics_port,
                                   "pid": os.getpid()}))
        tmp.replace(path)
