"""ClientKeys: what a client socket presents to a daemon that requires CurveZMQ keys; and silence_hint, what to
say when a daemon never answers (a CURVE handshake that fails is silence to the client: zmq reports nothing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from kvtier.auth.files import AuthError, Keypair, endpoint_key_name, load_keypair, load_public


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
    this client's keys, or requiring keys it has none of (a CURVE refusal is silence to the client). Pure text:
    no probe of the port, so a client without keys behaves as it did before kvtier had keys."""
    if keys is not None:
        return (f" (this client presents CurveZMQ keys from {keys.directory}: a daemon that does not list its "
                f"client.key in authorized/, a server key that is not the daemon's, or a daemon without --auth-dir "
                f"all look like silence; check auth_dir)")
    return (" (no reply has ever come: the daemon is down or stalled, or it requires CurveZMQ keys (started "
            "with --auth-dir): then set auth_dir)")


__all__ = ["ClientKeys", "silence_hint"]
