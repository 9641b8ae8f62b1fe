"""Serving a daemon without authentication is a choice its operator states (``--insecure-bind``).

Without ``--auth-dir`` kvtier-master and kvtier-pool serve only their own user's processes: a client must
present the daemon's owner token (owner.py), which only that user can read. A client on another host cannot
read it, so a daemon without keys bound beyond loopback must serve without the token: whoever reaches its
ports gets every op, roles or not (read and overwrite blocks, clear a pool, register a pool of one's own). The
daemons' CLIs refuse such a bind unless the operator passes ``--insecure-bind``, which turns the token off
(then every local user is served too), and log a warning naming the endpoints, once at start-up.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Iterable

LOCAL_NAMES = {"localhost", "lo"}  # zmq accepts an interface name as the host too; lo is loopback


def host_of(endpoint: str) -> str | None:
    """The host part of a tcp:// endpoint ("[::1]" -> "::1"); None for ipc://, inproc:// and other transports."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme != "tcp":
        return None
    host = rest.rpartition(":")[0] if ":" in rest else rest
    if ";" in host:  # tcp://source;destination: the destination is the bound address
        host = host.rpartition(";")[2]
    return host.strip("[]")


def is_local(endpoint: str) -> bool:
    """Whether only this host can reach ``endpoint``: ipc://, inproc://, or tcp on a loopback address."""
    host = host_of(endpoint)
    if host is None:
        return endpoint.startswith(("ipc://", "inproc://"))
    return is_loopback_host(host)


def is_loopback_host(host: str) -> bool:
    """A loopback address or name (resolved: every address it resolves to must be loopback)."""
    if host in LOCAL_NAMES:
        return True
    if host in ("*", "", "0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False  # an interface name (eth0) or an unknown name: assume the network can reach it
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def check_binds(prog: str, endpoints: Iterable[str], *, auth: bool, insecure: bool, log: logging.Logger) -> None:
    """ValueError (the CLI prints it and exits 2) when ``endpoints`` reach beyond this host without keys and
    without ``--insecure-bind``; with it (no keys), one warning."""
    if auth:
        return
    exposed = [e for e in endpoints if not is_local(e)]
    if not exposed and insecure:
        log.warning("%s serves %s WITHOUT AUTHENTICATION (--insecure-bind): any local user may do any op, including "
                    "reading and overwriting blocks, clearing pools and registering pools of its own", prog,
                    ", ".join(endpoints))
        return
    if not exposed:
        return  # the owner token: only this user's processes
    what = ", ".join(exposed)
    if not insecure:
        raise ValueError(f"{what} can be reached from other hosts and {prog} has no --auth-dir: anyone who reaches "
                         "it could read and overwrite blocks, clear pools and register pools of their own. Start it "
                         "with --auth-dir DIR (docs/pool.md 'Authenticated sockets'), bind a loopback or ipc:// "
                         "address, or pass --insecure-bind to serve the network (and every local user) without keys")
    log.warning("%s serves %s WITHOUT AUTHENTICATION (--insecure-bind): any host that reaches it may do any op, "
                "including reading and overwriting blocks, clearing pools and registering pools of its own", prog, what)


__all__ = ["check_binds", "host_of", "is_local", "is_loopback_host"]
