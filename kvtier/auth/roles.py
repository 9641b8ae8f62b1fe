"""Roles: what each admitted CurveZMQ key may do on kvtier-master and kvtier-pool (``--auth-dir DIR``).

The role of a key is the directory its public key file sits in, so ``ls`` answers "who may do what":

    DIR/authorized/
        engines/*.key     engines and routers: put/get/lookup/locate on pools, lookups, costs, placements and
                          hints (pin, unpin, priority) on the master
        daemons/*.key     kvtier-pool daemons reporting to the master (a copy of each pool's server.key):
                          register, heartbeat, events, inventory and goodbye as a node; ping and hints
        operators/*.key   people and their tools: what an engine may do, plus ``clear`` on a pool and the
                          master's admin ops (``forget`` a node)
        *.key             keys straight in authorized/ (the layout before roles): admitted as engines, with a
                          warning at start-up naming the file

A key listed in two directories has both roles. ``kvtier keys generate DIR --role R`` writes ``role = R``
into the key files' metadata; a key whose metadata names another role than the directory it sits in is a
start-up error (an engine key copied into operators/ by mistake would otherwise get an operator's rights).

Each op a daemon serves needs one *permission*; a role is a set of permissions (``ROLE_PERMISSIONS``). Without
``--auth-dir`` there are no keys and so no roles: every op is served (docs/reliability.md says what that exposes).
Immutable after loading; any thread may read it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.auth.files import AuthError, load_public
from kvtier.wire import ERR_FORBIDDEN, WireError

log = logging.getLogger("kvtier.auth")

ENGINE, DAEMON, OPERATOR = "engine", "daemon", "operator"
ROLES = (ENGINE, DAEMON, OPERATOR)
ROLE_DIRS = {ENGINE: "engines", DAEMON: "daemons", OPERATOR: "operators"}

# Permissions, one per kind of op.
READ = "read"    # ping, lookup, cost, locate, heat, top, nodes, hints; a pool's hello/contains/stats
DATA = "data"    # blocks in and out of pools (put, get, reserve/commit, acquire/release, remove); route_put
HINTS = "hints"  # the master's pin, unpin, priority
NODE = "node"    # the master's register, heartbeat, events, inventory, goodbye
ADMIN = "admin"  # a pool's clear; the master's forget

ROLE_PERMISSIONS: Mapping[str, frozenset[str]] = {
    ENGINE: frozenset({READ, DATA, HINTS}),
    DAEMON: frozenset({READ, NODE}),
    OPERATOR: frozenset({READ, DATA, HINTS, ADMIN}),
}

_ROLE_LINE = re.compile(r"^\s*role\s*=\s*\"?([A-Za-z]+)\"?\s*$", re.MULTILINE)


def roles_with(permission: str) -> list[str]:
    """The roles that grant ``permission`` (for error messages: "needs a daemon key")."""
    return [r for r in ROLES if permission in ROLE_PERMISSIONS[r]]


def declared_role(path: Path) -> str | None:
    """The ``role = ...`` a key file's metadata declares (kvtier keys generate --role), or None."""
    try:
        m = _ROLE_LINE.search(path.read_text(errors="replace"))
    except OSError:
        return None
    return m.group(1).lower() if m else None


@dataclass(frozen=True)
class RoleBook:
    """Public key (z85 text, as zmq reports a peer's User-Id) -> its roles, read from ``authorized/``."""

    roles: Mapping[str, frozenset[str]]
    directory: Path
    grants: Mapping[str, frozenset[str]] = field(default_factory=dict)  # key -> its permissions (from roles)

    def __post_init__(self) -> None:
        grants = {k: frozenset().union(*(ROLE_PERMISSIONS[r] for r in rs)) for k, rs in self.roles.items()}
        object.__setattr__(self, "grants", grants)

    @classmethod
    def load(cls, authorized: Path) -> RoleBook:
        """Read ``authorized/`` (AuthError naming the problem: not a directory, an unreadable key, a key whose
        metadata contradicts its directory)."""
        if not authorized.is_dir():
            raise AuthError(f"{authorized} is not a directory: it holds the public keys of the clients a daemon "
                            f"admits, by role ({', '.join(d + '/' for d in ROLE_DIRS.values())}; create it, even "
                            "empty)")
        found: dict[str, set[str]] = {}
        flat = sorted(authorized.glob("*.key"))
        for path in flat:
            declared = declared_role(path)
            if declared is not None and declared != ENGINE:
                raise AuthError(f"{path} is a {declared} key (its metadata says role = {declared}) but sits straight in "
                                f"{authorized}/, which admits engines: move it to {authorized}/{ROLE_DIRS.get(declared, '?')}/")
            found.setdefault(_key(path), set()).add(ENGINE)
        if flat:
            log.warning("%d keys straight in %s (%s) are admitted as engines (put/get/lookup/hints); put daemon keys "
                        "in %s/daemons/ and operator keys in %s/operators/, engine keys in %s/engines/", len(flat),
                        authorized, ", ".join(p.name for p in flat[:8]), authorized, authorized, authorized)
        for role, sub in ROLE_DIRS.items():
            d = authorized / sub
            if not d.exists():
                continue
            if not d.is_dir():
                raise AuthError(f"{d} is not a directory (it holds the public keys of {role} clients)")
            for path in sorted(d.glob("*.key")):
                declared = declared_role(path)
                if declared is not None and declared != role:
                    raise AuthError(f"{path} is a {declared} key (its metadata says role = {declared}) in the {role}s' "
                                    f"directory: move it to {authorized}/{ROLE_DIRS.get(declared, '?')}/, or "
                                    f"generate a {role} key (kvtier keys generate DIR --role {role})")
                found.setdefault(_key(path), set()).add(role)
        return cls({k: frozenset(v) for k, v in found.items()}, authorized)

    def keys(self) -> set[bytes]:
        """Every admitted public key (z85 bytes, as the ZAP handler compares them)."""
        return {k.encode("ascii") for k in self.roles}

    def of(self, key: str) -> frozenset[str]:
        return self.roles.get(key, frozenset())

    def permissions(self, key: str) -> frozenset[str]:
        """What the key ``key`` (z85 text) may do: the union of its roles' permissions."""
        return self.grants.get(key, frozenset())

    def check(self, op: str, permission: str | None, key: str) -> None:
        """WireError ERR_FORBIDDEN naming the role ``op`` needs, unless ``key`` may do it (``permission`` None: an
        op the daemon does not know, left to its own error). The one check both daemons make per request."""
        if permission is None or permission in self.permissions(key):
            return
        raise WireError(ERR_FORBIDDEN, forbidden_message(op, permission, key, self.of(key), self.directory))

    def describe(self) -> str:
        counts = {r: sum(r in rs for rs in self.roles.values()) for r in ROLES}
        return ", ".join(f"{n} {r} key{'s' if n != 1 else ''}" for r, n in counts.items())


def _key(path: Path) -> str:
    return load_public(path).decode("ascii")


def check_role(role: str) -> str:
    if role not in ROLES:
        raise AuthError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    return role


def forbidden_message(op: str, permission: str, key: str, roles: Iterable[str], book_dir: Path) -> str:
    """Why ``key`` may not do ``op``, and which directory would let it."""
    have = ", ".join(sorted(roles)) or "no"
    need = " or ".join(roles_with(permission))
    dirs = " or ".join(f"{book_dir}/{ROLE_DIRS[r]}/" for r in roles_with(permission))
    article = "an" if need[:1] in "aeiou" else "a"
    return (f"op {op!r} needs {article} {need} key; this client's key {key[:12]}... has {have} role(s) (a key in "
            f"{dirs} may do it)")


__all__ = ["ADMIN", "DAEMON", "DATA", "ENGINE", "HINTS", "NODE", "OPERATOR", "READ", "ROLES", "ROLE_DIRS",
           "ROLE_PERMISSIONS", "RoleBook", "check_role", "declared_role", "forbidden_message", "roles_with"]
