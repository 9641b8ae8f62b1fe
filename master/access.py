"""Who is asking the master: a request's Caller, and whether its roles allow the op (kvtier/auth/roles.py).

With ``--auth-dir`` zmq tags each message with the public key of the connection that sent it (its User-Id,
proven by the CURVE handshake); the server turns it into a Caller before the op runs, and an op its roles do
not grant is refused with ERR_FORBIDDEN naming the role it needs. Without keys every caller is ANONYMOUS and
every op is served. The caller's key is also what quotas are counted by (nodes and hints per key,
service.py) and what a node registration is bound to (ops_node.py). Immutable; made on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from kvtier.auth.roles import RoleBook


@dataclass(frozen=True)
class Caller:
    """``key``: the client's CurveZMQ public key (z85), "" without keys. ``permissions`` None: no --auth-dir."""

    key: str = ""
    permissions: frozenset[str] | None = None
    roles: frozenset[str] = frozenset()

    @property
    def quota(self) -> str:
        """What per-client limits count by: the key, or one shared name for everyone without keys."""
        return self.key or ANONYMOUS_QUOTA

    def check(self, op: str, permission: str | None, book: RoleBook | None) -> None:
        """ERR_FORBIDDEN unless this caller may run ``op`` (which needs ``permission``); no keys: every op."""
        if self.permissions is None or book is None or permission is None or permission in self.permissions:
            return
        book.check(op, permission, self.key)


ANONYMOUS_QUOTA = "anonymous"
ANONYMOUS = Caller()
