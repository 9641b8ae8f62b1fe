"""ClientKeys: what a client socket presents to a daemon that requires CurveZMQ keys; and silence_hint, what to
say when a daemon never answers (a CURVE handshake that fails is silence to the client: zmq reports nothing).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from kvtier.auth.files import AuthError, Keypair, endpoint_key_name, load_keypair, load_public

PROBE_S = 0.2  # how long silence_hint waits for a TCP connect to the daemon's port


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


def silence_hint(endpoint: str, keys: ClientKeys | None) -> str:
    """A clause for a "no reply" error that has never had a reply from ``endpoint``: the daemon may be refusing
    this client's keys, or requiring keys it has none of. Probes the port (a TCP or unix connect, at most
    PROBE_S) only when the client has no keys; '' when there is nothing to suggest."""
    if keys is not None:
        return (f" (this client presents CurveZMQ keys from {keys.directory}: a daemon that does not list its "
                f"client.key in authorized/, a server key that is not the daemon's, or a daemon without --auth-dir "
                f"all look like silence; check auth_dir)")
    if _port_accepts(endpoint):
        return (" (its port accepts connections but nothing answered: the daemon is stalled, or requires "
                "CurveZMQ keys (started with --auth-dir): then set auth_dir)")
    return ""


def _port_accepts(endpoint: str) -> bool:
    scheme, _, rest = endpoint.partition("://")
    try:
        if scheme == "tcp":
            host, _, port = rest.rpartition(":")
            with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S):
                return True
        if scheme == "ipc":
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(PROBE_S)
                s.connect(rest)
                return True
    except (OSError, ValueError):
        return False
    return False


__all__ = ["ClientKeys", "silence_hint"]
