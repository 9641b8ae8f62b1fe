"""What keeps the pool's zmq port open to honest clients whatever else connects to it.

* ``raise_fd_limit()``: every connection is a descriptor; under the usual soft limit of 1,024 a thousand idle
  connections lock every new client out. The pool raises its soft limit to the hard one at start.
* ``bind_private(sock, endpoint)``: an ipc:// socket file is created with the process's umask (0777 under
  umask 000): the pool binds it under umask 077 and makes it 0600, so only its own user can connect.
* ``PortWatch``: the socket's monitor. zmq itself times out a connection that has not finished its handshake
  (greeting, and with --auth-dir the CURVE handshake and ZAP) within ``--handshake-s`` (ZMQ_HANDSHAKE_IVL,
  set by the server): an unauthenticated connection is dropped after that long, before it can send a
  request. The watch counts connections (open, still handshaking) and those timeouts for the stats and
  metrics, and passes failed handshakes (CURVE keys, the owner token) to the auth gate's log (a socket has one
  monitor).

Threads: PortWatch runs one thread per watched socket; its counts are plain ints read from anywhere.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("kvtier.pool")

MAX_FDS = 1 << 20


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (at most MAX_FDS); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else MAX_FDS, MAX_FDS)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as e:
        log.warning("cannot raise the open-files limit from %d to %d (%s): about %d connections at once",
                    soft, want, e, soft)
        return soft
    log.info("open-files limit raised from %d to %d (each client connection is one)", soft, want)
    return want


def bind_private(sock: zmq.Socket[Any], endpoint: str) -> None:
    """Bind ``sock``; an ipc:// socket file is created under umask 077 and made 0600."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):  # @: abstract, no file
        sock.bind(endpoint)
        return
    path = Path(endpoint[len("ipc://"):])
    path.parent.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)


class PortWatch:
    """The monitor of one listening zmq socket. ``count(name, n)`` receives counter increments (the pool's
    stats); ``auth`` (the daemon's gate: kvtier.auth.ServerAuth or OwnerGate) is told of failed handshakes."""

    EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_ACCEPT_FAILED)

    def __init__(self, sock: zmq.Socket[Any], ctx: zmq.Context[Any], count: Any, auth: Any = None) -> None:
        self.accepted = self.disconnected = self.handshaken = self.failed = 0
        self._count, self._auth = count, auth
        self._stop = threading.Event()
        address = f"inproc://kvtier-pool-monitor-{id(sock):x}"
        sock.monitor(address, self.EVENTS)
        self._monitor = ctx.socket(zmq.PAIR)
        self._monitor.connect(address)
        self._thread = threading.Thread(target=self._run, name="kvtier-pool-monitor", daemon=True)
        self._thread.start()

    @property
    def open(self) -> int:
        return max(0, self.accepted - self.disconnected)

    @property
    def handshaking(self) -> int:
        return max(0, self.accepted - self.handshaken - self.failed)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._monitor.poll(200):
                    continue
                event = recv_monitor_message(self._monitor)
                kind, value = event["event"], int(event["value"])
                if kind == zmq.EVENT_MONITOR_STOPPED:
                    return
                self._on(kind, value, event["endpoint"])
        except zmq.ZMQError:
            pass  # the context is going away
        finally:
            self._monitor.close(linger=0)

    def _on(self, kind: int, value: int, endpoint: Any) -> None:
        if kind == zmq.EVENT_ACCEPTED:
            self.accepted += 1
        elif kind == zmq.EVENT_DISCONNECTED:
            self.disconnected += 1
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.handshaken += 1
        elif kind == zmq.EVENT_ACCEPT_FAILED:
            self._count("zmq_accept_failed", 1)
            log.warning("zmq port: accept failed (%s)", os.strerror(value) if value else value)
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self.failed += 1
            # EAGAIN: ZMQ_HANDSHAKE_IVL ran out (an idle or unauthenticated connection); else it closed first (the
            # gate's to count and say: without the owner token a client hangs up seeing the daemon wants one).
            if value == errno.EAGAIN:
                self._count("zmq_handshake_timeouts", 1)
            elif self._auth is not None:
                self._auth.handshake_closed(value, endpoint)
            else:
                self._count("zmq_closed_in_handshake", 1)
        else:  # a protocol or ZAP failure: the auth gate logs and counts those
            self.failed += 1
            if self._auth is not None and kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                self._auth.handshake_failed(value, endpoint)
