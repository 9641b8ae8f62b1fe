"""Client: who sent a request to the pool, as far as the pool can tell. Lease ownership, quotas, fairness and
(with kvtier/auth's roles) permissions hang off it.

* ``key``: the CurveZMQ public key (z85) the client proved it holds, with ``--auth-dir``; "" without auth.
* ``peer``: what the transport says about the other end: its IP address for tcp (no port: every connection of
  a host is one peer, on the zmq port and the data port alike; an IPv6 address counts as its /64, what one
  host can hand itself), zmq's peer credentials (uid, gid, pid) of the connected process for ipc. Without
  auth a stranger can open many connections and sessions, but not change its address; an ipc socket is the
  pool's user's only (0600).
* ``session``: a token the pool handed out in the reply to this client's hello (``Sessions``; an HMAC, so
  the pool keeps no table a stranger could fill). A lease is bound to the account *and* the session that
  took it: another connection of the same host (or process) cannot release or commit it.
* ``role``: what the key may do; "" until roles exist (``PoolState.role_of`` is the hook that assigns one).

``account`` is what budgets, quotas and the dispatcher's fair queues are keyed by: the key when there is one,
else the peer. Immutable; safe to share between threads.
"""

from __future__ import annotations

import functools
import ipaddress
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from kvtier.auth import DataTokens
from kvtier.auth.peercred import peer_address

SESSION_BYTES = 32


@dataclass(frozen=True)
class Client:
    key: str
    peer: str
    session: bytes = b""
    role: str = ""

    @property
    def account(self) -> str:
        return f"key:{self.key}" if self.key else self.peer

    @property
    def owner(self) -> tuple[str, bytes]:
        """What a lease is bound to: only a request with the same account and session acts on it."""
        return self.account, self.session

    def with_session(self, session: bytes) -> Client:
        return Client(self.key, self.peer, session, self.role)


LOCAL = Client("", "local")  # the pool itself (shutdown, janitor)


def from_zmq(frame: zmq.Frame, curve: bool) -> tuple[str, str]:
    """(key, peer) of the connection a received frame came on: zmq's User-Id (set by the ZAP handler to the
    client's z85 public key; only a ``curve`` socket has one) and Peer-Address metadata."""
    key = ""
    if curve:
        try:
            key = frame.get("User-Id") or ""
        except zmq.ZMQError:  # not authenticated (cannot happen past a CURVE handshake, but never a crash)
            key = ""
    return str(key), peer_of(peer_address(frame) or "?")


@functools.lru_cache(maxsize=4096)
def peer_of(address: str) -> str:
    """The peer an address counts as: an IPv4 address as it is, an IPv6 address as its /64, anything else
    (zmq's ipc peer credentials) as it is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        if not ip.is_loopback:
            return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def encode(key: str, peer: str) -> bytes:
    """The frame the dispatcher hands a worker with each request (it cannot read zmq metadata itself)."""
    return msgpack.packb([key, peer])


def decode(frame: Any) -> Client:
    key, peer = msgpack.unpackb(bytes(frame))
    return Client(str(key), str(peer))


class Sessions:
    """Session tokens: ``issue()`` one per hello, ``check(token)`` whether this pool (this run) issued it. A
    token is a nonce and its HMAC under a key drawn at start (kvtier/auth/tokens.py): checking one needs no
    table. The last CHECKED tokens found valid are remembered (only valid ones: a stranger's guesses cannot
    fill it), so a client's every lease op costs a lookup, not an HMAC. Thread-safe."""

    CHECKED = 4096

    def __init__(self) -> None:
        self._tokens = DataTokens()
        self._valid: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def issue(self) -> bytes:
        return self._tokens.issue()

    def check(self, token: Any) -> bool:
        if not isinstance(token, bytes) or len(token) != SESSION_BYTES:
            return False
        with self._lock:
            if token in self._valid:
                self._valid.move_to_end(token)
                return True
        if not self._tokens.check(token):
            return False
        with self._lock:
            self._valid[token] = None
            if len(self._valid) > self.CHECKED:
                self._valid.popitem(last=False)
        return True
