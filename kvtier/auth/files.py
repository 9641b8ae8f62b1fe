"""Key files: generate a CurveZMQ keypair (zmq.auth's certificate format), load one, name per-endpoint keys.

A secret key file is written 0600 from the start (the process umask is 077 while zmq writes it, so it is
never readable by others, not even for a moment); the public file is then made 0644. Loading a secret key
that others may read logs a warning (ssh refuses; a key mounted from a Kubernetes secret is often 0644).
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

log = logging.getLogger("kvtier.auth")

SECRET_SUFFIX = ".key_secret"
PUBLIC_SUFFIX = ".key"


class AuthError(ValueError):
    """A key file or directory is missing or unreadable (a start-up error: the CLIs print it on one line)."""


@dataclass(frozen=True)
class Keypair:
    """A CurveZMQ keypair, both halves z85-encoded (40 bytes each), as zmq's socket options take them."""

    public: bytes
    secret: bytes


def generate(directory: str | os.PathLike[str], name: str = "client", *, force: bool = False,
             role: str | None = None) -> tuple[Path, Path]:
    """Write ``directory/<name>.key`` (public, 0644) and ``<name>.key_secret`` (0600); their paths. An existing
    keypair is kept (AuthError) unless ``force``: overwriting a daemon's key locks every client out. ``role``
    (kvtier/auth/roles.py) is written into both files' metadata (``role = engine``), for the humans who copy
    the public key into a daemon's authorized/<role>s/ and for the daemon, which refuses a key found in another
    role's directory."""
    if not name or "/" in name or name.startswith("."):
        raise AuthError(f"key name {name!r}: use a plain file name such as 'server' or 'engine-3'")
    d = Path(directory)
    public, secret = d / f"{name}{PUBLIC_SUFFIX}", d / f"{name}{SECRET_SUFFIX}"
    if not force and (public.exists() or secret.exists()):
        raise AuthError(f"{secret} or {public} exists already (--force replaces them, and locks out every "
                        f"peer that trusts the old public key)")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    old = os.umask(0o077)  # the secret is 0600 from its first byte (the CLI is single-threaded here)
    try:
        secret.unlink(missing_ok=True)  # an existing file keeps its mode when rewritten
        public.unlink(missing_ok=True)
        zmq.auth.create_certificates(str(d), name, metadata={"role": role} if role else None)
    finally:
        os.umask(old)
    if role:  # zmq writes metadata into the secret file only; the public file is the one that travels
        text = public.read_text()
        public.write_text(text.replace("metadata\n", f"metadata\n    role = {role}\n", 1))
    public.chmod(0o644)
    secret.chmod(0o600)
    return public, secret


def load_keypair(path: str | os.PathLike[str]) -> Keypair:
    """The keypair in a ``.key_secret`` file; AuthError naming the file when it is missing or has no secret."""
    p = Path(path)
    try:
        public, secret = zmq.auth.load_certificate(str(p))
    except (OSError, ValueError) as e:
        raise AuthError(f"cannot read the CurveZMQ keypair {p}: {e} (kvtier keys generate makes one)") from None
    if not secret:
        raise AuthError(f"{p} holds no secret key (a {SECRET_SUFFIX} file does; {PUBLIC_SUFFIX} is the public half)")
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        log.warning("%s is readable by others (mode %04o): chmod 600 it", p, mode)
    return Keypair(public, secret)


def load_public(path: str | os.PathLike[str]) -> bytes:
    """The public key in a ``.key`` file; AuthError naming the file."""
    try:
        return zmq.auth.load_certificate(str(path))[0]
    except (OSError, ValueError) as e:
        raise AuthError(f"cannot read the CurveZMQ public key {path}: {e}") from None


def endpoint_key_name(endpoint: str) -> str:
    """The per-endpoint server key file name: tcp://10.0.0.2:7400 -> 10.0.0.2_7400.key, ipc:///run/p.sock ->
    run_p.sock.key (the endpoint without its scheme, other characters as '_')."""
    rest = endpoint.partition("://")[2] or endpoint
    return re.sub(r"[^A-Za-z0-9.-]+", "_", rest).strip("_") + PUBLIC_SUFFIX


__all__ = ["AuthError", "Keypair", "endpoint_key_name", "generate", "load_keypair", "load_public"]
