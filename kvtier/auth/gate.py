"""HandshakeGate: what both of a daemon's connection gates share (ServerAuth: CurveZMQ keys, server.py;
OwnerGate: the owner token of a keyless start, owner.py): a refused connection counted and logged, and the
monitor that sees handshakes failing before the ZAP handler is asked (a client speaking another mechanism).

Threads: the monitor runs one thread per watched socket; ``handshake_failures`` is a plain counter, read from
any thread; ``count(name)`` is called from the ZAP and monitor threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtier.ratelog import RateLimitedLog

log = logging.getLogger("kvtier.auth")

LOG_EVERY_S = 60.0  # one line per kind of refusal per minute (with how many more were held back)
MONITOR_POLL_MS = 200

# The counters a gate passes to ``count(name)`` (server.py, owner.py, HandshakeGate below) -> the ``reason`` label
# both daemons give them on port="zmq" of their refused-connections metric: one table, so kvtier-pool and
# kvtier-master name one event alike (docs/master.md "Metrics").
REASONS: dict[str, str] = {
    "auth_refused_key": "key_not_authorized",  # a CurveZMQ client key not admitted
    "auth_handshake_failed": "handshake_failed",  # the handshake failed (wrong server key, a broken client)
    "auth_refused_token": "wrong_owner_token",  # a keyless daemon's owner token, but not this one
    "auth_no_token": "no_owner_token",  # no owner token at all (another user's client, or one with keys)
    "auth_refused_uid": "other_uid_on_ipc",  # the right token, but the kernel says another uid on an ipc socket
    "zmq_closed_in_handshake": "closed_in_handshake",  # hung up (or timed out) before the handshake ended
}


class HandshakeGate:
    """The shared half of a daemon's gate. Subclasses say what a failed handshake means (``explain``)."""

    FAILED_COUNTER = "auth_handshake_failed"  # the counters a failed handshake adds to (the daemon's metrics)
    MECHANISM_COUNTER = FAILED_COUNTER  # ... when the client spoke another mechanism (no keys, no token)
    CLOSED_COUNTER = "zmq_closed_in_handshake"  # ... when it hung up (or timed out) before the handshake ended

    def __init__(self, count: Callable[[str], None] | None = None) -> None:
        self.handshake_failures = 0
        self._count = count
        self._bad = RateLimitedLog(log, LOG_EVERY_S)
        self._watchers: list[threading.Thread] = []
        self._stop = threading.Event()

    def counted(self, name: str) -> None:
        if self._count is not None:
            self._count(name)

    def explain(self, value: int) -> tuple[str, str]:
        """(kind, why) of a handshake that failed with zmq protocol error ``value``, for the log line."""
        return "other", f"a client's handshake failed (zmq protocol error {value:#x})"

    # Not EVENT_HANDSHAKE_FAILED_NO_DETAIL by default: a connection closed before any greeting (a health check, a
    # port scan) says nothing about keys.
    WATCHED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL

    def watch(self, sock: zmq.Socket[Any], ctx: zmq.Context[Any]) -> None:
        """Log handshakes that fail before ZAP is asked on ``sock`` (a socket has one monitor: kvtier-pool's
        PortWatch calls ``handshake_failed`` and ``handshake_closed`` instead)."""
        address = f"inproc://kvtier-auth-monitor-{id(sock):x}"
        sock.monitor(address, self.WATCHED)
        monitor = ctx.socket(zmq.PAIR)
        monitor.connect(address)
        t = threading.Thread(target=self._monitor, args=(monitor,), name="kvtier-auth-monitor", daemon=True)
        t.start()
        self._watchers.append(t)

    def stop_watching(self) -> None:
        self._stop.set()
        for t in self._watchers:
            t.join(2.0)

    def _monitor(self, monitor: zmq.Socket[Any]) -> None:
        try:
            while not self._stop.is_set():
                if not monitor.poll(MONITOR_POLL_MS):
                    continue
                event = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                    self.handshake_closed(int(event["value"]), event["endpoint"])
                else:
                    self.handshake_failed(int(event["value"]), event["endpoint"])
        except zmq.ZMQError:
            pass  # the context is going away
        finally:
            monitor.close(linger=0)

    def handshake_failed(self, value: int, endpoint: bytes | str) -> None:
        """Count and log a handshake that failed on ``endpoint`` with zmq protocol error ``value``."""
        self.handshake_failures += 1
        kind, why = self.explain(value)
        self.counted(self.FAILED_COUNTER if kind != "mechanism" else self.MECHANISM_COUNTER)
        where = endpoint.decode() if isinstance(endpoint, bytes) else endpoint
        self._bad("handshake:" + kind, logging.WARNING, "refused a connection on %s: %s", where, why)

    def handshake_closed(self, value: int, endpoint: bytes | str) -> None:
        """Count a connection closed (or timed out: EAGAIN) before its handshake ended (where the gate watches
        those, ``WATCHED``, or kvtier-pool's PortWatch passes them on)."""
        self.counted(self.CLOSED_COUNTER)


__all__ = ["LOG_EVERY_S", "REASONS", "HandshakeGate"]
