"""Who is at the other end of an ipc:// connection: the kernel's peer credentials, as zmq reports them.

On an ipc:// (unix socket) connection zmq reads SO_PEERCRED when the connection is made and puts it into
every received message's ``Peer-Address`` metadata as ``<name>:<uid>:<gid>:<pid>`` (both ends: a pool sees
its client's, a client its pool's). The kernel fills it in, so no peer can forge it: it is the one identity a
keyless daemon has for a local caller, and the one proof a client has that a file a pool names is the pool's
own (shm.py: the file's owner must be the pool's uid). A tcp:// peer's ``Peer-Address`` is an IP address:
no credentials (None).
"""

from __future__ import annotations

import ipaddress
import os
import stat
from dataclasses import dataclass
from typing import Any

import zmq


@dataclass(frozen=True)
class PeerCred:
    uid: int
    gid: int
    pid: int

    def __str__(self) -> str:
        return f"uid {self.uid} (pid {self.pid})"


def peer_address(frame: Any) -> str:
    """A received zmq frame's ``Peer-Address`` metadata ("" when zmq has none for it)."""
    try:
        return str(frame.get("Peer-Address") or "")
    except (zmq.ZMQError, AttributeError):  # AttributeError: bytes, not a zmq.Frame (copy=True)
        return ""


def ipc_cred(address: str) -> PeerCred | None:
    """The credentials in an ipc peer's ``Peer-Address`` (or a pool's account string made from one); None for
    an IP address, a network, or anything else."""
    try:
        ipaddress.ip_network(address, strict=False)
        return None
    except ValueError:
        pass
    parts = address.rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return PeerCred(int(parts[1]), int(parts[2]), int(parts[3]))


class NotPeersFile(ValueError):
    """A file a peer named is not one the peer owns (or not a plain file): mapping it would lend the peer this
    process's access to it."""


def open_peers_file(path: str, flags: int, uid: int | None, what: str) -> int:
    """Open ``path``, a file a peer of uid ``uid`` named as its own (a pool's shared DRAM or generations), and
    return the fd; NotPeersFile unless the opened inode is a regular file owned by ``uid``.

    Why the owner: a peer can read and write every file it owns, so mapping one gives it nothing it did not
    have; a file it does not own (root's 0600 secret, this process's own files) is refused, whatever path,
    symlink (O_NOFOLLOW) or hard link names it: the check is on the inode opened, so nothing can swap the file
    between the check and the mapping. ``uid`` None (no kernel credentials: not an ipc peer) is refused."""
    if uid is None:
        raise NotPeersFile(f"{what} {path!r}: the pool's uid is unknown (not an ipc:// connection), so the file "
                           "cannot be proven to be the pool's")
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            kind = "a regular file" if stat.S_ISREG(st.st_mode) else "not a regular file"
            raise NotPeersFile(f"{what} {path!r} is {kind} owned by uid {st.st_uid}, the pool runs as uid {uid}: "
                               "a pool only ever names a file it created itself")
    except BaseException:
        os.close(fd)
        raise
    return fd


__all__ = ["NotPeersFile", "PeerCred", "ipc_cred", "open_peers_file", "peer_address"]
