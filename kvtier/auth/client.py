"""What a client socket presents to a daemon: ClientKeys (CurveZMQ keys, for a daemon started with --auth-dir)
or, without keys, the owner token a keyless daemon of this user published (owner.py); ``secure_client`` picks.
And silence_hint, what to say when a daemon never answers (a failed handshake is silence to the client: zmq
reports nothing).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from kvtier.auth.files import AuthError, Keypair, endpoint_key_name, load_keypair, load_public
from kvtier.auth.owner import client_claim, owner_token
from kvtier.auth.peercred import ipc_cred

log = logging.getLogger("kvtier.auth")


@dataclass(frozen=True)
class ClientKeys:
    """A client's keypair and the public key of the daemon it talks to (one endpoint). Immutable; ``apply``
    sets them on a socket before it connects (any thread that owns the socket)."""

    own: Keypair
    server: bytes
    directory: Path

    @classmethod
    def load(cls, directory: str | os.PathLike[str], endpoint: str = "", *, own: str = "client",
             server_file: str | None = None) -> ClientKeys:
        """``directory/<own>.key_secret`` and the daemon's public key: ``server_file`` when given, else
        ``servers/<endpoint_key_name(endpoint)>`` if it exists, else ``server.key``. AuthError names a missing
        file."""
        d = Path(directory)
        if not d.is_dir():
            raise AuthError(f"auth_dir {d} is not a directory (it holds client.key_secret and server.key)")
        if server_file is not None:
            server = d / server_file
        else:
            per_endpoint = d / "servers" / endpoint_key_name(endpoint) if endpoint else None
            server = per_endpoint if per_endpoint is not None and per_endpoint.exists() else d / "server.key"
        if not server.exists():
            raise AuthError(f"no daemon public key for {endpoint or 'the daemon'}: {server} is missing (copy the "
                            f"daemon's server.key there)")
        return cls(load_keypair(d / f"{own}.key_secret"), load_public(server), d)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_publickey = self.own.public
        sock.curve_secretkey = self.own.secret
        sock.curve_serverkey = self.server


def secure_client(sock: zmq.Socket[Any], endpoint: str, keys: ClientKeys | None) -> bool:
    """Set what ``sock`` presents to the daemon at ``endpoint``, before it connects: ``keys`` when given, else
    the owner token of a keyless daemon of this user if one is published for ``endpoint`` (read once per
    socket), else nothing (a daemon started with --insecure-bind). The one place every client socket asks.

    True: the daemon must be this user's own (an owner token is published for it), so a reply over ipc from
    another uid is a squatter's (``not_owner``, the caller's check of each reply's kernel credentials). An ipc
    socket file another uid owns is not ours to begin with: the token is not presented there at all."""
    if keys is not None:
        keys.apply(sock)
        return False
    token = owner_token(endpoint)
    if token is None:
        return False
    holder = ipc_file_owner(endpoint)
    if holder is not None and holder != os.geteuid():
        log.warning("not presenting the owner token to %s: its socket file belongs to uid %d, not to this user (a "
                    "process squatting a stopped daemon's path?)", endpoint, holder)
        return True
    sock.plain_username = client_claim().encode()
    sock.plain_password = token.encode()
    return True


def not_owner(peer: str) -> int | None:
    """The uid of an ipc peer (zmq's Peer-Address, kernel credentials) that is not this user; None for this
    user or a peer without credentials (tcp)."""
    cred = ipc_cred(peer)
    return cred.uid if cred is not None and cred.uid != os.geteuid() else None


def ipc_file_owner(endpoint: str) -> int | None:
    """The uid owning the socket file of an ipc:// ``endpoint``; None for tcp, an abstract socket, no file."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return None
    try:
        return os.stat(endpoint[len("ipc://"):]).st_uid
    except OSError:
        return None


def silence_hint(endpoint: str, keys: ClientKeys | None) -> str:
    """A clause for a "no reply" error that has never had a reply from ``endpoint``: the daemon may be refusing
    this client's keys, or requiring keys it has none of (a CURVE refusal is silence to the client). Pure text:
    no probe of the port, so a client without keys behaves as it did before kvtier had keys."""
    if keys is not None:
        return (f" (this client presents CurveZMQ keys from {keys.directory}: a daemon that does not list its "
                f"client.key in authorized/, a server key that is not the daemon's, or a daemon without --auth-dir "
                f"all look like silence; check auth_dir)")
    return (" (no reply has ever come: the daemon is down or stalled, or it requires CurveZMQ keys (started "
            "with --auth-dir): then set auth_dir; or it is another user's daemon started without keys, which "
            "serves only its own user's processes unless started with --insecure-bind)")


__all__ = ["ClientKeys", "not_owner", "secure_client", "silence_hint"]
