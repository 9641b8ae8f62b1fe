"""kvtier/auth/peercred.py: an ipc peer's kernel credentials from zmq's Peer-Address, and the one way a file a
peer names is opened (regular file, owned by the peer's uid, no symlink followed). Real zmq sockets, real
files; the other-owner cases need root (chown)."""

from __future__ import annotations

import ipaddress
import os

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from kvtier.auth.peercred import NotPeersFile, ipc_cred, open_peers_file, peer_address

NOBODY = 65534


@given(st.ip_addresses())
def test_an_ip_address_carries_no_credentials(ip):
    assert ipc_cred(str(ip)) is None
    assert ipc_cred(str(ipaddress.ip_network(f"{ip}/{ip.max_prefixlen // 2}", strict=False))) is None


@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz.-", max_size=20), st.integers(0, 2**32 - 1),
       st.integers(0, 2**32 - 1), st.integers(1, 2**22))
def test_an_ipc_peer_address_gives_back_its_uid_gid_and_pid(name, uid, gid, pid):
    cred = ipc_cred(f"{name}:{uid}:{gid}:{pid}")
    assert cred is not None and (cred.uid, cred.gid, cred.pid) == (uid, gid, pid)


def test_both_ends_of_an_ipc_connection_see_the_others_kernel_credentials(tmp_path):
    ctx = zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        server.bind(f"ipc://{tmp_path}/s.sock")
        client.connect(f"ipc://{tmp_path}/s.sock")
        client.send(b"hello")
        ident, msg = server.recv_multipart(copy=False)
        assert ipc_cred(peer_address(msg)) is not None
        assert (ipc_cred(peer_address(msg)).uid, ipc_cred(peer_address(msg)).pid) == (os.geteuid(), os.getpid())
        server.send_multipart([ident.bytes, b"hi"])
        reply = client.recv(copy=False)
        assert ipc_cred(peer_address(reply)).uid == os.geteuid()
        assert peer_address(b"no metadata") == ""
    finally:
        server.close(0)
        client.close(0)
        ctx.term()


def test_only_a_regular_file_the_peer_owns_is_opened(tmp_path):
    me = os.geteuid()
    own = tmp_path / "own.shm"
    own.write_bytes(b"x" * 64)
    fd = open_peers_file(str(own), os.O_RDONLY, me, "the pool's file")
    os.close(fd)
    with pytest.raises(NotPeersFile, match="uid is unknown"):
        open_peers_file(str(own), os.O_RDONLY, None, "the pool's file")
    with pytest.raises(NotPeersFile, match="owned by uid"):
        open_peers_file(str(own), os.O_RDONLY, me + 1, "the pool's file")
    link = tmp_path / "link.shm"
    link.symlink_to(own)
    with pytest.raises(OSError):  # O_NOFOLLOW: a name that is a symlink is never followed
        open_peers_file(str(link), os.O_RDONLY, me, "the pool's file")
    with pytest.raises(NotPeersFile, match="not a regular file"):
        open_peers_file(str(tmp_path), os.O_RDONLY, me, "the pool's file")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_file_the_peer_does_not_own_is_refused_whatever_links_to_it(tmp_path):
    """A peer of uid 65534 names root's file, directly or by a hard link it made: the inode's owner decides."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 64)
    secret.chmod(0o600)
    hard = tmp_path / "hard"
    os.link(secret, hard)
    for name in (secret, hard):
        with pytest.raises(NotPeersFile, match=f"owned by uid 0, the pool runs as uid {NOBODY}"):
            open_peers_file(str(name), os.O_RDONLY, NOBODY, "the pool's file")
    os.chown(secret, NOBODY, NOBODY)  # the peer's own file: it could read it anyway
    os.close(open_peers_file(str(hard), os.O_RDONLY, NOBODY, "the pool's file"))
