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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvtier.auth.files import load_keypair
from kvtier.auth.gate import HandshakeGate
from kvtier.auth.roles import RoleBook

log = logging.getLogger("kvtier.auth")

MAX_LOGGED_KEYS = 1024  # refused keys logged apart; past that (someone minting keys) they share one line


class ServerAuth(HandshakeGate):
    """The gate of one daemon process. ``count(name)``, if given, is called for each refusal
    (``auth_refused_key``, ``auth_handshake_failed``) from the ZAP or monitor thread."""

    def __init__(self, directory: str | os.PathLike[str], count: Callable[[str], None] | None = None) -> None:
        self.directory = Path(directory)
        self.keys = load_keypair(self.directory / "server.key_secret")
        self.book = RoleBook.load(self.directory / "authorized")
        self.authorized = self.book.keys()
        super().__init__(count)
        self.refused = 0
        self._logged: set[bytes] = set()
        self._authenticator: ThreadAuthenticator | None = None

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

    def secure(self, sock: zmq.Socket[Any], bind: str = "") -> None:
        """Make ``sock`` a CURVE server (before it binds; one key for every ``bind``)."""
        sock.curve_server = True
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public

    @staticmethod
    def restrict(endpoint: str) -> None:
        """A bound ipc:// socket file becomes 0600: only this user's processes may even try a handshake (zmq
        creates it with the umask's mode)."""
        if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):  # @: abstract, no file
            os.chmod(endpoint[len("ipc://"):], 0o600)

    def stop(self) -> None:
        self.stop_watching()
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None

    # ---- the ZAP handler's callback (zmq.auth calls it on its thread) -----------------------------------

    def callback(self, domain: str, key: bytes) -> bool:
        """Whether the client with public key ``key`` (z85) is admitted."""
        if key in self.authorized:
            return True
        self.refused += 1
        self.counted("auth_refused_key")
        if key not in self._logged and len(self._logged) < MAX_LOGGED_KEYS:
            self._logged.add(key)
        kind = key.decode("ascii", "replace") if key in self._logged else "other"
        self._bad("refused:" + kind, logging.WARNING, "refused a client: CurveZMQ public key %s is not in %s "
                  "(to admit it, copy its public key file into engines/, daemons/ or operators/ there, by its role, "
                  "and restart)", kind, self.directory / "authorized")
        return False

    def explain(self, value: int) -> tuple[str, str]:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "mechanism", "a client without CurveZMQ keys (no auth_dir) tried to connect"
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "crypto", ("a client's CurveZMQ handshake failed to decrypt: its server key is not this "
                              f"daemon's ({self.directory}/server.key)")
        return super().explain(value)


__all__ = ["ServerAuth"]
