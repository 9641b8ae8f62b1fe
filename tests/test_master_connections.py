"""Connections that do nothing must not lock honest clients out of the master's port, nor make it hold memory:
a real kvtier-master subprocess attacked over real TCP sockets (tests/zmtp.py speaks just enough ZMTP).

* 1,100 idle connections (finished zmq handshakes, and raw sockets that never handshake) to a master started
  under the usual soft file-descriptor limit of 1,024: a new client is served at once;
* raw sockets that never finish the handshake are closed after --handshake-timeout-s;
* 100 strangers that each declare a 16 MiB message and send part of it cost the master nothing: zmq reads at
  most MAXMSGSIZE (derived from --max-batch-keys) and closes those connections at the declaration.
"""

from __future__ import annotations

import time

import pytest

from kvtier import wire
from kvtier.client import MasterClient
from masterproc import MasterProcess
from zmtp import RawPeer, frame_header, host_port, rss_bytes

MiB = 1 << 20
# tests/zmtp.py speaks ZMTP's NULL mechanism: a master serving every local user (--insecure-bind) lets its peers
# finish the handshake, which is what these bounds are about (a keyless master's owner token stops another user
# at the handshake: test_owner_token.py).
OPEN = ("--insecure-bind",)


@pytest.mark.slow  # a connection stress: 1000 sockets
def test_a_thousand_idle_connections_do_not_lock_new_clients_out(tmp_path):
    # The soft limit most hosts start daemons with; the hard one is what this machine allows.
    master = MasterProcess(tmp_path, lease_s=30.0, prefix=("prlimit", "--nofile=1024:8192", "--"), args=OPEN)
    with master:
        host, port = host_port(master.endpoint)
        idle = [RawPeer(host, port, handshake=i % 2 == 0) for i in range(1100)]
        try:
            time.sleep(0.5)  # the master accepts them (or, at its fd limit, cannot)
            t0 = time.perf_counter()
            with MasterClient(master.endpoint, timeout_s=3.0) as m:
                assert m.ping()["version"] == wire.VERSION
            assert time.perf_counter() - t0 < 3.0
            assert "file descriptor limit raised from 1024" in master.log()
        finally:
            for p in idle:
                p.close()


def test_connections_that_never_finish_the_handshake_are_closed(tmp_path):
    """Within the default --handshake-timeout-s (5 s; zmq's own default was 30 s)."""
    with MasterProcess(tmp_path, args=OPEN) as master:
        host, port = host_port(master.endpoint)
        silent = [RawPeer(host, port, handshake=False) for _ in range(50)]
        t0 = time.monotonic()
        try:
            assert all(p.closed_by_peer(max(0.1, t0 + 8.0 - time.monotonic())) for p in silent)
        finally:
            for p in silent:
                p.close()


def test_strangers_declaring_huge_messages_cost_the_master_nothing(tmp_path):
    with MasterProcess(tmp_path, lease_s=30.0, args=OPEN) as master:
        host, port = host_port(master.endpoint)
        before = rss_bytes(master.pid)
        peers = [RawPeer(host, port) for _ in range(100)]
        chunk = b"\x55" * MiB
        try:
            for p in peers:
                try:
                    p.sock.sendall(frame_header(16 * MiB))
                    for _ in range(4):
                        p.sock.sendall(chunk)
                except OSError:
                    continue  # closed by the master: what should happen
            time.sleep(0.5)
            grown = rss_bytes(master.pid) - before
            assert grown < 48 * MiB, f"master RSS grew {grown / MiB:.0f} MiB for 100 unfinished messages"
            assert all(p.closed_by_peer(2.0) for p in peers)
            with MasterClient(master.endpoint, timeout_s=3.0) as m:
                assert m.ping()["version"] == wire.VERSION
        finally:
            for p in peers:
                p.close()


@pytest.fixture(autouse=True)
def _enough_fds():
    """This test process opens 1,100+ sockets of its own."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    yield
