"""DataTokens: what admits a connection to the pool's raw TCP data port when the pool requires keys.

The data port is not zmq, so CURVE cannot guard it. Instead the pool hands every client that says hello over
the CURVE control channel (authenticated and encrypted) a fresh token, and a data connection must present one
as its first TOKEN_BYTES bytes. A token is a random nonce and its HMAC under a key the pool draws at start, so
checking one needs no table (nothing to evict, nothing an attacker can fill) and the compare is constant-time;
a restarted pool draws a new key, and clients fetch new tokens with their hello after the restart.

What it does not do: the data port's bytes are not encrypted, and the token crosses the wire in clear, so
anyone who can read that network can read blocks and reuse a token until the pool restarts. Run the data port
on a private network, or use pool_transport "tcp" (block bytes in CURVE-encrypted zmq frames) instead.

Thread-safe (no mutable state after construction).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

TOKEN_BYTES = 32
_NONCE = 16


class DataTokens:
    """``issue()`` a token; ``check(token)``: whether this object issued it."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def issue(self) -> bytes:
        nonce = secrets.token_bytes(_NONCE)
        return nonce + self._mac(nonce)

    def check(self, token: bytes) -> bool:
        if len(token) != TOKEN_BYTES:
            return False
        return hmac.compare_digest(self._mac(token[:_NONCE]), token[_NONCE:])

    def _mac(self, nonce: bytes) -> bytes:
        return hmac.new(self._key, nonce, hashlib.sha256).digest()[: TOKEN_BYTES - _NONCE]


__all__ = ["TOKEN_BYTES", "DataTokens"]
