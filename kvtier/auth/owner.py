"""The owner token: who may use a kvtier-master or kvtier-pool started without keys (no ``--auth-dir``) —
the processes of the user who started it, and no one else, unless its operator says so (``--insecure-bind``).

    gate = OwnerGate(count, binds)          # a fresh random token, or the one a bind's endpoint already has
    gate.start(ctx); gate.secure(sock, b)   # a PLAIN server whose ZAP handler wants b's token; before bind(b)
    gate.publish(endpoints)                 # after bind: runtime_dir()/<endpoint's name>.token, 0600
    ...
    gate.stop()                             # a clean stop removes the files it published

    secure_client(sock, endpoint, keys)     # kvtier/auth/client.py: a client of the same user presents it

Where: ``runtime_dir()`` is ``$KVTIER_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/kvtier``, else
``/tmp/kvtier-<uid>``: a directory mode 0700, owned by this user and not a symlink (checked, never trusted:
another user who made it first gets an error naming it, not our token). A token file is named by the endpoint
a client dials (``token_name``: the port for tcp, so tcp://localhost:P and tcp://127.0.0.1:P agree; the path
for ipc, readable and hashed), so a client finds it with no configuration. It outlives a daemon that dies (kill
-9, a crash): a daemon restarted on the same endpoint keeps its token, because a client's zmq socket presents the
token it read at creation on every reconnect (a pool restarted after kill -9 must not lock out the engines that
used it). A daemon that stops cleanly removes its files: a later server on that port (another program, a daemon
with keys) must not make this user's clients speak PLAIN to it. Each bound endpoint admits only its own token
(the ZAP domain says which bind a connection came in on), and on ipc only this user's uid (the kernel's
credentials, which zmq puts in the ZAP request's address: a token that leaked to another user does not let it
in). Another local user can
read neither the directory nor the file, and without the token its handshake fails: it cannot send the daemon a
single request. The daemon's other doors follow from this one: the pool's data port wants a token handed out
in the (token-gated) hello (kvtier/auth/tokens.py), its shared-memory files are 0600, its ipc sockets 0600.

PLAIN sends the token in clear: on loopback and ipc only this host's root can see it, and a daemon binds
beyond loopback without keys only with ``--insecure-bind`` (exposure.py), which serves without the token at all.
But it goes to whoever listens: over ipc a client checks the server's kernel uid (client.py, channel.py); over
tcp a local user squatting a dead daemon's port receives it (docs/reliability.md 11.1, not covered: CurveZMQ with a
pinned server key is the fix).
The check is once per connection (the zmq handshake), constant-time; nothing per request.

Threads: the ZAP handler runs on its own thread; the counters are plain ints read from anywhere.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pwd
import re
import secrets
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvtier.auth.exposure import host_of, is_local
from kvtier.auth.files import AuthError
from kvtier.auth.gate import HandshakeGate
from kvtier.auth.peercred import ipc_cred
from kvtier.envvars import ENV_RUNTIME_DIR

log = logging.getLogger("kvtier.auth")

RUNTIME_ENV = ENV_RUNTIME_DIR
TOKEN_SUFFIX = ".token"
MAX_CLAIM = 64  # characters of a refused client's self-description kept for the log
MIN_TOKEN = 32  # characters of a token file worth keeping at a restart (a fresh one has 43)
READABLE = 80  # characters of an ipc path kept readable in its token file's name (then the hash: names < 255)


def runtime_dir(create: bool = False) -> Path:
    """This user's directory for owner tokens; AuthError when it is not safely ours (another user's, a
    symlink, readable by others). ``create``: make it (0700) if missing."""
    if os.environ.get(RUNTIME_ENV):
        d = Path(os.environ[RUNTIME_ENV])
    elif os.environ.get("XDG_RUNTIME_DIR"):
        d = Path(os.environ["XDG_RUNTIME_DIR"]) / "kvtier"
    else:
        d = Path("/tmp") / f"kvtier-{os.geteuid()}"
    if create:
        try:
            d.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            pass
        except OSError as e:
            raise AuthError(f"cannot create the owner-token directory {d}: {e}") from None
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        raise AuthError(f"owner-token directory {d} does not exist (no keyless daemon of this user ran)") from None
    if not stat.S_ISDIR(st.st_mode):
        raise AuthError(f"owner-token directory {d} is not a directory (a symlink or a file): remove it, or set "
                        f"{RUNTIME_ENV} to a directory of your own")
    if st.st_uid != os.geteuid():
        raise AuthError(f"owner-token directory {d} belongs to uid {st.st_uid}, not to this user (uid "
                        f"{os.geteuid()}): someone made it first; remove it, or set {RUNTIME_ENV}")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise AuthError(f"owner-token directory {d} has mode {stat.S_IMODE(st.st_mode):04o}: chmod 700 it")
    return d


def token_name(endpoint: str) -> str | None:
    """The token file name of ``endpoint``: tcp://127.0.0.1:7400 -> tcp-7400.token (only loopback listens
    without --insecure-bind, and one port has one listener), ipc:///run/p.sock -> ipc-run_p.sock-<hash>.token
    (the path made readable, which maps /a/b_c and /a_b/c alike, so a hash of the whole path tells them apart);
    None for an endpoint that is not this host's (no token there) or has no fixed name (a port still *)."""
    if not is_local(endpoint):
        return None
    scheme, _, rest = endpoint.partition("://")
    if scheme == "tcp":
        port = rest.rpartition(":")[2]
        return f"tcp-{port}{TOKEN_SUFFIX}" if port.isdigit() and host_of(endpoint) is not None else None
    readable = re.sub(r"[^A-Za-z0-9.-]+", "_", rest).strip("_")[-READABLE:]
    digest = hashlib.blake2b(endpoint.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()
    return f"{scheme}-{readable}-{digest}{TOKEN_SUFFIX}"


def owner_token(endpoint: str) -> str | None:
    """The token a daemon of this user published for ``endpoint``, or None (none published, or the directory
    or file is not safely ours: then presenting nothing fails like a stranger would, and the daemon logs it)."""
    name = token_name(endpoint)
    if name is None:
        return None
    try:
        path = runtime_dir() / name
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (AuthError, OSError):
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            log.warning("ignoring owner token %s: not this user's 0600 file (uid %d, mode %04o)", path, st.st_uid,
                        stat.S_IMODE(st.st_mode))
            return None
        return os.read(fd, 256).decode("ascii", "replace").strip() or None
    finally:
        os.close(fd)


def forget_tokens(endpoints: Iterable[str]) -> None:
    """Remove this user's token files for ``endpoints`` (a daemon serving them without a token: its clients
    must not present a stale one, which its NULL socket would refuse)."""
    for e in endpoints:
        name = token_name(e)
        if name is None:
            continue
        try:
            (runtime_dir() / name).unlink(missing_ok=True)
        except (AuthError, OSError):
            pass


def client_claim() -> str:
    """What a client says it is (PLAIN's user name): for the daemon's log when its token is wrong. A claim,
    not a proof; the token is the proof."""
    return f"uid={os.geteuid()} pid={os.getpid()}"


class OwnerGate(HandshakeGate):
    """The gate of a keyless daemon. ``count(name)`` gets ``auth_refused_token`` (a wrong token: none, or
    another endpoint's), ``auth_refused_uid`` (an ipc peer of another uid, whatever it presents) and
    ``auth_no_token`` (a client that presented none: another user's, or one with keys)."""

    FAILED_COUNTER = "auth_handshake_failed"
    MECHANISM_COUNTER = "auth_no_token"
    # A client without the token sees the daemon's PLAIN greeting and may hang up before sending its own
    # mechanism, so the daemon sees a connection closed in its handshake, not a mismatch: watched too.
    WATCHED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL

    def __init__(self, count: Callable[[str], None] | None = None, binds: Iterable[str] = ()) -> None:
        """``binds``: the endpoints about to be bound. One of them already holding a token of this user (a
        daemon restarted on a fixed port or ipc path) keeps it, so the clients of the previous daemon, whose
        sockets present the old token on every reconnect, get back in without restarting."""
        super().__init__(count)
        self.directory = runtime_dir(create=True)  # AuthError: a start-up error, before anything is bound
        self.uid = os.geteuid()
        self.user = _user_name(self.uid)
        self.refused = 0
        self.refused_uid = 0
        self._fresh = secrets.token_urlsafe(32).encode("ascii")
        self._kept = {n: t.encode("ascii") for n, t in ((token_name(e), owner_token(e)) for e in binds)
                      if n is not None and t is not None and t.isascii() and len(t) >= MIN_TOKEN}
        # The token each bind admits, by the ZAP domain ``secure`` gives it (the bind string itself).
        self._by_bind = {b: self._kept.get(token_name(b) or "", self._fresh) for b in binds}
        self._published: list[tuple[Path, bytes]] = []  # what stop() removes (if still ours)
        self._authenticator: _TokenAuthenticator | None = None

    def start(self, ctx: zmq.Context[Any]) -> None:
        self._authenticator = _TokenAuthenticator(ctx, self)
        self._authenticator.start()

    def secure(self, sock: zmq.Socket[Any], bind: str) -> None:
        """Make ``sock`` a PLAIN server for its next ``bind`` (call just before it; zmq takes a socket's options
        when it binds, so each bound endpoint keeps its own ZAP domain): a handshake without ``bind``'s token
        fails."""
        if bind not in self._by_bind:
            raise ValueError(f"{bind!r} is not one of the binds this gate was made for ({sorted(self._by_bind)})")
        sock.zap_domain = bind.encode("utf-8", "surrogateescape")
        sock.plain_server = True

    def publish(self, endpoints: Iterable[str]) -> list[Path]:
        """Write the token for each bound ``endpoint`` (0600, atomically: a client never reads half of it)."""
        written = []
        for e in endpoints:
            name = token_name(e)
            if name is None:
                continue
            path = self.directory / name
            if name in self._kept:
                self._published.append((path, self._kept[name]))
                continue
            tmp = path.with_name(f".{name}.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, self._fresh)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            written.append(path)
            self._published.append((path, self._fresh))
        log.info("owner token on: only %s's processes may connect (token files in %s; --insecure-bind serves "
                 "every local user, --auth-dir uses keys)", self.user, self.directory)
        return written

    def stop(self) -> None:
        """A clean stop: no more handshakes, and the token files this daemon published removed (each only if it
        still holds this daemon's token: a daemon started since on that endpoint owns it now). A daemon that
        dies (kill -9) leaves them, so its successor keeps the token its clients present."""
        self.stop_watching()
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        for path, token in self._published:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                if hmac.compare_digest(os.read(fd, 256).strip(), token):
                    path.unlink(missing_ok=True)
            except OSError:
                pass
            finally:
                os.close(fd)
        self._published = []

    def admits(self, password: bytes, claim: str, address: str, domain: str = "") -> bool:
        """Whether a PLAIN handshake's password is the token of the bind it came in on (``domain``: the ZAP
        domain ``secure`` gave that bind; constant-time) and, on ipc (``address`` carries the kernel's
        credentials), whether the peer is this user. A refusal is counted and logged with who the client says it
        is and where it came from (on ipc: its proven uid and pid)."""
        cred = ipc_cred(address)
        if cred is not None and cred.uid != self.uid:
            self.refused_uid += 1
            self.counted("auth_refused_uid")
            self._bad("uid", logging.WARNING, "refused an ipc connection from %s (says %r): not %s (uid %d); only "
                      "the owner's processes may connect, whatever token they present", cred, claim[:MAX_CLAIM],
                      self.user, self.uid)
            return False
        token = self._by_bind.get(domain)
        if token is not None and hmac.compare_digest(password, token):
            return True
        self.refused += 1
        self.counted("auth_refused_token")
        self._bad("token", logging.WARNING, "refused a connection from %s on %s (says %r): wrong owner token (only "
                  "%s's processes can read %s)", cred or address or "ipc", domain or "?", claim[:MAX_CLAIM],
                  self.user, self.directory)
        return False

    def handshake_closed(self, value: int, endpoint: bytes | str) -> None:
        super().handshake_closed(value, endpoint)
        where = endpoint.decode() if isinstance(endpoint, bytes) else endpoint
        self._bad("handshake:closed", logging.WARNING, "refused a connection on %s: closed or timed out in the "
                  "handshake (%s) before presenting the owner token (a client without it hangs up on seeing that "
                  "the daemon wants one; or a port probe)", where, os.strerror(value) if value else "closed")

    def explain(self, value: int) -> tuple[str, str]:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "mechanism", (f"a client without the owner token (another user's process, a client with "
                                 f"CurveZMQ keys, or a token file it could not read in {self.directory}): only "
                                 f"{self.user}'s processes may connect to a daemon started without --auth-dir "
                                 "(--insecure-bind serves every user)")
        return super().explain(value)


class _TokenAuthenticator(ThreadAuthenticator):
    """zmq's ZAP handler, answering PLAIN by the gate (a constant-time compare, a counted refusal)."""

    def __init__(self, ctx: zmq.Context[Any], gate: OwnerGate) -> None:
        super().__init__(ctx, log=logging.getLogger("kvtier.auth.zap"))
        self._gate = gate
        self._address = ""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # The peer's address: an IP on tcp; on ipc "<name>:<uid>:<gid>:<pid>", the kernel's SO_PEERCRED.
        self._address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else ""
        await super().handle_zap_message(msg)

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        if self._gate.admits(password.encode("utf-8", "replace"), username, self._address, domain):
            return True, b"OK"
        return False, b"wrong owner token"


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


__all__ = ["RUNTIME_ENV", "OwnerGate", "client_claim", "forget_tokens", "owner_token", "runtime_dir", "token_name"]
