"""ServerAuth: a daemon's CurveZMQ gate (kvtier-master and kvtier-pool, ``--auth-dir DIR``).

    auth = ServerAuth(DIR)           # reads DIR/server.key_secret and DIR/authorized/*.key (AuthError if absent)
    auth.start(ctx)                  # a ZAP handler for every socket of ctx (zmq's ThreadAuthenticator)
    auth.secure(sock); auth.watch(sock, ctx)          # before sock.bind()
    ...
    auth.stop()                      # after the sockets are closed, before ctx.term()

A client is admitted when its CURVE handshake proves it holds the secret half of a key in ``authorized/`` (or
one of its role directories, kvtier/auth/roles.py); everything after the handshake is encrypted (tcp:// and
ipc:// alike). zmq tags every message of an admitted connection with the client's public key (its User-Id),
and ``permissions(key)`` says what that key's roles allow: the daemons check it per op. A refused key is
logged once a minute per key, with the directory to add it to; a client without keys, or with another
daemon's server key, fails the handshake before ZAP is asked, which ``watch`` logs from the socket's monitor.
Neither reaches the daemon's request loop, so nothing a refused peer sends can hurt it. The key list is read at start: adding or
removing a client means restarting the daemon.

Threads: the ZAP callback runs on the authenticator's thread, the monitor on one thread per watched socket.
``refused`` and ``handshake_failures`` are plain counters, read from any thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from kvtier.auth.files import load_keypair
from kvtier.auth.roles import RoleBook
from kvtier.ratelog import RateLimitedLog

log = logging.getLogger("kvtier.auth")

LOG_EVERY_S = 60.0  # one line per refused key (or kind of failed handshake) per minute
MAX_LOGGED_KEYS = 1024  # refused keys logged apart; past that (someone minting keys) they share one line
MONITOR_POLL_MS = 200


class ServerAuth:
    """The gate of one daemon process. ``count(name)``, if given, is called for each refusal
    (``auth_refused_key``, ``auth_handshake_failed``) from the ZAP or monitor thread."""

    def __init__(self, directory: str | os.PathLike[str], count: Callable[[str], None] | None = None) -> None:
        self.directory = Path(directory)
        self.keys = load_keypair(self.directory / "server.key_secret")
        self.book = RoleBook.load(self.directory / "authorized")
        self.authorized = self.book.keys()
        self.refused = 0
        self.handshake_failures = 0
        self._count = count
        self._logged: set[bytes] = set()
        self._bad = RateLimitedLog(log, LOG_EVERY_S)
        self._authenticator: ThreadAuthenticator | None = None
        self._watchers: list[threading.Thread] = []
        self._stop = threading.Event()

    def start(self, ctx: zmq.Context[Any]) -> None:
        self._authenticator = ThreadAuthenticator(ctx, log=logging.getLogger("kvtier.auth.zap"))
        self._authenticator.start()
        self._authenticator.configure_curve_callback("*", self)
        if self.authorized:
            log.info("CurveZMQ on: %d client keys admitted (%s; %s/authorized)", len(self.authorized),
                     self.book.describe(), self.directory)
        else:
            log.warning("CurveZMQ on, but %s/authorized holds no *.key: no client can connect", self.directory)

    def permissions(self, key: str) -> frozenset[str]:
        """What the admitted key ``key`` (z85 text: a message's User-Id) may do (kvtier/auth/roles.py)."""
        return self.book.permissions(key)

    def secure(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server (before it binds)."""
        sock.curve_server = True
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public

    @staticmethod
    def restrict(endpoint: str) -> None:
        """A bound ipc:// socket file becomes 0600: only this user's processes may even try a handshake (zmq
        creates it with the umask's mode)."""
        if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):  # @: abstract, no file
            os.chmod(endpoint[len("ipc://"):], 0o600)

    def watch(self, sock: zmq.Socket[Any], ctx: zmq.Context[Any]) -> None:
        """Log handshakes that fail before ZAP is asked (no keys, another daemon's server key) on ``sock``."""
        address = f"inproc://kvtier-auth-monitor-{id(sock):x}"
        # Not EVENT_HANDSHAKE_FAILED_NO_DETAIL: a connection closed before any greeting (a health check, a port
        # scan, kvtier's own silence_hint probe) says nothing about keys.
        sock.monitor(address, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        monitor = ctx.socket(zmq.PAIR)
        monitor.connect(address)
        t = threading.Thread(target=self._monitor, args=(monitor,), name="kvtier-auth-monitor", daemon=True)
        t.start()
        self._watchers.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._watchers:
            t.join(2.0)
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None

    # ---- the ZAP handler's callback (zmq.auth calls it on its thread) -----------------------------------

    def callback(self, domain: str, key: bytes) -> bool:
        """Whether the client with public key ``key`` (z85) is admitted."""
        if key in self.authorized:
            return True
        self.refused += 1
        if self._count is not None:
            self._count("auth_refused_key")
        if key not in self._logged and len(self._logged) < MAX_LOGGED_KEYS:
            self._logged.add(key)
        kind = key.decode("ascii", "replace") if key in self._logged else "other"
        self._bad("refused:" + kind, logging.WARNING, "refused a client: CurveZMQ public key %s is not in %s "
                  "(to admit it, copy its public key file into engines/, daemons/ or operators/ there, by its role, "
                  "and restart)", kind, self.directory / "authorized")
        return False

    # ---- the monitor --------------------------------------------------------------------------------------

    def _monitor(self, monitor: zmq.Socket[Any]) -> None:
        try:
            while not self._stop.is_set():
                if not monitor.poll(MONITOR_POLL_MS):
                    continue
                event = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                self._failed_handshake(int(event["value"]), event["endpoint"])
        except zmq.ZMQError:
            pass  # the context is going away
        finally:
            monitor.close(linger=0)

    def handshake_failed(self, value: int, endpoint: bytes | str) -> None:
        """Count and log a failed handshake seen by a monitor of the daemon's own (kvtier-pool's PortWatch:
        a socket has one monitor, so a daemon that watches its port for more than this calls it)."""
        self._failed_handshake(value, endpoint)

    def _failed_handshake(self, value: int, endpoint: bytes | str) -> None:
        self.handshake_failures += 1
        if self._count is not None:
            self._count("auth_handshake_failed")
        where = endpoint.decode() if isinstance(endpoint, bytes) else endpoint
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            kind, why = "mechanism", "a client without CurveZMQ keys (no auth_dir) tried to connect"
        elif value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            kind, why = "crypto", ("a client's CurveZMQ handshake failed to decrypt: its server key is not this "
                                   f"daemon's ({self.directory}/server.key)")
        else:
            kind, why = "other", f"a client's handshake failed (zmq protocol error {value:#x})"
        self._bad("handshake:" + kind, logging.WARNING, "refused a connection on %s: %s", where, why)


__all__ = ["ServerAuth"]
